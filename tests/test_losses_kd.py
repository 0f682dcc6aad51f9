"""Distillation losses (train/losses.py) against straightforward reference implementations."""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.train.losses import (divergence_from_logprobs, kd_divergence, kd_divergence_topk, kd_loss, kd_mask,
                          topk_logprobs)

KINDS = ["fkl", "rkl", "jsd", "tvd"]


def fixed_logits(n: int = 5, vocab: int = 11, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, vocab, generator=g, dtype=torch.float64) * 2, torch.randn(n, vocab, generator=g,
                                                                                   dtype=torch.float64) * 2


def reference(p: list[float], q: list[float], kind: str, beta: float = 0.5) -> float:
    """Scalar loops over the probabilities, straight from the definitions."""
    def kl(a, b):
        return sum(x * math.log(x / y) for x, y in zip(a, b) if x > 0)

    if kind == "fkl":
        return kl(p, q)
    if kind == "rkl":
        return kl(q, p)
    if kind == "jsd":
        m = [beta * x + (1 - beta) * y for x, y in zip(p, q)]
        return beta * kl(p, m) + (1 - beta) * kl(q, m)
    if kind == "tvd":
        return 0.5 * sum(abs(x - y) for x, y in zip(p, q))
    raise AssertionError(kind)


def softmax_list(row: torch.Tensor, temperature: float = 1.0) -> list[float]:
    e = [math.exp(float(v) / temperature) for v in row]
    s = sum(e)
    return [x / s for x in e]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_full_vocab_equals_reference(kind, temperature):
    student, teacher = fixed_logits()
    got = kd_divergence(student, teacher, kind, beta=0.3, temperature=temperature)
    want = [reference(softmax_list(t, temperature), softmax_list(s, temperature), kind, 0.3) * temperature ** 2
            for s, t in zip(student, teacher)]
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_jsd_half_is_js_and_limits():
    student, teacher = fixed_logits(seed=1)
    fkl, rkl = kd_divergence(student, teacher, "fkl"), kd_divergence(student, teacher, "rkl")
    log_p, log_q = torch.log_softmax(teacher, -1), torch.log_softmax(student, -1)
    m = 0.5 * (log_p.exp() + log_q.exp())
    js = 0.5 * (log_p.exp() * (log_p - m.log())).sum(-1) + 0.5 * (log_q.exp() * (log_q - m.log())).sum(-1)
    assert torch.allclose(kd_divergence(student, teacher, "jsd", beta=0.5).double(), js, atol=1e-6)
    small, large = 1e-6, 1 - 1e-6
    assert torch.allclose(kd_divergence(student, teacher, "jsd", beta=small) / small, fkl, rtol=2e-3, atol=1e-4)
    assert torch.allclose(kd_divergence(student, teacher, "jsd", beta=large) / (1 - large), rkl, rtol=2e-3, atol=1e-4)
    with pytest.raises(ValueError, match="0 < beta < 1"):
        kd_divergence(student, teacher, "jsd", beta=1.0)
    with pytest.raises(ValueError, match="distillation divergence must be one of"):
        kd_divergence(student, teacher, "kl2")


@pytest.mark.parametrize("temperature", [1.0, 2.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_forward_kl_equals_the_generic_divergence_and_its_gradient(temperature, dtype):
    """kd_divergence's FKL (chunked, its gradient computed in the forward pass) against the generic log-prob path,
    over more rows than a chunk, a (B, T, V) batch, a teacher with -inf logits (probability 0), a bf16 student."""
    from draftsmith.train.losses import FUSED_KL_ROWS, divergence_from_logprobs
    torch.manual_seed(0)
    shape = (3, FUSED_KL_ROWS + 5, 40)
    student = (3 * torch.randn(shape)).to(dtype).requires_grad_(True)
    teacher = 3 * torch.randn(shape)
    teacher[0, 1, :7] = float("-inf")
    weights = torch.rand(shape[:-1])
    fused = kd_divergence(student, teacher, "fkl", temperature=temperature)
    (fused * weights).sum().backward()
    generic_student = student.detach().clone().requires_grad_(True)
    log_q = torch.log_softmax(generic_student.float() / temperature, -1)
    log_p = torch.log_softmax(teacher / temperature, -1)
    generic = divergence_from_logprobs(log_p, log_q, "fkl") * temperature ** 2
    (generic * weights).sum().backward()
    assert fused.dtype == torch.float32 and student.grad.dtype == dtype
    assert torch.allclose(fused, generic, rtol=1e-5, atol=1e-5)
    assert torch.allclose(student.grad.float(), generic_student.grad.float(), rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(kd_divergence(student, teacher, "fkl", temperature=temperature), fused.detach())


@pytest.mark.parametrize("kind", KINDS)
def test_zero_when_equal(kind):
    student, _ = fixed_logits()
    got = kd_divergence(student, student.clone(), kind)
    assert torch.allclose(got, torch.zeros_like(got), atol=1e-6)


def stored_topk(teacher: torch.Tensor, k: int):
    values, indices = teacher.topk(k, dim=-1)
    return values.float(), indices, torch.logsumexp(teacher, -1).float()


@pytest.mark.parametrize("kind", KINDS)
def test_topk_bucket_equals_reference(kind):
    student, teacher = fixed_logits(seed=2)
    k = 3
    values, indices, lse = stored_topk(teacher, k)
    got = kd_divergence_topk(student, values, indices, lse, kind, beta=0.7)
    want = []
    for s, t, idx in zip(student, teacher, indices):
        p, q = softmax_list(t), softmax_list(s)
        ids = idx.tolist()
        p_b = [p[i] for i in ids] + [1 - sum(p[i] for i in ids)]
        q_b = [q[i] for i in ids] + [1 - sum(q[i] for i in ids)]
        want.append(reference(p_b, q_b, kind, 0.7))
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_topk_renormalize_equals_reference(kind):
    student, teacher = fixed_logits(seed=3)
    values, indices, lse = stored_topk(teacher, 4)
    got = kd_divergence_topk(student, values, indices, lse, kind, temperature=2.0, tail="renormalize")
    want = [reference(softmax_list(v, 2.0), softmax_list(s[idx], 2.0), kind) * 4.0
            for s, v, idx in zip(student, values, indices)]
    assert torch.allclose(got.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_topk_with_all_ids_equals_full(kind):
    student, teacher = fixed_logits(seed=4)
    values, indices, lse = stored_topk(teacher, teacher.shape[-1])
    full = kd_divergence(student, teacher, kind)
    assert torch.allclose(kd_divergence_topk(student, values, indices, lse, kind), full, atol=1e-5)


def test_topk_bucket_refuses_temperature_and_bad_tail():
    student, teacher = fixed_logits()
    values, indices, lse = stored_topk(teacher, 3)
    with pytest.raises(ValueError, match="needs temperature 1"):
        topk_logprobs(student, values, indices, lse, temperature=2.0)
    with pytest.raises(ValueError, match="top-k tail handling must be one of"):
        topk_logprobs(student, values, indices, lse, tail="drop")


def test_kd_mask_alignment():
    loss_mask = torch.tensor([[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]])
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    assert kd_mask(loss_mask, attention).int().tolist() == [[0, 1, 1, 0, 0], [1, 1, 1, 0, 0]]


@pytest.mark.parametrize("kind", KINDS)
def test_kd_loss_masked_mean_and_gradients(kind):
    g = torch.Generator().manual_seed(5)
    student = (torch.randn(2, 6, 13, generator=g) * 3).requires_grad_(True)
    teacher = torch.randn(2, 6, 13, generator=g) * 3
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    out = kd_loss(student, kind, teacher_logits=teacher, mask=mask, beta=0.5)
    per = kd_divergence(student.detach(), teacher, kind)
    assert int(out.tokens) == 5
    assert torch.allclose(out.loss.detach(), per[mask].mean(), atol=1e-6)
    out.loss.backward()
    assert torch.isfinite(student.grad).all() and student.grad[~mask].abs().sum() == 0
    # top-k teacher from the same logits, explicit normaliser
    values, indices = teacher.topk(4, -1)
    student.grad = None
    top = kd_loss(student, kind, topk_values=values.bfloat16(), topk_indices=indices,
                  logsumexp=torch.logsumexp(teacher, -1), mask=mask, normalizer=10.0)
    top.loss.backward()
    assert torch.isfinite(top.loss) and torch.isfinite(student.grad).all()
    assert torch.allclose(top.loss.detach() * 10.0, top.total)


def test_kd_loss_needs_one_teacher():
    student, teacher = fixed_logits()
    with pytest.raises(ValueError, match="exactly one teacher"):
        kd_loss(student, "fkl")
    with pytest.raises(ValueError, match="exactly one teacher"):
        kd_loss(student, "fkl", teacher_logits=teacher, topk_values=teacher[:, :2])


def test_extreme_logits_stay_finite():
    student = torch.tensor([[100.0, -100.0, 0.0]], requires_grad=True)
    teacher = torch.tensor([[-100.0, 100.0, 0.0]])
    for kind in KINDS:
        loss = kd_divergence(student, teacher, kind).sum()
        (grad,) = torch.autograd.grad(loss, student)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), kind
    assert divergence_from_logprobs(torch.log_softmax(teacher, -1), torch.log_softmax(teacher, -1), "tvd").item() == 0
