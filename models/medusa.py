"""Medusa heads (Cai et al., 2024): K extra decoding heads on the target's final hidden state.

Head k (k = 1..K) predicts the token k + 1 positions after the position it reads (the target's
own LM head predicts 1 ahead). Each head = `num_layers` ResBlocks (x + SiLU(W x + b), W zero-
initialised so an untrained head starts as the target's LM head) followed by an LM head
initialised from the target's. Parameter names follow the FasterDecoding Medusa layout
(`medusa_head.{k}.{j}.linear.*` for ResBlocks, `medusa_head.{k}.{num_layers}.weight` for the LM
head) so exports need no renaming. On disk: `models.artifacts.save_medusa` / `load_medusa_heads`.

Draft vocabulary (models.vocab): with `draft_vocab_size` the heads score only the subset
(`draft_to_target` saved as a buffer); `head: own` gives each head its own Linear(H -> size)
(initialised from the target's rows), `head: slice` shares one frozen slice of the target's LM head
among the heads (only the indices are saved; `init_lm_heads` fills it from the target).

Trees ("medusa_choices"): a node is a path of child ranks from the root. `arca_paths` builds the
greedy expected-acceptance tree of a budget from measured per-rank head accuracies (Medusa's tree
search / Ghidorah's ARCA step 1):
Static Medusa trees from measured head accuracies (Medusa's tree search / Ghidorah's ARCA step 1).

`accuracy[d][r]` is the probability that head d + 1's rank-r candidate is the correct token at depth
d + 1 (measured on held-out data: the recipe's `head_accuracy.json` "rank_accuracy"). Assuming
independence, the tree node reached by child ranks (r_1, ..., r_d) is accepted with probability

    value(r_1..r_d) = prod_i accuracy[i - 1][r_i]

and the expected number of accepted draft tokens of a tree is the sum of its node values (a node
counts when its whole path is accepted). `arca_paths` grows the tree greedily: starting from the
root, it repeatedly adds the candidate node of largest value whose parent is already in the tree,
until `budget` nodes are placed. Candidates are only ever the *next* rank of a node's children, so
every node's children use ranks 0..k-1 (what `MedusaDrafter` and sampling verification need); when
accuracies decrease with rank this is no restriction and the greedy tree is the optimal one of its
size for this objective (the top-`budget` values form an ancestor- and rank-closed set).

`budget` counts draft nodes; the verification forward processes budget + 1 tokens (the root too).
Ghidorah refines this estimate by brute-force search over leaves and same-level nodes against real
acceptance; that step needs the decoder and is not done here.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from draftsmith.errors import UserError
from draftsmith.models.kernels import WeightPrecision, gather_weights, invariant_model, invariant_rows
from draftsmith.models.vocab import DraftHead, DraftVocab

HIDDEN_LAYER = -1  # the final normed hidden state, as the target's LM head (and MedusaDrafter) read it


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # ResBlocks per head
    draft_vocab_size: int | None = None  # None: the target's full vocabulary
    head: DraftHead = DraftHead.OWN  # own: an output layer per head; slice: the target's rows, frozen and shared

    def __post_init__(self):
        if self.head not in (DraftHead.OWN, DraftHead.SLICE):  # (a DraftHead equals its text value)
            raise ValueError(f"head must be 'own' or 'slice', got {self.head!r}")
        self.head = DraftHead(self.head)

    @property
    def output_size(self) -> int:
        return self.draft_vocab_size or self.vocab_size

    def to_dict(self) -> dict:
        return {**asdict(self), "head": self.head.value}


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # identity at start: the head begins as the LM head
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (…, H) -> (…, H)
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        own = config.head is DraftHead.OWN
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)],
                          *([nn.Linear(config.hidden_size, config.output_size, bias=False)] if own else []))
            for _ in range(config.num_heads))
        if config.draft_vocab_size is not None:
            self.register_buffer("draft_to_target", torch.arange(config.draft_vocab_size))  # set_vocab / loading
        if not own:
            self.register_buffer("sliced_head", torch.zeros(config.output_size, config.hidden_size), persistent=False)
            self.sliced_ready = False

    @property
    def draft_vocab(self) -> DraftVocab | None:
        if self.config.draft_vocab_size is None:
            return None
        return DraftVocab(self.draft_to_target.cpu(), self.config.vocab_size)

    def set_vocab(self, vocab: DraftVocab) -> "MedusaHeads":
        if vocab.size != self.config.draft_vocab_size or vocab.target_size != self.config.vocab_size:
            raise ValueError(f"a draft vocabulary of {vocab.size} of {vocab.target_size} tokens does not fit these "
                             f"heads ({self.config.draft_vocab_size} of {self.config.vocab_size})")
        self.draft_to_target.copy_(vocab.draft_to_target)
        return self

    @torch.no_grad()
    def init_lm_heads(self, lm_head_weight: torch.Tensor) -> None:
        """The target's LM head (V, H) -> every head's output layer (own), or the shared frozen slice; rows of
        the draft vocabulary when there is one."""
        rows = lm_head_weight
        if self.config.draft_vocab_size is not None:
            rows = lm_head_weight[self.draft_to_target.to(lm_head_weight.device)]
        if self.config.head is DraftHead.SLICE:
            self.sliced_head = rows.to(self.sliced_head.device, self.sliced_head.dtype).clone()
            self.sliced_ready = True
            return
        for head in self.medusa_head:
            head[-1].weight.copy_(rows.to(head[-1].weight.dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (…, H) target final hidden states -> logits (K, …, V or the draft vocabulary's size)."""
        out = torch.stack([head(hidden) for head in self.medusa_head])
        if self.config.head is DraftHead.OWN:
            return out
        if not self.sliced_ready:
            raise RuntimeError("sliced Medusa heads need the target's LM head: call init_lm_heads(weight) first")
        return nn.functional.linear(out, self.sliced_head.to(out.dtype))


def full_vocabulary_heads(heads: MedusaHeads, lm_head: torch.Tensor) -> MedusaHeads:
    """The heads over the target's whole vocabulary, for layouts that have no draft vocabulary (FasterDecoding's):
    each head's ResBlocks as trained, its output layer the target's LM head `lm_head` (V, H) with the draft tokens'
    rows as the heads score them (a slice head's rows are the target's own, unchanged). A draft token keeps its
    logit; the tokens outside the draft vocabulary now score too, from the target's rows."""
    config = replace(heads.config, draft_vocab_size=None, head=DraftHead.OWN)
    full = MedusaHeads(config)
    index = heads.draft_to_target.to(lm_head.device)
    with torch.no_grad():
        for mine, theirs in zip(full.medusa_head, heads.medusa_head):
            for layer in range(config.num_layers):
                mine[layer].load_state_dict(theirs[layer].state_dict())
            rows = lm_head.detach().float().clone()
            rows[index] = (heads.sliced_head if heads.config.head is DraftHead.SLICE else theirs[-1].weight).float()
            mine[-1].weight.copy_(rows)
    return full.eval()


# ---------------------------------------------------------------------------------------------
# Trees from head accuracies
# ---------------------------------------------------------------------------------------------

# A small default tree for CPU budgets: 2-3 candidates near the root, deeper along the top path.
DEFAULT_MEDUSA_PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 1, 0],
                        [0, 0, 0, 0], [0, 0, 0, 0, 0]]


def _check_accuracy(accuracy: Sequence[Sequence[float]]) -> list[list[float]]:
    table = [[float(a) for a in row] for row in accuracy]
    if not table:
        raise UserError("accuracy table is empty (one row per head expected)")
    for d, row in enumerate(table):
        for r, a in enumerate(row):
            if not 0.0 <= a <= 1.0:
                raise UserError(f"accuracy[{d}][{r}] = {a} is not a probability")
        if sum(row) > 1.0 + 1e-6:
            raise UserError(f"accuracy[{d}] sums to {sum(row):.4f} > 1: pass per-rank accuracies, not cumulative "
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


def arca_paths(accuracy: Sequence[Sequence[float]], budget: int, max_depth: int | None = None) -> list[list[int]]:
    """Greedy expected-acceptance tree of `budget` nodes as Medusa "choices" (child-rank paths).

    accuracy: (num_heads, num_ranks) per-rank accuracies; max_depth: at most this many heads
    (default: all). Returns the paths in the order they were added (a prefix of the result is
    the greedy tree of that smaller budget); fewer than `budget` when the table runs out of nodes
    (depth x ranks) or of nodes with a nonzero value. Ties go to the shallower, then
    lexicographically smaller path.
    """
    table = _check_accuracy(accuracy)
    if budget < 0:
        raise UserError(f"budget must be >= 0, got {budget}")
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
    while frontier and len(paths) < budget:
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
        raise UserError(f"{path}: no 'rank_accuracy' table")
    return doc["rank_accuracy"]


class InvariantMedusaHeads(nn.Module):
    """Medusa heads on the batch-invariant kernels (what a compiled-engine round runs): the ResBlocks' Linears as
    InvariantLinears, and a shared slice of the target's LM head (head: slice) as one InvariantLinear that scores
    every head's row in a single pass over its weights. The stock mm took ~5 ms for three rows of SmolLM2's 8k-row
    slice on 2 cores (19 MB: ~0.6 ms of weight stream)."""

    def __init__(self, heads: MedusaHeads, precision: WeightPrecision = WeightPrecision.MODEL):
        super().__init__()
        self.blocks = invariant_model(heads.medusa_head, precision, gather=False)
        self.slice = invariant_rows(heads.sliced_head, precision) if heads.config.head is DraftHead.SLICE else None
        gather_weights(self)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """As MedusaHeads.forward: hidden (..., H) -> logits (K, ..., V or the draft vocabulary's size)."""
        out = torch.stack([block(hidden) for block in self.blocks])
        return out if self.slice is None else self.slice(out)
