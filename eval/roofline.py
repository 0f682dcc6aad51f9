"""Roofline probe: how far a target forward of w tokens is from what this machine allows.

    python -m draftsmith.eval.roofline output=results/roofline/<machine kind>.json

Measures, on the torch threads used:
- the machine: the weight-stream bandwidth (the batch-invariant linear over a 256 MB fp32 weight, one row: what a
  decode step streams; the faster of the weight in ordinary memory and in a huge-page weight arena, where the
  engine keeps its weights) beside a plain reduction over 512 MB, and matmul throughput in float32, bfloat16 and int8
  (torch's own large GEMMs) and the invariant kernels' at 64 rows (float32, and int8 x int8 for w8a8's bound);
- the target on the compiled engine (`compile.kernels`, default the batch-invariant kernels; these forwards read the
  model's own LM head, the one the bound counts): T(w) for every width,
  beside its bound max(bytes / bandwidth, FLOPs / throughput), bytes = its weights + the KV cache it reads, FLOPs =
  2 x weights x w + attention;
- T(w) split by part: the decoder's linear layers and the LM head (their ops timed alone on the same weights),
  attention (the op over the filled cache), and the rest (norms, rotary, residuals, cache writes, launch and
  Python overhead) as T(w) minus those parts;
- where the engine has a greedy head (`compile.head`), T(w) of the forwards greedy decoding runs, beside the bound of
  their bytes (the head's int8 or bf16 copy in place of the model's);
- the drafters on the same engine and kernels: the feature drafter (`drafter`, default the target's bundled one)
  T(w) of its forward over the same cached length, and Medusa heads (`medusa`, a trained final/ or snapshot
  directory) T(w) of their logits, each beside its bound.
Writes JSON and a markdown table (beside the JSON); prints the table.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from draftsmith.config import check_config, config_to_dict, option, section
from draftsmith.errors import exit_with
from draftsmith.eval.documents import cpu_isa, cpu_model, parse_document_command, write_document
from draftsmith.eval.latency import interleaved_seconds, measure_forward_latency, mt_bench_context
from draftsmith.models.artifacts import load_dgf, load_medusa_heads
from draftsmith.models.bundled import DEFAULT_TARGET, bundled_drafter
from draftsmith.models.compiled import CompileSettings, CompiledDGFEngine
from draftsmith.models.medusa import InvariantMedusaHeads
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import (InvariantLinear, Kernels, WeightPrecision, arena_zeros, kernel_isa, load_kernels,
                                      pack_weight)
from draftsmith.models.target import TargetModel, resolve_dtype

WIDTHS = [1, 2, 4, 8, 16, 32, 64]


@dataclass
class RooflineConfig:
    target: str = option(DEFAULT_TARGET, "the target: registry name, model directory or tiny:<family>")
    dtype: str = option("float32", "the target's dtype (float32 | bfloat16)")
    widths: list[int] = option(factory=lambda: list(WIDTHS), help="tokens per forward", ge=1)
    context_tokens: int = option(256, "KV-cache length each forward attends over", ge=1)
    repeats: int = option(10, "timed forwards per width (the median is reported)", ge=1)
    drafter: str | None = option("bundled", "the feature drafter timed on the same engine: a train/dgf.py final/ or "
                                            "snapshot directory, bundled (the target's bundled drafter) or null")
    medusa: str | None = option(None, "Medusa heads timed on the same kernels: a train/medusa.py final/ or snapshot "
                                      "directory (null: none)")
    compile: CompileSettings = section(CompileSettings, "the compiled engine measured")
    output: str | None = option(None, "JSON path (a markdown table is written beside it); null: print only")

    def __post_init__(self):
        check_config(self)


def call_seconds(run) -> float:
    """Wall seconds of one call of `run`."""
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def median_seconds(times: dict[int, list[float]]) -> dict[int, float]:
    return {width: statistics.median(seconds) for width, seconds in times.items()}


def best_seconds(run, repeats: int = 5) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def stream_roofs() -> dict:
    """Weight-stream bandwidth (GB/s) on this machine's torch threads: the invariant kernel reading 256 MB of packed
    weights (on huge pages and on ordinary pages), and a plain 512 MB reduction."""
    load_kernels()
    weight = pack_weight(torch.randn(65536, 1024))
    arena = arena_zeros([weight])[0].copy_(weight)
    row = torch.randn(1, 1024)
    stream_4k_s = best_seconds(lambda: torch.ops.draftsmith.linear(row, weight, None, None, 65536))
    stream_s = best_seconds(lambda: torch.ops.draftsmith.linear(row, arena, None, None, 65536))
    big = torch.ones(128 * 2 ** 20)
    sum_s = best_seconds(big.sum)
    nbytes = weight.numel() * 4
    return {"stream_gbs": nbytes / min(stream_s, stream_4k_s) / 1e9, "stream_ordinary_memory_gbs":
            nbytes / stream_4k_s / 1e9, "reduction_gbs": big.numel() * 4 / sum_s / 1e9}


def restream(roofs: dict) -> dict:
    """The roofs with the stream measured again after the timings: these VMs' bandwidth moves by the minute (27-59
    GB/s on one Zen 4 within an hour), so the bound uses the mean of the readings before and after, both kept."""
    after = stream_roofs()
    both = {f"{key}_before": roofs[key] for key in after} | {f"{key}_after": value for key, value in after.items()}
    return roofs | both | {key: (roofs[key] + value) / 2 for key, value in after.items()}


def machine_roofs() -> dict:
    """Weight-stream bandwidth (GB/s) and matmul throughput (GFLOPS) on this machine's torch threads."""
    roofs = stream_roofs()
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    flops = 2 * 2048 ** 3
    roofs["float32_gflops"] = flops / best_seconds(lambda: a @ b, 3) / 1e9
    a16, b16 = a.bfloat16(), b.bfloat16()
    roofs["bfloat16_gflops"] = flops / best_seconds(lambda: a16 @ b16, 3) / 1e9
    ai, bi = torch.randint(-127, 127, (2048, 2048), dtype=torch.int8), torch.randint(-127, 127, (2048, 2048),
                                                                                     dtype=torch.int8)
    roofs["int8_gops"] = flops / best_seconds(lambda: torch._int_mm(ai, bi), 3) / 1e9
    x64, w = torch.randn(64, 1024), pack_weight(torch.randn(4096, 1024))
    roofs["kernel_float32_gflops"] = 2 * 64 * 4096 * 1024 / best_seconds(
        lambda: torch.ops.draftsmith.linear(x64, w, None, None, 4096), 10) / 1e9
    w8a8 = InvariantLinear(nn.Linear(1024, 4096, bias=False), WeightPrecision.W8A8)
    roofs["kernel_int8_gops"] = 2 * 64 * 4096 * 1024 / best_seconds(lambda: w8a8(x64), 10) / 1e9
    return roofs


SPLIT_PRODUCTS = 4  # bf16 products per float32 multiply-add of split_bf16 layers (x_hi, x_lo times w_hi, w_lo)


def throughput_of(roofs: dict, dtype: torch.dtype, linears: list) -> float:
    """The best measured rate (GFLOPS, or GOPS for int8 x int8 layers) for these layers: torch's GEMM or the
    invariant kernel's (split_bf16: the bf16 rate over its four products a multiply-add)."""
    if any(m.precision is WeightPrecision.W8A8 for m in linears):
        return max(roofs["int8_gops"], roofs["kernel_int8_gops"])
    if any(m.precision is WeightPrecision.SPLIT_BF16 for m in linears):
        return roofs["bfloat16_gflops"] / SPLIT_PRODUCTS
    if dtype == torch.float32:
        return max(roofs["float32_gflops"], roofs["kernel_float32_gflops"])
    return roofs["bfloat16_gflops"]


def model_linears(model) -> tuple[list, object]:
    """(the decoder's linear modules, the LM head) of a model running on the invariant kernels."""
    head = model.get_output_embeddings()
    return [m for m in model.modules() if isinstance(m, InvariantLinear) and m is not head], head


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def part_seconds(model, config, width: int, context: int) -> dict:
    """Seconds of the linear layers, the LM head and attention of one forward of `width` tokens, timed alone."""
    linears, head = model_linears(model)
    inputs = {k: torch.randn(width, k, dtype=model.dtype) for k in {m.in_features for m in [*linears, head]}}
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    dim = head_dim(cfg)
    q = torch.randn(1, heads, width, dim, dtype=model.dtype)
    keys = torch.randn(1, kv_heads, config.compile.capacity, dim, dtype=model.dtype)
    mask = torch.full((1, 1, width, config.compile.capacity), torch.finfo(torch.float32).min)
    mask[..., :context + width] = 0
    layers = cfg.num_hidden_layers
    return {"linear": best_seconds(lambda: [m(inputs[m.in_features]) for m in linears]),
            "head": best_seconds(lambda: head(inputs[head.in_features])),
            "attention": best_seconds(lambda: [torch.ops.draftsmith.attention(q, keys, keys, mask, 0.125)
                                               for _ in range(layers)])}


def bound_seconds(model, roofs: dict, width: int, context: int, layers_config, dtype: torch.dtype,
                  head: nn.Module | None = None) -> float:
    """max(bytes / stream, FLOPs / throughput) of a forward of `width` tokens over `context` cached ones: the
    InvariantLinears' packed weights and params, plus attention over the layers `layers_config` describes (an HF
    config; None: no attention, as Medusa heads). With `head` (a GreedyHead) in place of the model's LM head: its
    copy's bytes for this width, and no head FLOPs (a lower bound: they run at the copy's rate)."""
    linears = ([m for m in model.modules() if isinstance(m, InvariantLinear)] if head is None
               else model_linears(model)[0])
    copies = [] if head is None else [head.copy_for(width)]
    weights = sum(t.numel() * t.element_size() for t in [m.packed for m in linears] + copies)
    params = sum(m.in_features * m.out_features for m in linears)
    cfg = layers_config
    kv_bytes = attention_flops = 0
    if cfg is not None:
        dim = head_dim(cfg)
        kv_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (context + width) * dim * dtype.itemsize
        attention_flops = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * width * (context + width) * dim
    flops = 2 * params * width + attention_flops
    throughput = throughput_of(roofs, dtype, linears)
    return max((weights + kv_bytes) / (roofs["stream_gbs"] * 1e9), flops / (throughput * 1e9))


def feature_drafter_rows(config: RooflineConfig, base: TargetModel, roofs: dict, context: int) -> dict:
    """T(w) of the feature drafter's compiled forward over `context` cached tokens, beside its bound."""
    path = bundled_drafter(base.name) if config.drafter == "bundled" else config.drafter
    model, _ = load_dgf(path, base, dtype=base.dtype)
    engine = CompiledDGFEngine(model.eval(), config.compile)
    engine.prepare(tuple(config.widths))
    hidden, vocab = model.config.hidden_size, base.model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    cache = engine.new_cache(context + max(config.widths))
    engine.forward(torch.randn(1, context, hidden, generator=generator, dtype=base.dtype),
                   torch.randint(0, vocab, (1, context), generator=generator), cache)
    past = cache.length

    def seconds_of(width: int) -> float:
        features, ids = torch.randn(1, width, hidden, dtype=base.dtype), torch.randint(0, vocab, (1, width))
        seconds = call_seconds(lambda: engine.forward(features, ids, cache))
        engine.truncate(cache, past)
        return seconds

    times = median_seconds(interleaved_seconds(seconds_of, config.widths, config.repeats))
    runs = engine.runs
    shown = f"bundled: {Path(path).name}" if config.drafter == "bundled" else str(path)
    return {"path": shown, "widths": {w: {"ms": 1000 * t, "bound_ms": 1000 * bound_seconds(
        runs, roofs, w, context, model.block_config, base.dtype)} for w, t in times.items()}}


def medusa_rows(config: RooflineConfig, base: TargetModel, roofs: dict) -> dict:
    """T(w) of Medusa heads' logits for w hidden states on the invariant kernels, beside their bound (weights
    streamed once, no attention)."""
    heads, _ = load_medusa_heads(config.medusa, device=base.device, target=base)
    runs = InvariantMedusaHeads(heads.eval(), config.compile.weights)
    dtype = next(heads.parameters()).dtype  # the hidden state's, as MedusaDrafter casts it
    hidden = torch.randn(max(config.widths), heads.config.hidden_size, dtype=dtype)
    with torch.inference_mode():
        times = median_seconds(interleaved_seconds(lambda width: call_seconds(lambda: runs(hidden[:width])),
                                                   config.widths, config.repeats))
    return {"path": config.medusa, "widths": {w: {"ms": 1000 * t, "bound_ms": 1000 * bound_seconds(
        runs, roofs, w, 0, None, dtype)} for w, t in times.items()}}


def greedy_step_rows(target: TargetModel, times: dict[int, list[float]], context: int, roofs: dict) -> dict:
    """T(w) of the forwards greedy decoding runs (`times`: through the compiled engine's greedy head) beside their
    bound."""
    runs, head = target.engine.runs, target.engine.greedy_head
    return {w: {"ms": 1000 * t, "bound_ms": 1000 * bound_seconds(runs, roofs, w, context, runs.config, runs.dtype,
                                                                 head)} for w, t in median_seconds(times).items()}


def run_roofline(config: RooflineConfig) -> dict:
    dtype = resolve_dtype(config.dtype)
    config.compile.check_dtype(dtype, [Backend.COMPILED])  # before the machine's roofs are timed (minutes)
    roofs = machine_roofs()
    print("[roofline] machine: " + ", ".join(f"{k} {v:.1f}" for k, v in roofs.items()), flush=True)
    base = TargetModel.from_pretrained(config.target, dtype=dtype)
    target = base.with_backend(Backend.COMPILED, config.compile)
    target.prepare(tuple(config.widths))
    context = mt_bench_context(base.tokenizer, config.context_tokens)
    times = measure_forward_latency(target, context, config.widths, config.repeats, argmax_only=False)
    greedy_times = (measure_forward_latency(target, context, config.widths, config.repeats)
                    if target.engine.greedy_head is not None else None)
    roofs = restream(roofs)
    greedy = greedy_step_rows(target, greedy_times, context.shape[1], roofs) if greedy_times else {}
    print(f"[roofline] stream {roofs['stream_gbs_before']:.1f} GB/s before the timings, "
          f"{roofs['stream_gbs_after']:.1f} after", flush=True)
    runs = target.engine.runs
    rows = {}
    for width in config.widths:
        total = statistics.median(times[width])
        parts = part_seconds(runs, config, width, context.shape[1]) if config.compile.kernels is Kernels.INVARIANT \
            else {}
        parts["rest"] = total - sum(parts.values())
        bound = (bound_seconds(runs, roofs, width, context.shape[1], runs.config, runs.dtype)
                 if parts.get("linear") is not None else None)
        rows[width] = {"ms": 1000 * total, "bound_ms": bound and 1000 * bound,
                       "parts_ms": {k: 1000 * v for k, v in parts.items()}}
        print(f"  T({width}) = {1000 * total:.1f} ms" + (f", bound {1000 * bound:.1f} ms" if bound else ""),
              flush=True)
    drafters = {}
    if config.drafter is not None:
        drafters["feature drafter"] = feature_drafter_rows(config, base, roofs, context.shape[1])
    if config.medusa is not None:
        drafters["Medusa heads"] = medusa_rows(config, base, roofs)
    for name, drafter in drafters.items():
        print(f"  {name}: " + ", ".join(f"T({w}) = {row['ms']:.2f} ms" for w, row in drafter["widths"].items()),
              flush=True)
    info = {"processor": cpu_model(), "isa": cpu_isa(), "kernel_isa": kernel_isa(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}
    return {"format": "draftsmith.roofline/1", "config": config_to_dict(config), "machine_info": info,
            "roofs": roofs, "widths": rows, "greedy_head_widths": greedy, "drafters": drafters}


def stream_memory(roofs: dict) -> str:
    """How the stream was read: before and after the timings, from huge or ordinary pages ('' for what results from
    before the probe measured it do not have)."""
    ordinary = roofs.get("stream_ordinary_memory_gbs")
    moved = (f"the mean of {roofs['stream_gbs_before']:.1f} before and {roofs['stream_gbs_after']:.1f} after the "
             "timings; " if "stream_gbs_after" in roofs else "")
    return moved + ("" if ordinary is None else f"{ordinary:.1f} from ordinary 4 KB pages; ")


def format_roofline(document: dict) -> str:
    info, roofs, config = document["machine_info"], document["roofs"], document["config"]
    lines = [f"Roofline of {config['target']} ({config['dtype']}, compile.kernels={config['compile']['kernels']}, "
             f"weights={config['compile']['weights']}) over {config['context_tokens']} cached tokens: "
             f"{info['processor']} ({info['isa']}; kernels {info['kernel_isa']}), {info['torch_threads']} torch "
             f"threads, torch {info['torch']}.", "",
             f"Machine: weight stream {roofs['stream_gbs']:.1f} GB/s ({stream_memory(roofs)}a plain 512 MB "
             f"reduction: {roofs['reduction_gbs']:.1f}); matmul float32 {roofs['float32_gflops']:.0f} GFLOPS, bfloat16 "
             f"{roofs['bfloat16_gflops']:.0f}, int8 {roofs['int8_gops']:.0f} GOPS; the invariant kernel at 64 rows "
             f"{roofs['kernel_float32_gflops']:.0f} GFLOPS float32, int8 x int8 {roofs['kernel_int8_gops']:.0f} GOPS.",
             "",
             "| w | T(w) ms | T(w)/T(1) | bound ms | bound / T(w) | linear ms | LM head ms | attention ms | rest ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    rows = document["widths"]
    first = rows[min(rows, key=int)]["ms"]
    for width, row in rows.items():
        parts = row["parts_ms"]
        bound, total = row["bound_ms"], row["ms"]
        cells = [f"{parts[k]:.1f}" if k in parts else "-" for k in ("linear", "head", "attention", "rest")]
        bound_cells = [f"{bound:.1f}", f"{bound / total:.0%}"] if bound else ["-", "-"]
        lines.append(f"| {width} | {total:.1f} | {total / first:.2f} | " + " | ".join(bound_cells + cells) + " |")
    greedy = document.get("greedy_head_widths") or {}
    if greedy:
        first = greedy[min(greedy, key=int)]["ms"]
        lines += ["", "The forwards greedy decoding runs (the greedy head: an int8 or bf16 copy of the LM head "
                      "streamed, the bound counting its bytes and not its FLOPs):", "",
                  "| w | T(w) ms | T(w)/T(1) | bound ms | bound / T(w) |", "|---|---|---|---|---|"]
        lines += [f"| {w} | {row['ms']:.1f} | {row['ms'] / first:.2f} | {row['bound_ms']:.1f} | "
                  f"{row['bound_ms'] / row['ms']:.0%} |" for w, row in greedy.items()]
    for name, drafter in document.get("drafters", {}).items():
        rows = drafter["widths"]
        first = rows[min(rows, key=int)]["ms"]
        lines += ["", f"{name[0].upper() + name[1:]} ({drafter['path']}) on the same engine and kernels:", "",
                  "| w | T(w) ms | T(w)/T(1) | bound ms | bound / T(w) |", "|---|---|---|---|---|"]
        lines += [f"| {w} | {row['ms']:.2f} | {row['ms'] / first:.2f} | {row['bound_ms']:.2f} | "
                  f"{row['bound_ms'] / row['ms']:.0%} |" for w, row in rows.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> dict:
    config, out = parse_document_command("draftsmith.eval.roofline", __doc__, RooflineConfig, argv)
    document = run_roofline(config)
    write_document(out, document, format_roofline(document))
    return document


if __name__ == "__main__":
    exit_with(main)
