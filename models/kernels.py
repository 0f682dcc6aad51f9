"""Batch-invariant CPU kernels (models/native/batch_invariant.cpp) and the model surgery that runs a stock HF
model on them: every Linear becomes an `InvariantLinear` (weights packed once, in float32, bfloat16, weight-only
int8, w8a8: int8 weights times inputs quantized to int8 in blocks of 32 as they arrive, exact integer dot products,
or on AMX float32 as split bf16 pairs) and attention goes through `draftsmith::attention`, registered in
transformers' attention table.

Why: a verify of w tokens must compute, row for row, exactly what w one-token steps compute, or a near-tie flips a
speculative output away from the target's own plain output. Stock kernels (oneDNN, inductor's GEMM templates,
SDPA) pick blockings and reduction splits by the number of rows; these kernels reduce every output element in one
fixed order whatever the rows, the thread count, or (attention) where its visible keys lie in the cache, so
speculative decoding is lossless by construction in every precision. They also read each weight from memory once per
forward (up to 9 rows in one pass of a register tile), so a verify of a few tokens costs about one step, and attention
reads only the keys a row sees (not the whole preallocated cache), in blocks of 512 of them that the threads share
(a row's blocks depend only on how many keys it sees, so a long row splits the same way in a step and in a verify).
A model's packed weights live in one arena on transparent huge pages, in the order a forward streams them. Beside
them, ops for the decode loop's own small steps, each one call where torch takes several ops that run cold after a
forward: the greedy head's argmax (`argmax_last`) and a draft tree's level (`top_log_probs`).

The extension is built once per machine (torch.utils.cpp_extension, ~40 s; `python -m draftsmith.models.kernels
build`, which scripts/install.sh runs) into $DRAFTSMITH_CACHE/kernels/<source digest>; the instruction set is
picked at load time (AVX-512 with AMX tiles: linear layers with bfloat16 weights on its tiles, the rest as with
AVX-512 BF16; AVX-512 with BF16, AVX-512, AVX2 + FMA, scalar; DRAFTSMITH_KERNEL_ISA forces a lower one).
Where it cannot build, `KernelsUnavailable` says so in one line and `compile.kernels=inductor` runs the stock
kernels instead.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import io
import itertools
import mmap
import os
from pathlib import Path

import torch
from torch import nn

from draftsmith.config import TextEnum
from draftsmith.errors import UserError, exit_with
from draftsmith.fileio import dir_lock
from draftsmith.models.registry import draftsmith_cache

SOURCE_DIRECTORY = Path(__file__).with_name("native")
SOURCES = ("batch_invariant.cpp", "invariant_impl.h")
PANEL = 48  # output columns per packed weight panel (invariant_impl.h's PANEL)
HUGE_PAGE = 2 << 20  # bytes of an x86 transparent huge page
WEIGHT_ALIGNMENT = 64  # bytes: each packed weight starts on a cache line of the arena
ATTENTION_NAME = "draftsmith_invariant"


class KernelsUnavailable(UserError):
    """The batch-invariant kernels could not be built or loaded here; compile.kernels=inductor runs without them."""


class Kernels(TextEnum):
    """Which kernels a compiled graph calls; part of its package key."""

    INVARIANT = "invariant"  # draftsmith::linear and draftsmith::attention: batch-invariant, weight-streaming
    INDUCTOR = "inductor"  # the stock graph: inductor's GEMM templates, SDPA (not batch-invariant)


class WeightPrecision(TextEnum):
    """How an InvariantLinear stores its weights; activations stay in the model's dtype."""

    MODEL = "model"  # the model's own dtype (float32 or bfloat16)
    INT8 = "int8"  # weight-only int8, one float32 scale per output row (symmetric, round to nearest)
    # int8 weights as INT8, and int8 inputs: each input row quantized as it arrives, in blocks of 32 (symmetric, a
    # scale per block, as llama.cpp's q8_0), then exact integer dot products (AVX-512 VNNI where the CPU has it);
    # float32 activations between the layers
    W8A8 = "w8a8"
    # float32 weights as (hi, lo) bfloat16 pairs in their 4 bytes and float32 inputs split so as they arrive, every
    # product of the 16-bit-significand halves summed in float32 on AMX tiles (draftsmith::linear_split): a verify
    # of 16 costs ~1.3 of its steps, its step more than float32's on the Xeon (results/roofline/README.md); each
    # product within ~2^-16 of float32's (float32 models, AMX CPUs)
    SPLIT_BF16 = "split_bf16"

    @property
    def label(self) -> str:
        """How a results table names it ("" for the model's own dtype)."""
        return WEIGHT_LABELS[self]


class HeadLogits(TextEnum):
    """What a compiled target's LM head computes."""

    MODEL = "model"  # every logit, from the model's own weights (sampling needs them)
    GREEDY = "greedy"  # GreedyHead: int8 / bf16 logits, those that could be the largest recomputed exactly (greedy)


WEIGHT_LABELS = {WeightPrecision.MODEL: "", WeightPrecision.INT8: "int8 weights",
                 WeightPrecision.W8A8: "w8a8 (int8 weights and inputs)",
                 WeightPrecision.SPLIT_BF16: "split bf16 (float32 as bf16 pairs, AMX)"}
FLOAT32_INPUTS = (WeightPrecision.W8A8, WeightPrecision.SPLIT_BF16)  # precisions that take float32 inputs only


KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the activations draftsmith::linear and ::attention take


def check_kernel_dtype(dtype: torch.dtype) -> None:
    """The kernels take float32 or bfloat16 activations; another dtype is refused in one line (entry points call it
    before any work, invariant_model again when it builds)."""
    if dtype not in KERNEL_DTYPES:
        raise UserError(f"the batch-invariant kernels take float32 or bfloat16 and this model runs in "
                        f"{str(dtype).split('.')[-1]}: use dtype=float32 or dtype=bfloat16, or compile.kernels=inductor")


def check_activations(precision: WeightPrecision, dtype: torch.dtype) -> None:
    """The kernels take float32 or bfloat16 activations, w8a8 and split_bf16 float32 only; a model in another dtype
    is refused in one line."""
    check_kernel_dtype(dtype)
    if precision in FLOAT32_INPUTS and dtype != torch.float32:
        raise UserError(f"weights={precision} takes float32 inputs and this model runs in {str(dtype).split('.')[-1]}: "
                        "use dtype=float32, or weights=int8 (weight-only) for a bfloat16 model")


def precision_runs_here(precision: WeightPrecision) -> bool:
    """Whether the kernels run `precision` as they are loaded: split_bf16 on AMX tiles only, the others everywhere."""
    return precision is not WeightPrecision.SPLIT_BF16 or kernel_isa() == KernelIsa.AVX512_AMX


def check_precision_runs(precision: WeightPrecision) -> None:
    """split_bf16 runs on AMX tiles only; elsewhere (or with the kernels forced lower) one line says so."""
    if not precision_runs_here(precision):
        raise UserError(f"weights=split_bf16 runs on AMX tiles and the kernels here run {kernel_isa()}: use "
                        "weights=model (float32)")


def source_digest() -> str:
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((SOURCE_DIRECTORY / name).read_bytes())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:16]


def build_directory() -> Path:
    """Where this machine builds and caches the kernels of the current sources."""
    return draftsmith_cache() / "kernels" / source_digest()


_MODULE = None
_ARGMAX_OP = False  # whether the loaded build defines draftsmith::argmax
_TOP_OP = False  # and draftsmith::top_log_probs


def use_sources(directory: Path) -> None:
    """Build and load the kernels from another copy of native/ (an A/B of kernel changes: eval.kernel_ab); only
    before this process has loaded them."""
    global SOURCE_DIRECTORY
    if _MODULE is not None:
        raise UserError("use_sources: this process has loaded the kernels already")
    SOURCE_DIRECTORY = Path(directory)


def load_kernels(verbose: bool = False):
    """The extension module (built on first use, then loaded from the cache); registers the ops and their fake
    kernels once per process."""
    global _MODULE, _ARGMAX_OP, _TOP_OP
    if _MODULE is not None:
        return _MODULE
    from torch.utils import cpp_extension

    build = build_directory()
    build.mkdir(parents=True, exist_ok=True)
    log = io.StringIO()
    try:
        with dir_lock(build), contextlib.redirect_stdout(log):
            # torch's own build baton: a build killed half-way leaves it behind and every later load would wait on it
            # forever; under this process's flock no other build is running, so one found here is stale
            (build / "lock").unlink(missing_ok=True)
            module = cpp_extension.load(
                name="draftsmith_kernels", sources=[str(SOURCE_DIRECTORY / SOURCES[0])], build_directory=str(build),
                extra_cflags=["-O3", "-ffp-contract=off", "-fopenmp"], extra_ldflags=["-fopenmp"],
                verbose=verbose)
    except (RuntimeError, OSError, ImportError) as err:
        first = " ".join(str(err).split())[:140]
        raise KernelsUnavailable(f"the batch-invariant kernels did not build here ({first}); run with "
                                 "compile.kernels=inductor") from err
    check_forced_isa(module)
    register_fakes()
    _ARGMAX_OP = hasattr(torch.ops.draftsmith, "argmax")  # (eval.kernel_ab's baseline builds may predate it)
    _TOP_OP = hasattr(torch.ops.draftsmith, "top_log_probs")
    _MODULE = module
    return module


def require_available_isa(module, name: str, what: str) -> None:
    """`name` is an instruction set this CPU runs, else one line (`what`: the option that named it)."""
    if name not in module.available_isas():
        raise UserError(f"{what}={name}: this CPU runs {', '.join(module.available_isas())}")


def check_forced_isa(module) -> None:
    """DRAFTSMITH_KERNEL_ISA, where set, names a set this CPU runs (else one line now, not an error from the first
    op call deep in a model). A build without available_isas (eval.kernel_ab's older baselines) checks it itself."""
    forced = os.environ.get("DRAFTSMITH_KERNEL_ISA", "")
    if forced and hasattr(module, "available_isas"):
        require_available_isa(module, forced, "DRAFTSMITH_KERNEL_ISA")


def register_fakes() -> None:
    """Shape functions, so torch.export / AOTInductor graphs call the ops (the package calls them at run time); only
    for the ops the loaded build defines (eval.kernel_ab runs this code on an older build as its baseline)."""
    fakes = {
        "linear": lambda x, packed, scale, bias, out_features: x.new_empty((*x.shape[:-1], out_features)),
        "linear_i8": lambda x, packed, scale, bias, out_features: x.new_empty((*x.shape[:-1], out_features)),
        "linear_split": lambda x, packed, bias, out_features: x.new_empty((*x.shape[:-1], out_features)),
        "greedy_head": lambda x, packed, scale, weight: x.new_empty((*x.shape[:-1], weight.shape[0]),
                                                                    dtype=torch.float32),
        "argmax": lambda x: x.new_empty(x.shape[:-1], dtype=torch.long),
        "top_log_probs": lambda logits, k: (logits.new_empty((logits.shape[0], k)),
                                            logits.new_empty((logits.shape[0], k), dtype=torch.long),
                                            logits.new_empty(logits.shape[:1], dtype=torch.float64)),
        "attention": lambda q, k, v, mask, scaling: q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3])),
    }
    for name, fake in fakes.items():
        if hasattr(torch.ops.draftsmith, name):
            torch.library.register_fake(f"draftsmith::{name}")(fake)


class KernelIsa(TextEnum):
    """The kernels' instruction sets (batch_invariant.cpp's ISA_NAMES): DRAFTSMITH_KERNEL_ISA picks one for a process,
    kernels_on for some calls of it."""

    AVX512_AMX = "avx512_amx"
    AVX512_BF16 = "avx512_bf16"
    AVX512 = "avx512"
    AVX2 = "avx2"
    SCALAR = "scalar"


@contextlib.contextmanager
def kernels_on(isa: KernelIsa | None):
    """The kernels run with `isa` inside the block (None: as they do), then with the set they ran with before. Every
    set reads the same packed weights, so a model built under one runs under another (a baseline timed on other
    kernels in the same run); one this CPU lacks is refused with one line."""
    if isa is None:
        yield
        return
    module = load_kernels()
    require_available_isa(module, str(isa), "kernel_isa")
    previous = module.set_kernel_isa(str(isa))
    try:
        yield
    finally:
        module.set_kernel_isa(previous)


def kernel_isa() -> str:
    """The instruction set the kernels run with in this process (avx512_amx, avx512_bf16, avx512, avx2 or scalar: the
    best this CPU runs, or DRAFTSMITH_KERNEL_ISA's, or kernels_on's inside its block)."""
    return load_kernels().kernel_isa()


def available_isas() -> list[str]:
    """Every instruction set DRAFTSMITH_KERNEL_ISA may name on this machine, lowest first."""
    return list(load_kernels().available_isas())


def loaded_isa() -> str | None:
    """kernel_isa() where this process has loaded the kernels (a run on them), else None (nothing is built)."""
    return _MODULE.kernel_isa() if _MODULE is not None else None


def argmax_last(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1), the same indices (the first of equal values, the first NaN where any): draftsmith::argmax
    where this process runs the kernels and x is float32 on the CPU (a greedy token from 49,152 logits in ~11 us on
    the Xeon against torch's ~120: results/engine_kernels_xeon/argmax), else torch's."""
    if _ARGMAX_OP and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() and x.shape[-1]:
        return torch.ops.draftsmith.argmax(x)
    return x.argmax(-1)


def top_log_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row of `logits` (rows, vocabulary): its k most likely tokens' log-probabilities (float32, best first),
    their indices, and the log of their total probability (float64, (rows,)): torch's log_softmax, topk and logsumexp.
    draftsmith::top_log_probs where this process runs the kernels and the logits are float32 on the CPU (one call a
    draft tree's level instead of three ops, each cold after a forward: results/engine_kernels_epyc_avx2), else
    torch's ops (the same values up to rounding; equal values may come in another order)."""
    if _TOP_OP and logits.dtype == torch.float32 and logits.device.type == "cpu":
        return torch.ops.draftsmith.top_log_probs(logits, k)
    top = torch.topk(torch.log_softmax(logits.float(), -1), k, dim=-1)
    return top.values, top.indices, torch.logsumexp(top.values.double(), -1)


# -- packing ------------------------------------------------------------------------------------------------------

def pack_weight(weight: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """(N, K) Linear weight -> the kernel's panels of 48 output columns, K in groups of `group` consecutive inputs
    (ceil(N/48), ceil(K/group), 48, group): float32 and weight-only int8 one (stored (ceil(N/48), K, 48)), bfloat16
    pairs (the default for it), int8 x int8 quads (INT8_QUAD). Padding is zero."""
    group = group or (2 if weight.dtype == torch.bfloat16 else 1)
    (n, k), panels, groups = weight.shape, -(-weight.shape[0] // PANEL), -(-weight.shape[1] // group)
    padded = weight.new_zeros((panels * PANEL, groups * group))
    padded[:n, :k] = weight
    packed = padded.view(panels, PANEL, groups, group).permute(0, 2, 1, 3).contiguous()
    return packed.view(panels, groups, PANEL) if group == 1 else packed


INT8_QUAD = 4  # inputs per int8 x int8 dot product (invariant_impl.h's QUAD)


def split_bf16(weight: torch.Tensor) -> torch.Tensor:
    """(N, K) float32 weight -> (N, 2K) bfloat16: each weight as its pair (hi, lo), hi = bf16(w), lo = bf16(w - hi)
    (16 of float32's 24 significand bits, in its 4 bytes), the layout draftsmith::linear_split packs as bf16 pairs."""
    weight = weight.detach().float()
    high = weight.to(torch.bfloat16)
    low = (weight - high.float()).to(torch.bfloat16)
    return torch.stack([high, low], dim=-1).view(weight.shape[0], 2 * weight.shape[1])


QUAD_COLUMNS, QUAD_STEP = 16, 64  # an AMX int8 tile's columns and the inputs a tile step takes


def pack_quads(quantized: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 rows -> the AMX int8 tiles' column tiles (ceil(N/16), K'/4, 16, 4), K' = K padded to 64: each tile
    of 16 columns one contiguous stream, its inputs in quads (the greedy head's INT8_QUADS copy). Padding is zero."""
    n, k = quantized.shape
    tiles, padded = -(-n // QUAD_COLUMNS), -(-k // QUAD_STEP) * QUAD_STEP
    out = quantized.new_zeros((tiles * QUAD_COLUMNS, padded))
    out[:n, :k] = quantized
    return out.view(tiles, QUAD_COLUMNS, padded // 4, 4).permute(0, 2, 1, 3).contiguous()


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale per output row): symmetric, round to nearest."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class InvariantLinear(nn.Module):
    """A Linear computed by the batch-invariant kernels, its weight packed once: draftsmith::linear for the model's
    dtype and weight-only int8 (with scales), draftsmith::linear_i8 for w8a8 (int8 quads with scales),
    draftsmith::linear_split for split_bf16 ((hi, lo) bf16 pairs)."""

    def __init__(self, linear: nn.Linear, precision: WeightPrecision = WeightPrecision.MODEL):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        scale = None
        self.precision = precision
        if precision is WeightPrecision.SPLIT_BF16:
            weight = split_bf16(weight)
        elif precision is not WeightPrecision.MODEL:
            weight, scale = quantize_int8(weight)
        self.register_buffer("packed", pack_weight(weight, INT8_QUAD if precision is WeightPrecision.W8A8 else None))
        self.register_buffer("scale", scale)
        # float32 once here: the kernel adds the bias in float32, so no call converts it again
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.precision is WeightPrecision.W8A8:
            return torch.ops.draftsmith.linear_i8(x, self.packed, self.scale, self.bias, self.out_features)
        if self.precision is WeightPrecision.SPLIT_BF16:
            return torch.ops.draftsmith.linear_split(x, self.packed, self.bias, self.out_features)
        return torch.ops.draftsmith.linear(x, self.packed, self.scale, self.bias, self.out_features)


class WideCopy(TextEnum):
    """The greedy head's copy for a forward of several rows."""
    BF16 = "bf16"  # the head's rows rounded to bf16, on the bf16 dot products (half a float32 head's bytes)
    INT8_PAIRS = "int8 pairs"  # the int8 rows in input pairs, widened to bf16 on AMX tiles (a quarter of its bytes)
    INT8_QUADS = "int8 quads"  # the int8 rows in column tiles, times the inputs' two int8 halves on AMX int8 tiles

    @property
    def amx_only(self) -> bool:
        """Whether only AMX tiles read this copy (elsewhere the head reads its int8 rows)."""
        return self is not WideCopy.BF16


# From how many rows the greedy head's approximate logits come from its wide copy instead of the int8 rows on vector
# multiply-adds, and which copy, per instruction set (absent: int8 at every width). With a bf16 dot product (Zen 4, 2
# threads, SmolLM2's head alone, cold, medians: results/engine_kernels_zen4/greedy_head_rows/): int8 0.63 / 0.67 /
# 0.89 / 1.17 / 1.28 / 2.25 ms at 1 / 4 / 6 / 8 / 9 / 16 rows, bf16 1.20 / 1.22 / 1.30 / 1.34 / 1.35 / 1.75 (10th
# percentiles cross at 8): the int8 copy streams half the bytes and its multiply-adds fit under its stream up to
# about 8 rows. With AMX (the Xeon, the same probe, results/engine_kernels_xeon/greedy_head_rows/) the int8 rows in
# column tiles times the inputs' int8 halves, summed in integers, cost less than every other copy at every width
# (probe_int8_quads.json): 1.11 / 1.22 / 1.35 / 1.60 ms at 1 / 4 / 8 / 16 rows, int8 on multiply-adds 1.15 / 1.37 /
# 1.96 / 3.82, int8 pairs widened to bf16 1.43 / 1.57 / 1.88 / 2.30 (nothing widened, no float sums): the quads from
# one row.
GREEDY_WIDE = {"avx512_bf16": (8, WideCopy.BF16), "avx512_amx": (1, WideCopy.INT8_QUADS)}


def wide_copy(wide: WideCopy, weight: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """The greedy head's wide copy, packed: bf16 rows in pairs, or its int8 rows (`quantized`) in pairs or quads."""
    if wide is WideCopy.BF16:
        return pack_weight(weight.to(torch.bfloat16))
    return pack_weight(quantized, 2) if wide is WideCopy.INT8_PAIRS else pack_quads(quantized)


class GreedyHead(nn.Module):
    """An LM head for greedy decoding: logits whose argmax is the argmax of the exact logits, from a quarter or (a wide
    copy of bf16 rows) half of a float32 head's bytes (draftsmith::greedy_head).

    Approximate logits a_j come from the head's rows rounded to int8 (a scale s_j = max|w_j| / 127 per row, round to
    nearest), or, where the forward has GREEDY_WIDE's rows, from its wide copy: rows and inputs rounded to bfloat16,
    or (AMX) the int8 rows times inputs rounded to bfloat16 or times the inputs as X = round(x / s_x), s_x = max|x|
    / (127 * 128), in two int8 halves (X = 128 hi + lo) summed in integers. |a_j - x . w_j| <= s_j * sum_k |x_k| *
    (c + 127 (K + 2) 2^-24): an int8 weight is within s_j / 2 of its float (c = 1/2); a bf16 product within 2^-8
    |x_k w_jk| <= 2^-8 127 s_j |x_k| (c = 1/2 covers it); an int8 weight times a bf16 input adds 2^-9 127 s_j |x_k|
    (c = 1/2 + 127/512); the rest bounds the float32 sums. The int8 halves add s_j * 64 K s_x instead (|x_k - s_x
    X_k| <= 0.503 s_x, |q_jk| <= 127). Every row j whose upper bound reaches the largest lower bound could hold the
    largest exact logit; each is recomputed in float64 (the inputs in a fixed order: its value does not depend on
    what else the forward holds) and replaces a_j. On SmolLM2 a few rows of 49,152 are recomputed a token (means 6
    and 15 at c = 1/2 and 3/4 over 250 MT-Bench positions; 7.6 with the int8 halves:
    scripts/jobs/greedy_candidates_probe.py). So the greedy token is the exact logits' argmax (float64 to float32,
    ties to the first) whatever the width and the approximation: batch-invariant in float32 and bfloat16 (and within
    one approximation each row's logits are the same bits at any width). The other logits are approximations:
    sampling reads the model's head."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise UserError("the greedy head takes an LM head without a bias")
        weight = linear.weight.detach()
        quantized, scale = quantize_int8(weight)
        self.wide_from_rows, self.wide = GREEDY_WIDE.get(kernel_isa(), (None, None))
        self.register_buffer("packed", pack_weight(quantized))
        self.register_buffer("packed_wide", None if self.wide is None else wide_copy(self.wide, weight, quantized))
        self.register_buffer("scale", scale)
        self.register_buffer("weight", weight.contiguous())  # the model's own rows (tied to the embedding: shared)

    @property
    def rows_apart(self) -> bool:
        """Whether a verify's rows cost less one at a time, each only where its verify asks for it (GreedyRows), than
        together: where every width reads the int8 copy, one row streams it and each more row in a pass adds its
        multiply-adds at the float32 rate (the AVX2 EPYC, SmolLM2's head, cold: 1.34 / 1.90 / 3.19 / 6.16 ms at
        1 / 2 / 4 / 8 rows, scripts/jobs/greedy_head_rows_probe.py), and a greedy verify reads only its accepted
        path's rows (tau of them: a chain of 3's head 3.5 -> 2.1 ms a round there). With a bf16 dot product (AVX-512
        BF16) the int8 copy's rows fit under its stream up to GREEDY_WIDE's rows and the wide copy's beyond: together
        (the Zen 4: 4 rows 0.67 ms together, a chain of 3's tau ~2.1 rows apart ~1.3 ms)."""
        return self.wide_from_rows is None

    def copy_for(self, rows: int) -> torch.Tensor:
        """The packed copy a forward of `rows` rows streams: the int8 one where the kernels now run an instruction set
        that does not read the wide one (the int8 pairs and quads are the AMX tiles': kernels_on, a bench's
        kernel_isa=)."""
        wide = self.wide_from_rows is not None and rows >= self.wide_from_rows
        if wide and self.wide.amx_only and kernel_isa() != KernelIsa.AVX512_AMX:
            return self.packed
        return self.packed_wide if wide else self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        return torch.ops.draftsmith.greedy_head(x, self.copy_for(rows), self.scale, self.weight)


# Linears of one parent module that the HF Llama-family code feeds the same input, first member first.
SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class JoinedProjection(nn.Module):
    """The first of several Linears fed one input (q/k/v, gate/up): one InvariantLinear over their concatenated
    weights computes every member's output in one pass (one call, one weight stream: 210 -> 120 calls a step for
    SmolLM2, each call costing ~11 us beyond its bytes on 2 threads). It returns its own columns and keeps the rest
    for its siblings until each has taken them. A column is the same dot product in the same order as in its own
    Linear, so every output is bit-identical to the separate Linears'."""

    def __init__(self, linears: list[nn.Linear], precision: WeightPrecision = WeightPrecision.MODEL):
        super().__init__()
        weight = torch.cat([linear.weight.detach() for linear in linears])
        bias = None if linears[0].bias is None else torch.cat([linear.bias.detach() for linear in linears])
        self.joined = invariant_rows(weight, precision, bias)
        ends = list(itertools.accumulate(linear.out_features for linear in linears))
        self.columns = list(zip([0, *ends[:-1]], ends))
        self.in_features, self.out_features = linears[0].in_features, linears[0].out_features
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (input, joined output) for the siblings
        self.untaken = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.joined(x)
        self.pending, self.untaken = (x, out), len(self.columns) - 1
        return out[..., :self.columns[0][1]]

    def sibling_output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member `index`'s columns for input `x`: from the pending pass when it was over this very input, else
        from a pass of its own."""
        start, end = self.columns[index]
        pending = self.pending  # read once: another thread may start a pass of its own meanwhile
        if pending is None or pending[0] is not x:
            return self.joined(x)[..., start:end]
        out = pending[1]
        self.untaken -= 1
        if self.untaken == 0:
            self.pending = None
        return out[..., start:end]


class SiblingProjection(nn.Module):
    """A later member of a JoinedProjection: its columns of the joined pass (the weights live in the first)."""

    def __init__(self, first: JoinedProjection, index: int):
        super().__init__()
        self.__dict__["first"] = first  # not a child: the joined weight is streamed and counted once
        self.index = index
        self.in_features = first.in_features
        self.out_features = first.columns[index][1] - first.columns[index][0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first.sibling_output(self.index, x)


def join_projections(parent: nn.Module, precision: WeightPrecision) -> None:
    """Replace each SHARED_INPUT_GROUPS group of `parent`'s Linears (same input width, all with or all without a
    bias) by a JoinedProjection and its SiblingProjections, in place."""
    for names in SHARED_INPUT_GROUPS:
        linears = [getattr(parent, name, None) for name in names]
        if not all(isinstance(linear, nn.Linear) for linear in linears):
            continue
        if len({(linear.in_features, linear.bias is None) for linear in linears}) != 1:
            continue
        first = JoinedProjection(linears, precision)
        setattr(parent, names[0], first)
        for index, name in enumerate(names[1:], start=1):
            setattr(parent, name, SiblingProjection(first, index))


def weight_arena(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeroed uint8 for packed weights or a KV cache: on Linux one anonymous mapping, 2 MB aligned and
    advised for transparent huge pages (a step streams every weight once, so 4 KB pages cost it a TLB miss per page;
    measured on a Zen 4 VM, one process, interleaved: SmolLM2's 211 linear calls 19.6 -> 17.3 ms, a step over 2,000
    cached tokens 5-8% cheaper with its cache there too); elsewhere, or where the advice is refused, ordinary memory.
    The tensors viewing it keep the mapping alive."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled
    with contextlib.suppress(OSError):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes]


def arena_zeros(like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Zeroed contiguous tensors with the shapes and dtypes of `like`, in order in one weight_arena, each starting on
    a cache line."""
    sizes = [-(-tensor.numel() * tensor.element_size() // WEIGHT_ALIGNMENT) * WEIGHT_ALIGNMENT for tensor in like]
    arena, offset, views = weight_arena(sum(sizes)), 0, []
    for tensor, size in zip(like, sizes):
        nbytes = tensor.numel() * tensor.element_size()
        views.append(arena[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape))
        offset += size
    return views


def gather_weights(*models: nn.Module) -> None:
    """Move every InvariantLinear's packed weight of `models` into one weight_arena, in module order (the order a
    forward streams them), in place; the values are unchanged."""
    linears = [module for model in models for module in model.modules() if isinstance(module, InvariantLinear)]
    for linear, placed in zip(linears, arena_zeros([linear.packed for linear in linears])):
        placed.copy_(linear.packed)
        linear.packed = placed


def invariant_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface over draftsmith::attention: query (B, H, q, D), key/value (B, Hkv, k, D),
    an additive mask (B, 1, q, >= k) -> (B, q, H, D). Causal when no mask is given."""
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise UserError("the batch-invariant attention has no softcap or sliding window: use compile.kernels=inductor")
    q_len, k_len = query.shape[2], key.shape[2]
    if attention_mask is None:
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
        attention_mask = torch.zeros(q_len, k_len, device=query.device).masked_fill_(~allowed, float("-inf"))
        attention_mask = attention_mask[None, None]
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    return torch.ops.draftsmith.attention(query, key, value, attention_mask, scale), None


def register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, invariant_attention)


def invariant_model(model: nn.Module, precision: WeightPrecision = WeightPrecision.MODEL,
                    join_inputs: bool = True, gather: bool = True) -> nn.Module:
    """A copy of `model` that runs on the batch-invariant kernels: its Linears replaced by InvariantLinears (those fed
    one input joined, unless `join_inputs` is false: the reference the joined ones are tested against) and its
    attention by draftsmith::attention. The original is unchanged (its other weights are shared, not copied). The
    packed weights are gathered into one arena unless `gather` is false (for a caller that adds InvariantLinears of
    its own, a drafter's head, and gathers them all once)."""
    check_activations(precision, next(model.parameters()).dtype)
    load_kernels()
    check_precision_runs(precision)
    register_attention()
    referenced = [value for module in model.modules() for value in vars(module).values()
                  if isinstance(value, nn.Module)]  # modules held outside the tree (a drafter's target embedding)
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [t for module in referenced for t in [*module.parameters(), *module.buffers()]]
    clone = copy.deepcopy(model, memo={id(tensor): tensor for tensor in tensors})
    for parent in list(clone.modules()):
        if join_inputs:
            join_projections(parent, precision)
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, InvariantLinear(child, precision))
    if gather:
        gather_weights(clone)
    for config in {id(c): c for c in (getattr(m, "config", None) for m in clone.modules()) if c is not None}.values():
        if hasattr(config, "_attn_implementation"):
            config._attn_implementation = ATTENTION_NAME
    return clone


def frozen_linear(rows: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """A frozen Linear over the weight rows (N, K) and an optional bias (N,), e.g. a slice of the target's LM head
    (nothing is initialised and thrown away: it is built on the meta device, then given these tensors)."""
    linear = nn.Linear(rows.shape[1], rows.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(rows, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def invariant_rows(rows: torch.Tensor, precision: WeightPrecision, bias: torch.Tensor | None = None) -> InvariantLinear:
    """An InvariantLinear over the weight rows (N, K) and an optional bias (N,) (frozen_linear's, packed)."""
    return InvariantLinear(frozen_linear(rows, bias), precision)


def main(argv: list[str]) -> None:
    """`python -m draftsmith.models.kernels build`: build (or find) the kernels and say which instruction set."""
    if argv[:1] != ["build"] or len(argv) > 1:
        raise UserError("usage: python -m draftsmith.models.kernels build")
    load_kernels(verbose=False)
    print(f"batch-invariant kernels ready ({kernel_isa()}) in {build_directory()}")


if __name__ == "__main__":
    exit_with(main)
