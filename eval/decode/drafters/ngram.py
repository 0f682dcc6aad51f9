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
from draftsmith.eval.decode.tree import DraftTree, depth_list, trie


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
        self.index = NgramIndex(self.min_ngram, self.max_ngram)

    def continuations(self, context: torch.Tensor) -> list[list[int]]:
        """Up to num_branches distinct continuations, longest n-gram and most recent match first."""
        tokens = self.index.update(context.tolist())
        found: list[list[int]] = []
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            for start in reversed(self.index.starts[n].get(tuple(tokens[-n:]), ())):
                follow = tokens[start + n: start + n + self.budget]
                if follow not in found:
                    found.append(follow)
                    if len(found) == self.num_branches:
                        return found
        return found

    def forget(self) -> None:
        self.index = NgramIndex(self.min_ngram, self.max_ngram)

    def propose(self, root, context, sampling, generator) -> DraftTree:
        tokens, parents = trie(self.continuations(context))
        tokens, parents = tokens[: self.budget], parents[: self.budget]  # first-seen order: parents stay in
        if not tokens:
            return DraftTree.empty(context.device)
        return DraftTree.from_lists(tokens, parents, depth_list(parents), device=context.device)


class NgramIndex:
    """Where each n-gram of a context starts, for the windows that end before its last token, kept from one round to
    the next: a context that extends the one before is indexed from where that one ended (a few tokens a round, no
    tensor op), any other anew."""

    def __init__(self, min_ngram: int, max_ngram: int):
        self.sizes = range(min_ngram, max_ngram + 1)
        self.tokens: list[int] = []
        self.starts: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in self.sizes}

    def update(self, tokens: list[int]) -> list[int]:
        """Index `tokens`, the context as a list; returns them."""
        known = len(self.tokens)
        if known > len(tokens) or tokens[:known] != self.tokens:
            self.starts, known = {n: {} for n in self.sizes}, 0
        for end in range(max(known, 1), len(tokens)):  # the windows ending before the last token
            for n, starts in self.starts.items():
                if end >= n:
                    starts.setdefault(tuple(tokens[end - n:end]), []).append(end - n)
        self.tokens = tokens
        return tokens
