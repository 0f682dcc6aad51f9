"""Every drafter's default tree and budget, declared once: drafters (eval/decode/drafters), bench methods
(eval/bench/methods.py) and exports (models/exports.py, their manifest's `tree`) all read them from here.

`budget` is the most draft nodes a drafter proposes per round (a chain's length, a tree's node count). An export
manifest's `tree` is `TreeShape.to_manifest()`: {"depth", "topk", "budget"}; manifests written before the key was
spelled out call the budget `g` (Dovetail's name), and `TreeShape.from_manifest` reads both.
"""

from __future__ import annotations

from dataclasses import dataclass

TREE_BUDGET = 16  # draft nodes per round of every tree drafter (Dovetail's g = 16)
CHAIN_BUDGET = 4  # draft tokens per round of chain drafters
# Medusa heads' default tree: 3 nodes, the ARCA tree from their held-out per-rank accuracy. On the Zen 4 goal bench
# (10M-token heads) 3 nodes gave 1.33-1.34x in three runs, 5 nodes 1.30x, 11 nodes 1.02-1.03x: a wider tree's
# extra acceptance (tau 1.45 -> 1.68) costs more per round than it returns. Where a verify's extra rows are cheaper
# (the AVX2 EPYC with rows in quads and grouped requests) 5 nodes lead: 1.22x against 3 nodes' 1.16x, 8 nodes 1.16x
# (results/drafter_families_epyc_avx2/medusa_trees_request_groups); the families table runs both.
MEDUSA_BUDGET = 3


@dataclass(frozen=True)
class TreeShape:
    depth: int
    topk: int
    budget: int

    def to_manifest(self) -> dict:
        return {"depth": self.depth, "topk": self.topk, "budget": self.budget}

    @classmethod
    def from_manifest(cls, tree: dict, default: "TreeShape") -> "TreeShape":
        """The manifest's tree (missing keys from `default`; `g` is the budget's older name)."""
        budget = tree.get("budget", tree.get("g", default.budget))
        return cls(int(tree.get("depth", default.depth)), int(tree.get("topk", default.topk)), int(budget))


DGF_TREE = TreeShape(depth=7, topk=10, budget=TREE_BUDGET)  # Dovetail's dynamic tree for feature drafters
LM_TREE = TreeShape(depth=4, topk=3, budget=TREE_BUDGET)  # a small LM's EAGLE-2-style dynamic tree
LM_CHAIN_SPEC = f"lm-chain:budget={CHAIN_BUDGET}"
LM_TREE_SPEC = f"lm-tree:depth={LM_TREE.depth},topk={LM_TREE.topk},budget={LM_TREE.budget}"
