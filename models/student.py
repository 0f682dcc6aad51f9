"""Small students built from a target: a stock HF model keeping a subset of its decoder layers.

Used as a draft model (self-speculation with a truncated copy) and as a distillation student
initialisation. The result is an ordinary `PreTrainedModel` of the target's class, so it
saves/loads with `save_pretrained` and works as `assistant_model=` in HF generate.

A lean student directory (`save_lean_student`) holds only what training changed: the kept decoder layers and the
final norm (`student_layers.safetensors`, bfloat16 by default) and `lean_student.json` naming the target and the
layer ids; the embeddings and LM head are the target's, so the student is rebuilt from the target at load
(`TargetModel.from_pretrained(<dir>)` does it; `python -m draftsmith.models.student expand <dir> <out>` writes the
whole HF model for engines that load files, such as llama.cpp's converter).
"""

from __future__ import annotations

import copy
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from draftsmith.config import option, parse_script
from draftsmith.errors import UserError, exit_with
from draftsmith.fileio import atomic_write_json, refuse_overwrite
from draftsmith.models.registry import resolve_model_path

LEAN_CONFIG = "lean_student.json"
LEAN_WEIGHTS = "student_layers.safetensors"
SHARED_WITH_TARGET = ("embed_tokens", "lm_head")  # parameter names a lean student takes from its target


def layer_subset_student(model: PreTrainedModel, layer_ids: list[int]) -> PreTrainedModel:
    """A copy of `model` that keeps only decoder layers `layer_ids` (embeddings, norm, head shared copies)."""
    num_layers = model.config.num_hidden_layers
    if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids):
        raise UserError(f"layer_ids must be a non-empty subset of 0..{num_layers - 1} (the model's decoder layers), "
                        f"got {layer_ids}")
    student = copy.deepcopy(model)
    decoder = student.get_decoder()
    decoder.layers = nn.ModuleList(decoder.layers[i] for i in layer_ids)
    for new_index, layer in enumerate(decoder.layers):  # the cache is indexed by layer_idx
        layer.self_attn.layer_idx = new_index
    student.config.num_hidden_layers = len(layer_ids)
    if getattr(student.config, "layer_types", None) is not None:
        student.config.layer_types = [student.config.layer_types[i] for i in layer_ids]
    return student


def every_nth_layer(num_layers: int, n: int) -> list[int]:
    """Layer ids 0, n, 2n, ... plus the last layer (a common shallow-student choice)."""
    ids = list(range(0, num_layers, n))
    if ids[-1] != num_layers - 1:
        ids.append(num_layers - 1)
    return ids


def save_lean_student(student: PreTrainedModel, directory: str | Path, target: str, layer_ids: list[int],
                      dtype: torch.dtype = torch.bfloat16) -> None:
    """The decoder layers and final norm of a layer-subset student (every tensor but the target's embeddings and
    LM head) in `dtype`, and the recipe to rebuild it: the target's name and the layer ids it kept."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in student.state_dict().items()
             if not any(part in name for part in SHARED_WITH_TARGET)}
    save_file(state, str(out / LEAN_WEIGHTS))
    atomic_write_json(out / LEAN_CONFIG, {"target": target, "layer_ids": list(layer_ids), "dtype": str(dtype)})


def lean_student_spec(path: str | Path) -> dict | None:
    """The rebuild recipe of a lean student directory ({target, layer_ids}), or None for anything else."""
    file = Path(path) / LEAN_CONFIG
    return json.loads(file.read_text()) if file.is_file() else None


def rebuild_lean_student(target_model: PreTrainedModel, path: str | Path) -> PreTrainedModel:
    """The student of a lean directory, built from its target's model (which it copies; the target is unchanged)."""
    spec = lean_student_spec(path)
    if spec is None:
        raise UserError(f"{path} is not a lean student directory ({LEAN_CONFIG} is missing)")
    student = layer_subset_student(target_model, spec["layer_ids"])
    load_lean_weights(student, path, spec)
    return student


def load_lean_weights(student: PreTrainedModel, path: str | Path, spec: dict) -> None:
    """Load a lean directory's layers and final norm (its recipe `spec`) into a layer-subset student of its target
    and layer ids, in the student's dtype; the embeddings and LM head stay the student's."""
    weights = load_file(str(Path(path) / LEAN_WEIGHTS))
    dtype = next(student.parameters()).dtype
    missing, unexpected = student.load_state_dict({k: v.to(dtype) for k, v in weights.items()}, strict=False)
    missing = [name for name in missing if not any(part in name for part in SHARED_WITH_TARGET)]
    if missing or unexpected:
        raise UserError(f"{path}/{LEAN_WEIGHTS} does not fit {spec['target']} with layers {spec['layer_ids']}: "
                        f"missing {missing[:3]}, unexpected {unexpected[:3]}")


@dataclass
class ExpandCommand:
    command: Literal["expand"] = option(help="expand: write the whole HF model of a lean student (the first bare word)")
    source: str = option(help="the lean student directory (the second bare word)")
    out: str = option(help="the HF model directory written (the third bare word)")


def main(argv: list[str] | None = None) -> int:
    """`python -m draftsmith.models.student expand <lean dir> <out dir>`: the whole HF model and tokenizer."""
    args = parse_script("python -m draftsmith.models.student", main.__doc__, ExpandCommand,
                        sys.argv[1:] if argv is None else argv, positional=("command", "source", "out"))
    spec = lean_student_spec(args.source)
    if spec is None:
        raise UserError(f"{args.source} is not a lean student directory ({LEAN_CONFIG} is missing)")
    refuse_overwrite(Path(args.out), False, instead="choose another out")
    base = resolve_model_path(spec["target"])
    student = rebuild_lean_student(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), args.source)
    student.save_pretrained(args.out)
    AutoTokenizer.from_pretrained(base).save_pretrained(args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    exit_with(main)
