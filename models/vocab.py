"""A draft vocabulary: the subset of the target's tokens a drafter proposes (EAGLE-3 / FR-Spec).

Drafters score `size` tokens instead of the target's V, so their output layer costs size/V of a
full head; verification stays on the full vocabulary, so the decoder's output never changes (a
token outside the subset is simply never drafted; its probability under the drafter is 0, which
speculative sampling handles exactly).

    draft_to_target (size,) int64   the subset's target ids, ascending (draft id i <-> target id d2t[i])
    target_to_draft (V,) int64      the draft id of each target id, -1 outside the subset

On disk (`draft_vocab.safetensors`): `draft_to_target` plus metadata (target vocabulary size, a
sha256 of the ids). EAGLE-3 / vLLM speculators store `d2t` as offsets (target = draft + d2t[draft])
and `t2d` as a bool mask: `eagle3_maps` converts.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from draftsmith.config import TextEnum
from draftsmith.errors import UserError
from draftsmith.fileio import atomic_write
from draftsmith.models.kernels import frozen_linear


class DraftHead(TextEnum):
    """What scores a drafter's next tokens."""

    TARGET = "target"  # the target's LM head, over the full vocabulary
    SLICE = "slice"  # the target's rows of a draft vocabulary, frozen (and shared where several heads read them)
    OWN = "own"  # the drafter's own output layer (over a draft vocabulary or the full one)


VOCAB_FILE = "draft_vocab.safetensors"


@dataclass
class DraftVocab:
    draft_to_target: torch.Tensor  # (size,) int64, ascending target ids
    target_size: int  # V

    def __post_init__(self):
        ids = self.draft_to_target.long().cpu()
        if ids.ndim != 1 or ids.numel() == 0:
            raise UserError("a draft vocabulary needs at least one token id")
        if bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= self.target_size:
            raise UserError(f"draft vocabulary ids must be distinct, ascending and inside [0, {self.target_size})")
        self.draft_to_target = ids

    @classmethod
    def from_ids(cls, ids, target_size: int) -> "DraftVocab":
        return cls(torch.as_tensor(sorted(set(int(i) for i in ids)), dtype=torch.long), target_size)

    @classmethod
    def full(cls, target_size: int) -> "DraftVocab":
        return cls(torch.arange(target_size), target_size)

    @property
    def size(self) -> int:
        return self.draft_to_target.numel()

    @property
    def target_to_draft(self) -> torch.Tensor:
        mapping = torch.full((self.target_size,), -1, dtype=torch.long)
        mapping[self.draft_to_target] = torch.arange(self.size)
        return mapping

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids (any shape) -> target ids."""
        return self.draft_to_target.to(draft_ids.device)[draft_ids]

    def to_draft(self, target_ids: torch.Tensor) -> torch.Tensor:
        """Target ids (any shape) -> draft ids, -1 outside the subset."""
        return self.target_to_draft.to(target_ids.device)[target_ids]

    def scatter(self, draft_rows: torch.Tensor) -> torch.Tensor:
        """(..., size) draft-vocabulary rows -> (..., V) rows, zero outside the subset."""
        out = draft_rows.new_zeros(*draft_rows.shape[:-1], self.target_size)
        out[..., self.draft_to_target.to(draft_rows.device)] = draft_rows
        return out

    def digest(self) -> str:
        return hashlib.sha256(f"{self.target_size}:".encode() + self.draft_to_target.numpy().tobytes()).hexdigest()

    def eagle3_maps(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d2t offsets (size,) int64, t2d mask (V,) bool): EAGLE-3's and vLLM speculators' layout."""
        mask = torch.zeros(self.target_size, dtype=torch.bool)
        mask[self.draft_to_target] = True
        return self.draft_to_target - torch.arange(self.size), mask

    def save(self, directory: str | Path) -> Path:
        metadata = {"target_vocab_size": str(self.target_size), "draft_vocab_size": str(self.size),
                    "sha256": self.digest()}
        return atomic_write(Path(directory) / VOCAB_FILE, lambda tmp: save_file(
            {"draft_to_target": self.draft_to_target.contiguous()}, str(tmp), metadata=metadata))

    @classmethod
    def load(cls, path: str | Path) -> "DraftVocab":
        """From a directory holding draft_vocab.safetensors, or the file itself (digest checked)."""
        path = Path(path)
        if path.is_dir():
            path = path / VOCAB_FILE
        if not path.is_file():
            raise UserError(f"no draft vocabulary at {path} (make one: python -m draftsmith.data.draft_vocab)")
        with safe_open(str(path), "pt") as handle:
            metadata = handle.metadata() or {}
        vocab = cls(load_file(str(path))["draft_to_target"], int(metadata.get("target_vocab_size", 0)))
        if metadata.get("sha256") not in (None, vocab.digest()):
            raise UserError(f"{path}: the ids do not match their recorded sha256 (a damaged file): remake it")
        return vocab


def with_sliced_head(model: nn.Module, vocab: DraftVocab) -> nn.Module:
    """The same causal LM (shared modules and weights) whose LM head scores only the draft vocabulary:
    a frozen copy of the head's rows `draft_to_target`, training-free (logits (…, size)). The original
    model is untouched (a shallow copy with its own module table)."""
    head = model.get_output_embeddings()
    if head.weight.shape[0] != vocab.target_size:
        raise UserError(f"the draft vocabulary is for {vocab.target_size} tokens; this model's LM head has "
                        f"{head.weight.shape[0]}")
    rows = vocab.draft_to_target.to(head.weight.device)
    with torch.no_grad():
        sliced = frozen_linear(head.weight[rows], None if head.bias is None else head.bias[rows])
    clone = copy.copy(model)
    clone._modules = dict(model._modules)  # its own module table: replacing the head leaves `model` as it is
    clone.set_output_embeddings(sliced)
    return clone
