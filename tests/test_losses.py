"""Losses == reference formulas on fixed tensors; accumulation equivalence of the normalisers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from draftsmith.train.losses import (IGNORE_INDEX, head_weights, lm_labels, lm_loss, medusa_labels, medusa_loss, rank_hits,
                          shifted_labels, teacher_positions)


def _batch(seed=0, batch=3, length=9, vocab=11):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, length), generator=gen)
    mask = (torch.rand(batch, length, generator=gen) > 0.3).long()
    return ids, mask


def test_medusa_labels_match_loops():
    ids, mask = _batch()
    k_heads = 3
    labels = medusa_labels(ids, mask, k_heads)
    assert labels.shape == (k_heads, 3, 9)
    for k in range(1, k_heads + 1):
        for b in range(3):
            for t in range(9):
                j = t + k + 1
                want = int(ids[b, j]) if j < 9 and mask[b, j] else IGNORE_INDEX
                assert int(labels[k - 1, b, t]) == want


def test_lm_labels_are_next_token():
    ids, mask = _batch(1)
    labels = lm_labels(ids, mask)
    for b in range(3):
        for t in range(9):
            want = int(ids[b, t + 1]) if t + 1 < 9 and mask[b, t + 1] else IGNORE_INDEX
            assert int(labels[b, t]) == want
    assert torch.equal(shifted_labels(ids, mask, 20), torch.full_like(ids, IGNORE_INDEX))


def test_head_weights():
    assert torch.allclose(head_weights(4, 0.8), torch.tensor([1.0, 0.8, 0.64, 0.512]))
    assert torch.allclose(head_weights(2, weights=[0.3, 0.7]), torch.tensor([0.3, 0.7]))
    with pytest.raises(ValueError, match="3 head weights given for 2 heads"):
        head_weights(2, weights=[1, 1, 1])


def _reference_loss(logits, labels, weights, teacher=None, alpha=0.0, tau=1.0):
    total = 0.0
    for k in range(logits.shape[0]):
        terms = []
        for n in range(logits.shape[1]):
            y = int(labels[k, n])
            if y == IGNORE_INDEX:
                continue
            z = logits[k, n].double()
            ce = -(z[y] - torch.logsumexp(z, 0))
            term = (1 - alpha) * ce
            if teacher is not None and alpha > 0:
                p = torch.softmax(teacher[k, n].double() / tau, 0)
                q = torch.softmax(z / tau, 0)
                term = term + alpha * tau ** 2 * (p * (p.log() - q.log())).sum()
            terms.append(term)
        total += float(weights[k]) * (sum(terms) / max(len(terms), 1))
    return float(total)


@pytest.mark.parametrize("alpha,tau", [(0.0, 1.0), (0.3, 1.0), (0.5, 2.0), (1.0, 1.0)])
def test_medusa_loss_matches_reference(alpha, tau):
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 7, 13, generator=gen)
    teacher = torch.randn(3, 7, 13, generator=gen)
    labels = torch.randint(0, 13, (3, 7), generator=gen)
    labels[0, 2] = labels[2, :4] = IGNORE_INDEX
    weights = head_weights(3, 0.8)
    out = medusa_loss(logits, labels, weights, teacher, distill_weight=alpha, temperature=tau)
    assert out.loss.item() == pytest.approx(_reference_loss(logits, labels, weights, teacher, alpha, tau), rel=1e-5)
    assert out.head_tokens.tolist() == [6, 7, 3]
    ce0 = F.cross_entropy(logits[0], labels[0], ignore_index=IGNORE_INDEX, reduction="sum")
    assert out.head_ce[0].item() == pytest.approx(ce0.item(), rel=1e-6)


def test_medusa_loss_validates():
    logits, labels = torch.randn(2, 4, 5), torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="teacher_logits"):
        medusa_loss(logits, labels, head_weights(2), distill_weight=0.5)
    with pytest.raises(ValueError, match="do not match"):
        medusa_loss(logits, labels[:, :3], head_weights(2))


def test_global_normaliser_makes_accumulation_exact():
    """Two halves normalised by the whole batch's token counts == the whole batch at once."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 10, 9, generator=gen, requires_grad=True)
    labels = torch.randint(0, 9, (2, 10), generator=gen)
    labels[1, 7:] = IGNORE_INDEX
    weights = head_weights(2)
    whole = medusa_loss(logits, labels, weights).loss
    (grad_whole,) = torch.autograd.grad(whole, logits)
    norm = (labels != IGNORE_INDEX).sum(1).float()
    halves = [medusa_loss(logits[:, s], labels[:, s], weights, normalizer=norm).loss
              for s in (slice(0, 4), slice(4, 10))]
    (grad_parts,) = torch.autograd.grad(sum(halves), logits)
    assert sum(halves).item() == pytest.approx(whole.item(), rel=1e-6)
    assert torch.allclose(grad_parts, grad_whole, atol=1e-7)


def test_lm_loss_matches_cross_entropy():
    ids, mask = _batch(5, vocab=13)
    logits = torch.randn(3, 9, 13, generator=torch.Generator().manual_seed(5))
    labels = lm_labels(ids, mask)
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    assert lm_loss(logits, labels).item() == pytest.approx(ref.item(), rel=1e-6)
    count = int((labels != IGNORE_INDEX).sum())
    assert lm_loss(logits, labels, normalizer=1.0).item() == pytest.approx(ref.item() * count, rel=1e-5)


def test_rank_hits_match_sorting():
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 50, 20, generator=gen)
    labels = torch.randint(0, 20, (2, 50), generator=gen)
    labels[1, :5] = IGNORE_INDEX
    hits = rank_hits(logits, labels, max_rank=4)
    for k in range(2):
        order = logits[k].argsort(-1, descending=True)
        for r in range(4):
            want = sum(1 for n in range(50) if labels[k, n] != IGNORE_INDEX and order[n, r] == labels[k, n])
            assert int(hits[k, r]) == want
    top1 = (logits[0].argmax(-1) == labels[0]).sum()
    assert int(hits[0, 0]) == int(top1)


def test_teacher_positions():
    pos = torch.tensor([0, 3, 5])
    assert teacher_positions(pos, 2).tolist() == [[1, 4, 6], [2, 5, 7]]


def test_distillation_with_teacher_equal_to_student_is_zero_kl():
    logits = torch.randn(2, 6, 8)
    labels = torch.randint(0, 8, (2, 6))
    out = medusa_loss(logits, labels, head_weights(2), teacher_logits=logits.clone(), distill_weight=1.0)
    assert out.loss.item() == pytest.approx(0.0, abs=1e-6)
    assert math.isfinite(out.head_ce.sum().item())
