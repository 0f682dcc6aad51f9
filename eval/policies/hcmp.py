"""Ghidorah's hetero-core model parallelism (HCMP, section III-B) on the stock HF target.

The verification forward is split across two processing units ("unit 0" and "unit 1"; two
devices, or the same device twice, optionally in two threads) without copying any modeling code:

  - Linear layers, split by output columns (III-B 1): every `nn.Linear` inside the decoder layers
    is replaced by a `SplitLinear` holding two column shards of its weight (rows of the
    (out, in) torch weight) on the two units. Both shards read the same input and write disjoint
    slices of the output, which are concatenated: no all-reduce. On one device the shards are
    views of the original weight (no extra memory).
  - Attention, split into a dense and a sparse part (III-B 2): a custom attention function
    registered with transformers' `AttentionInterface` under the name "hcmp". It receives the
    full (past + n) mask from the stock attention module and splits the key axis at
    `split = round(ratio * past)`: unit 0 computes the queries against keys [0, split) (the KV
    cache: dense, no mask needed unless it carries padding), unit 1 against [split, past + n)
    (the rest of the cache and the tree tokens with the tree mask: sparse). ratio = 1 is
    Ghidorah's default (all of the cache on the high-parallelism unit); smaller ratios move the
    left boundary of the cache to the sparse unit for load balance. The two partial results
    are merged with online-softmax rescaling (`merge_attention_partials`, a pure function).

Split ratios are per layer type: `qkv` (q/k/v projections), `o` (output projection), `mlp`
(gate/up/down) and `attention` (cache fraction on unit 0); a ratio is the fraction of output
columns (or of the cache) on unit 0. `hcmp_mode(target, HcmpConfig(...))` applies the split for
the duration of a `with` block and restores the stock modules afterwards, so one loaded target
serves both plain and HCMP decoding in the same benchmark run. The split forward equals the
unsplit one to float tolerance (tests/test_hcmp.py); decoding with it is lossless.
"""

from __future__ import annotations

import contextlib
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import AttentionInterface

from draftsmith.errors import UserError
from draftsmith.eval.decode.decoder import DecodeResult, Method, SpeculativeDecoder
from draftsmith.eval.decode.drafters.base import Drafter
from draftsmith.models.engine import Backend
from draftsmith.models.target import resolve_device

LAYER_TYPES = ("qkv", "o", "mlp", "attention")
_QKV = ("q_proj", "k_proj", "v_proj")
_O = ("o_proj",)
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass
class HcmpConfig:
    """Two processing units and the fraction of each layer type's work on unit 0."""

    device0: str = "cpu"  # the high-parallelism unit (GPU in Ghidorah): dense attention part
    device1: str = "cpu"  # the low-parallelism unit (CPU): sparse attention part
    ratios: dict[str, float] = field(default_factory=lambda: {"qkv": 0.5, "o": 0.5, "mlp": 0.5, "attention": 1.0})
    threads: bool = False  # run the two units' shares in two Python threads (torch releases the GIL)

    def __post_init__(self):
        unknown = set(self.ratios) - set(LAYER_TYPES)
        if unknown:
            raise UserError(f"unknown HCMP layer type(s) {sorted(unknown)}; known: {', '.join(LAYER_TYPES)}")
        merged = {"qkv": 0.5, "o": 0.5, "mlp": 0.5, "attention": 1.0}
        merged.update({k: float(v) for k, v in self.ratios.items()})
        for name, ratio in merged.items():
            if not 0.0 <= ratio <= 1.0:
                raise UserError(f"HCMP ratio for {name} must be in [0, 1], got {ratio}")
        self.ratios = merged

    @classmethod
    def uniform(cls, ratio: float, **kwargs) -> "HcmpConfig":
        """Linear layers at `ratio` on unit 0, all of the cache on unit 0 (Ghidorah's default)."""
        return cls(ratios={"qkv": ratio, "o": ratio, "mlp": ratio, "attention": 1.0}, **kwargs)


class _Units:
    """Runs the two units' shares, sequentially or in two threads."""

    _pool: ThreadPoolExecutor | None = None
    _lock = threading.Lock()

    def __init__(self, threads: bool):
        self.threads = threads

    def run(self, first, second):
        if not self.threads:
            return first(), second()
        with _Units._lock:
            if _Units._pool is None:
                _Units._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hcmp-unit1")
        future = _Units._pool.submit(second)
        return first(), future.result()


class SplitLinear(nn.Module):
    """An nn.Linear split by output columns over two units: y = [x W0^T + b0, x W1^T + b1]."""

    def __init__(self, linear: nn.Linear, ratio: float, device0: torch.device, device1: torch.device,
                 units: _Units):
        super().__init__()
        out_features = linear.out_features
        self.split = int(round(ratio * out_features))  # output columns on unit 0
        self.out_device = linear.weight.device
        self.device0, self.device1, self.units = device0, device1, units
        weight, bias = linear.weight.detach(), None if linear.bias is None else linear.bias.detach()
        # Row slices of the (out, in) weight are contiguous views: no copy on the same device.
        self.weight0 = weight[: self.split].to(device0)  # (split, in)
        self.weight1 = weight[self.split:].to(device1)  # (out - split, in)
        self.bias0 = None if bias is None else bias[: self.split].to(device0)
        self.bias1 = None if bias is None else bias[self.split:].to(device1)
        self.in_features, self.out_features = linear.in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        if self.split == self.out_features:
            return nn.functional.linear(x.to(self.device0), self.weight0, self.bias0).to(self.out_device)
        if self.split == 0:
            return nn.functional.linear(x.to(self.device1), self.weight1, self.bias1).to(self.out_device)
        part0, part1 = self.units.run(
            lambda: nn.functional.linear(x.to(self.device0), self.weight0, self.bias0),
            lambda: nn.functional.linear(x.to(self.device1), self.weight1, self.bias1))
        return torch.cat([part0.to(self.out_device), part1.to(self.out_device)], dim=-1)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, unit0_cols={self.split}"


# --------------------------------------------------------------------------------------------
# Attention: partial attention with log-sum-exp, and the online-softmax merge (pure functions)
# --------------------------------------------------------------------------------------------

def partial_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of `query` over one slice of the keys, with its log-sum-exp.

    query (B, h, q, d), key/value (B, h, k, d), mask additive (B or 1, 1 or h, q, k) or None.
    Returns (out (B, h, q, d) float32 normalised within the slice, lse (B, h, q) float32). An
    empty slice (k = 0) gives out = 0 and lse = -inf, so it drops out of the merge.
    """
    batch, heads, q_len, dim = query.shape
    if key.shape[-2] == 0:
        return (torch.zeros(batch, heads, q_len, value.shape[-1], dtype=torch.float32, device=query.device),
                torch.full((batch, heads, q_len), -math.inf, dtype=torch.float32, device=query.device))
    scores = torch.matmul(query, key.transpose(-1, -2)).float() * scaling  # (B, h, q, k)
    if mask is not None:
        scores = scores + mask.float()
    lse = torch.logsumexp(scores, dim=-1)  # (B, h, q)
    probs = torch.exp(scores - lse[..., None])
    out = torch.matmul(probs.to(value.dtype), value).float()  # (B, h, q, d)
    return out, lse


def merge_attention_partials(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> torch.Tensor:
    """Online-softmax merge: softmax over the union of key slices from per-slice results.

    out_i (B, h, q, d) = softmax_i(S_i) V_i, lse_i = logsumexp(S_i). The merged output is
    sum_i exp(lse_i - lse) out_i with lse = logsumexp_i(lse_i): exactly softmax([S_0, S_1]) V.
    """
    lse = torch.logsumexp(torch.stack(lses), dim=0)  # (B, h, q)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)  # all slices empty: output 0
    merged = torch.zeros_like(outs[0])
    for out, part_lse in zip(outs, lses):
        merged = merged + torch.exp(part_lse - lse_safe)[..., None] * out
    return merged


def _repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return states
    batch, kv_heads, length, dim = states.shape
    return states[:, :, None].expand(batch, kv_heads, groups, length, dim).reshape(batch, kv_heads * groups, length, dim)


def _causal_tail(q_len: int, past: int, start: int, kv_len: int, dtype, device) -> torch.Tensor:
    """Additive causal mask (1, 1, q, kv_len - start) for keys [start, kv_len): query i sees keys <= past + i."""
    keys = torch.arange(start, kv_len, device=device)
    queries = torch.arange(q_len, device=device) + past
    allowed = keys[None, :] <= queries[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


_ACTIVE: dict[int, tuple[HcmpConfig, _Units]] = {}  # id(model config) -> settings, while hcmp_mode is on


def hcmp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention function: dense (cache) part on unit 0, sparse part on unit 1.

    query (B, h, q, d); key/value (B, kv_h, past + q, d) after the cache update; attention_mask
    additive (B, 1, q, past + q) or None (plain causal). Returns ((B, q, h, d), None) like
    transformers' own attention functions.
    """
    if dropout:
        raise ValueError("hcmp attention is for inference (dropout must be 0)")
    config, units = _ACTIVE.get(id(module.config), (HcmpConfig(), _Units(False)))
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    q_len, kv_len = query.shape[-2], key.shape[-2]
    past = kv_len - q_len
    split = int(round(config.ratios["attention"] * past))  # keys [0, split) on unit 0
    if attention_mask is not None:
        mask = attention_mask[..., :kv_len]
        if mask.dtype == torch.bool:  # "may attend" -> additive
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(
                ~mask, torch.finfo(query.dtype).min)
        dense_mask, sparse_mask = mask[..., :split], mask[..., split:]
        if dense_mask.numel() and bool((dense_mask == 0).all()):
            dense_mask = None  # the cache is fully visible: no mask needed (only padding would need one)
    else:
        dense_mask = None  # every query sees the whole cache
        sparse_mask = _causal_tail(q_len, past, split, kv_len, query.dtype, query.device)
    device0, device1 = resolve_device(config.device0), resolve_device(config.device1)
    out_device = query.device

    def dense():
        return partial_attention(query.to(device0), key[..., :split, :].to(device0), value[..., :split, :].to(device0),
                                 None if dense_mask is None else dense_mask.to(device0), scaling)

    def sparse():
        return partial_attention(query.to(device1), key[..., split:, :].to(device1), value[..., split:, :].to(device1),
                                 sparse_mask.to(device1), scaling)

    (out0, lse0), (out1, lse1) = units.run(dense, sparse)
    merged = merge_attention_partials([out0.to(out_device), out1.to(out_device)],
                                      [lse0.to(out_device), lse1.to(out_device)])
    return merged.to(query.dtype).transpose(1, 2).contiguous(), None


AttentionInterface.register("hcmp", hcmp_attention)


# --------------------------------------------------------------------------------------------
# Applying the split to a stock model
# --------------------------------------------------------------------------------------------

def _layer_type(name: str) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in _QKV:
        return "qkv"
    if leaf in _O:
        return "o"
    if leaf in _MLP:
        return "mlp"
    return None


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__}: no decoder layer list at .model.layers; HCMP supports "
                         "Llama/Qwen2-style causal LMs")
    return layers


def _attention_configs(model: nn.Module) -> list:
    """Every config object an attention module of the model reads `_attn_implementation` from."""
    configs = {id(model.config): model.config}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            configs[id(config)] = config
    return list(configs.values())


class HcmpPlan:
    """Prebuilt SplitLinear replacements for one model; `apply()`/`restore()` swap them in and out."""

    def __init__(self, model: nn.Module, config: HcmpConfig):
        self.model, self.config = model, config
        self.units = _Units(config.threads)
        device0, device1 = resolve_device(config.device0), resolve_device(config.device1)
        self.swaps: list[tuple[nn.Module, str, nn.Linear, SplitLinear]] = []  # (parent, attr, stock, split)
        for layer in _decoder_layers(model):
            for name, module in layer.named_modules():
                kind = _layer_type(name)
                if kind is None or not isinstance(module, nn.Linear):
                    continue
                parent = layer.get_submodule(name.rsplit(".", 1)[0]) if "." in name else layer
                split = SplitLinear(module, config.ratios[kind], device0, device1, self.units)
                self.swaps.append((parent, name.rsplit(".", 1)[-1], module, split))
        if not self.swaps:
            raise ValueError("no q/k/v/o/gate/up/down projections found in the decoder layers")
        self.saved_impl: list[tuple[object, str]] = []

    def apply(self) -> None:
        for parent, attr, _, split in self.swaps:
            setattr(parent, attr, split)
        self.saved_impl = [(config, config._attn_implementation) for config in _attention_configs(self.model)]
        for config, _ in self.saved_impl:
            config._attn_implementation = "hcmp"
            _ACTIVE[id(config)] = (self.config, self.units)

    def restore(self) -> None:
        for parent, attr, stock, _ in self.swaps:
            setattr(parent, attr, stock)
        for config, implementation in self.saved_impl:
            config._attn_implementation = implementation
            _ACTIVE.pop(id(config), None)
        self.saved_impl = []


@contextlib.contextmanager
def hcmp_mode(model: nn.Module, config: HcmpConfig | None = None, plan: HcmpPlan | None = None):
    """Run the stock `model` with HCMP splitting inside the block; the stock modules come back after."""
    plan = plan or HcmpPlan(model, config or HcmpConfig())
    plan.apply()
    try:
        yield plan
    finally:
        plan.restore()


class HcmpDecoder:
    """A SpeculativeDecoder whose target verification forwards run in HCMP mode."""

    def __init__(self, inner: SpeculativeDecoder, plan: HcmpPlan):
        self.inner, self.plan = inner, plan

    def generate(self, input_ids: torch.Tensor) -> DecodeResult:
        with hcmp_mode(self.inner.target.model, plan=self.plan):
            return self.inner.generate(input_ids)


class HcmpPolicy(Method):
    """A decoding method: any drafter (or none: plain decoding), the target split across two units."""

    backend = Backend.EAGER  # the split replaces the eager module's layers; a compiled graph would not see it

    def __init__(self, drafter: Drafter | None, config: HcmpConfig, name: str = "hcmp"):
        self.drafter, self.config, self.name = drafter, config, name

    def make_decoder(self, target, config) -> HcmpDecoder:
        return HcmpDecoder(SpeculativeDecoder(target, self.drafter, config, self.kept_prompt(config)),
                           HcmpPlan(target.model, self.config))
