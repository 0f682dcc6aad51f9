"""Union of several drafters: their trees merged into one trie per round, or a cascade.

A training-free lookup drafter and a trained one miss different tokens: prompt lookup copies spans
the context repeats (MT-Bench's second turns, names, code identifiers), a trained drafter predicts
fresh text. Verifying both proposals in one target forward keeps the better of the two per round
for the price of a few more tree nodes.

  mode "union" (bench method `union`): every sub-drafter proposes its own tree (its own shape and
      budget); the trees are merged into a trie (a prefix two drafters share becomes one node).
      Sub-drafters come in priority order: the first one's nodes go in first (and first among
      siblings), later ones add the nodes they do not share; the merge stops at `budget` nodes,
      and insertion order keeps the cut tree ancestor-closed.
  mode "first" (bench method `cascade`): the sub-drafters are asked in order and the first
      non-empty tree is the proposal (the lookup when the context repeats a 2-gram, else the
      trained drafter, which skips its forward that round). Sub-drafters that were not asked still
      `observe` every committed token, so their state stays in step.

Losslessness: in union mode the sub-drafters propose greedily (sampling None), so every node is a
deterministic function of the context and the tree carries no q rows (point masses), which
`verify_sampling` handles exactly (as for Minions). In first mode the chosen drafter's own tree,
with its q rows at temperature > 0, is proposed unchanged: which drafter is chosen depends only on
the context and the earlier drafters' draws, never on the chosen one's, so its q is the
distribution its nodes were drawn from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.config import TextEnum, enum_member
from draftsmith.eval.decode.drafters.base import TREE_BUDGET, CompositeDrafter, Drafter, Sampling
from draftsmith.eval.decode.tree import DraftTree


@dataclass
class MergedProposal:
    tokens: list[int]  # per node, insertion order (parents first)
    parents: list[int]  # -1 = root
    owners: list[int]  # per node: the first sub-drafter that proposed it


def merge_trees(trees: list[DraftTree], budget: int) -> MergedProposal:
    """Trie of several topologically ordered trees, in priority order, cut at `budget` nodes."""
    key_to_node: dict[tuple[int, int], int] = {}
    merged = MergedProposal([], [], [])
    for owner, tree in enumerate(trees):
        local: dict[int, int] = {}  # this tree's node -> merged node
        for node, (token, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
            merged_parent = -1 if parent < 0 else local.get(parent)
            if merged_parent is None:  # its parent was cut by the budget
                continue
            key = (merged_parent, int(token))
            if key not in key_to_node:
                if len(merged.tokens) >= budget:
                    continue
                key_to_node[key] = len(merged.tokens)
                merged.tokens.append(int(token))
                merged.parents.append(merged_parent)
                merged.owners.append(owner)
            local[node] = key_to_node[key]
    return merged


def credit_accepted(merged: MergedProposal, accepted: list[int]) -> list[int]:
    """Owners of the merged nodes along the accepted tokens' path (one per accepted draft token)."""
    owners, node = [], -1
    for token in accepted:
        node = next((child for child, parent in enumerate(merged.parents)
                     if parent == node and merged.tokens[child] == token), None)
        if node is None:
            break
        owners.append(merged.owners[node])
    return owners


class UnionMode(TextEnum):
    UNION = "union"  # every drafter's tree, merged
    FIRST = "first"  # the first drafter that proposes (a cascade)


class UnionDrafter(CompositeDrafter):
    """Merged trees of several drafters, or the first that proposes (see the module docstring)."""

    def __init__(self, drafters: list[Drafter], mode: UnionMode | str = UnionMode.UNION,
                 budget: int = TREE_BUDGET, name: str = "union"):
        mode = enum_member(UnionMode, mode, "union: mode")
        super().__init__(drafters, what=name)
        self.mode, self.budget, self.name = mode, budget, name
        self.proposed = [0] * len(drafters)  # rounds in which each sub-drafter's tree was used
        self.accepted = [0] * len(drafters)  # accepted draft tokens credited to each (first proposer)
        self._last: MergedProposal | None = None

    def begin(self, prompt_ids):
        super().begin(prompt_ids)
        self._last = None

    def observe(self, tokens, hidden):
        super().observe(tokens, hidden)
        if self._last is not None:  # tokens = the round's root, then its accepted draft tokens
            for owner in credit_accepted(self._last, tokens[1:].tolist()):
                self.accepted[owner] += 1
            self._last = None

    @torch.inference_mode()
    def propose(self, root: int, context: torch.Tensor, sampling: Sampling | None, generator) -> DraftTree:
        if self.mode is UnionMode.FIRST:
            return self._first(root, context, sampling, generator)
        trees = [drafter.propose(root, context, None, None) for drafter in self.drafters]
        merged = merge_trees(trees, self.budget)
        for owner in set(merged.owners):
            self.proposed[owner] += 1
        self._last = merged
        if not merged.tokens:
            return DraftTree.empty(context.device)
        return DraftTree.from_parents(torch.tensor(merged.tokens, device=context.device),
                                      torch.tensor(merged.parents, device=context.device))

    def _first(self, root, context, sampling, generator) -> DraftTree:
        for index, drafter in enumerate(self.drafters):
            tree = drafter.propose(root, context, sampling, generator)
            if tree.size:
                self.proposed[index] += 1
                self._last = MergedProposal(tree.tokens.tolist(), tree.parents.tolist(), [index] * tree.size)
                return tree
        self._last = None
        return DraftTree.empty(context.device)

    def summary(self) -> dict:
        names = [d.name for d in self.drafters]
        return {"mode": self.mode, "rounds_proposed": dict(zip(names, self.proposed)),
                "accepted_tokens": dict(zip(names, self.accepted))}
