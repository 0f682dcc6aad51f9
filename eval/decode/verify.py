"""Verification of a draft tree against one target forward: greedy and speculative sampling.

`logits` rows are slots: row 0 = the root (last committed token), row i + 1 = tree node i; row s
is the target's prediction for the token that follows slot s.

Greedy: follow, from the root, the child whose token equals the target's argmax; stop when no
child matches; the target's argmax at the last accepted slot is the bonus token. The output is
the target's greedy continuation whatever the draft was.

Sampling (multi-candidate recursive rejection sampling, SpecInfer / EAGLE; one candidate =
Leviathan et al. / Chen et al.): at the current slot with target distribution p, try its children
in the order they were drawn. Child c (token x, drawn from q_c) is accepted with probability
min(1, p(x) / q_c(x)); on rejection p <- normalise(max(p - q_c, 0)) and the next child is tried.
If every child is rejected the next token is drawn from the final residual p; if an accepted node
has no children the bonus token is drawn from the target at that node. Each step is a valid
speculative-sampling step on the current residual, so the emitted token is distributed exactly as
the target's p, provided child c really was drawn from q_c given its earlier siblings (drafters
draw siblings without replacement and pass q with earlier siblings removed; a deterministic
proposal is a point mass, q = None).
"""

from __future__ import annotations

from typing import Callable

import torch

from draftsmith.eval.decode.tree import DraftTree
from draftsmith.models.kernels import argmax_last


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Warp (…, V) logits into sampling probabilities: temperature, then optional top-k / top-p.

    The same function is applied to target and draft logits so that p and q are the distributions
    actually sampled from.
    """
    if temperature <= 0:
        raise ValueError("logits_to_probs is for sampling; temperature must be > 0")
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(logits, descending=True, dim=-1)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop_sorted = cumulative - torch.softmax(sorted_logits, dim=-1) >= top_p  # keep the first token always
        drop = drop_sorted.scatter(-1, sorted_index, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.softmax(logits, dim=-1)


def children_lists(parents: torch.Tensor) -> list[list[int]]:
    """children[s] = node indices whose parent slot is s (slot 0 = root), in node order."""
    children: list[list[int]] = [[] for _ in range(parents.numel() + 1)]
    for node, parent in enumerate(parents.tolist()):
        children[parent + 1].append(node)
    return children


def verify_greedy(tree: DraftTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """Longest path whose tokens equal the target's argmax, plus the bonus token.

    logits (n+1, V). Returns (accepted node indices from depth 1 down, bonus token id).
    """
    predicted = argmax_last(logits).tolist()  # (n+1,) target's next token per slot
    return greedy_path(tree, predicted.__getitem__)


def greedy_path(tree: DraftTree, predicted: Callable[[int], int]) -> tuple[list[int], int]:
    """verify_greedy's walk with `predicted(slot)` the target's greedy token after `slot`, asked for the slots of
    the accepted path only, in order (models.engine.GreedyRows computes just those)."""
    tokens = tree.tokens.tolist()
    children = children_lists(tree.parents)
    accepted: list[int] = []
    slot = 0
    while True:
        token = predicted(slot)
        match = next((c for c in children[slot] if tokens[c] == token), None)
        if match is None:
            return accepted, token
        accepted.append(match)
        slot = match + 1


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Recursive rejection sampling over the tree; target_probs (n+1, V) already warped.

    Returns (accepted node indices from depth 1 down, next token id drawn from the target or its
    residual). Lossless: the emitted sequence is distributed as sampling from the target.
    """
    tokens = tree.tokens.tolist()
    children = children_lists(tree.parents)
    device = target_probs.device
    accepted: list[int] = []
    slot = 0
    while True:
        residual = target_probs[slot]
        next_slot = None
        for child in children[slot]:
            token = tokens[child]
            q_token = 1.0 if tree.draft_probs is None else float(tree.draft_probs[child, token])
            p_token = float(residual[token])
            uniform = float(torch.rand((), generator=generator, device=device))
            if q_token > 0 and uniform * q_token < p_token:  # accept with prob min(1, p/q)
                next_slot = child + 1
                break
            if tree.draft_probs is None:
                residual = residual.clone()
                residual[token] = 0.0
            else:
                residual = (residual - tree.draft_probs[child].to(residual.dtype)).clamp_(min=0)
            total = residual.sum()
            if float(total) <= 0:  # p == q up to rounding: p/q >= 1 would have accepted; fall back safely
                residual = target_probs[slot]
            else:
                residual = residual / total
        if next_slot is None:
            token = int(torch.multinomial(residual, 1, generator=generator))
            return accepted, token
        accepted.append(next_slot - 1)
        slot = next_slot
