"""Training losses as pure tensor functions (no modules, no training-loop knowledge).

Medusa (Cai et al., 2024). Head k (k = 1..K) reading the target's final hidden state at position t
predicts the token at t + k + 1 (the target's own LM head predicts t + 1). Its loss is

    L_k = mean over valid t of  (1 - a) * CE(head_k(h_t), x_{t+k+1})
                               + a * tau^2 * KL(softmax(z_{t+k} / tau) || softmax(head_k(h_t) / tau))

where z_{t+k} are the target's logits at position t + k (its predicted distribution for x_{t+k+1}),
a = `distill_weight` (0: hard labels only, Medusa-1; 1: pure self-distillation) and tau the
distillation temperature. A position is valid for head k when t + k + 1 < T and the loss mask is
set on the predicted token x_{t+k+1}. The total is sum_k lambda_k L_k with lambda_k = decay^(k-1)
(the paper's "lambda_k = 0.8^k" schedule as implemented in FasterDecoding/Medusa, where the
first head has weight 1) or an explicit list.

"mean over valid t" divides by `normalizer[k]` when given (the number of valid tokens of head k in
the whole optimizer step - every micro-batch and process), which makes gradient accumulation and
data parallelism exactly equivalent to one large batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from draftsmith.config import TextEnum, enum_member

IGNORE_INDEX = -100


def head_weights(num_heads: int, decay: float = 0.8, weights: Sequence[float] | None = None) -> torch.Tensor:
    """lambda_k for heads 1..K: `weights` if given, else decay^(k-1). (K,) float32"""
    if weights is not None:
        if len(weights) != num_heads:
            raise ValueError(f"{len(weights)} head weights given for {num_heads} heads")
        return torch.tensor([float(w) for w in weights], dtype=torch.float32)
    return torch.tensor([decay ** k for k in range(num_heads)], dtype=torch.float32)


def shifted_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, shift: int) -> torch.Tensor:
    """Labels (B, T): [b, t] = input_ids[b, t + shift] where t + shift < T and the loss mask is set
    on that token, else IGNORE_INDEX."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    length = input_ids.shape[1]
    if shift < length:
        target = input_ids[:, shift:]  # (B, T - shift)
        keep = loss_mask[:, shift:].bool()
        labels[:, : length - shift] = torch.where(keep, target, torch.full_like(target, IGNORE_INDEX))
    return labels


def medusa_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Labels (K, B, T) of the heads: head k (index k - 1) predicts the token k + 1 ahead."""
    return torch.stack([shifted_labels(input_ids, loss_mask, k + 1) for k in range(1, num_heads + 1)])


def lm_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Next-token labels (B, T) for the target's own LM head (position t predicts t + 1)."""
    return shifted_labels(input_ids, loss_mask, 1)


def teacher_positions(positions: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(K, N) time index of the target logits that head k distils from at time `positions` (N,).

    Head k at position t learns the target's distribution for x_{t+k+1}, i.e. its logits at t + k.
    """
    offsets = torch.arange(1, num_heads + 1, device=positions.device)[:, None]  # (K, 1)
    return positions[None, :] + offsets


@dataclass
class MedusaLoss:
    loss: torch.Tensor  # scalar: sum_k lambda_k L_k (differentiable)
    head_ce: torch.Tensor  # (K,) detached: hard-label CE summed over valid tokens
    head_kl: torch.Tensor  # (K,) detached: KL summed over valid tokens (zeros without a teacher)
    head_tokens: torch.Tensor  # (K,) valid token counts in this batch


def medusa_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                teacher_logits: torch.Tensor | None = None, distill_weight: float = 0.0,
                temperature: float = 1.0, normalizer: torch.Tensor | None = None) -> MedusaLoss:
    """Weighted Medusa loss over selected positions.

    logits (K, N, V) head logits; labels (K, N) with IGNORE_INDEX where a head has no target;
    teacher_logits (K, N, V) the target's logits for the same predicted tokens (needed when
    distill_weight > 0); normalizer (K,) per-head token counts to divide by (default: this
    batch's valid counts).
    """
    num_heads = logits.shape[0]
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}")
    if not 0.0 <= distill_weight <= 1.0:
        raise ValueError(f"distill_weight must be in [0, 1], got {distill_weight}")
    if distill_weight > 0 and teacher_logits is None:
        raise ValueError("distill_weight > 0 needs teacher_logits")
    valid = labels != IGNORE_INDEX  # (K, N)
    tokens = valid.sum(dim=1)  # (K,)
    if normalizer is None:
        normalizer = tokens.clamp(min=1)
    weights = weights.to(logits.device, torch.float32)
    total = logits.new_zeros((), dtype=torch.float32)
    head_ce, head_kl = [], []
    for k in range(num_heads):
        head_logits = logits[k].float()  # (N, V)
        ce = F.cross_entropy(head_logits, labels[k], ignore_index=IGNORE_INDEX, reduction="sum")
        per_head = (1.0 - distill_weight) * ce if distill_weight < 1.0 else head_logits.new_zeros(())
        kl = head_logits.new_zeros(())
        if teacher_logits is not None and distill_weight > 0:
            log_q = F.log_softmax(head_logits / temperature, dim=-1)  # (N, V)
            log_p = F.log_softmax(teacher_logits[k].float() / temperature, dim=-1)
            kl_tok = (log_p.exp() * (log_p - log_q)).sum(-1)  # (N,)
            kl = (kl_tok * valid[k]).sum()
            per_head = per_head + distill_weight * temperature ** 2 * kl
        total = total + weights[k] * per_head / normalizer[k]
        head_ce.append(ce.detach())
        head_kl.append(kl.detach())
    return MedusaLoss(total, torch.stack(head_ce), torch.stack(head_kl), tokens)


def lm_loss(logits: torch.Tensor, labels: torch.Tensor, normalizer: torch.Tensor | float | None = None) -> torch.Tensor:
    """Next-token CE of the target: logits (B, T, V), labels (B, T) from `lm_labels`.

    Summed over valid tokens and divided by `normalizer` (default: their count)."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
    if normalizer is None:
        normalizer = (labels != IGNORE_INDEX).sum().clamp(min=1)
    return ce / normalizer


@torch.no_grad()
def rank_hits(logits: torch.Tensor, labels: torch.Tensor, max_rank: int) -> torch.Tensor:
    """(K, max_rank) counts: [k, r] = valid positions where the label is head k's rank-r candidate.

    A label's rank is the number of logits strictly above its own. top-k accuracy of head k =
    hits[k, :k].sum() / valid tokens; hits / tokens is the per-rank accuracy ARCA trees use.
    """
    valid = labels != IGNORE_INDEX  # (K, N)
    safe = labels.clamp(min=0)
    label_logit = logits.gather(-1, safe[..., None])  # (K, N, 1)
    rank = (logits > label_logit).sum(-1)  # (K, N)
    hits = torch.zeros(logits.shape[0], max_rank, dtype=torch.long, device=logits.device)
    for r in range(max_rank):
        hits[:, r] = ((rank == r) & valid).sum(-1)
    return hits


# ---------------------------------------------------------------------------------------------
# EAGLE / DGF feature drafters (Li et al., 2024; Dovetail). At position t the drafter predicts the
# target feature f_{t+1}; its logits lm_head(f^_{t+1}) predict x_{t+2}. With m_t = 1 on valid
# positions and N the normalizer (valid positions of the whole optimizer step):
#   feature loss  L_f = sum_t m_t * mean_h SmoothL1_beta(f^_{t+1,h} - f_{t+1,h}) / N     (EAGLE's vloss)
#   soft CE       L_p = sum_t m_t * -sum_v p_t(v) log q_t(v) / N                          (EAGLE's ploss)
# with p_t the target's distribution for x_{t+2} and q_t = softmax(drafter logits); hard CE uses
# the one-hot of x_{t+2} instead of p_t. Unrolled ("training-time test") step j has weight decay^j.
# ---------------------------------------------------------------------------------------------


def feature_regression_loss(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor,
                            normalizer: torch.Tensor | float | None = None, beta: float = 1.0) -> torch.Tensor:
    """pred/target (…, H), mask (…) -> sum over masked positions of the per-position mean SmoothL1, / normalizer."""
    per = F.smooth_l1_loss(pred.float(), target.float(), reduction="none", beta=beta).mean(-1)  # (…)
    mask = mask.to(per.dtype)
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1)
    return (per * mask).sum() / normalizer


def soft_cross_entropy(logits: torch.Tensor, target_logprobs: torch.Tensor, mask: torch.Tensor,
                       normalizer: torch.Tensor | float | None = None) -> torch.Tensor:
    """-sum_v p(v) log softmax(logits)(v) per position (p = exp(target_logprobs), both (…, V)), masked, / normalizer."""
    log_q = F.log_softmax(logits.float(), dim=-1)
    per = -(target_logprobs.float().exp() * log_q).sum(-1)  # (…)
    mask = mask.to(per.dtype)
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1)
    return (per * mask).sum() / normalizer


def topk_soft_cross_entropy(logits: torch.Tensor, topk_indices: torch.Tensor, topk_logits: torch.Tensor,
                            mask: torch.Tensor, normalizer: torch.Tensor | float | None = None) -> torch.Tensor:
    """Soft CE against a target known only through its top-k logits (…, k): p = softmax over those k
    (the target renormalised to its top-k), q = the drafter's full softmax at those tokens."""
    log_q = F.log_softmax(logits.float(), dim=-1).gather(-1, topk_indices.long())  # (…, k)
    p = torch.softmax(topk_logits.float(), dim=-1)
    per = -(p * log_q).sum(-1)
    mask = mask.to(per.dtype)
    if normalizer is None:
        normalizer = mask.sum().clamp(min=1)
    return (per * mask).sum() / normalizer


def hard_cross_entropy(logits: torch.Tensor, labels: torch.Tensor,
                       normalizer: torch.Tensor | float | None = None) -> torch.Tensor:
    """CE to labels (…) with IGNORE_INDEX, summed over valid positions / normalizer (default: their count)."""
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                         reduction="sum")
    if normalizer is None:
        normalizer = (labels != IGNORE_INDEX).sum().clamp(min=1)
    return ce / normalizer


def unrolled_step_weights(steps: int, decay: float) -> torch.Tensor:
    """Weights decay^j of unrolled steps j = 0..steps-1 (step 0 = teacher-forced features). (steps,)"""
    return torch.tensor([decay ** j for j in range(steps)], dtype=torch.float32)


# ---------------------------------------------------------------------------------------------
# Knowledge distillation of a student LM toward the target (train/distill.py)
# ---------------------------------------------------------------------------------------------
#
# p = the target's (teacher's) next-token distribution, q = the student's, both softmax(logits / T)
# at temperature T. Divergences per position (DistillSpec, Zhou et al. 2024; GKD, Agarwal et al.):
#
#     fkl   forward KL   KL(p || q) = sum_v p_v (log p_v - log q_v)          (mode covering)
#     rkl   reverse KL   KL(q || p) = sum_v q_v (log q_v - log p_v)          (mode seeking)
#     jsd   generalized JSD(beta) = beta KL(p || m) + (1 - beta) KL(q || m),  m = beta p + (1 - beta) q,
#           0 < beta < 1; beta = 0.5 is the ordinary Jensen-Shannon divergence, JSD(beta) / beta -> FKL
#           as beta -> 0 and JSD(beta) / (1 - beta) -> RKL as beta -> 1
#     tvd   total variation  0.5 * sum_v |p_v - q_v|
#
# Every divergence is multiplied by T^2 (Hinton et al.'s convention, which keeps gradient scales
# comparable across temperatures; a no-op at T = 1).
#
# Teachers given as stored top-k logits (data/features.py: the k largest logits z_1..z_k of the
# target, their token ids, and the logsumexp L of the full logit vector, so z_i - L are exact
# log-probabilities) cannot give the full distribution; two ways to handle the tail:
#
#     tail="bucket"       (k + 1)-way distributions: the k stored tokens plus one "everything else"
#                         bucket. Teacher: p_i = exp(z_i - L), p_tail = 1 - sum_i p_i. Student: its
#                         full-softmax probabilities of the same k ids, and its remaining mass
#                         (logsumexp of its logits outside the k ids). The divergence of these coarse
#                         distributions is a lower bound of the full-vocabulary one (data-processing
#                         inequality) and equals it when the teacher puts no mass outside its top k and
#                         the student matches inside. Needs T = 1 (the tempered tail mass would need
#                         the logsumexp of z / T, which is not stored).
#     tail="renormalize"  both distributions restricted to the k stored ids and renormalised there
#                         (softmax over the k teacher logits / T, softmax over the student's logits
#                         of those ids / T); works at any temperature, ignores the tail entirely.

class Divergence(TextEnum):
    FKL = "fkl"  # KL(teacher || student)
    RKL = "rkl"  # KL(student || teacher)
    JSD = "jsd"  # generalized Jensen-Shannon, beta
    TVD = "tvd"  # total variation


class TopkTail(TextEnum):
    BUCKET = "bucket"
    RENORMALIZE = "renormalize"


TAIL_FLOOR = 1e-8  # smallest tail-bucket probability (see topk_logprobs)


def _at_least_float32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _kl_from_logprobs(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) along the last axis from log-probabilities; terms with a = 0 count 0. (...,)"""
    a = log_a.exp()
    terms = torch.where(a > 0, a * (log_a - log_b), torch.zeros_like(a))
    return terms.sum(-1)


def divergence_from_logprobs(log_p: torch.Tensor, log_q: torch.Tensor, kind: Divergence | str,
                             beta: float = 0.5) -> torch.Tensor:
    """Per-position divergence between teacher log-probs `log_p` and student log-probs `log_q`.

    log_p, log_q (..., C) normalised along the last axis (C = vocab, or k + 1 for top-k buckets).
    Returns (...,) float32 (float64 for float64 inputs).
    """
    kind = enum_member(Divergence, kind, "distillation divergence")
    if kind is Divergence.JSD and not 0.0 < beta < 1.0:
        raise ValueError(f"generalized JSD needs 0 < beta < 1, got {beta} (use fkl / rkl for the limits)")
    return DIVERGENCES[kind](_at_least_float32(log_p), _at_least_float32(log_q), beta)


def _jensen_shannon(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1.0 - beta))  # (..., C)
    return beta * _kl_from_logprobs(log_p, log_m) + (1.0 - beta) * _kl_from_logprobs(log_q, log_m)


DIVERGENCES = {
    Divergence.FKL: lambda log_p, log_q, beta: _kl_from_logprobs(log_p, log_q),
    Divergence.RKL: lambda log_p, log_q, beta: _kl_from_logprobs(log_q, log_p),
    Divergence.JSD: _jensen_shannon,
    Divergence.TVD: lambda log_p, log_q, beta: 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1),
}


FUSED_KL_ROWS = 16  # rows a chunk of the fused forward KL: its temporaries (rows x V floats) stay in cache


class FusedForwardKL(torch.autograd.Function):
    """KL(softmax(t / T) || softmax(s / T)) T^2 per row, its gradient in the student's logits s, T (softmax(s / T) -
    softmax(t / T)), computed in the same pass, chunk by chunk of FUSED_KL_ROWS rows: one (N, V) tensor kept for the
    backward instead of autograd's several, each chunk's temporaries in cache (the generic path's passes over a
    2,000 x 49,152 batch took ~a quarter of a SmolLM2 student's step on 2 cores). The teacher gets no gradient."""

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
        rows = _at_least_float32(student).reshape(-1, student.shape[-1])
        teach = teacher.reshape(-1, teacher.shape[-1]).to(rows.dtype)
        out = rows.new_empty(rows.shape[0])
        grad = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        for start in range(0, rows.shape[0], FUSED_KL_ROWS):
            chunk = slice(start, start + FUSED_KL_ROWS)
            log_q = F.log_softmax(rows[chunk] / temperature, dim=-1)
            log_p = F.log_softmax(teach[chunk] / temperature, dim=-1)
            p = log_p.exp()
            terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
            out[chunk] = terms.sum(-1) * temperature ** 2
            if grad is not None:
                grad[chunk] = (log_q.exp_() - p) * temperature
        ctx.save_for_backward(grad)
        ctx.student_dtype = student.dtype
        return out.reshape(student.shape[:-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (grad,) = ctx.saved_tensors
        per_row = grad * grad_out.reshape(-1, 1).to(grad.dtype)
        return per_row.reshape(*grad_out.shape, -1).to(ctx.student_dtype), None, None


def kd_divergence(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: Divergence | str,
                  beta: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """Full-vocabulary divergence per position: logits (..., V) -> (...,), times T^2."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} differ in shape")
    if enum_member(Divergence, kind, "distillation divergence") is Divergence.FKL and not teacher_logits.requires_grad:
        return FusedForwardKL.apply(student_logits, teacher_logits, temperature)
    log_q = F.log_softmax(_at_least_float32(student_logits) / temperature, dim=-1)
    log_p = F.log_softmax(_at_least_float32(teacher_logits) / temperature, dim=-1)
    return divergence_from_logprobs(log_p, log_q, kind, beta) * temperature ** 2


def topk_logprobs(student_logits: torch.Tensor, topk_values: torch.Tensor, topk_indices: torch.Tensor,
                  logsumexp: torch.Tensor | None, temperature: float = 1.0,
                  tail: TopkTail | str = TopkTail.BUCKET) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher, student) log-probs over the stored top-k ids (+ the tail bucket), see above.

    student_logits (..., V); topk_values (..., k) teacher logits; topk_indices (..., k) their ids;
    logsumexp (...,) of the teacher's full logits (needed for tail="bucket").
    Returns two (..., k + 1) tensors for "bucket", (..., k) for "renormalize".
    """
    tail = enum_member(TopkTail, tail, "top-k tail handling")
    if topk_values.shape != topk_indices.shape or topk_values.shape[:-1] != student_logits.shape[:-1]:
        raise ValueError(f"top-k values {tuple(topk_values.shape)} / indices {tuple(topk_indices.shape)} do not match "
                         f"student logits {tuple(student_logits.shape)}")
    student = _at_least_float32(student_logits)
    indices = topk_indices.long()
    values = topk_values.to(student.dtype)
    picked = student.gather(-1, indices)  # (..., k) student logits of the teacher's top-k ids
    if tail is TopkTail.RENORMALIZE:
        return F.log_softmax(values / temperature, dim=-1), F.log_softmax(picked / temperature, dim=-1)
    if temperature != 1.0:
        raise ValueError("tail='bucket' needs temperature 1 (the stored logsumexp is of the untempered logits); "
                         "use tail='renormalize' for another temperature")
    if logsumexp is None:
        raise ValueError("tail='bucket' needs the teacher's logsumexp")
    log_p_top = values - logsumexp.to(student.dtype)[..., None]  # (..., k) exact teacher log-probs
    # The stored values are bf16-rounded: the top-k mass can exceed 1 by a rounding error.
    # Both tails are floored at TAIL_FLOOR so that an empty tail (k = V, or rounding) on one side never
    # meets a non-empty one as log 0 (that term would be infinite); the floor's own error is <= 1e-8.
    top_mass = log_p_top.exp().sum(-1).clamp(max=1.0)
    log_p_tail = torch.log1p(-top_mass).clamp(min=math.log(TAIL_FLOOR))  # (...,)
    student_lse = torch.logsumexp(student, dim=-1)  # (...,)
    rest = student.scatter(-1, indices, float("-inf"))  # (..., V) logits outside the top-k ids
    log_q_tail = (torch.logsumexp(rest, dim=-1) - student_lse).clamp(min=math.log(TAIL_FLOOR))
    log_q_top = picked - student_lse[..., None]
    log_p = torch.cat([log_p_top, log_p_tail[..., None]], dim=-1)
    log_q = torch.cat([log_q_top, log_q_tail[..., None]], dim=-1)
    return log_p, log_q


def kd_divergence_topk(student_logits: torch.Tensor, topk_values: torch.Tensor, topk_indices: torch.Tensor,
                       logsumexp: torch.Tensor | None, kind: Divergence | str, beta: float = 0.5,
                       temperature: float = 1.0, tail: TopkTail | str = TopkTail.BUCKET) -> torch.Tensor:
    """Divergence per position against a stored top-k teacher: (...,), times T^2."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    log_p, log_q = topk_logprobs(student_logits, topk_values, topk_indices, logsumexp, temperature, tail)
    return divergence_from_logprobs(log_p, log_q, kind, beta) * temperature ** 2


def kd_mask(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) bool: positions t whose next token t + 1 is trained (assistant-only loss mask).

    Logits at t predict token t + 1, so a position is distilled when the loss mask is set on the
    token it predicts (the same alignment as `lm_labels`). The last position predicts nothing.
    """
    keep = torch.zeros_like(loss_mask, dtype=torch.bool)
    keep[:, :-1] = loss_mask[:, 1:].bool()
    if attention_mask is not None:
        keep[:, :-1] &= attention_mask[:, 1:].bool()
    return keep


@dataclass
class KDLoss:
    loss: torch.Tensor  # scalar: sum of per-position divergences / normalizer (differentiable)
    total: torch.Tensor  # detached sum of per-position divergences
    tokens: torch.Tensor  # number of distilled positions


def kd_loss(student_logits: torch.Tensor, kind: Divergence | str, *, teacher_logits: torch.Tensor | None = None,
            topk_values: torch.Tensor | None = None, topk_indices: torch.Tensor | None = None,
            logsumexp: torch.Tensor | None = None, mask: torch.Tensor | None = None, beta: float = 0.5,
            temperature: float = 1.0, tail: TopkTail | str = TopkTail.BUCKET,
            normalizer: torch.Tensor | float | None = None) -> KDLoss:
    """Token-level distillation loss, summed over masked positions and divided by `normalizer`.

    student_logits (..., V); the teacher is either `teacher_logits` (..., V) or the top-k triple
    (`topk_values`, `topk_indices` (..., k), `logsumexp` (...,)); `mask` (...,) bool selects the
    positions (e.g. `kd_mask(loss_mask)`; None: all). `normalizer` defaults to the number of
    selected positions (pass the step's global count for exact gradient accumulation).
    """
    if (teacher_logits is None) == (topk_values is None):
        raise ValueError("give exactly one teacher: teacher_logits, or topk_values + topk_indices (+ logsumexp)")
    if mask is not None:
        mask = mask.bool()
        student_logits = student_logits[mask]  # (N, V)
        if teacher_logits is not None:
            teacher_logits = teacher_logits[mask]
        else:
            topk_values, topk_indices = topk_values[mask], topk_indices[mask]
            logsumexp = logsumexp[mask] if logsumexp is not None else None
    if teacher_logits is not None:
        per_position = kd_divergence(student_logits, teacher_logits, kind, beta, temperature)
    else:
        if topk_indices is None:
            raise ValueError("topk_values needs topk_indices")
        per_position = kd_divergence_topk(student_logits, topk_values, topk_indices, logsumexp, kind, beta,
                                          temperature, tail)
    tokens = torch.tensor(per_position.numel(), device=per_position.device)
    total = per_position.sum()
    if normalizer is None:
        normalizer = tokens.clamp(min=1)
    return KDLoss(total / normalizer, total.detach(), tokens)
