"""Re-ranking a block drafter's candidates by the tokens before them.

A block drafter (DFlash) proposes every position of its block from one forward: block position d reads a mask
where the token drafted at d - 1 will be, so its distribution q_d is a marginal over what may come first. Given a
node's two tokens before it (its parent's and grandparent's; the root and the context's last before the root at
depth 1), a candidate c of position d scores

    log q_d(c) + weight * log P(c | two before)                            (the training answers' n-gram prior,
                                                                            data.ngram_prior; from depth 2 on)
               + context_weight * (log(1 + n(last, c)) + log(1 + n(two before, c)))   (the request's own tokens)

where n counts the pairs and triples in the request's committed tokens (prompt and output so far). Normalized
over the position's candidates, the scores are each node's log-probability under its parent, summed down a path
as the path's. Any proposal is verified, so the output is the target's whatever the prior says.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from draftsmith.data.ngram_prior import NgramPrior
from draftsmith.eval.decode.drafters.base import InputError

PRIOR_WEIGHT = 0.2  # the probe's best on held-out answers (results/drafter_families_epyc_avx2/dflash_prior)
CANDIDATES = 10  # each block position's top candidates re-ranked


class CandidatePrior:
    def __init__(self, ngrams: NgramPrior | None, weight: float, context_weight: float):
        self.ngrams, self.weight, self.context_weight = ngrams, weight, context_weight
        self.begin()

    def begin(self) -> None:
        """A new request: no context counted."""
        self.tokens: list[int] = []
        self.pairs: Counter = Counter()
        self.triples: Counter = Counter()

    def extend(self, context: torch.Tensor | list[int]) -> None:
        """Count the committed tokens not yet counted (`context`: the request's tokens so far, root last; only
        the new ones are read, so a round costs its few tokens, not the whole context). After it, `tokens[-2:]` are
        the token before the root and the root."""
        if len(context) < len(self.tokens):
            self.begin()
        new = context[len(self.tokens):]
        for token in (new.tolist() if isinstance(new, torch.Tensor) else new):
            tokens = self.tokens
            if tokens:
                self.pairs[tokens[-1], token] += 1
            if len(tokens) > 1:
                self.triples[tokens[-2], tokens[-1], token] += 1
            tokens.append(token)

    def scores(self, depth: int, before: int, last: int, candidates: list[int]) -> list[float]:
        """What each candidate token of block position `depth` gains under a node whose token is `last` and whose
        parent's is `before` (at depth 1: the root and the token before it)."""
        if self.ngrams is not None and self.weight and depth >= 2:
            out = [self.weight * value for value in self.ngrams.log_prob(before, last, candidates)]
        else:
            out = [0.0] * len(candidates)
        if self.context_weight:
            pairs, triples = self.pairs, self.triples
            for column, token in enumerate(candidates):
                seen = pairs.get((last, token), 0)
                if seen:
                    followed = triples.get((before, last, token), 0)
                    out[column] += self.context_weight * (math.log1p(seen) + math.log1p(followed))
        return out


def refuse_sampled_prior(name: str, prior: CandidatePrior | None, sampling, remedy: str) -> None:
    """A prior re-ranks greedy trees only: a sampled node's distribution must be the drafter's own."""
    if sampling is not None and prior is not None:
        raise InputError(f"{name}: a prior re-ranks a greedy tree; a sampled node's distribution must be the "
                         f"drafter's own: {remedy} or decode greedily")


def reranked(log_q: list[float], candidates: list[int], gains: list[float], share: float,
             k: int) -> list[tuple[float, int]]:
    """The k best of a node's candidates by log q + gain, as (log-probability, token), best first: q times the gains'
    factors renormalized over the candidates and scaled to `share`, the log of the candidates' total probability
    under q (so keep_above and stop_below cut a re-ranked tree as they cut the drafter's own)."""
    level = [q + gain for q, gain in zip(log_q, gains)]
    top = max(level)
    norm = top + math.log(sum(math.exp(score - top) for score in level)) - share
    best = sorted(range(len(level)), key=level.__getitem__, reverse=True)[:k]
    return [(level[index] - norm, candidates[index]) for index in best]
