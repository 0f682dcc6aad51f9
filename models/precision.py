"""The arithmetic a draft LM runs in. The target verifies in float32, so whatever the drafter's precision the output
is exactly the target's greedy output; a cheaper drafter only changes what is proposed and what a round costs.

- float32: the model as loaded.
- bfloat16: weights and activations in bf16 (fast where the CPU has AVX512-BF16/AMX; emulated, and slower,
  where it has not).
- int8: torch's dynamic int8 quantization of every Linear (int8 weights, activations quantized per call; the
  fbgemm / x86 kernels that ship with torch). Eager only: AOTInductor does not compile these modules.
- int8-weights: weight-only int8 (one scale per output row, symmetric) with bf16 activations, through the kernel
  torch ships for it (`aten._weight_int8pack_mm`, what gpt-fast runs on a CPU); the rest of the model in bf16.
  AOTInductor compiles it. Half the bytes of bf16 per weight, which pays where weights stream from memory: the
  0.5B drafter's round is 13-34% cheaper than bf16 on a Zen 4 CPU with AVX-512 BF16 (results/qwen_draft_int8; an
  isolated, cache-resident compiled bf16 matmul is as fast); on an AVX2 CPU the kernel is slower than fp32.
"""

from __future__ import annotations

import copy
import enum

import torch
from torch import nn
from transformers import PreTrainedModel

from draftsmith.models.kernels import InvariantLinear

INT8_KERNEL_ALIGNMENT = 16  # torch 2.13's _weight_int8pack_mm returns wrong sums (or crashes) unless in_features is a
#                            multiple of 16 (measured: 904 and 24 wrong, 897 a segfault); other Linears stay in bf16


class DraftPrecision(enum.Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"
    INT8_WEIGHTS = "int8-weights"

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
    if precision is DraftPrecision.INT8_WEIGHTS:
        converted = with_int8_weights(copy.deepcopy(model).to(torch.bfloat16).eval())
        converted.config.tie_word_embeddings = False  # a tied head got its own int8 copy; nothing re-ties them
        return converted
    from torch.ao.quantization import quantize_dynamic

    return quantize_dynamic(copy.deepcopy(model).eval(), {torch.nn.Linear}, dtype=torch.qint8)


class Int8WeightLinear(nn.Module):
    """A Linear whose weight is int8 with one bf16 scale per output row (symmetric, round to nearest), computed in
    bf16 by torch's weight-only int8 kernel."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_int8", torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias


def weight_count(model: nn.Module) -> int:
    """The model's weights: its parameters and the weights an Int8WeightLinear or InvariantLinear keeps as buffers."""
    int8 = sum(module.weight_int8.numel() for module in model.modules() if isinstance(module, Int8WeightLinear))
    packed = sum(module.in_features * module.out_features for module in model.modules()
                 if isinstance(module, InvariantLinear))
    return sum(parameter.numel() for parameter in model.parameters()) + int8 + packed


def with_int8_weights(model: nn.Module) -> nn.Module:
    """`model` (in bf16) with every Linear the kernel can take replaced in place by an Int8WeightLinear; a tied
    output head gets its own int8 copy (the input embedding stays bf16)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.in_features % INT8_KERNEL_ALIGNMENT == 0:
                setattr(parent, name, Int8WeightLinear(child))
    return model
