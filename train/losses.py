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

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
