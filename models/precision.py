"""The arithmetic a draft LM runs in. The target verifies in float32, so whatever the drafter's precision the output
is exactly the target's greedy output; a cheaper drafter only changes what is proposed and what a round costs.

- float32: the model as loaded.
- bfloat16: weights and activations in bf16 (fast where the CPU has AVX512-BF16/AMX; emulated, and slower,
  where it has not).
- int8: torch's dynamic int8 quantization of every Linear (int8 weights, activations quantized per call; the
  fbgemm / x86 kernels that ship with torch). Eager only: AOTInductor does not compile these modules.
"""

from __future__ import annotations

import copy
import enum

import torch
from transformers import PreTrainedModel


class DraftPrecision(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"

    @property
    def compiles(self) -> bool:
        """Whether the compiled backend can run a model of this precision."""
        return self is not DraftPrecision.INT8


def with_precision(model: PreTrainedModel, precision: DraftPrecision) -> PreTrainedModel:
    """A copy of `model` in `precision` (the model itself for float32; the original is never changed)."""
    if precision is DraftPrecision.FLOAT32:
        return model
    if precision is DraftPrecision.BFLOAT16:
        return copy.deepcopy(model).to(torch.bfloat16).eval()
    from torch.ao.quantization import quantize_dynamic

    return quantize_dynamic(copy.deepcopy(model).eval(), {torch.nn.Linear}, dtype=torch.qint8)
