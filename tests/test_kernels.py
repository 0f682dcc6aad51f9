"""The batch-invariant kernels (models/kernels.py, models/native/): exact against a float64 reference within the
precision's rounding, and row-for-row identical whatever the number of rows, the precision, the shape, the thread
count and the instruction set; attention identical wherever a row's visible keys lie in the cache; a model on them
verifies exactly what one-token steps compute, eager and compiled, in float32, bfloat16, int8 weights, w8a8 (int8
weights and inputs, exact against an integer reference on every instruction set) and split_bf16 (AMX: float32 as bf16
pairs, within float32's sums of the halves' exact products); the greedy head's argmax is the exact logits' argmax, near
ties included, at any width and on every instruction set."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_model
from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.dflash import DFlashDrafter
from draftsmith.eval.decode.drafters.lm import LMDrafter
from draftsmith.eval.decode.drafters.medusa import MedusaDrafter
from draftsmith.models.compiled import CompiledEngine, CompileSettings
from draftsmith.models.medusa import InvariantMedusaHeads
from draftsmith.errors import UserError
from draftsmith.config import ConfigError
from draftsmith.models.kernels import (WEIGHT_ALIGNMENT, GreedyHead, InvariantLinear, KernelIsa, WeightPrecision,
                                       argmax_last, available_isas, check_forced_isa, frozen_linear, invariant_model,
                                       kernel_isa, kernels_on, load_kernels, pack_quads, pack_weight, quantize_int8,
                                       split_bf16, top_log_probs)
from draftsmith.models import kernels as kernels_module
from draftsmith.models.dflash import DFlashConfig, DFlashModel
from draftsmith.models.dgf import DGFConfig, DGFModel, invariant_drafter
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.student import layer_subset_student
from draftsmith.models.target import TargetModel
from draftsmith.models.vocab import DraftVocab

load_kernels()
ON_AMX = kernel_isa() == KernelIsa.AVX512_AMX
needs_amx = pytest.mark.skipif(not ON_AMX, reason="split_bf16 runs on AMX tiles only")
AVAILABLE_ISAS = available_isas()  # scalar, avx2, avx512, avx512_bf16, avx512_amx: as far as this CPU goes


def reference_linear(x, weight, scale, bias):
    w = weight.double() * (scale.double()[:, None] if scale is not None else 1)
    out = x.double() @ w.T
    return out + bias.double() if bias is not None else out


def linear_case(rows: int, n: int, k: int, precision: str, seed: int, bias: bool = True):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator)
    x = torch.randn(rows, k, generator=generator)
    b = torch.randn(n, generator=generator) if bias else None
    scale = None
    if precision == "bfloat16":
        weight, x = weight.bfloat16(), x.bfloat16()
    elif precision == "int8":
        weight, scale = quantize_int8(weight)
    return x, weight, scale, b


@pytest.mark.parametrize("precision,tolerance", [("float32", 1e-5), ("bfloat16", 8e-3), ("int8", 1e-5)])
def test_linear_matches_reference(precision, tolerance):
    for n, k in [(64, 64), (100, 37), (192, 576), (7, 1)]:
        x, weight, scale, bias = linear_case(9, n, k, precision, seed=n + k)
        out = torch.ops.draftsmith.linear(x, pack_weight(weight), scale, bias, n)
        assert out.dtype == x.dtype and out.shape == (9, n)
        expected = reference_linear(x, weight, scale, bias)
        assert (out.double() - expected).abs().max() <= tolerance * expected.abs().max()


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(2, 150), n=st.integers(1, 200), k=st.integers(1, 300),
       precision=st.sampled_from(["float32", "bfloat16", "int8"]), bias=st.booleans(), seed=st.integers(0, 99))
def test_linear_rows_are_batch_invariant(rows, n, k, precision, bias, seed):
    """Every row of a w-row product equals the same row computed alone and inside any other row count."""
    x, weight, scale, b = linear_case(rows, n, k, precision, seed, bias)
    packed = pack_weight(weight)
    full = torch.ops.draftsmith.linear(x, packed, scale, b, n)
    for start, stop in [(0, 1), (rows - 1, rows), (1, rows), (0, rows // 2 + 1)]:
        part = torch.ops.draftsmith.linear(x[start:stop], packed, scale, b, n)
        assert torch.equal(part, full[start:stop])


def w8a8_reference(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """draftsmith::linear_i8's definition in float64: each row's inputs in blocks of 32, each block quantized alone
    (round half to even of x * (127 / max|x|)), its exact integer dot product with the int8 weights scaled by the
    block's scale, the blocks summed, times the column's scale, + bias."""
    pad = -x.shape[-1] % 32
    blocks = torch.nn.functional.pad(x, (0, pad)).unflatten(-1, (-1, 32))  # (M, B, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, torch.tensor(127.0) / largest, torch.zeros_like(largest))
    q = torch.round(blocks * inverse).clamp(-127, 127).long()
    weight, scale = quantize_int8(linear.weight)
    weight = torch.nn.functional.pad(weight.long(), (0, pad)).unflatten(-1, (-1, 32))  # (N, B, 32)
    sums = (q[:, None] * weight[None]).sum(-1)  # (M, N, B), exact
    out = (sums.double() * (largest[..., 0] / 127.0).double()[:, None]).sum(-1) * scale.double()
    return out + linear.bias.double() if linear.bias is not None else out


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(1, 200), k=st.integers(1, 300), bias=st.booleans(),
       seed=st.integers(0, 99))
def test_w8a8_linear_matches_reference_and_is_batch_invariant(rows, n, k, bias, seed):
    """int8 weights and inputs: the reference up to float32's rounding of the block sums, and a row the same bits
    whatever the rows (one of them all zeros, one with an outlier)."""
    generator = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=bias)
    torch.nn.init.normal_(linear.weight, generator=generator)
    x = torch.randn(rows, k, generator=generator) * 4
    x[rows // 2] = 0
    x[0, k // 2] = 300.0
    module = InvariantLinear(linear, WeightPrecision.W8A8)
    full = module(x)
    expected = w8a8_reference(x, linear)
    assert (full.double() - expected).abs().max() <= 1e-5 * expected.abs().max() + 1e-6
    for start, stop in [(0, 1), (rows - 1, rows), (0, rows // 2 + 1)]:
        assert torch.equal(module(x[start:stop]), full[start:stop])


def halves(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    high = t.to(torch.bfloat16)
    return high.double(), (t - high.float()).to(torch.bfloat16).double()


@needs_amx
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), n=st.integers(1, 200), k=st.integers(1, 300), bias=st.booleans(),
       seed=st.integers(0, 99))
def test_split_bf16_linear_matches_reference_and_is_batch_invariant(rows, n, k, bias, seed):
    """float32 as (hi, lo) bf16 pairs: the sum of the halves' exact products in float64 up to float32's rounding of
    the sums, within ~2^-16 of the float32 product, and a row the same bits whatever the rows."""
    generator = torch.Generator().manual_seed(seed)
    linear = torch.nn.Linear(k, n, bias=bias)
    torch.nn.init.normal_(linear.weight, generator=generator)
    x = torch.randn(rows, k, generator=generator) * 3
    x[rows // 2] = 0
    module = InvariantLinear(linear, WeightPrecision.SPLIT_BF16)
    assert module.packed.dtype == torch.bfloat16 and module.packed.numel() == pack_weight(linear.weight).numel() * 2
    full = module(x)
    (x_hi, x_lo), (w_hi, w_lo) = halves(x), halves(linear.weight.detach())
    expected = (x_hi + x_lo) @ (w_hi + w_lo).T + (linear.bias.double() if bias else 0)
    magnitude = x.double().abs() @ linear.weight.double().abs().T + (linear.bias.double().abs() if bias else 0) + 1e-6
    assert ((full.double() - expected).abs() / magnitude).max() <= (k + 2) * 2.0 ** -24
    exact = x.double() @ linear.weight.double().T + (linear.bias.double() if bias else 0)
    assert ((full.double() - exact).abs() / magnitude).max() <= 2.0 ** -15
    for start, stop in [(0, 1), (rows - 1, rows), (0, rows // 2 + 1)]:
        assert torch.equal(module(x[start:stop]), full[start:stop])


def test_split_bf16_weights_hold_sixteen_significant_bits_in_four_bytes():
    weight = torch.randn(5, 7)
    pairs = split_bf16(weight)
    assert pairs.dtype == torch.bfloat16 and pairs.shape == (5, 14)
    rebuilt = pairs[:, 0::2].double() + pairs[:, 1::2].double()
    assert ((rebuilt - weight.double()).abs() <= weight.double().abs() * 2.0 ** -16).all()


def test_split_bf16_is_one_line_off_amx_and_for_a_bfloat16_model():
    model = tiny_model("llama", seed=1, num_layers=1)
    with kernels_on(KernelIsa.SCALAR), pytest.raises(UserError, match="split_bf16 runs on AMX tiles and the kernels "
                                                                      "here run scalar"):
        invariant_model(model, WeightPrecision.SPLIT_BF16)
    with pytest.raises(UserError, match="weights=split_bf16 takes float32 inputs"):
        invariant_model(model.bfloat16(), WeightPrecision.SPLIT_BF16)


def test_w8a8_is_the_same_bits_on_every_instruction_set():
    """The integer block sums are exact and their float sums in one order: every instruction set this CPU runs
    (forced in a fresh process) gives the same output bits, rows alone or together."""
    script = (
        "import hashlib, torch\n"
        "from draftsmith.models.kernels import InvariantLinear, WeightPrecision, load_kernels\n"
        "load_kernels(); torch.manual_seed(0)\n"
        "linear = torch.nn.Linear(203, 130); x = torch.randn(11, 203) * 3; x[2, 7] = 500.0\n"
        "module = InvariantLinear(linear, WeightPrecision.W8A8); full = module(x)\n"
        "assert all(torch.equal(module(x[r:r + 1]), full[r:r + 1]) for r in range(11))\n"
        "print(hashlib.sha256(full.numpy().tobytes()).hexdigest())\n")
    digests = set()
    for isa in AVAILABLE_ISAS:
        result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "DRAFTSMITH_KERNEL_ISA": isa},
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stderr[-2000:]
        digests.add(result.stdout.split()[-1])
    assert len(digests) == 1, digests


def test_an_unknown_forced_instruction_set_is_one_line():
    """DRAFTSMITH_KERNEL_ISA naming a set this CPU does not run is refused when the kernels load, in one line."""
    script = "from draftsmith.models.kernels import load_kernels; load_kernels()"
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "DRAFTSMITH_KERNEL_ISA": "avx1024"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "DRAFTSMITH_KERNEL_ISA=avx1024: this CPU runs scalar, " in result.stderr


def test_a_forced_instruction_set_is_left_to_a_build_without_available_isas(monkeypatch):
    """eval.kernel_ab's baseline may be a build older than available_isas: the forced set is then the build's own to
    check (it refuses an unknown one itself), not an AttributeError at load; a current build still checks it here."""
    monkeypatch.setenv("DRAFTSMITH_KERNEL_ISA", "avx1024")
    check_forced_isa(SimpleNamespace())  # an older build: no available_isas
    with pytest.raises(UserError, match="DRAFTSMITH_KERNEL_ISA=avx1024: this CPU runs scalar"):
        check_forced_isa(SimpleNamespace(available_isas=lambda: ["scalar"]))


def test_kernels_on_runs_some_calls_on_another_instruction_set_in_the_same_process():
    """kernels_on: the calls inside run another set (the same packed weights: its own outputs, as a fresh process
    forced to it computes them), the set before is back after; one this CPU lacks is refused in one line."""
    default = kernel_isa()
    torch.manual_seed(0)
    linear = torch.nn.Linear(77, 130)
    x = torch.randn(5, 77)
    module = InvariantLinear(linear, WeightPrecision.MODEL)
    before = module(x)
    with kernels_on(KernelIsa.SCALAR):
        assert kernel_isa() == "scalar"
        scalar = module(x)
    assert kernel_isa() == default and torch.equal(module(x), before)
    assert (scalar - before).abs().max() <= 1e-5 * before.abs().max()
    with kernels_on(None):
        assert kernel_isa() == default
    missing = [isa for isa in KernelIsa if str(isa) not in AVAILABLE_ISAS]
    if missing:
        with pytest.raises(UserError, match=f"kernel_isa={missing[0]}: this CPU runs scalar"):
            with kernels_on(missing[0]):
                pass
    assert kernel_isa() == default


def test_w8a8_refuses_a_bfloat16_model_in_one_line():
    with pytest.raises(UserError, match="weights=w8a8 takes float32 inputs"):
        invariant_model(tiny_model("llama", seed=1, num_layers=1).bfloat16(), WeightPrecision.W8A8)


def test_a_float16_model_is_refused_in_one_line():
    with pytest.raises(UserError, match="take float32 or bfloat16 and this model runs in float16"):
        invariant_model(tiny_model("llama", seed=1, num_layers=1).half())


def test_linear_is_thread_count_invariant():
    x, weight, scale, bias = linear_case(13, 300, 130, "float32", seed=1)
    packed, threads = pack_weight(weight), torch.get_num_threads()
    full = torch.ops.draftsmith.linear(x, packed, scale, bias, 300)
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.draftsmith.linear(x, packed, scale, bias, 300), full)
    finally:
        torch.set_num_threads(threads)


def attention_inputs(rows: int, keys: int, dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, rows, 16, generator=generator).to(dtype)
    k = torch.randn(1, 2, keys, 16, generator=generator).to(dtype)
    v = torch.randn(1, 2, keys, 16, generator=generator).to(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_matches_softmax_reference(dtype):
    q, k, v = attention_inputs(5, 40, dtype)
    allowed = torch.rand(5, 40, generator=torch.Generator().manual_seed(2)) < 0.6
    allowed[:, 0] = True
    mask = torch.zeros(1, 1, 5, 40).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    out = torch.ops.draftsmith.attention(q, k, v, mask, 0.25)
    scores = (q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2)) * 0.25 + mask.double()
    expected = (scores.softmax(-1) @ v.double().repeat_interleave(2, 1)).transpose(1, 2)
    assert (out.double() - expected).abs().max() < (1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_ignores_where_visible_keys_lie(dtype):
    """A tree row whose ancestors are scattered among other nodes' slots computes exactly what the same row computes
    after the accepted path was moved to contiguous slots (plain decoding's layout), at any row count."""
    q, k, v = attention_inputs(3, 30, dtype, seed=5)
    visible = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 17, 21]  # prefix 0..9, then ancestors among tree slots
    scattered = torch.full((1, 1, 3, 30), torch.finfo(torch.float32).min)
    scattered[..., visible] = 0
    contiguous_k, contiguous_v = k.clone(), v.clone()
    contiguous_k[:, :, 10:13], contiguous_v[:, :, 10:13] = k[:, :, [13, 17, 21]], v[:, :, [13, 17, 21]]
    compact = torch.full((1, 1, 1, 30), torch.finfo(torch.float32).min)
    compact[..., :13] = 0
    tree = torch.ops.draftsmith.attention(q, k, v, scattered, 0.25)
    plain = torch.ops.draftsmith.attention(q[:, :, 1:2], contiguous_k, contiguous_v, compact, 0.25)
    assert torch.equal(tree[:, 1:2], plain)


def chain_inputs(rows: int, context: int, kv_heads: int, groups: int, head_dim: int, seed: int = 0):
    """A verify of `rows` chained tokens after `context` cached ones, in a cache with slack (a row sees the
    context and the rows up to itself)."""
    generator = torch.Generator().manual_seed(seed)
    capacity = context + rows + 20
    q = torch.randn(1, kv_heads * groups, rows, head_dim, generator=generator)
    k = torch.randn(1, kv_heads, capacity, head_dim, generator=generator)
    v = torch.randn(1, kv_heads, capacity, head_dim, generator=generator)
    mask = torch.full((1, 1, rows, capacity), torch.finfo(torch.float32).min)
    for row in range(rows):
        mask[0, 0, row, :context + row + 1] = 0
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context,groups,head_dim", [(1020, 3, 64), (1500, 3, 128), (300, 4, 64), (700, 6, 64)])
def test_long_rows_in_key_blocks_are_batch_invariant(context, groups, head_dim, dtype):
    """Rows over more than one block of visible keys (some rows crossing a block boundary), on the fixed paths and
    off them: each row alone, at one thread or two, computes exactly its row of the verify, and matches softmax."""
    q, k, v, mask = chain_inputs(8, context, 2, groups, head_dim)
    assert_rows_alone_and_softmax(q.to(dtype), k.to(dtype), v.to(dtype), mask, groups)


def assert_rows_alone_and_softmax(q, k, v, mask, groups: int, widths: tuple[int, ...] = ()) -> None:
    """The verify of every row at two threads: its first `widths` rows computed alone as a narrower verify, each row
    alone at one thread and two, are bit-identical to its rows; and it matches softmax in float64."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = torch.ops.draftsmith.attention(q, k, v, mask, 0.125)
        for width in widths:
            assert torch.equal(torch.ops.draftsmith.attention(q[:, :, :width], k, v, mask[:, :, :width], 0.125),
                               full[:, :width]), width
        for row in range(q.shape[2]):
            for count in (1, 2):
                torch.set_num_threads(count)
                alone = torch.ops.draftsmith.attention(q[:, :, row:row + 1], k, v, mask[:, :, row:row + 1], 0.125)
                assert torch.equal(alone, full[:, row:row + 1]), (row, count)
    finally:
        torch.set_num_threads(threads)
    scores = q.double() @ k.double().repeat_interleave(groups, 1).transpose(-1, -2) * 0.125 + mask.double()
    expected = (scores.softmax(-1) @ v.double().repeat_interleave(groups, 1)).transpose(1, 2)
    assert (full.double() - expected).abs().max() < (1e-5 if q.dtype == torch.float32 else 2e-2)


def tree_inputs(context: int, parents: list[int], kv_heads: int, groups: int, head_dim: int, seed: int = 0):
    """A tree verify after `context` cached tokens: node i (slot context + i) sees the context, its ancestors and
    itself (parents[i] < i, -1 for a root)."""
    generator = torch.Generator().manual_seed(seed)
    rows, capacity = len(parents), context + len(parents) + 8
    q = torch.randn(1, kv_heads * groups, rows, head_dim, generator=generator)
    k = torch.randn(1, kv_heads, capacity, head_dim, generator=generator)
    v = torch.randn(1, kv_heads, capacity, head_dim, generator=generator)
    mask = torch.full((1, 1, rows, capacity), torch.finfo(torch.float32).min)
    mask[..., :context] = 0
    for row in range(rows):
        node = row
        while node >= 0:
            mask[0, 0, row, context + node] = 0
            node = parents[node]
    return q, k, v, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("context,groups,head_dim", [(250, 3, 64), (600, 3, 64), (40, 2, 128), (300, 4, 64)])
def test_tree_rows_taken_together_are_batch_invariant(context, groups, head_dim, dtype):
    """A verify's rows share the context's keys and then part their ways (a tree's branches), and a task may take
    several rows together over the keys they share: each row alone, at one thread or two, still computes exactly
    its row of the verify, at any width, and matches softmax."""
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 6, 7, 9, 4, 13, 14]
    q, k, v, mask = tree_inputs(context, parents, 3, groups, head_dim)
    assert_rows_alone_and_softmax(q.to(dtype), k.to(dtype), v.to(dtype), mask, groups, widths=(2, 3, 9))


def test_a_build_killed_half_way_does_not_hang_the_next_load():
    """torch's build baton left in the kernels' build folder (a first build interrupted) is taken away under the
    folder's flock, so a fresh process loads the kernels instead of waiting on it forever."""
    from draftsmith.fileio import dir_lock
    from draftsmith.models import kernels
    build = kernels.build_directory()
    baton = build / "lock"
    with dir_lock(build):  # as a killed build leaves it: not while another process is between its flock and baton
        baton.touch()
    subprocess.run([sys.executable, "-c", "from draftsmith.models.kernels import load_kernels; load_kernels()"],
                   check=True, timeout=300)
    with dir_lock(build):
        assert not baton.exists()


@pytest.mark.parametrize("isa", AVAILABLE_ISAS)
def test_every_instruction_set_is_batch_invariant(isa):
    """Each instruction set this CPU runs (forced through DRAFTSMITH_KERNEL_ISA in a fresh process)."""
    script = (
        "import torch\n"
        "from draftsmith.models.kernels import load_kernels, kernel_isa, pack_quads, pack_weight, quantize_int8\n"
        f"load_kernels(); assert kernel_isa() == {isa!r}, kernel_isa()\n"
        "g = torch.Generator().manual_seed(0)\n"
        "for dtype in (torch.float32, torch.bfloat16, torch.int8):\n"
        "    w = torch.randn(130, 77, generator=g); x = torch.randn(19, 77, generator=g); s = None\n"
        "    if dtype is torch.int8: w, s = quantize_int8(w)\n"
        "    elif dtype is torch.bfloat16: w, x = w.bfloat16(), x.bfloat16()\n"
        "    p = pack_weight(w); full = torch.ops.draftsmith.linear(x, p, s, None, 130)\n"
        "    ref = x.double() @ (w.double() * (s.double()[:, None] if s is not None else 1)).T\n"
        "    assert (full.double() - ref).abs().max() < 0.05 * ref.abs().max()\n"
        "    for r in range(19): assert torch.equal(torch.ops.draftsmith.linear(x[r:r + 1], p, s, None, 130), "
        "full[r:r + 1])\n"
        "    for m in range(2, 19): assert torch.equal(torch.ops.draftsmith.linear(x[:m], p, s, None, 130), "
        "full[:m])\n"  # every tile and pass the row counts take (AVX2: quads, a pair and three rows of the wide
        # kernel in float32, the narrow tile beyond a row in bf16 and int8; AVX-512: one pass of the tile up to 9 rows,
        # two passes up to 18)
        "w = torch.randn(301, 77, generator=g); w[1::2] = w[::2][:150]; x = torch.randn(12, 77, generator=g)\n"
        "exact = (x.double() @ w.double().T).float().argmax(-1); q8, s = quantize_int8(w)\n"
        "amx = kernel_isa() == 'avx512_amx'; tiles = [pack_weight(q8, 2), pack_quads(q8)]\n"
        "for p in [pack_weight(q8), pack_weight(w.bfloat16())] + (tiles if amx else []):\n"
        "    full = torch.ops.draftsmith.greedy_head(x, p, s, w); assert torch.equal(full.argmax(-1), exact)\n"
        "    for r in range(12): assert torch.equal(torch.ops.draftsmith.greedy_head(x[r:r + 1], p, s, w), "
        "full[r:r + 1])\n"
        "y = torch.randn(3, 49157, generator=g); y[1, 7] = y[1, 9] = 50.0; y[2, 49150] = float('nan')\n"
        "assert torch.equal(torch.ops.draftsmith.argmax(y), y.argmax(-1))\n"
        "for p in ([] if amx else tiles):\n"  # the int8 pairs and quads are the tiles' copies: refused elsewhere
        "    try: torch.ops.draftsmith.greedy_head(x, p, s, w); raise AssertionError('ran')\n"
        "    except RuntimeError as error: assert 'AMX tiles' in str(error), error\n"
        "q, k, v = torch.randn(1, 4, 6, 40, generator=g), torch.randn(1, 2, 50, 40, generator=g), "
        "torch.randn(1, 2, 50, 40, generator=g)\n"
        "mask = torch.zeros(1, 1, 6, 50); mask[..., 45:] = torch.finfo(torch.float32).min\n"
        "full = torch.ops.draftsmith.attention(q, k, v, mask, 0.2)\n"
        "ref = ((q @ k.repeat_interleave(2, 1)[..., :45, :].transpose(-1, -2)) * 0.2).softmax(-1) @ "
        "v.repeat_interleave(2, 1)[..., :45, :]\n"
        "assert (full - ref.transpose(1, 2)).abs().max() < 1e-4\n"
        "for r in range(6): assert torch.equal(torch.ops.draftsmith.attention(q[:, :, r:r + 1], k, v, "
        "mask[:, :, r:r + 1], 0.2), full[:, r:r + 1])\n"
        "q, k, v = torch.randn(1, 6, 5, 64, generator=g), torch.randn(1, 2, 700, 64, generator=g), "
        "torch.randn(1, 2, 700, 64, generator=g)\n"  # the fixed path (3 heads of 64) over two key blocks
        "mask = torch.zeros(1, 1, 5, 700); mask[..., 690:] = torch.finfo(torch.float32).min\n"
        "full = torch.ops.draftsmith.attention(q, k, v, mask, 0.125)\n"
        "ref = ((q @ k.repeat_interleave(3, 1)[..., :690, :].transpose(-1, -2)) * 0.125).softmax(-1) @ "
        "v.repeat_interleave(3, 1)[..., :690, :]\n"
        "assert (full - ref.transpose(1, 2)).abs().max() < 1e-4\n"
        "for r in range(5): assert torch.equal(torch.ops.draftsmith.attention(q[:, :, r:r + 1], k, v, "
        "mask[:, :, r:r + 1], 0.125), full[:, r:r + 1])\n")
    result = subprocess.run([sys.executable, "-c", script], env={**os.environ, "DRAFTSMITH_KERNEL_ISA": isa},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def near_tie_head(n: int, k: int, rows: int, dtype: torch.dtype, seed: int):
    """A head (n, k) and inputs (rows, k) whose logits hold near ties and exact ones: rows copied, some nudged by one
    part in 10^7 of an input, a zero row, an input with an outlier and one of zeros."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator)
    x = torch.randn(rows, k, generator=generator) * 3
    x[0, 0] = 300.0
    x[rows // 2] = 0
    for j in range(1, n, 3):
        weight[j] = weight[j - 1]  # an exact tie
        if j % 2:
            weight[j, j % k] += 1e-7 * weight[j, j % k].abs().clamp(min=1.0)  # a near one
    weight[n // 2] = 0
    return weight.to(dtype), x.to(dtype)


def exact_argmax(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The exact logits' argmax: float64 products and sums, rounded to float32, ties to the first."""
    return (x.double() @ weight.double().T).float().argmax(-1)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, 20), n=st.integers(2, 400), k=st.integers(1, 300),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 99))
def test_greedy_head_argmax_is_the_exact_argmax_at_any_width(rows, n, k, dtype, seed):
    """Every approximation (int8 weights; bf16 weights and inputs; on AMX int8 weights in pairs times bf16 inputs, and
    in quads times the inputs' int8 halves) gives the exact argmax, and a row is the same bits whatever the rows
    beside it."""
    weight, x = near_tie_head(n, k, rows, dtype, seed)
    quantized, scale = quantize_int8(weight.float())
    expected = exact_argmax(x, weight)
    tiles = [pack_weight(quantized, 2), pack_quads(quantized)] if kernel_isa() == "avx512_amx" else []
    for packed in [pack_weight(quantized), pack_weight(weight.to(torch.bfloat16)), *tiles]:
        full = torch.ops.draftsmith.greedy_head(x, packed, scale, weight)
        assert full.dtype == torch.float32 and full.shape == (rows, n)
        assert torch.equal(full.argmax(-1), expected)
        for start, stop in [(0, 1), (rows - 1, rows), (1, rows), (0, rows // 2 + 1)]:
            assert torch.equal(torch.ops.draftsmith.greedy_head(x[start:stop], packed, scale, weight),
                               full[start:stop])


SPECIAL_VALUES = (float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, 1.0 + 2 ** -23)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 300), seed=st.integers(0, 999),
       special=st.lists(st.tuples(st.integers(0, 10 ** 6), st.sampled_from(SPECIAL_VALUES)), max_size=6),
       rounded=st.booleans())
def test_argmax_last_is_torch_argmax_on_every_instruction_set(rows, n, seed, special, rounded):
    """draftsmith::argmax picks torch.argmax's indices: the first of equal values (ties, -0.0 beside 0.0), the first
    NaN where any, infinities, vector tails of any length, on every instruction set this CPU runs."""
    x = torch.randn(rows, n, generator=torch.Generator().manual_seed(seed))
    x = x.round() if rounded else x  # ties
    for place, value in special:
        x.view(-1)[place % x.numel()] = value
    expected = x.argmax(-1)
    for isa in AVAILABLE_ISAS:
        with kernels_on(KernelIsa(isa)):
            assert torch.equal(argmax_last(x), expected), isa
            assert torch.equal(argmax_last(x[0]), expected[0]), isa  # one row: a 0-d index, as torch's
    assert torch.equal(argmax_last(x.double()), x.double().argmax(-1))  # not float32: torch's own
    assert torch.equal(argmax_last(x[0, 0]), x[0, 0].argmax(-1))  # a 0-d value: torch's own


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 300), k=st.integers(1, 12), seed=st.integers(0, 999),
       rounded=st.booleans())
def test_top_log_probs_are_torch_log_softmax_topk_and_logsumexp(rows, n, k, seed, rounded):
    """draftsmith::top_log_probs (a draft tree's level in one call): each row's k best log-probabilities, best first,
    as torch's log_softmax and topk give them, equal values with the lower index first, and the log of their total
    probability; on every instruction set, and torch's own ops where the kernels are not loaded."""
    k = min(k, n)
    x = 4 * torch.randn(rows, n, generator=torch.Generator().manual_seed(seed))
    x = x.round() if rounded else x  # ties
    log_probs = torch.log_softmax(x.double(), -1)
    order = sorted(range(n), key=lambda j: -x[0, j].item())[:k]  # ties: the lower index first (a stable sort)
    for isa in AVAILABLE_ISAS:
        with kernels_on(KernelIsa(isa)):
            values, indices, shares = top_log_probs(x, k)
        assert values.dtype == torch.float32 and indices.shape == (rows, k) and shares.dtype == torch.float64
        assert indices[0].tolist() == order, isa
        assert torch.allclose(values.double(), log_probs.gather(1, indices), atol=1e-5), isa
        assert torch.allclose(shares, torch.logsumexp(log_probs.gather(1, indices), -1), atol=1e-5), isa
    with mock.patch.object(kernels_module, "_TOP_OP", False):  # torch's ops: the same values
        fallback = top_log_probs(x, k)
    assert torch.allclose(fallback[0], values, atol=1e-5) and torch.allclose(fallback[2], shares, atol=1e-5)


def test_greedy_head_module_switches_copies_by_width_and_keeps_the_argmax():
    """GreedyHead: int8 for one row, its wide copy from GREEDY_WIDE's rows where a bf16 dot exists; every width's
    argmax the exact one; an LM head with a bias is refused in one line."""
    weight, x = near_tie_head(300, 64, 12, torch.float32, seed=3)
    head = GreedyHead(frozen_linear(weight))
    expected = exact_argmax(x, weight)
    assert torch.equal(torch.cat([head(x[r:r + 1]) for r in range(12)]).argmax(-1), expected)
    assert torch.equal(head(x).argmax(-1), expected)
    with pytest.raises(UserError, match="without a bias"):
        GreedyHead(torch.nn.Linear(8, 5))
    for lower in [isa for isa in AVAILABLE_ISAS if isa != KernelIsa.AVX512_AMX][-1:]:  # the kernels switched below
        with kernels_on(KernelIsa(lower)):  # the head built on AMX tiles' copies still runs (its int8 copy)
            assert torch.equal(head(x).argmax(-1), expected)


def test_invariant_linear_module_keeps_shape_and_bias():
    linear = torch.nn.Linear(20, 70)
    module = InvariantLinear(linear)
    x = torch.randn(2, 3, 20)
    assert torch.allclose(module(x), linear(x), atol=1e-5)
    int8 = InvariantLinear(linear, WeightPrecision.INT8)
    assert int8.packed.dtype == torch.int8 and torch.allclose(int8(x), linear(x), atol=0.05)
    w8a8 = InvariantLinear(linear, WeightPrecision.W8A8)
    assert w8a8.packed.dtype == torch.int8 and w8a8(x).shape == (2, 3, 70)
    assert torch.allclose(w8a8(x), linear(x), atol=0.05)


@pytest.mark.parametrize("dtype,precision", [(torch.float32, WeightPrecision.MODEL),
                                             (torch.bfloat16, WeightPrecision.MODEL),
                                             (torch.float32, WeightPrecision.INT8),
                                             (torch.float32, WeightPrecision.W8A8)])
def test_weights_are_gathered_in_one_arena_in_streaming_order(dtype, precision):
    """invariant_model packs every Linear into one weight arena, in module order and cache-line aligned, with the
    values pack_weight gives; q/k/v and gate/up are one joined weight each (4 weights a layer and the head)."""
    model = tiny_model("llama", seed=3, num_layers=2).to(dtype)
    for join_inputs, per_layer in ((True, 4), (False, 7)):
        runs = invariant_model(model, precision, join_inputs=join_inputs)
        linears = [m for m in runs.modules() if isinstance(m, InvariantLinear)]
        assert len(linears) == 2 * per_layer + 1
        assert len({m.packed.untyped_storage().data_ptr() for m in linears}) == 1
        starts = [m.packed.data_ptr() for m in linears]
        assert starts == sorted(starts) and all(start % WEIGHT_ALIGNMENT == 0 for start in starts)
    originals = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for original, linear in zip(originals, linears):
        assert torch.equal(linear.packed, InvariantLinear(original, precision).packed)


@pytest.mark.parametrize("family,bias", [("llama", False), ("qwen2", True)])
@pytest.mark.parametrize("dtype,precision", [(torch.float32, WeightPrecision.MODEL),
                                             (torch.bfloat16, WeightPrecision.MODEL),
                                             (torch.float32, WeightPrecision.INT8),
                                             (torch.float32, WeightPrecision.W8A8)])
def test_joined_projections_are_bit_identical_to_separate_ones(family, bias, dtype, precision):
    """q/k/v (with Qwen2's biases) and gate/up joined into one weight each, stored as the separate ones are, give
    bit for bit the logits of one InvariantLinear per Linear, over a prompt and a verify; a sibling fed another input
    computes its own pass."""
    model = tiny_model(family, seed=4, num_layers=2).to(dtype)
    stored = {(m.packed.dtype, m.packed.element_size()) for m in invariant_model(model, precision).modules()
              if isinstance(m, InvariantLinear)}
    assert stored == {(m.packed.dtype, m.packed.element_size()) for m in invariant_model(
        model, precision, join_inputs=False).modules() if isinstance(m, InvariantLinear)} and len(stored) == 1
    assert (model.model.layers[0].self_attn.k_proj.bias is not None) == bias
    ids = torch.randint(0, model.config.vocab_size, (1, 11), generator=torch.Generator().manual_seed(2))
    logits = []
    for join_inputs in (True, False):
        target = TargetModel(invariant_model(model, precision, join_inputs=join_inputs), tokenizer=None)
        cache = target.new_cache()
        logits.append(torch.cat([target.forward(ids[:, :6], cache).logits, target.forward(ids[:, 6:], cache).logits], 1))
    assert torch.equal(*logits)
    attention = invariant_model(model, precision).model.layers[0].self_attn
    x, y = (torch.randn(3, model.config.hidden_size, dtype=dtype) for _ in range(2))
    attention.q_proj(x)
    alone = invariant_model(model, precision, join_inputs=False).model.layers[0].self_attn
    assert torch.equal(attention.k_proj(y), alone.k_proj(y)) and torch.equal(attention.v_proj(x), alone.v_proj(x))


@pytest.mark.parametrize("dtype,precision", [(torch.float32, WeightPrecision.MODEL),
                                             (torch.bfloat16, WeightPrecision.MODEL),
                                             (torch.float32, WeightPrecision.INT8),
                                             (torch.float32, WeightPrecision.W8A8),
                                             pytest.param(torch.float32, WeightPrecision.SPLIT_BF16,
                                                          marks=needs_amx)])
def test_model_verify_equals_steps_eager(family, dtype, precision):
    """A stock HF model on the invariant kernels: a 7-token forward over a cache gives exactly the logits of seven
    one-token forwards, and the original model is left as it was."""
    model = tiny_model(family, seed=1).to(dtype)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    runs = invariant_model(model, precision)
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    target = TargetModel(runs, tokenizer=None)
    cache = target.new_cache()
    target.forward(ids[:, :5], cache)
    together = target.forward(ids[:, 5:], cache).logits
    target.truncate(cache, 5)
    alone = torch.cat([target.forward(ids[:, i:i + 1], cache).logits for i in range(5, 12)], 1)
    assert torch.equal(together, alone)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())
    assert not any(isinstance(m, InvariantLinear) for m in model.modules())


@pytest.mark.parametrize("dtype,weights", [(torch.float32, "model"), (torch.bfloat16, "model"),
                                           (torch.float32, "int8"), (torch.float32, "w8a8"),
                                           pytest.param(torch.float32, "split_bf16", marks=needs_amx)])
def test_compiled_verify_equals_steps(tmp_path, dtype, weights):
    """Through the compiled engine (one shared-width AOTInductor graph calling the ops): a verify of 6 tokens, a
    prompt chunk and one-token steps agree bit for bit."""
    model = tiny_model("llama", seed=2, num_layers=2).to(dtype)
    settings = CompileSettings(buckets=[1, 8], capacity=64, autotune=False, weights=weights)
    target = TargetModel(model, None, engine=CompiledEngine(model, settings, cache_dir=tmp_path))
    ids = torch.randint(0, model.config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(1))
    cache = target.new_cache()
    prefill = target.forward(ids[:, :8], cache).logits
    verify = target.forward(ids[:, 8:], cache).logits
    target.truncate(cache, 0)
    steps = torch.cat([target.forward(ids[:, i:i + 1], cache).logits for i in range(14)], 1)
    assert torch.equal(torch.cat([prefill, verify], 1), steps)


def test_compiled_greedy_head_serves_greedy_forwards_only(tmp_path):
    """A float32 target's compiled engine reads the greedy head where a forward asks for the argmax only: its argmax
    is the model head's and the one-token steps' (whose approximate logits come from the other copy); other forwards
    read the model's head bit for bit. The default is the model's head for bf16 (greedy when asked); int8 weights
    refuse it in one line."""
    model = tiny_model("llama", seed=2, num_layers=2)
    settings = CompileSettings(buckets=[1, 8], capacity=64, autotune=False)
    engine = CompiledEngine(model, settings, cache_dir=tmp_path)
    assert engine.greedy_head is not None
    target = TargetModel(model, None, engine=engine)
    ids = torch.randint(0, model.config.vocab_size, (1, 14), generator=torch.Generator().manual_seed(1))
    cache = target.new_cache()
    full = target.forward(ids, cache).logits
    target.truncate(cache, 0)
    greedy = torch.cat([target.forward(ids[:, :8], cache, argmax_only=True).logits,
                        target.forward(ids[:, 8:], cache, argmax_only=True).logits], 1)
    target.truncate(cache, 0)
    steps = torch.cat([target.forward(ids[:, i:i + 1], cache, argmax_only=True).logits for i in range(14)], 1)
    assert torch.equal(greedy.argmax(-1), steps.argmax(-1)) and torch.equal(greedy.argmax(-1), full.argmax(-1))
    target.truncate(cache, 0)
    assert torch.equal(target.forward(ids, cache).logits, full)
    model_head = CompiledEngine(model, CompileSettings(buckets=[1, 8], capacity=64, autotune=False, head="model"),
                                cache_dir=tmp_path)
    assert model_head.greedy_head is None
    half = tiny_model("llama", seed=2, num_layers=2).to(torch.bfloat16)
    assert not settings.greedy_head(half.dtype)
    assert CompileSettings(head="greedy").greedy_head(half.dtype)
    with pytest.raises(ConfigError, match="weights=model"):
        CompileSettings(head="greedy", weights="int8")


def test_a_greedy_verify_reads_only_its_paths_rows_where_they_cost_less_apart(tmp_path, monkeypatch):
    """Where the greedy head costs less a row apart (GreedyHead.rows_apart: the int8 copy at every width), a forward
    with greedy_rows returns no logits but each row's greedy token on demand, one head pass a row asked for, equal
    to the logits' argmax; elsewhere the logits. Decoding reads either way and emits plain greedy's tokens."""
    passes = []
    forward = GreedyHead.forward
    monkeypatch.setattr(GreedyHead, "forward", lambda self, x: passes.append(x.shape[1]) or forward(self, x))
    model = tiny_model("llama", seed=2, num_layers=2)
    engine = CompiledEngine(model, CompileSettings(buckets=[1, 8], capacity=64, autotune=False), cache_dir=tmp_path)
    target = TargetModel(model, None, engine=engine)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    cache = target.new_cache()
    expected = target.forward(ids, cache, argmax_only=True).logits[0].argmax(-1).tolist()
    prompt = torch.tensor([[5, 9, 2, 7, 5, 9, 2]])
    plain = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                           do_sample=False)[0, prompt.shape[1]:].tolist()
    draft = layer_subset_student(model, [0])
    for rows_apart in (True, False):
        monkeypatch.setattr(GreedyHead, "rows_apart", property(lambda self: rows_apart))
        target.truncate(cache, 0)
        passes.clear()
        out = target.forward(ids, cache, argmax_only=True, greedy_rows=True)
        if rows_apart:
            assert out.logits is None and passes == []
            assert [out.greedy(row) for row in (3, 0, 3, 5)] == [expected[row] for row in (3, 0, 3, 5)]
            assert passes == [1, 1, 1]  # row 3 once
        else:
            assert out.greedy is None and out.logits[0].argmax(-1).tolist() == expected and passes == [6]
        for drafter in (LMDrafter(draft, mode="chain", budget=3),
                        LMDrafter(draft, mode="tree", depth=3, topk=2, budget=7)):
            config = DecodeConfig(max_new_tokens=16, budget_limit=7)
            decoded = SpeculativeDecoder(target, drafter, config).generate(prompt)
            assert decoded.tokens == plain and decoded.stats.verify_forwards < 16


@pytest.mark.parametrize("head", ["slice", "own"])
def test_medusa_heads_on_the_invariant_kernels(head):
    """The compiled engine's Medusa heads (models.compiled.InvariantMedusaHeads) give the heads' logits, a row
    the same whatever rows come with it, and the decoder's drafter runs them on the compiled backend."""
    config = MedusaConfig(hidden_size=32, vocab_size=50, num_heads=3, draft_vocab_size=20, head=head)
    heads = MedusaHeads(config).eval()
    heads.set_vocab(DraftVocab(torch.arange(0, 40, 2), 50))
    heads.init_lm_heads(torch.randn(50, 32, generator=torch.Generator().manual_seed(0)))
    runs = InvariantMedusaHeads(heads)
    hidden = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        assert torch.allclose(runs(hidden), heads(hidden), atol=1e-5)
        assert torch.equal(runs(hidden)[:, 2], runs(hidden[2:3])[:, 0])
    assert MedusaDrafter(heads, runs=runs).runs is runs


def one_arena(*modules: torch.nn.Module) -> bool:
    """Whether every InvariantLinear of `modules` streams from one weight arena, in module order."""
    linears = [m for module in modules for m in module.modules() if isinstance(m, InvariantLinear)]
    starts = [m.packed.data_ptr() for m in linears]
    return len({m.packed.untyped_storage().data_ptr() for m in linears}) == 1 and starts == sorted(starts)


def test_a_drafters_head_streams_from_the_arena_of_its_layers():
    """The feature drafter's sliced head, the Medusa heads' shared slice and a DFlash block's head are gathered with
    their drafter's layers, once, into one arena."""
    model = tiny_model("llama", seed=5, num_layers=2)
    vocab = DraftVocab.from_ids(range(0, model.config.vocab_size, 2), model.config.vocab_size)
    config = DGFConfig.for_target(model.config, num_blocks=1, draft_vocab_size=vocab.size, head="slice")
    runs = invariant_drafter(DGFModel(config).attach_target(model).set_vocab(vocab).eval(), WeightPrecision.MODEL)
    assert isinstance(runs.draft_head, InvariantLinear) and one_arena(runs)
    medusa = MedusaHeads(MedusaConfig(hidden_size=32, vocab_size=50, num_heads=2, draft_vocab_size=20, head="slice"))
    medusa.set_vocab(DraftVocab(torch.arange(0, 40, 2), 50))
    medusa.init_lm_heads(torch.randn(50, 32))
    assert one_arena(InvariantMedusaHeads(medusa.eval()))
    dflash_config = DFlashConfig.from_target(model.config, num_layers=2, block_size=4, target_layer_ids=[0, 1],
                                             mask_token_id=model.config.vocab_size - 1)
    block = DFlashDrafter(DFlashModel(dflash_config).attach_target(model).eval(), vocab=vocab,
                          precision=WeightPrecision.MODEL)
    assert one_arena(block.engine.model, block.engine.head)


def test_a_compiled_cache_is_zeroed_in_one_arena(tmp_path):
    """A compiled engine's new KV cache: every layer's keys and values zero, in one huge-page arena, and two caches
    never share memory."""
    model = tiny_model("llama", seed=5, num_layers=2)
    engine = CompiledEngine(model, CompileSettings(buckets=[1, 4], capacity=32, autotune=False), cache_dir=tmp_path)
    first, second = engine.new_cache(), engine.new_cache()
    assert all(tensor.shape == like.shape and tensor.dtype == like.dtype and not tensor.any()
               for tensor, like in zip(first.tensors, engine.kv))
    assert len({tensor.untyped_storage().data_ptr() for tensor in first.tensors}) == 1
    assert first.tensors[0].untyped_storage().data_ptr() != second.tensors[0].untyped_storage().data_ptr()
