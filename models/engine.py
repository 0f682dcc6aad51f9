"""How a model runs its forwards: the eager engine (a growing DynamicCache) and what every engine returns.

An engine drives one stock HF causal LM: `new_cache`, `forward(input_ids, cache, position_ids,
allowed, hidden_layers) -> TargetOutput`, `commit(cache, keep)` (keep only some slots: the
accepted path), `truncate(cache, length)` and `cache_length(cache)`. Tree verification is one
ordinary forward with an additive 4D mask (transformers passes a 4D mask through unchanged) and
explicit position ids (siblings share a position). `models.compiled.CompiledEngine` is the static-
shape, compiled engine with the same interface.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from draftsmith.config import TextEnum
from draftsmith.models.kernels import argmax_last


def _cache_keyword() -> str:
    """The name transformers gives the KV cache argument of models, decoder layers and attention: `cache` from
    5.2x on (`past_key_values` is then deprecated and warns), `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(LlamaDecoderLayer.forward).parameters else "past_key_values"


CACHE_KEYWORD = _cache_keyword()


def with_cache(cache) -> dict:
    """The keyword argument that hands `cache` to a model, decoder layer or attention of this transformers."""
    return {CACHE_KEYWORD: cache}


class Backend(TextEnum):
    """How a model's forwards run; resolved once at the entry point (a command's `backend=`), keyed in the one
    table of engines (`models.target.ENGINES`) and in every result."""

    EAGER = "eager"  # HF forward with a growing DynamicCache
    COMPILED = "compiled"  # models.compiled: static shapes, AOT-compiled graphs


class GreedyRows:
    """The greedy token after each row of a forward, computed when first asked for, one row a pass of `head` (an LM
    head whose argmax is exact whatever the width: models.kernels.GreedyHead). A greedy verify asks only for the
    rows of its accepted path."""

    def __init__(self, head: Callable[[torch.Tensor], torch.Tensor], final: torch.Tensor):
        self.head, self.final, self.tokens = head, final, {}  # final: (1, n, H), the head's inputs

    def __call__(self, row: int) -> int:
        if row not in self.tokens:
            self.tokens[row] = int(argmax_last(self.head(self.final[:, row:row + 1])[0, 0]))
        return self.tokens[row]


@dataclass
class TargetOutput:
    logits: torch.Tensor | None  # (B, n, V) float32; None where the greedy tokens come row by row (`greedy`)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer index -> (B, n, H)
    greedy: GreedyRows | None = None  # a forward(..., greedy_rows=True) whose engine computes rows apart


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a timer around GPU work reads nothing otherwise); a no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (…, q, k) 'may attend' -> additive float mask: 0 allowed, dtype-min forbidden."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Shrink the cache to its first `length` slots (a negative crop argument removes slots in
    both transformers 4.x and 5.x; positive arguments changed meaning between them)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def commit_kv(cache: DynamicCache, keep: torch.Tensor) -> None:
    """Keep only the cache slots `keep` (1D, increasing) along the sequence axis, in place.

    After a tree forward the cache holds past + tree slots; `keep` = the prefix plus the accepted
    path. Contiguous prefixes are cropped (no copy); anything else is gathered.
    """
    kept = keep.numel()
    contiguous = kept == 0 or (int(keep[-1]) == kept - 1)  # increasing, so 0..kept-1 exactly
    if contiguous:
        crop_cache(cache, kept)
        return
    for layer in cache.layers:
        if not hasattr(layer, "keys") or type(layer).__name__ != "DynamicLayer":
            raise NotImplementedError(f"commit_kv supports full-attention DynamicLayer caches, got {type(layer).__name__}")
        index = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)  # (B, kv_heads, kept, head_dim)
        layer.values = layer.values.index_select(-2, index)


class EagerBuild:
    """What every eager engine shares: nothing to build or free, a DynamicCache that grows by each forward."""

    name = Backend.EAGER

    def prepare(self, sizes: tuple[int, ...] | None = None) -> None:
        """Nothing to build ahead of time (a compiled engine builds or loads its graphs here)."""

    def release(self, sizes: tuple[int, ...] | None = None) -> None:
        """Nothing to free."""

    def graph_groups(self, sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
        """These input sizes grouped by what `prepare` builds for them (eager: nothing, one group)."""
        return [tuple(sizes)]

    def build_seconds(self) -> dict[str, float]:
        """Seconds spent compiling and loading graphs in this process (none here)."""
        return {"compile_s": 0.0, "load_s": 0.0}

    def cache_length(self, cache: DynamicCache) -> int:
        return cache.get_seq_length()

    def truncate(self, cache: DynamicCache, length: int) -> None:
        crop_cache(cache, length)

    def fits(self, max_length: int) -> bool:
        """Whether this engine's caches take a request of up to `max_length` tokens (a DynamicCache grows: always)."""
        return True


class EagerEngine(EagerBuild):
    """Eager PyTorch forwards over a DynamicCache that grows by each forward's tokens."""

    def __init__(self, model: PreTrainedModel):
        self.model = model

    def new_cache(self, max_length: int | None = None) -> DynamicCache:
        """An empty KV cache (`max_length` is what static engines preallocate; a DynamicCache grows)."""
        return DynamicCache(config=self.model.config)

    def commit(self, cache: DynamicCache, keep: torch.Tensor) -> None:
        commit_kv(cache, keep)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: DynamicCache | None = None,
                position_ids: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
                hidden_layers: tuple[int, ...] = (), last_only: bool = False,
                argmax_only: bool = False, greedy_rows: bool = False) -> TargetOutput:
        """(`argmax_only`, `greedy_rows`: every logit is computed here anyway.)"""
        mask = None if allowed is None else additive_mask(allowed, self.model.dtype)
        out = self.model(input_ids=input_ids, **with_cache(cache), position_ids=position_ids,
                         attention_mask=mask, use_cache=cache is not None,
                         output_hidden_states=bool(hidden_layers), logits_to_keep=int(last_only))
        hidden = {layer: out.hidden_states[layer] for layer in hidden_layers}
        return TargetOutput(logits=out.logits.float(), hidden=hidden)
