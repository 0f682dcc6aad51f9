"""Prompt-lookup (n-gram) drafter: training-free, proposes continuations of earlier matches.

The last n tokens of the context (n from `max_ngram` down to `min_ngram`) are searched for in
the context itself, most recent match first; the `budget` tokens that followed a match are
proposed. With `num_branches` > 1 several distinct continuations are merged into a trie, giving
a token tree, cut to `budget` nodes in first-seen order (earlier branches win), so `budget` is the
node budget as for every drafter. Proposals are deterministic, so for sampling each node is a point mass.
"""

from __future__ import annotations

import torch

from draftsmith.eval.decode.drafters.base import Drafter, InputError, check_sizes
from draftsmith.eval.decode.tree import DraftTree, trie


NGRAM_BUDGET = 5  # tokens proposed after a match


class NgramDrafter(Drafter):
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, budget: int = NGRAM_BUDGET, num_branches: int = 1,
                 name: str = "ngram"):
        check_sizes(name, max_ngram=max_ngram, min_ngram=min_ngram, budget=budget, num_branches=num_branches)
        if not min_ngram <= max_ngram:
            raise InputError(f"{name}: need min_ngram <= max_ngram, got {min_ngram} > {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.budget, self.num_branches = budget, num_branches
        self.name = name

    def continuations(self, context: torch.Tensor) -> list[list[int]]:
        """Up to num_branches distinct continuations, longest n-gram and most recent match first."""
        found: list[list[int]] = []
        length = context.numel()
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            pattern = context[-n:]
            windows = context[: length - 1].unfold(0, n, 1)  # (length - n, n): windows ending before the last token
            starts = torch.nonzero((windows == pattern).all(-1)).flatten().tolist()
            for start in reversed(starts):
                follow = context[start + n: start + n + self.budget].tolist()
                if follow and follow not in found:
                    found.append(follow)
                    if len(found) == self.num_branches:
                        return found
        return found

    def propose(self, root, context, sampling, generator) -> DraftTree:
        tokens, parents = trie(self.continuations(context))
        tokens, parents = tokens[: self.budget], parents[: self.budget]  # first-seen order: parents stay in
        if not tokens:
            return DraftTree.empty(context.device)
        return DraftTree.from_parents(torch.tensor(tokens, device=context.device),
                                      torch.tensor(parents, device=context.device))
