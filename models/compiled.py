"""The `compiled` backend: the stock HF model's decoder (and the DGF drafter with the target's frozen embedding),
compiled ahead of time over a preallocated KV cache (gpt-fast's recipe, on the CPU). An LM head runs after its
graph, on the rows that need logits (every row of a verify, a prompt's last); greedy decoding's forwards, and a
float32 feature drafter's greedy chain, read the greedy head there (`compile.head`; models.kernels.GreedyHead: the
exact argmax from int8 or bf16 copies of the head).

- Static cache: the KV cache is preallocated to `capacity` slots (transformers' `StaticCache`
  layers, re-pointed at tensors this engine owns).
- Graphs (`shared_width`, the default): one AOTInductor package per model whose width is symbolic,
  from 1 to the largest bucket (decode steps, verification, drafting and prompt chunks run at their
  exact width, nothing padded; exported size-obliviously so that width 1 is not specialised).
  Inductor's CPU GEMM templates take a symbolic M, so the shared graph keeps the autotuned kernels
  (a 1536x8960 Linear, 2 threads: 1.36 / 1.64 / 3.23 ms at 1 / 2 / 8 rows, against 1.35 / 1.76 /
  3.20 ms for a graph per width; results/latency/linear_width_probe.md) while the model's frozen
  weights exist once instead of once per bucket. `shared_width=false`: one package per bucket (1, 2, 4, ..., 64), inputs padded to the
  smallest bucket >= n; padded slots attend only to themselves and no real slot attends to them.
  Prompts longer than the largest bucket are fed in causal chunks.
- Each package is `torch.export` of the model's forward (the cache tensors are inputs the graph
  writes into), compiled by AOTInductor with the weights frozen, so inductor's autotuned GEMM
  templates apply (`max_autotune`, CPU and CUDA).
- Cached on disk: `$DRAFTSMITH_CACHE/compiled/<key>/<graph>.pt2`, the key a hash of the model
  (config, a sample of every weight), dtype, device type, capacity, autotuning and torch version.
  The first run compiles (minutes; `compile_s`, reported apart from decode time), later runs load
  the packages in about a second each (`load_s`).
- KV commit copies the accepted slots to the front of the uncommitted region inside the cache;
  truncation only moves the committed length.
- Memory: on the batch-invariant kernels a package holds no weights and runs on the step's packed ones
  (`share_weights`); on inductor's kernels each package holds a frozen copy; `release` drops a graph.
- CUDA: the same packages hold device kernels; CUDA graphs are not captured (no GPU to test them on).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.fx.experimental._config as fx_config
import transformers
from torch import nn
from torch.utils import _pytree
from transformers import StaticCache

from draftsmith.config import ConfigError, Unread, check_config, option
from draftsmith.errors import UserError
from draftsmith.fileio import environment_variable, process_alive
from draftsmith.models.dgf import DGFModel, invariant_drafter
from draftsmith.models.engine import Backend, GreedyRows, TargetOutput, additive_mask, with_cache
from draftsmith.models.kernels import (GreedyHead, HeadLogits, InvariantLinear, JoinedProjection, Kernels,
                                      SiblingProjection, WeightPrecision, argmax_last, arena_zeros, check_kernel_dtype,
                                      invariant_attention, invariant_model)
from draftsmith.models.precision import Int8WeightLinear
from draftsmith.models.registry import draftsmith_cache

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_CAPACITY = 1024  # KV slots: prompt + new tokens + one tree must fit
PACKAGE_VERSION = 2  # bump when StepModule's inputs or outputs change, or what a package holds (2: no weights)


@dataclass
class CompileSettings:
    """How the compiled backend builds its graphs (all of it part of the package cache key)."""

    buckets: list[int] = option(factory=lambda: list(BUCKETS), help="input sizes with a compiled graph (the "
                                "largest also feeds prompts in chunks)", ge=1)
    capacity: int = option(DEFAULT_CAPACITY, "KV-cache slots: prompt + new tokens + one padded tree", ge=2)
    autotune: bool = option(True, "inductor max_autotune: GEMM templates benchmarked per shape (off: faster "
                                  "builds, slower graphs)")
    shared_width: bool = option(True, "one graph of symbolic width serves 1 .. the largest bucket (no padding, "
                                      "one weight copy); false: one padded graph per bucket")
    kernel_profile: bool = option(False, "record every generated kernel in torch.profiler (analysis builds only)")
    kernels: Kernels = option(Kernels.INVARIANT, "invariant: the batch-invariant, weight-streaming kernels "
                              "(models/kernels.py: a verify computes exactly what one-token steps compute); inductor: "
                              "the stock graph (not batch-invariant)")
    weights: WeightPrecision = option(WeightPrecision.MODEL, "the target's stored weights: model (its dtype), int8 "
                                      "(weight-only, a scale per output row), w8a8 (int8 weights, and each input "
                                      "row quantized to int8 as it arrives: integer dot products; float32 models) "
                                      "or split_bf16 (float32 weights and inputs as bf16 (hi, lo) pairs, every "
                                      "product of the halves summed in float32 on AMX tiles: a verify of 16 costs ~1.3 "
                                      "of its steps, but its step is slower than float32's on the Xeon measured; "
                                      "float32 models, AMX CPUs); invariant kernels only")
    head: HeadLogits | None = option(None, "the LM head of greedy decoding's forwards: greedy (int8 or bf16 copies "
                                     "streamed, the logits that could be the largest recomputed exactly: the exact "
                                     "argmax from a quarter to half of a float32 head's bytes; invariant kernels, "
                                     "weights=model), model (every logit from the model's weights); null: greedy for "
                                     "a float32 model where it applies, else model (a feature drafter's greedy "
                                     "chain too). Sampling and drafters' trees read the model's head")

    def __post_init__(self):
        check_config(self)
        if self.weights is not WeightPrecision.MODEL and self.kernels is not Kernels.INVARIANT:
            raise ConfigError(f"weights: {self.weights} runs on the invariant kernels only (set kernels=invariant)")
        if self.head is HeadLogits.GREEDY and not self.greedy_head_applies:
            raise ConfigError("head: greedy streams int8 / bf16 copies of a head in the model's own weights: it needs "
                              "kernels=invariant and weights=model or split_bf16")
        self.buckets = sorted(set(self.buckets))
        if not self.buckets:
            raise ConfigError("buckets: give at least one input size")
        if self.capacity <= self.buckets[-1]:
            raise ConfigError(f"capacity: {self.capacity} must exceed the largest bucket {self.buckets[-1]}")

    def slots_for(self, max_length: int) -> int:
        """KV slots an engine of these settings needs for a request of up to `max_length` tokens: those, and one padded
        forward of the largest bucket past them."""
        return max_length + self.buckets[-1]

    @property
    def greedy_head_applies(self) -> bool:
        """Whether the greedy head can serve these settings (the invariant kernels, the model's own weights or their
        split_bf16 pairs: the head's exact argmax is of its float32 rows either way)."""
        return self.kernels is Kernels.INVARIANT and self.weights in (WeightPrecision.MODEL, WeightPrecision.SPLIT_BF16)

    def greedy_head(self, dtype: torch.dtype) -> bool:
        """Whether greedy decoding's forwards on a model in `dtype` read the greedy head: as `head` says, by default
        for float32 models where it applies. (A bfloat16 head already streams half the bytes and costs the same
        as the greedy head's from two rows, and its greedy token is the argmax of logits rounded to bfloat16,
        whose ties the exact argmax would break otherwise.)"""
        if self.head is not None:
            return self.head is HeadLogits.GREEDY
        return self.greedy_head_applies and dtype == torch.float32

    def runs_invariant_kernels(self, backend: Backend) -> bool:
        """Whether a model on `backend` with these settings runs on the batch-invariant kernels."""
        return backend is Backend.COMPILED and self.kernels is Kernels.INVARIANT

    def check_dtype(self, dtype: torch.dtype, backends: Sequence[Backend]) -> None:
        """Before any work: a dtype the batch-invariant kernels do not take, where one of `backends` runs on them."""
        if any(self.runs_invariant_kernels(backend) for backend in backends):
            check_kernel_dtype(dtype)


def compile_unread(unread, reader: str) -> list[Unread]:
    """One Unread rule per `compile.*` option: a command that measures nothing on the compiled engine
    (`unread(config)`) refuses them by name (config.refuse_unread)."""
    return [Unread(f"compile.{f.name}", unread, reader) for f in fields(CompileSettings)]


class DirectRunner:
    """A loaded AOTInductor package called with its inputs as they come: the package's own __call__ parses its call
    spec (JSON) and flattens the inputs again on every call, ~0.1 ms a forward on 2 cores (a drafter's round makes
    four); a step's inputs are positional tensors already in the package's order, so they go straight to the loader."""

    def __init__(self, package):
        self.package = package
        self.out_spec = _pytree.treespec_loads(package.loader.get_call_spec()[1])

    def __call__(self, *tensors: torch.Tensor):
        return _pytree.tree_unflatten(self.package.loader.boxed_run(list(tensors)), self.out_spec)


class CompileUnavailable(UserError):
    """The compiled backend cannot run here (no compiler, an unsupported model); use backend=eager."""


# transformers' rotary types whose cos and sin depend on more than the position (on the sequence's length)
DYNAMIC_ROTARY = frozenset({"dynamic", "longrope"})


class RotaryTables(nn.Module):
    """The cos and sin of each of a cache's `capacity` positions from a model's own rotary embedding, computed once
    (eager, float32, cast to the forward's dtype as the embedding casts them). A compiled forward reads its rows'
    instead of computing them: inductor inlines the rotary's cos and sin into every layer's rotary kernel (SmolLM2:
    30 cos and sin computations of each element a forward; 0.1-0.5 ms of a 17-37 ms forward at 1-16 rows on the AVX2
    EPYC, results/engine_kernels_epyc_avx2/rotary_tables)."""

    def __init__(self, rotary: nn.Module, capacity: int, device: torch.device):
        super().__init__()
        with torch.no_grad():
            cos, sin = rotary(torch.zeros(1, device=device), torch.arange(capacity, device=device)[None])
        self.register_buffer("cos", cos[0].float().contiguous())  # (capacity, head_dim)
        self.register_buffer("sin", sin[0].float().contiguous())

    @staticmethod
    def of(model: nn.Module, capacity: int) -> RotaryTables | None:
        """Tables for `model`'s rotary embedding (its `rotary_emb`), None where it has none or a dynamic one."""
        rotary = getattr(model, "rotary_emb", None)
        if rotary is None or getattr(rotary, "rope_type", "default") in DYNAMIC_ROTARY:
            return None
        return RotaryTables(rotary, capacity, next(model.parameters()).device)

    def rows(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of each position in `position_ids` (1, b): (1, b, head_dim) in x's dtype."""
        return self.cos[position_ids].to(x.dtype), self.sin[position_ids].to(x.dtype)

    @contextlib.contextmanager
    def replacing(self, rotary: nn.Module):
        """Inside, `rotary`'s forwards (x, position_ids) return the tables' rows (a hook on the stock module)."""
        def hook(module, args, kwargs, output):
            return self.rows(args[0] if args else kwargs["x"], args[1] if len(args) > 1 else kwargs["position_ids"])
        handle = rotary.register_forward_hook(hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()


class StepModule(nn.Module):
    """One forward of the stock model's decoder over a StaticCache whose tensors are this module's inputs; the LM
    head stays outside the graph (CompiledEngine applies it to the rows that need logits: a prompt's last only).

    forward(input_ids (1, b), position_ids (1, b), mask (1, 1, b, capacity) additive, past () long,
            *kv) -> hidden states (layers + 1, 1, b, H), the last one after the final norm (the head's input);
    kv = every layer's keys, then every layer's values, (1, kv_heads, capacity, head_dim) each, written at
    past .. past + b - 1.
    """

    def __init__(self, model: nn.Module, cache: StaticCache):
        super().__init__()
        self.decoder = model.get_decoder()
        self.cache = cache
        self.rotary = RotaryTables.of(self.decoder, cache.get_max_length())

    def forward(self, input_ids, position_ids, mask, past, *kv):
        point_cache(self.cache, past, kv)
        with self.rotary.replacing(self.decoder.rotary_emb) if self.rotary else contextlib.nullcontext():
            out = self.decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=mask,
                               **with_cache(self.cache), use_cache=True, output_hidden_states=True)
        return torch.stack(out.hidden_states)


class DGFStepModule(nn.Module):
    """One forward of a DGF drafter (fusion, blocks, its final norm) over a StaticCache.

    forward(features (1, b, H), input_ids (1, b), position_ids (1, b), mask (1, 1, b, capacity), past,
            *kv) -> (predicted features (1, b, H), the output layer's inputs (1, b, H)). The head runs after the
    graph (CompiledDGFEngine), on the rows that need it, as the target's does. The target's embedding is
    registered here (not in the DGFModel), so it is frozen into the graph with the drafter.
    """

    traced_sources = (sys.modules[DGFModel.__module__],)

    def __init__(self, model: DGFModel, cache: StaticCache):
        super().__init__()
        model._need_target()
        self.model, self.cache = model, cache
        self.embedding = model._embed
        self.rotary = RotaryTables.of(model, cache.get_max_length())

    def forward(self, features, input_ids, position_ids, mask, past, *kv):
        point_cache(self.cache, past, kv)
        hidden = self.model.fusion(features, self.embedding(input_ids).to(features.dtype))
        position_embeddings = (self.rotary.rows(hidden, position_ids) if self.rotary
                               else self.model.rotary_emb(hidden, position_ids))
        for layer in self.model.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, **with_cache(self.cache),
                           use_cache=True, position_embeddings=position_embeddings)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        return hidden, self.model.head_input(hidden)


def point_cache(cache: StaticCache, past: torch.Tensor, kv: tuple) -> None:
    """Re-point a StaticCache's layers at the kv input tensors, writing from slot `past` on."""
    layers = cache.layers
    for i, layer in enumerate(layers):
        layer.keys, layer.values = kv[i], kv[len(layers) + i]
        layer.cumulative_length = past.clone()  # StaticLayer writes at its cumulative length


def zeroed_cache(like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zeroed KV tensors shaped as `like`'s, a request's own: on the CPU in one huge-page arena, as the weights (a
    long context's step reads all of it)."""
    if like[0].device.type == "cpu":
        return arena_zeros(like)
    return [torch.zeros_like(tensor) for tensor in like]


@dataclass
class StaticKV:
    """A request's view of the engine's preallocated cache: `length` committed slots."""

    tensors: list[torch.Tensor]
    length: int = 0

    @functools.cached_property
    def stacked(self) -> torch.Tensor | None:
        """Every tensor as one (tensors, heads, capacity, head_dim) view where they lie back to back in one storage
        (zeroed_cache's arena), else None: a commit moves every layer's slots in two ops instead of two a tensor."""
        first = self.tensors[0]
        step = first.numel() * first.element_size()
        if first.dim() != 4 or first.shape[0] != 1 or not first.is_contiguous() or any(
                tensor.shape != first.shape or tensor.dtype != first.dtype or not tensor.is_contiguous()
                or tensor.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or tensor.data_ptr() != first.data_ptr() + i * step for i, tensor in enumerate(self.tensors)):
            return None
        return first.as_strided((len(self.tensors), *first.shape[1:]), (first.numel(), *first.stride()[1:]))


def model_fingerprint(model: nn.Module, config: dict) -> str:
    """sha256 of a config and, per weight, its name, shape, dtype, sum and a strided sample."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            flat = tensor.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 4096)].float().cpu()
            digest.update(f"{name}{tuple(tensor.shape)}{tensor.dtype}{float(flat.float().sum()):.6e}".encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()


def traced_code_digest(step: nn.Module) -> str:
    """sha256 of the code a package traces (its step module; the DGF model's file): an edit there builds
    new packages instead of reusing stale ones."""
    sources = [inspect.getsource(type(step)), inspect.getsource(point_cache)]
    if any(isinstance(module, Int8WeightLinear) for module in step.modules()):
        sources.append(inspect.getsource(Int8WeightLinear))
    if any(isinstance(module, InvariantLinear) for module in step.modules()):
        sources += [inspect.getsource(cls) for cls in (InvariantLinear, JoinedProjection, SiblingProjection)]
        sources.append(inspect.getsource(invariant_attention))
    if any(isinstance(module, RotaryTables) for module in step.modules()):
        sources.append(inspect.getsource(RotaryTables))
    sources += [inspect.getsource(module) for module in getattr(step, "traced_sources", ())]  # a step's own model file
    return hashlib.sha256("\n".join(sources).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Graph:
    """One compiled package: a forward of exactly `width` tokens, or (shared) of any width from 1 to
    `width` (exported size-obliviously, so single tokens are not specialised)."""

    width: int
    shared: bool = False

    @property
    def name(self) -> str:
        return f"widths_1-{self.width}" if self.shared else f"bucket_{self.width}"

    def runs_at(self, n: int) -> int:
        """The width a forward of n tokens is run at (padded up to it)."""
        return n if self.shared else self.width


@contextlib.contextmanager
def scratch_inductor_cache(parent: Path):
    """Inductor's working files for one build in a scratch directory beside the package, removed
    afterwards: an AOT build writes the frozen weights there too (gigabytes per build of a 1.5B model,
    which the package already holds)."""
    with tempfile.TemporaryDirectory(prefix=".inductor_", dir=parent) as scratch, \
            environment_variable("TORCHINDUCTOR_CACHE_DIR", scratch):
        yield


def pad_width(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (1, n, ...) zero-padded along the token axis to `width`; x itself (contiguous) when it already
    is that wide, as every forward on the shared graph is."""
    n = x.shape[1]
    if n == width:
        return x.contiguous()
    out = x.new_zeros((x.shape[0], width, *x.shape[2:]))
    out[:, :n] = x
    return out


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for bucket in buckets:
        if bucket >= n:
            return bucket
    raise UserError(f"a forward of {n} tokens exceeds the largest bucket {buckets[-1]}")


def static_cache(config, capacity: int, initialise) -> tuple[StaticCache, list[torch.Tensor]]:
    """A StaticCache of `capacity` slots, its layers initialised by one forward `initialise(cache)`;
    returns it with its tensors (every layer's keys, then every layer's values)."""
    cache = StaticCache(config=config, max_cache_len=capacity)
    with torch.no_grad():
        initialise(cache)
    return cache, [layer.keys for layer in cache.layers] + [layer.values for layer in cache.layers]


class GraphPackages:
    """Job 1 of a compiled engine: the AOTInductor packages of a step module (whose last inputs are the KV
    tensors), built once per machine (cached on disk under a key of the model, settings and versions) and loaded
    per process. One package per bucket width, or, with `shared_width`, one package whose width is dynamic up to
    the largest bucket (every forward runs on it)."""

    def __init__(self, step: nn.Module, kv: list[torch.Tensor], fingerprint: str, settings: CompileSettings,
                 dtype: torch.dtype, device: torch.device, what: str, cache_dir: str | Path | None = None):
        self.step, self.kv, self.settings, self.what = step, kv, settings, what
        self.capacity, self.buckets, self.autotune = settings.capacity, tuple(settings.buckets), settings.autotune
        self.shared = settings.shared_width and self.buckets[-1] > 2  # a width range [1, 2] does not export
        self.dtype, self.device = dtype, device
        text = (f"{fingerprint}|{dtype}|{device.type}|{self.capacity}|{torch.__version__}|{transformers.__version__}|"
                f"{PACKAGE_VERSION}|{self.autotune}|{traced_code_digest(step)}")
        if settings.kernel_profile:
            text += "|kernel_profile"
        key = hashlib.sha256(text.encode()).hexdigest()[:24]
        self.directory = Path(cache_dir or draftsmith_cache() / "compiled") / key
        self.runners: dict[Graph, object] = {}
        self.compile_s: dict[str, float] = {}  # seconds spent compiling each graph in this process
        self.load_s: dict[str, float] = {}  # seconds spent loading a cached package
        self.shared_constants: dict[Graph, dict] = {}  # the tensors each package without weights runs on

    # -- compiling -----------------------------------------------------------------------------

    def example(self, width: int) -> tuple:
        """Inputs of one forward of `width` tokens (the step module's signature)."""
        raise NotImplementedError

    def width_axes(self, width) -> tuple:
        """torch.export dynamic_shapes of the step's inputs: `width` on every token axis."""
        raise NotImplementedError

    def graph_for(self, n: int) -> Graph:
        """The graph a forward of n tokens (at most the largest bucket) runs on."""
        if self.shared:
            return Graph(self.buckets[-1], shared=True)
        return Graph(bucket_for(n, self.buckets))

    def _compile(self, graph: Graph, path: Path, embed_weights: bool) -> None:
        try:
            from torch._inductor import aoti_compile_and_package
        except ImportError as err:
            raise CompileUnavailable(f"torch {torch.__version__} has no AOTInductor: use backend=eager") from err
        example_width = min(8, graph.width) if graph.shared else graph.width  # the shared graph's autotuning size
        axes = self.width_axes(torch.export.Dim("width", min=1, max=graph.width)) if graph.shared else None
        with torch.no_grad(), fx_config.patch(backed_size_oblivious=graph.shared):  # no 0/1 specialisation
            program = torch.export.export(self.step, self.example(example_width), dynamic_shapes=axes, strict=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".tmp_{os.getpid()}_{path.stem}.pt2")  # AOTInductor wants the .pt2 ending
        before = machine_load()
        configs = {"freezing": True, "max_autotune": self.autotune, "autotune_num_choices_displayed": 0,
                   "max_autotune_report_choices_stats": False,
                   "cpp.enable_kernel_profile": self.settings.kernel_profile}
        if not embed_weights:  # the package runs on the step's own tensors (share_weights): no copy built or stored
            configs |= {"aot_inductor.package_constants_in_so": False,
                        "aot_inductor.package_constants_on_disk_format": None}
        with torch.no_grad(), scratch_inductor_cache(path.parent):
            aoti_compile_and_package(program, package_path=str(tmp), inductor_configs=configs)
        tmp.replace(path)
        after = machine_load()  # autotuning times kernels: a busy or swapping machine picks slow ones for good
        path.with_suffix(".build.json").write_text(json.dumps({
            "built": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu_count": os.cpu_count(), "autotune": self.autotune,
            "weights": "embedded" if embed_weights else "shared",
            "load_average_1min": max(before["load_average_1min"], after["load_average_1min"]),
            "available_memory_gb": min(before["available_memory_gb"], after["available_memory_gb"])}))

    def prepare(self, sizes: tuple[int, ...] | None = None) -> None:
        """Compile (first run) or load (later runs) the packages that forwards of `sizes` tokens use
        (default: every bucket's)."""
        for graph in self._graphs_of(sizes):
            if graph in self.runners:
                continue
            path = self.directory / f"{graph.name}.pt2"
            if not path.is_file():
                self._timed_compile(graph, path, embed_weights=not self.shares_weights)
            start = time.perf_counter()
            runner = self._load(path)
            if not self._embeds_weights(path) and not self.share_weights(runner, graph):
                log.info("the %s package of %s folds weights of its own; rebuilt with them", graph.name, self.what)
                self._timed_compile(graph, path, embed_weights=True)
                runner = self._load(path)
            self.runners[graph] = DirectRunner(runner)
            self.load_s[graph.name] = time.perf_counter() - start

    def _timed_compile(self, graph: Graph, path: Path, embed_weights: bool) -> None:
        start = time.perf_counter()
        log.info("compiling %s of %s (once; cached in %s)", graph.name, self.what, self.directory)
        self._compile(graph, path, embed_weights)
        self.compile_s[graph.name] = self.compile_s.get(graph.name, 0.0) + time.perf_counter() - start

    @staticmethod
    def _load(path: Path):
        from torch._inductor import aoti_load_package

        with environment_variable("TMPDIR", str(extraction_directory())):  # where the loader unpacks
            return aoti_load_package(str(path))

    @staticmethod
    def _embeds_weights(path: Path) -> bool:
        record = path.with_suffix(".build.json")
        return not record.is_file() or json.loads(record.read_text()).get("weights", "embedded") == "embedded"

    @property
    def shares_weights(self) -> bool:
        """Whether packages run on the step's own tensors (invariant kernels), not a frozen copy (a 1.5B's build went
        over 24 GB); inductor folds a feature drafter's view of the target's embedding into a weight of its own."""
        return (not isinstance(self.step, DGFStepModule)
                and any(isinstance(module, InvariantLinear) for module in self.step.modules()))

    def share_weights(self, runner, graph: Graph) -> bool:
        """Point a package without weights at the step module's tensors (no copy; they stay alive with the step).
        False when the package names a weight the step does not hold (inductor folded a tensor the step only
        references, e.g. a drafter's view of the target's embedding)."""
        tensors = {**dict(self.step.named_parameters(remove_duplicate=False)),
                   **dict(self.step.named_buffers(remove_duplicate=False))}
        names = runner.get_constant_fqns()
        if any(name not in tensors for name in names):
            return False
        constants = {name: tensors[name].detach() for name in names}
        runner.load_constants(constants, check_full_update=True, user_managed=True)
        self.shared_constants[graph] = constants  # the package holds handles to these tensors, not references
        return True

    def release(self, sizes: tuple[int, ...] | None = None) -> None:
        """Drop the loaded packages of these sizes (default: all): a package with its own frozen copy of the
        weights frees it, so a big model can measure one graph at a time."""
        for graph in self._graphs_of(sizes):
            self.runners.pop(graph, None)
            self.shared_constants.pop(graph, None)

    def graph_groups(self, sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
        """These input sizes grouped by the graph they run on (the shared graph: one group)."""
        groups: dict[Graph, list[int]] = {}
        for size in sizes:
            groups.setdefault(self.graph_for(min(size, self.buckets[-1])), []).append(size)
        return [tuple(group) for _, group in sorted(groups.items(), key=lambda item: item[0].width)]

    def build_seconds(self) -> dict[str, float]:
        """Seconds spent compiling and loading packages in this process."""
        return {"compile_s": sum(self.compile_s.values()), "load_s": sum(self.load_s.values())}

    def build_conditions(self) -> dict | None:
        """How busy the machine was while its packages were built (the worst graph), None when unrecorded."""
        records = [json.loads(path.read_text()) for graph in self._graphs_of(None)
                   if (path := (self.directory / f"{graph.name}.build.json")).is_file()]
        if not records:
            return None
        return {"built": max(r["built"] for r in records), "cpu_count": records[0]["cpu_count"],
                "load_average_1min": max(r["load_average_1min"] for r in records),
                "available_memory_gb": min(r["available_memory_gb"] for r in records)}

    def _graphs_of(self, sizes: tuple[int, ...] | None) -> list[Graph]:
        sizes = self.buckets if sizes is None else sizes
        return sorted({self.graph_for(min(size, self.buckets[-1])) for size in sizes}, key=lambda g: g.name)



class StaticKVBook:
    """Job 2 of a compiled engine: the bookkeeping of its preallocated KV cache (`capacity` slots): new caches,
    commit (keep the accepted path), truncate, and the additive masks of padded forwards."""

    capacity: int
    buckets: tuple[int, ...]
    kv: list[torch.Tensor]
    dtype: torch.dtype
    device: torch.device

    def new_cache(self, max_length: int | None = None) -> StaticKV:
        """A fresh preallocated cache (its own tensors: two requests, e.g. a drafter and its target, never
        share one)."""
        if max_length is not None and not self.fits(max_length):
            raise UserError(f"this request needs up to {max_length} KV slots (+ one padded bucket); the compiled "
                            f"engine holds {self.capacity}: raise its capacity or shorten the request")
        return StaticKV(zeroed_cache(self.kv), 0)

    def cache_length(self, cache: StaticKV) -> int:
        return cache.length

    def fits(self, max_length: int) -> bool:
        """Whether this engine's caches take a request of up to `max_length` tokens (+ one padded bucket)."""
        return self.settings.slots_for(max_length) <= self.capacity

    def truncate(self, cache: StaticKV, length: int) -> None:
        cache.length = min(cache.length, length)

    def commit(self, cache: StaticKV, keep: torch.Tensor) -> None:
        """Keep the slots `keep` (increasing; the committed prefix first): the others move to the front
        of the uncommitted region, inside the cache."""
        kept = keep.numel()
        past = int((keep == torch.arange(kept, device=keep.device)).long().cumprod(0).sum())  # untouched prefix
        if past < kept:
            moved = keep[past:].to(self.device)
            for tensor in [cache.stacked] if cache.stacked is not None else cache.tensors:
                tensor[:, :, past:kept] = tensor.index_select(2, moved)
        cache.length = kept

    def static_mask(self, allowed: torch.Tensor | None, past: int, n: int, bucket: int) -> torch.Tensor:
        """(1, 1, bucket, capacity) additive mask (0 where a row sees a slot, the dtype's minimum elsewhere): real
        rows from `allowed` (None: causal), padded rows attend to their own slot only. A causal forward at its
        exact width (every decode step and chain) is a copy of a window of `causal_rows`: a few ops a forward."""
        if allowed is None and bucket == n:
            window = self.causal_rows[:n, self.capacity - past:2 * self.capacity - past]
            return window.clone(memory_format=torch.contiguous_format)[None, None]  # its own aligned storage
        out = torch.full((bucket, self.capacity), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)
        if allowed is None:
            allowed = torch.ones(n, past + n, dtype=torch.bool, device=self.device).tril(past)
        out[:n, :past + n].masked_fill_(allowed.reshape(n, past + n), 0.0)
        if bucket > n:
            pad = torch.arange(n, bucket, device=self.device)
            out[pad, past + pad] = 0.0
        return out[None, None]

    @functools.cached_property
    def causal_rows(self) -> torch.Tensor:
        """(largest bucket, 2 x capacity) additive: row i sees columns <= capacity + i, so columns capacity - past
        onwards are the causal mask of a forward after `past` slots (row i sees slots <= past + i)."""
        columns = torch.arange(2 * self.capacity, device=self.device)
        rows = torch.arange(self.buckets[-1], device=self.device)
        return additive_mask(columns[None, :] <= self.capacity + rows[:, None], self.dtype)



class BucketGraphs(GraphPackages, StaticKVBook):
    """A compiled engine's base: its graphs (GraphPackages) and its static cache (StaticKVBook), joined where a
    forward of n tokens picks its graph, pads to its width and masks the padding."""

    name = Backend.COMPILED

    def padded(self, cache: StaticKV, n: int, position_ids: torch.Tensor | None,
               allowed: torch.Tensor | None) -> tuple[object, int, torch.Tensor, torch.Tensor]:
        """(runner, width, positions (1, width), mask) of a forward of n tokens (width >= n: padded);
        the graph is loaded."""
        if n > self.buckets[-1]:
            raise UserError(f"a forward of {n} tokens exceeds the largest bucket {self.buckets[-1]}")
        past, graph = cache.length, self.graph_for(n)
        width = graph.runs_at(n)
        if past + width > self.capacity:
            raise UserError(f"the compiled engine's KV cache ({self.capacity} slots) is full")
        if graph not in self.runners:
            self.prepare((n,))
        positions = torch.arange(past, past + width, device=self.device)[None]
        if position_ids is not None:
            positions[:, :n] = position_ids
        return self.runners[graph], width, positions, self.static_mask(allowed, past, n, width)

    def check_chunkable(self, n: int, position_ids, allowed) -> None:
        if allowed is not None or position_ids is not None:
            raise UserError(f"a masked forward of {n} tokens exceeds the largest bucket {self.buckets[-1]}")


class CompiledEngine(BucketGraphs):
    """The target's static-shape forwards (see the module docstring); one request at a time per cache."""

    def __init__(self, model: nn.Module, settings: CompileSettings | None = None,
                 cache_dir: str | Path | None = None):
        settings = settings or CompileSettings()
        self.model = model.eval()
        device = model.device
        runs = invariant_model(model, settings.weights) if settings.kernels is Kernels.INVARIANT else model
        cache, kv = static_cache(model.config, settings.capacity, lambda c: runs(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), **with_cache(c), use_cache=True))
        super().__init__(StepModule(runs, cache), kv, model_fingerprint(runs, model.config.to_dict()), settings,
                         model.dtype, device, model.config.model_type, cache_dir)
        self.runs = runs  # the model the graphs run (on the invariant kernels: its linears packed)
        self.head = runs.get_output_embeddings()  # on the invariant kernels: its rows are the same at any width
        self.greedy_head = (placed_greedy_head(model.get_output_embeddings()) if settings.greedy_head(model.dtype)
                            else None)

    def example(self, width: int) -> tuple:
        ids = torch.zeros(1, width, dtype=torch.long, device=self.device)
        positions = torch.arange(width, device=self.device)[None]
        mask = self.static_mask(None, 0, width, width)
        return (ids, positions, mask, torch.tensor(0, device=self.device), *self.new_cache().tensors)

    def width_axes(self, width) -> tuple:
        return ({1: width}, {1: width}, {2: width}, None, tuple(None for _ in self.kv))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: StaticKV, position_ids: torch.Tensor | None = None,
                allowed: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                last_only: bool = False, argmax_only: bool = False, greedy_rows: bool = False) -> TargetOutput:
        n = input_ids.shape[1]
        if n > self.buckets[-1]:
            self.check_chunkable(n, position_ids, allowed)
            return self._chunked(input_ids, cache, hidden_layers, last_only, argmax_only)
        past = cache.length
        runner, width, positions, mask = self.padded(cache, n, position_ids, allowed)
        ids = pad_width(input_ids.to(self.device, torch.long), width)
        hidden = runner(ids, positions, mask, torch.tensor(past, device=self.device), *cache.tensors)
        cache.length = past + n
        final = hidden[-1][:, n - 1:n] if last_only else hidden[-1][:, :n]
        head = self.greedy_head if argmax_only and self.greedy_head is not None else self.head
        layers = {k: hidden[k][:, :n] for k in hidden_layers}
        if greedy_rows and head is self.greedy_head and head.rows_apart and final.shape[1] > 1:
            return TargetOutput(logits=None, hidden=layers, greedy=GreedyRows(head, final))
        return TargetOutput(logits=head(final).float(), hidden=layers)

    def _chunked(self, input_ids: torch.Tensor, cache: StaticKV, hidden_layers: tuple[int, ...],
                 last_only: bool, argmax_only: bool) -> TargetOutput:
        """A long causal forward (a prompt) in chunks of the largest bucket (with `last_only`, only the last
        chunk's last row meets the head)."""
        starts = range(0, input_ids.shape[1], self.buckets[-1])
        outs = [self.forward(input_ids[:, start:start + self.buckets[-1]], cache, hidden_layers=hidden_layers,
                             last_only=last_only, argmax_only=argmax_only) for start in starts]
        return TargetOutput(logits=outs[-1].logits if last_only else torch.cat([o.logits for o in outs], 1),
                            hidden={k: torch.cat([o.hidden[k] for o in outs], 1) for k in hidden_layers})


def placed_greedy_head(linear: nn.Linear) -> GreedyHead:
    """The greedy head of an LM head (`linear`), its int8 and wide copies in a weight arena of their own (huge
    pages)."""
    head = GreedyHead(linear)
    names = [name for name in ("packed", "packed_wide") if getattr(head, name) is not None]
    for name, placed in zip(names, arena_zeros([getattr(head, name) for name in names])):
        setattr(head, name, placed.copy_(getattr(head, name)))
    return head


def machine_load() -> dict:
    """1-minute load average and available memory (GB; Linux /proc/meminfo, else -1)."""
    available = -1.0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) / 2 ** 20
    return {"load_average_1min": os.getloadavg()[0], "available_memory_gb": round(available, 2)}


def extraction_directory() -> Path:
    """This process's folder for the AOTInductor loader, which unpacks every package (its weights included:
    6.7 GB for the 1.5B) into a temporary folder that only a clean exit removes; a killed bench left 15 GB in
    /tmp and the next one failed on a full disk. Folders of processes that are gone are removed first."""
    root = draftsmith_cache() / "aoti-extract"
    root.mkdir(parents=True, exist_ok=True)
    for folder in root.iterdir():
        if folder.name.isdigit() and int(folder.name) != os.getpid() and not process_alive(int(folder.name)):
            shutil.rmtree(folder, ignore_errors=True)
    mine = root / str(os.getpid())
    mine.mkdir(exist_ok=True)
    return mine


class CompiledDGFEngine(BucketGraphs):
    """The DGF drafter's static-shape forwards (the interface of models.dgf.EagerDGFEngine)."""

    def __init__(self, model: DGFModel, settings: CompileSettings | None = None,
                 cache_dir: str | Path | None = None):
        settings = settings or CompileSettings()
        self.model = model.eval()
        device, dtype, hidden = model.device, model.dtype, model.config.hidden_size
        if settings.kernels is Kernels.INVARIANT:
            model = invariant_drafter(model, settings.weights)
        cache, kv = static_cache(model.block_config, settings.capacity, lambda c: model(
            torch.zeros(1, 1, hidden, dtype=dtype, device=device), torch.zeros(1, 1, dtype=torch.long, device=device),
            cache=c))
        step = DGFStepModule(model, cache)  # the invariant copy, when it runs on those kernels
        self.runs = model  # the model the graphs and the head after them run
        head = self.model.head_linear()  # a greedy chain's argmax: the exact one from int8 / bf16 copies of its rows
        self.greedy_head = (placed_greedy_head(head) if settings.greedy_head(dtype) and head.bias is None else None)
        fingerprint = model_fingerprint(step, model.config.to_dict())  # the drafter and the target's parts
        super().__init__(step, kv, fingerprint, settings, dtype, device, f"dgf drafter ({model.config.fusion})",
                         cache_dir)

    def example(self, width: int) -> tuple:
        features = torch.zeros(1, width, self.model.config.hidden_size, dtype=self.dtype, device=self.device)
        ids = torch.zeros(1, width, dtype=torch.long, device=self.device)
        positions = torch.arange(width, device=self.device)[None]
        mask = self.static_mask(None, 0, width, width)
        return (features, ids, positions, mask, torch.tensor(0, device=self.device), *self.new_cache().tensors)

    def width_axes(self, width) -> tuple:
        return ({1: width}, {1: width}, {1: width}, {2: width}, None, tuple(None for _ in self.kv))

    @torch.inference_mode()
    def fuse_layers(self, layers: torch.Tensor) -> torch.Tensor:
        """The drafter's input features from the target's layers, on the kernels its forwards run on."""
        return self.runs.fuse_layers(layers)

    @torch.inference_mode()
    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, cache: StaticKV,
                position_ids: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted features (1, n, H), float32 logits (1, n or 1, V)), as EagerDGFEngine.forward."""
        n = input_ids.shape[1]
        if n > self.buckets[-1]:
            self.check_chunkable(n, position_ids, allowed)
            parts = [self.forward(features[:, s:s + self.buckets[-1]], input_ids[:, s:s + self.buckets[-1]], cache,
                                  last_only=last_only) for s in range(0, n, self.buckets[-1])]
            logits = parts[-1][1] if last_only else torch.cat([p[1] for p in parts], 1)
            return torch.cat([p[0] for p in parts], 1), logits
        hidden, head_inputs = self._graph(features, input_ids, cache, position_ids, allowed, last_only)
        return hidden, self.runs.head_output(head_inputs).float()

    @torch.inference_mode()
    def forward_argmax(self, features: torch.Tensor, input_ids: torch.Tensor, cache: StaticKV,
                       last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted features (1, n, H), each row's most likely draft token (1, n or 1)), as EagerDGFEngine's: a
        causal forward whose reader needs only the argmax (a greedy chain). With the greedy head (a float32 drafter
        on the invariant kernels) the argmax of the exact logits from a quarter of the head's bytes a row."""
        if self.greedy_head is None or input_ids.shape[1] > self.buckets[-1]:
            hidden, logits = self.forward(features, input_ids, cache, last_only=last_only)
            return hidden, argmax_last(logits)
        hidden, head_inputs = self._graph(features, input_ids, cache, last_only=last_only)
        return hidden, argmax_last(self.greedy_head(head_inputs))

    def _graph(self, features: torch.Tensor, input_ids: torch.Tensor, cache: StaticKV,
               position_ids: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
               last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted features (1, n, H), the head's inputs (1, n or 1, H)): one graph call of at most the largest
        bucket's width."""
        n, past = input_ids.shape[1], cache.length
        runner, width, positions, mask = self.padded(cache, n, position_ids, allowed)
        hidden, head_inputs = runner(pad_width(features.to(self.device, self.dtype), width),
                                     pad_width(input_ids.to(self.device, torch.long), width), positions, mask,
                                     torch.tensor(past, device=self.device), *cache.tensors)
        cache.length = past + n
        return hidden[:, :n], head_inputs[:, n - 1:n] if last_only else head_inputs[:, :n]
