"""Static Medusa trees from measured head accuracies (Medusa's tree search / Ghidorah's ARCA step 1).

`accuracy[d][r]` is the probability that head d + 1's rank-r candidate is the correct token at depth
d + 1 (measured on held-out data: the recipe's `head_accuracy.json` "rank_accuracy"). Assuming
independence, the tree node reached by child ranks (r_1, ..., r_d) is accepted with probability

    value(r_1..r_d) = prod_i accuracy[i - 1][r_i]

and the expected number of accepted draft tokens of a tree is the sum of its node values (a node
counts when its whole path is accepted). `arca_paths` grows the tree greedily: starting from the
root, it repeatedly adds the candidate node of largest value whose parent is already in the tree,
until `width` nodes are placed. Candidates are only ever the *next* rank of a node's children, so
every node's children use ranks 0..k-1 (what `MedusaDrafter` and sampling verification need); when
accuracies decrease with rank this is no restriction and the greedy tree is the optimal one of its
size for this objective (the top-`width` values form an ancestor- and rank-closed set).

`width` counts draft nodes; the verification forward processes width + 1 tokens (the root too).
Ghidorah refines this estimate by brute-force search over leaves and same-level nodes against real
acceptance; that step needs the decoder and is not done here.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from pathlib import Path


def _check_accuracy(accuracy: Sequence[Sequence[float]]) -> list[list[float]]:
    table = [[float(a) for a in row] for row in accuracy]
    if not table:
        raise ValueError("accuracy table is empty (one row per head expected)")
    for d, row in enumerate(table):
        for r, a in enumerate(row):
            if not 0.0 <= a <= 1.0:
                raise ValueError(f"accuracy[{d}][{r}] = {a} is not a probability")
        if sum(row) > 1.0 + 1e-6:
            raise ValueError(f"accuracy[{d}] sums to {sum(row):.4f} > 1: pass per-rank accuracies, not cumulative "
                             "top-k ones (see rank_accuracy_from_topk)")
    return table


def rank_accuracy_from_topk(topk: Sequence[Sequence[float]]) -> list[list[float]]:
    """Cumulative top-1..top-R accuracies per head -> per-rank accuracies (differences)."""
    return [[row[0]] + [row[r] - row[r - 1] for r in range(1, len(row))] for row in topk]


def path_value(path: Sequence[int], accuracy: Sequence[Sequence[float]]) -> float:
    """Estimated acceptance probability of the node reached by child ranks `path`."""
    value = 1.0
    for depth, rank in enumerate(path):
        row = accuracy[depth]
        value *= row[rank] if rank < len(row) else 0.0
    return value


def expected_accepted(paths: Sequence[Sequence[int]], accuracy: Sequence[Sequence[float]]) -> float:
    """Expected accepted draft tokens per step (add 1 for the bonus token to estimate tau)."""
    return sum(path_value(p, accuracy) for p in {tuple(p) for p in paths})


def arca_paths(accuracy: Sequence[Sequence[float]], width: int, max_depth: int | None = None) -> list[list[int]]:
    """Greedy expected-acceptance tree of `width` nodes as Medusa "choices" (child-rank paths).

    accuracy: (num_heads, num_ranks) per-rank accuracies; max_depth: at most this many heads
    (default: all). Returns the paths in the order they were added (a prefix of the result is
    the greedy tree of that smaller width); fewer than `width` when the table runs out of nodes
    (depth x ranks) or of nodes with a nonzero value. Ties go to the shallower, then
    lexicographically smaller path.
    """
    table = _check_accuracy(accuracy)
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width}")
    depth_limit = len(table) if max_depth is None else min(max_depth, len(table))
    paths: list[list[int]] = []
    frontier: list[tuple[float, int, tuple[int, ...], float, float]] = []  # (-value, depth, path, value, parent value)

    def offer(parent: tuple[int, ...], parent_value: float, rank: int) -> None:
        depth = len(parent)  # 0-based head index of the child
        if depth >= depth_limit or rank >= len(table[depth]):
            return
        value = parent_value * table[depth][rank]
        if value > 0.0:
            child = parent + (rank,)
            heapq.heappush(frontier, (-value, len(child), child, value, parent_value))

    offer((), 1.0, 0)
    while frontier and len(paths) < width:
        _, _, path, value, parent_value = heapq.heappop(frontier)
        paths.append(list(path))
        offer(path[:-1], parent_value, path[-1] + 1)  # the next sibling rank becomes available
        offer(path, value, 0)  # and the node's own first child
    return paths


def load_rank_accuracy(path: str | Path) -> list[list[float]]:
    """Per-rank accuracies from a recipe's `head_accuracy.json` (or the directory holding it)."""
    path = Path(path)
    if path.is_dir():
        path = path / "head_accuracy.json"
    if not path.is_file():
        raise FileNotFoundError(f"head accuracy file not found: {path}")
    doc = json.loads(path.read_text())
    if "rank_accuracy" not in doc:
        raise ValueError(f"{path}: no 'rank_accuracy' table")
    return doc["rank_accuracy"]
