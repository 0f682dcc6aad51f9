"""Medusa drafter: heads on the target's final hidden state fill a static tree ("choices").

Node at depth d with rank r takes the r-th candidate of head d (heads predict 2, 3, ... tokens
ahead of the last committed token, i.e. depth 1, 2, ... after the root). Greedy: candidates are
each head's top tokens. Sampling: candidates are draws without replacement from each head's
warped distribution; siblings are a prefix of those draws, so q rows are exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from peft import PeftModel
from torch import nn

from draftsmith.config import TextEnum, enum_member
from draftsmith.eval.decode.drafters.base import Drafter, Sampling, TreeCut, confident_subtree, static_tree_tokens
from draftsmith.eval.decode.tree import DraftTree, tree_from_paths
from draftsmith.models.artifacts import ACCURACY_FILE, ArtifactError, load_medusa_heads
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.medusa import (DEFAULT_MEDUSA_PATHS, InvariantMedusaHeads, MedusaHeads, arca_paths,
                                     load_rank_accuracy)
from draftsmith.models.trees import MEDUSA_BUDGET


class MedusaDrafter(Drafter):
    hidden_layers = (-1,)  # the final normed hidden state, as the target's LM head reads it

    def __init__(self, heads: MedusaHeads, paths: list[list[int]] | None = None, name: str = "medusa",
                 runs: nn.Module | None = None, keep_above: float | None = None):
        self.cut = TreeCut.checked(name, keep_above)  # dynamic size (greedy)
        self.heads = heads.eval()
        self.runs = runs or self.heads  # what computes the logits: the heads, or their batch-invariant copy
        self.vocab = heads.draft_vocab  # None: the heads score the full vocabulary
        self.name = name
        if paths is None:  # the default tree, cut to the depth these heads can fill
            paths = [path for path in DEFAULT_MEDUSA_PATHS if len(path) <= heads.config.num_heads]
        self.parents, self.depths, self.ranks = tree_from_paths(paths)
        self.budget = self.parents.numel()  # a static tree: its size
        if int(self.depths.max()) > heads.config.num_heads:
            raise ValueError(f"tree depth {int(self.depths.max())} exceeds num_heads={heads.config.num_heads}")
        for parent in [-1] + list(range(self.parents.numel())):  # siblings must be ranks 0..k-1
            ranks = sorted(self.ranks[self.parents == parent].tolist())
            if ranks != list(range(len(ranks))):
                raise ValueError(f"children of tree node {parent} have ranks {ranks}; each node's children "
                                 "must take ranks 0..k-1 (sampling verification draws them in order)")
        self.last_hidden: torch.Tensor | None = None

    def observe(self, tokens, hidden):
        self.last_hidden = hidden[-1][-1]  # (H,) state of the last committed token

    @torch.inference_mode()
    def propose(self, root, context, sampling: Sampling | None, generator) -> DraftTree:
        self.cut.refuse_sampling(self.name, sampling)
        param = next(self.heads.parameters())
        logits = self.runs(self.last_hidden.to(param.device, param.dtype)).float()  # (K, V)
        device = context.device
        head_probs = torch.softmax(logits, -1) if sampling is None else sampling.probs(logits)
        tokens, rows = static_tree_tokens(lambda depth: head_probs[depth - 1], self.depths, self.ranks, sampling,
                                          generator)
        node_probs = head_probs[self.depths - 1, tokens]
        probs = None if rows is None else rows.to(device)
        if self.vocab is not None:  # draft-vocabulary ids -> target ids, q rows onto the full vocabulary
            tokens = self.vocab.to_target(tokens)
            probs = None if probs is None else self.vocab.scatter(probs)
        tree = DraftTree(tokens.to(device), self.parents.to(device), self.depths.to(device), probs)
        return confident_subtree(tree, node_probs.to(device), self.cut)


class TargetAdapter(TextEnum):
    """What decoding does with the LoRA adapter Medusa-2 heads were trained with on the target."""

    REFUSE = "refuse"
    MERGE = "merge"  # merged into the target's weights
    IGNORE = "ignore"  # the base target (lower acceptance)


def load_medusa_drafter(path: str | Path, target, paths: list[list[int]] | None = None, budget: int | None = None,
                        target_adapter: TargetAdapter | str = TargetAdapter.REFUSE, name: str | None = None,
                        backend: Backend = Backend.EAGER, settings: CompileSettings | None = None,
                        keep_above: float | None = None):
    """A MedusaDrafter for `target` from a recipe's final/ directory.

    Refuses a manifest whose target hidden size, vocab size or vocab fingerprint differs from the
    given target's. Tree: `paths` if given; else an ARCA tree of `budget` nodes (default MEDUSA_BUDGET) from
    the held-out per-rank accuracies saved with the heads. Medusa-2 heads
    were trained on the LoRA-adapted target: `target_adapter="merge"` merges the saved adapter into
    `target.model` in place, "ignore" uses the target as given, "refuse" (default) raises. On the compiled
    `backend` with the batch-invariant kernels (`settings`), the heads run on those kernels too. `keep_above`
    (greedy): of the tree's nodes verify only those whose path probability under the heads is above it.
    """
    path, target_adapter = Path(path), enum_member(TargetAdapter, target_adapter, "target_adapter")
    heads, manifest = load_medusa_heads(path, device=target.device, target=target)
    adapter = manifest.get("target_adapter")
    if adapter:
        if target_adapter is TargetAdapter.REFUSE:
            raise ArtifactError(f"Medusa checkpoint {path} was trained jointly with a LoRA adapter on the target "
                             f"({path / adapter}); pass target_adapter='merge' to decode with the adapted target, "
                             "or 'ignore' to use the base target (lower acceptance)")
        if target_adapter is TargetAdapter.MERGE:
            target.model = PeftModel.from_pretrained(target.model, str(path / adapter)).merge_and_unload().eval()
    if paths is None:
        accuracy_file = path / ACCURACY_FILE
        if accuracy_file.is_file():
            paths = arca_paths(load_rank_accuracy(accuracy_file), budget or MEDUSA_BUDGET)
        elif budget is not None:
            raise ArtifactError(f"{accuracy_file} is missing: pass explicit paths")
        else:
            paths = [p for p in DEFAULT_MEDUSA_PATHS if len(p) <= heads.config.num_heads]
    settings = settings or CompileSettings()
    runs = None
    if settings.runs_invariant_kernels(backend):
        runs = InvariantMedusaHeads(heads, settings.weights)
    return MedusaDrafter(heads, paths, name=name or f"medusa:{path}", runs=runs, keep_above=keep_above)

