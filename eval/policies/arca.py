"""ARCA (Ghidorah III-C): acceptance recorded per tree rank, trees refined against it, profile documents.

The greedy expected-acceptance tree of a budget from per-rank accuracies (`arca_paths`) is a Medusa
artifact function and lives in `models.medusa` (exports record it as medusa_choices); it is
re-exported here. `RankRecorder` wraps any drafter and records which rank the target took at each
depth; `replay_tau` / `refine_paths` score and improve static trees against those recorded rounds
(Ghidorah's neighbour search over leaves and same-level nodes); profile documents are written by
`eval.arca_profile` and read by the bench's `arca:` method.
"""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.errors import UserError
from draftsmith.eval.decode.drafters.base import Drafter
from draftsmith.eval.decode.tree import DraftTree
from draftsmith.fileio import atomic_write
from draftsmith.models.engine import Backend
from draftsmith.models.medusa import (DEFAULT_MEDUSA_PATHS, arca_paths, expected_accepted, load_rank_accuracy,
                                      path_value, rank_accuracy_from_topk)

__all__ = ["DEFAULT_MEDUSA_PATHS", "arca_paths", "expected_accepted", "load_rank_accuracy", "path_value",
           "rank_accuracy_from_topk", "RankRecorder", "replay_tau", "refine_paths", "save_profile", "load_profile",
           "profile_paths", "interpolate_latency"]


# --------------------------------------------------------------------------------------------
# Acceptance recording and tree refinement (ARCA step 2)
# --------------------------------------------------------------------------------------------


class RankRecorder(Drafter):
    """Wraps a drafter; per round, the rank path the target took through the proposed tree.

    A node's rank is its position among its siblings in the tree (drafters list children best
    first). After a round, the tokens appended to the context (accepted + bonus) are walked down
    the tree: at depth k the target's token is found among the children of the depth k-1 path
    node (rank r, counted in hits[k][r]) or not (a miss, the round's end). Depths whose path node
    has no children in the tree are not attempts. The last round of each request, whose bonus
    token is never seen, is dropped.
    """

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.name, self.hidden_layers, self.tokenizer = inner.name, inner.hidden_layers, inner.tokenizer
        self.hits: dict[int, dict[int, int]] = {}  # depth -> rank -> rounds where the target took it
        self.attempts: dict[int, int] = {}  # depth -> rounds whose path node at depth - 1 had children
        self.rank_paths: list[list[int]] = []  # per round: ranks taken, then -1 if it ended on a miss
        self._pending: tuple[DraftTree, int] | None = None  # (tree, context length when proposed)

    def begin(self, prompt_ids):
        self._pending = None
        self.inner.begin(prompt_ids)

    def forget(self) -> None:
        self.inner.forget()

    def observe(self, tokens, hidden):
        self.inner.observe(tokens, hidden)

    def propose(self, root, context, sampling, generator):
        if self._pending is not None:
            tree, known = self._pending
            self._record(tree, context[known:].tolist())
        tree = self.inner.propose(root, context, sampling, generator)
        self._pending = (tree, context.numel())
        return tree

    def _record(self, tree: DraftTree, appended: list[int]) -> None:
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents):
            children.setdefault(parent, []).append(node)
        node, path = -1, []
        for depth, token in enumerate(appended, start=1):
            kids = children.get(node, [])
            if not kids:
                break
            self.attempts[depth] = self.attempts.get(depth, 0) + 1
            ranks = [i for i, kid in enumerate(kids) if tokens[kid] == token]
            if not ranks:
                path.append(-1)
                break
            rank = ranks[0]
            self.hits.setdefault(depth, {})
            self.hits[depth][rank] = self.hits[depth].get(rank, 0) + 1
            path.append(rank)
            node = kids[rank]
        self.rank_paths.append(path)

    def rank_accuracy(self, max_rank: int | None = None) -> list[list[float]]:
        """(depth, rank) conditional acceptance: hits / attempts at that depth."""
        table = []
        for depth in sorted(self.attempts):
            attempts = self.attempts[depth]
            hits = self.hits.get(depth, {})
            ranks = (max(hits) + 1) if hits else 1
            if max_rank is not None:
                ranks = min(ranks, max_rank)
            table.append([hits.get(r, 0) / attempts for r in range(ranks)])
        return table


def replay_tau(paths: list[list[int]], rank_paths: list[list[int]]) -> float:
    """Mean accepted length (bonus included) of the static rank tree `paths` over recorded rounds."""
    if not rank_paths:
        return float("nan")
    tree = {tuple(p) for p in paths}
    total = 0
    for ranks in rank_paths:
        accepted = 0
        for depth in range(1, len(ranks) + 1):
            if ranks[depth - 1] < 0 or tuple(ranks[:depth]) not in tree:
                break
            accepted = depth
        total += accepted + 1
    return total / len(rank_paths)


def _closed(tree: set[tuple[int, ...]]) -> bool:
    for path in tree:
        if len(path) > 1 and path[:-1] not in tree:
            return False
        if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in tree:
            return False
    return True


def refine_paths(paths: list[list[int]], rank_paths: list[list[int]], allowed: set[tuple[int, ...]] | None,
                 iterations: int = 8) -> tuple[list[list[int]], float]:
    """Neighbour search (Ghidorah: leaves and same-level nodes): swap one removable leaf for one
    free slot (the next rank under a tree node, or a first child) while the replayed tau improves.
    `allowed`: the nodes the replay can score exactly (the calibration tree); None = any."""
    tree = {tuple(p) for p in paths}
    best = replay_tau([list(p) for p in tree], rank_paths)
    for _ in range(iterations):
        leaves = [p for p in tree if not any(q[:-1] == p for q in tree if len(q) == len(p) + 1)
                  and p[:-1] + (p[-1] + 1,) not in tree]
        slots = set()
        for p in list(tree) + [()]:
            count = sum(1 for q in tree if len(q) == len(p) + 1 and q[:-1] == p)
            slots.add(p + (count,))
        slots -= tree
        if allowed is not None:
            slots &= allowed
        improved, candidate_best = False, None
        for leaf in leaves:
            for slot in slots:
                if slot[:-1] == leaf:
                    continue
                candidate = (tree - {leaf}) | {slot}
                if not _closed(candidate):
                    continue
                score = replay_tau([list(p) for p in candidate], rank_paths)
                if score > best + 1e-12:
                    best, candidate_best, improved = score, candidate, True
        if not improved:
            break
        tree = candidate_best
    return sorted([list(p) for p in tree], key=lambda p: (len(p), p)), best



# --------------------------------------------------------------------------------------------
# Profile documents (written by eval.arca_profile, read by the bench's `arca:` method)
# --------------------------------------------------------------------------------------------

PROFILE_VERSION = 3  # 1 called the budget "width"; 2 had no backend/dtype in its pick (eager, its dtype); both read


def save_profile(profile: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(profile, indent=2, default=str)))
    return path


def load_profile(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ARCA profile not found: {path}")
    try:
        doc = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not a JSON ARCA profile ({err})") from err
    if doc.get("version") == 1 and "widths" in doc and "best" in doc:  # the budget was called width
        doc["budgets"] = doc.pop("widths")
        doc["best"]["budget"] = doc["best"].pop("width", None)
        doc["version"] = 2
    if doc.get("version") == 2 and "best" in doc:  # measured on the eager engine in one dtype
        doc["best"].setdefault("backend", Backend.EAGER.value)
        doc["best"].setdefault("dtype", doc.get("config", {}).get("dtype", "float32"))
        doc["version"] = PROFILE_VERSION
    for key in ("version", "drafter", "best", "trees", "budgets"):
        if key not in doc:
            raise UserError(f"{path}: not an ARCA profile (missing {key!r})")
    if doc["version"] != PROFILE_VERSION:
        raise UserError(f"{path}: profile version {doc['version']}, this code reads {PROFILE_VERSION}")
    doc["trees"] = {int(w): paths for w, paths in doc["trees"].items()}
    return doc


def profile_paths(profile: dict, budget: int | None = None) -> list[list[int]]:
    """The tree ARCA chose for `budget` (default: the picked budget)."""
    budget = profile["best"]["budget"] if budget is None else budget
    if budget not in profile["trees"]:
        raise UserError(f"the profile has no tree for budget {budget}; budgets: {sorted(profile['trees'])}")
    return profile["trees"][budget]

def interpolate_latency(curve: dict[int, float], nodes: int, step: bool = False) -> float:
    """T at `nodes` draft nodes from the measured budgets: linear between them (eager), or, with `step`,
    the next measured budget's (a compiled engine pads to its bucket, measured at the bucket's top);
    clamped at the ends."""
    budgets = sorted(int(w) for w in curve)
    values = {int(w): t for w, t in curve.items()}
    if step:
        return values[next((b for b in budgets if b >= nodes), budgets[-1])]
    if nodes <= budgets[0]:
        return values[budgets[0]]
    if nodes in values:  # a measured budget: its own time (interpolating to it can round off its last bit)
        return values[nodes]
    for low, high in zip(budgets, budgets[1:]):
        if nodes <= high:
            return values[low] + (values[high] - values[low]) * (nodes - low) / (high - low)
    return values[budgets[-1]]
