"""Small students built from a target: a stock HF model keeping a subset of its decoder layers.

Used as a draft model (self-speculation with a truncated copy) and as a distillation student
initialisation. The result is an ordinary `PreTrainedModel` of the target's class, so it
saves/loads with `save_pretrained` and works as `assistant_model=` in HF generate.
"""

from __future__ import annotations

import copy

from torch import nn
from transformers import PreTrainedModel

from draftsmith.errors import UserError


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
