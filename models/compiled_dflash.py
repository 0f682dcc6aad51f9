"""The DFlash drafter on the compiled backend: two AOTInductor graphs over one static cache per request.

- The context graph (symbolic width 1 .. the largest bucket, as the target's shared graph) fuses m positions' target
  features and writes every draft layer's keys and values at their slots: after a round, the accepted tokens; the
  prompt in chunks of the largest bucket.
- The block graph (its one width: the block a round runs, root included) writes the block's keys and values after
  the context, attends to every slot up to the block's last (the rest of the cache is masked; on the batch-invariant
  kernels draftsmith::attention reads only those slots, not the cache's capacity) and returns the draft logits
  through the drafter's head, inside the graph. The next round's context overwrites those slots.

Eager, a round was ~70 module calls and as many small kernels in Python (the elementwise work of norms, rotary and
residuals between the Linears); compiled, that work is fused and the Linears are the same batch-invariant kernels
(models.kernels) the eager drafter runs on. Packages are cached as the target's are (models.compiled).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from torch import nn

from draftsmith.errors import UserError
from draftsmith.models.compiled import (CompileSettings, GraphPackages, StaticKV, model_fingerprint,
                                       zeroed_cache)
from draftsmith.models.dflash import DFlashModel
from draftsmith.models.engine import Backend


class DFlashContextStep(nn.Module):
    """forward(features (1, m, k * H), positions (1, m), *kv) -> positions (1, m), every layer's context keys and
    values written at slots `positions` of kv (every layer's keys, then every layer's values)."""

    traced_sources = (sys.modules[DFlashModel.__module__],)

    def __init__(self, model: DFlashModel):
        super().__init__()
        self.model = model

    def first_input(self, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An example of the first input: features of `width` positions."""
        return torch.zeros(1, width, self.model.fc.in_features, dtype=dtype, device=device)

    def forward(self, features, positions, *kv):
        self.model.context_into(features, positions, list(kv))
        return positions + 0  # a graph output (the writes into kv are the result)


class DFlashBlockStep(nn.Module):
    """forward(block ids (1, w), positions (1, w), *kv) -> draft logits of block positions 1 .. w - 1 (1, w - 1, V or
    the draft vocabulary's size); the block's keys and values written at slots `positions`. The target's embedding
    is registered here (the drafter only references it), the head is the drafter's."""

    traced_sources = (sys.modules[DFlashModel.__module__],)

    def __init__(self, model: DFlashModel, head: nn.Module):
        super().__init__()
        self.model, self.head, self.embedding = model, head, model.embedding

    def first_input(self, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An example of the first input: a block of `width` token ids."""
        return torch.zeros(1, width, dtype=torch.long, device=device)

    def forward(self, block_ids, positions, *kv):
        hidden = self.model.block_cached(block_ids, positions, list(kv))
        return self.head(hidden[:, 1:])  # the root's row proposes nothing


class DFlashGraphs(GraphPackages):
    """The packages of one of the two steps (their inputs: a token axis, positions, then the cache)."""

    name = Backend.COMPILED

    def __init__(self, step: nn.Module, runs: DFlashModel, kv: list[torch.Tensor], settings: CompileSettings,
                 what: str, cache_dir: str | Path | None):
        config = {**runs.config.to_dict(), "step": type(step).__name__, "width": settings.buckets}
        super().__init__(step, kv, model_fingerprint(step, config), settings, kv[0].dtype, kv[0].device, what,
                         cache_dir)
        self.runs = runs  # the model the graphs run

    def example(self, width: int) -> tuple:
        positions = torch.arange(width, device=self.device)[None]
        return (self.step.first_input(width, self.dtype, self.device), positions,
                *[torch.zeros_like(tensor) for tensor in self.kv])

    def width_axes(self, width) -> tuple:
        return ({1: width}, {1: width}, tuple(None for _ in self.kv))

    def run(self, first: torch.Tensor, past: int, cache: StaticKV) -> torch.Tensor:
        """One forward of `first`'s tokens at the slots from `past` on."""
        n = first.shape[1]
        graph = self.graph_for(n)
        if graph not in self.runners:
            self.prepare((n,))
        positions = torch.arange(past, past + n, device=self.device)[None]
        return self.runners[graph](first.contiguous(), positions, *cache.tensors)


class CompiledDFlashEngine:
    """A DFlash drafter's forwards on the compiled backend (the interface of models.dflash.EagerDFlashEngine):
    `runs` (the drafter on the batch-invariant kernels) and its `head`, a round's block of `width` tokens."""

    def __init__(self, runs: DFlashModel, head: nn.Module, width: int, settings: CompileSettings | None = None,
                 cache_dir: str | Path | None = None):
        settings = settings or CompileSettings()
        config, dtype = runs.config, runs.hidden_norm.weight.dtype
        if width > settings.buckets[-1]:
            raise UserError(f"a DFlash block of {width} tokens exceeds the compiled engine's largest bucket "
                            f"{settings.buckets[-1]}")
        shape = (1, config.num_kv_heads, settings.capacity, config.head_dim)
        self.kv = [torch.zeros(shape, dtype=dtype, device=runs.hidden_norm.weight.device)
                   for _ in range(2 * config.num_layers)]
        self.width, self.capacity, self.chunk = width, settings.capacity, settings.buckets[-1]
        self.context = DFlashGraphs(DFlashContextStep(runs), runs, self.kv, settings, "dflash drafter (context)",
                                    cache_dir)
        block = dataclasses.replace(settings, buckets=[width], shared_width=False)
        self.block = DFlashGraphs(DFlashBlockStep(runs, head), runs, self.kv, block, "dflash drafter (block)",
                                  cache_dir)
        self.cache = StaticKV(zeroed_cache(self.kv))  # one request at a time: begin() empties it

    @property
    def graphs(self) -> list[DFlashGraphs]:
        """Both steps' packages (what a bench builds before timing)."""
        return [self.context, self.block]

    def begin(self) -> None:
        self.cache.length = 0

    @property
    def length(self) -> int:
        return self.cache.length

    @torch.inference_mode()
    def append(self, features: torch.Tensor) -> None:
        """features (1, m, k * H) of the next m context positions (in chunks of the largest bucket)."""
        count = features.shape[1]
        if self.length + count + self.width > self.capacity:
            raise UserError(f"the DFlash drafter's compiled cache ({self.capacity} slots) cannot hold "
                            f"{self.length + count} context positions and a block of {self.width}: raise "
                            "compile.capacity")
        for start in range(0, count, self.chunk):
            part = features[:, start:start + self.chunk].to(self.context.dtype)
            self.context.run(part, self.length, self.cache)
            self.cache.length += part.shape[1]

    @torch.inference_mode()
    def logits(self, block_ids: torch.Tensor) -> torch.Tensor:
        """block_ids (1, width) at the positions after the context -> the draft logits of block positions 1 ..
        width - 1 (1, width - 1, V)."""
        return self.block.run(block_ids.long(), self.length, self.cache)
