"""Token trees as pure tensor functions: structure, attention masks, position ids, static trees.

A draft tree has n nodes in topological order (every parent index < its child's index). Node i
carries a token, its parent (-1 = the root, i.e. the last committed token that the target has not
processed yet) and its depth (1 for children of the root). The verification forward feeds
[root, node_0, ..., node_{n-1}], so "slot" s = 0 is the root and slot i + 1 is node i.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A proposal: tokens (n,), parents (n,), depths (n,) and, for sampling, the per-node q.

    `draft_probs` (n, V) row i is the distribution node i was drawn from (for a sibling drawn
    without replacement: the draft distribution with earlier siblings removed, renormalised).
    None means every node is a deterministic proposal (a point mass on its token).
    """

    tokens: torch.Tensor  # (n,) long
    parents: torch.Tensor  # (n,) long, -1 for children of the root
    depths: torch.Tensor  # (n,) long, >= 1
    draft_probs: torch.Tensor | None = None  # (n, V) float or None

    @property
    def size(self) -> int:
        return int(self.tokens.numel())

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.size else 0

    @classmethod
    def empty(cls, device: torch.device | None = None) -> "DraftTree":
        none = torch.empty(0, dtype=torch.long, device=device)
        return cls(tokens=none, parents=none.clone(), depths=none.clone())

    @classmethod
    def chain(cls, tokens: torch.Tensor, draft_probs: torch.Tensor | None = None) -> "DraftTree":
        """A single path root -> t0 -> t1 -> ... (the classic k-token speculation)."""
        n = tokens.numel()
        index = torch.arange(n, device=tokens.device)
        return cls(tokens=tokens.long(), parents=index - 1, depths=index + 1, draft_probs=draft_probs)

    @classmethod
    def from_parents(cls, tokens: torch.Tensor, parents: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> "DraftTree":
        return cls(tokens=tokens.long(), parents=parents.long(), depths=node_depths(parents),
                   draft_probs=draft_probs)

    @classmethod
    def from_lists(cls, tokens: list[int], parents: list[int], depths: list[int],
                   draft_probs: torch.Tensor | None = None, device: torch.device | None = None) -> "DraftTree":
        """A tree from Python lists (a drafter that grows its few nodes in lists: three tensors, no op per node)."""
        return cls(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                   parents=torch.tensor(parents, dtype=torch.long, device=device),
                   depths=torch.tensor(depths, dtype=torch.long, device=device), draft_probs=draft_probs)

    def validate(self) -> None:
        n = self.size
        if self.parents.shape != (n,) or self.depths.shape != (n,):
            raise ValueError("tokens, parents and depths must all have shape (n,)")
        index = torch.arange(n, device=self.parents.device)
        if bool((self.parents >= index).any()) or bool((self.parents < -1).any()):
            raise ValueError("tree nodes must be topologically ordered (parent index < node index)")
        if self.draft_probs is not None and self.draft_probs.shape[0] != n:
            raise ValueError("draft_probs must have one row per node")


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each node (root children = 1) from topologically ordered parents. (n,)"""
    return torch.tensor(depth_list(parents.tolist()), dtype=parents.dtype, device=parents.device)


def depth_list(parents: list[int]) -> list[int]:
    """node_depths over lists (a drafter's few nodes: no tensor op per node)."""
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """(n+1, n+1) bool over slots (0 = root): [a, b] True iff b is a or an ancestor of a."""
    n = parents.numel()
    rows = [[True] + [False] * n]
    for i, parent in enumerate(parents.tolist()):
        row = list(rows[parent + 1])  # inherit the parent's ancestors (its row is final: parents come first)
        row[i + 1] = True
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool, device=parents.device)  # one tensor, not two ops a node


def tree_attention_mask(parents: torch.Tensor, past_len: int) -> torch.Tensor:
    """Bool 'may attend' mask (1, 1, n+1, past_len + n+1) for the slots [root, nodes...]."""
    n = parents.numel()
    allowed = torch.ones(n + 1, past_len + n + 1, dtype=torch.bool, device=parents.device)
    allowed[:, past_len:] = ancestor_matrix(parents)
    return allowed[None, None]


def tree_position_ids(depths: torch.Tensor, past_len: int) -> torch.Tensor:
    """Position ids (1, n+1) for [root, nodes...]: the root sits at past_len, a node at past_len + depth."""
    root = torch.zeros(1, dtype=depths.dtype, device=depths.device)
    return (torch.cat([root, depths]) + past_len)[None]


def path_to_root(parents: torch.Tensor, node: int) -> list[int]:
    """Node indices from the root's child down to `node` (empty for node = -1)."""
    path = []
    parent_list = parents.tolist()
    while node >= 0:
        path.append(node)
        node = parent_list[node]
    return path[::-1]


def tree_from_paths(paths: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A static tree from Medusa-style "choices": each path lists child ranks from the root.

    [[0], [1], [0, 0], [0, 1]] = top-1 and top-2 at depth 1, then the top-1 and top-2 continuations
    of the depth-1 top-1. Every prefix of a path must itself be a path. Returns (parents (n,),
    depths (n,), ranks (n,)) with nodes sorted by (depth, path): rank = which candidate of its
    depth's distribution (its head, for Medusa) the node takes.
    """
    unique = sorted({tuple(p) for p in paths}, key=lambda p: (len(p), p))
    index = {path: i for i, path in enumerate(unique)}
    parents, ranks = [], []
    for path in unique:
        if not path or min(path) < 0:
            raise ValueError(f"invalid tree path {list(path)}")
        if len(path) > 1 and path[:-1] not in index:
            raise ValueError(f"tree path {list(path)} has no parent path {list(path[:-1])}")
        parents.append(index[path[:-1]] if len(path) > 1 else -1)
        ranks.append(path[-1])
    parents_t = torch.tensor(parents, dtype=torch.long)
    return parents_t, node_depths(parents_t), torch.tensor(ranks, dtype=torch.long)


def trie(sequences) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the trie of token sequences, nodes in first-seen (topological) order;
    shared prefixes become one path (prompt lookup's branches, Self-Draft's candidates)."""
    tokens, parents, index = [], [], {}  # (parent node, token) -> node
    for sequence in sequences:
        parent = -1
        for token in sequence:
            key = (parent, int(token))
            if key not in index:
                index[key] = len(tokens)
                tokens.append(int(token))
                parents.append(parent)
            parent = index[key]
    return tokens, parents


def chain_paths(length: int) -> list[list[int]]:
    """The paths of a k-token chain: [[0], [0, 0], ...]."""
    return [[0] * d for d in range(1, length + 1)]


def select_top_nodes(scores: torch.Tensor, parents: torch.Tensor, budget: int) -> torch.Tensor:
    """Keep the `budget` best-scoring nodes, closed under ancestors, in topological order: top_nodes over tensors,
    the kept indices as a tensor."""
    return torch.tensor(top_nodes(scores.tolist(), parents.tolist(), budget), dtype=torch.long, device=scores.device)


def top_nodes(scores: list[float], parents: list[int], budget: int) -> list[int]:
    """The `budget` best-scoring nodes, closed under ancestors, sorted (EAGLE-2's final re-ranking step).

    `scores` are cumulative log-probabilities (a child never scores above its parent, so the top set is
    ancestor-closed up to ties; ancestors are added explicitly to be safe)."""
    n = len(scores)
    if n <= budget:
        return list(range(n))
    # Stable sort by score then index so that, on ties, parents (smaller index) come first.
    order = sorted(range(n), key=lambda i: (-scores[i], i))
    keep: set[int] = set()
    for i in order:
        if len(keep) >= budget:
            break
        chain = []
        node = i
        while node >= 0 and node not in keep:
            chain.append(node)
            node = parents[node]
        if len(keep) + len(chain) <= budget:
            keep.update(chain)
    return sorted(keep)


def subtree(tree: DraftTree, keep: torch.Tensor) -> DraftTree:
    """Restrict a tree to the node indices `keep` (sorted, ancestor-closed), re-indexing parents."""
    remap = torch.full((tree.size,), -1, dtype=torch.long, device=tree.tokens.device)
    remap[keep] = torch.arange(keep.numel(), device=tree.tokens.device)
    old_parents = tree.parents[keep]
    new_parents = torch.where(old_parents >= 0, remap[old_parents.clamp(min=0)], old_parents)
    probs = None if tree.draft_probs is None else tree.draft_probs[keep]
    return DraftTree(tokens=tree.tokens[keep], parents=new_parents, depths=tree.depths[keep], draft_probs=probs)
