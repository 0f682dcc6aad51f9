"""Where a verify's time goes, width by width, in one process: the compiled float32 greedy forward of SmolLM2-135M over
256 cached tokens, each width's forward profiled (torch.profiler, the package built with kernel profiling) in turn,
widths interleaved so the machine's minute-to-minute rate hits every width alike. Sums each op's self time by part:
the linear layers (draftsmith::linear), the greedy head (draftsmith::greedy_head), attention (draftsmith::attention),
inductor's generated kernels (norms, rotary and the cache write, SiLU, residuals), allocations (aten::empty) and the
rest of the profiled wall time (dispatch, the profiler's own cost, and what the ops' events leave out), beside the
same forward's wall time unprofiled and the wall time of the package built without the kernels' profiling (the
engine's own: the profiling build's records cost ~8 ms a forward on the Xeon, flat in the width; T(w)/T(1) is of this
one). Prints a table; writes JSON and the table beside it where an output path is given (an existing one is
refused). WIDTHS: comma-separated widths instead of 1,4,8,9,12,16 (the first the ratios' base).
    scripts/jobs/quiet.sh python scripts/jobs/verify_parts_probe.py [output.json [WIDTHS]]
"""
import collections
import statistics
import sys

import torch
from ab_arguments import probe_output
from torch.profiler import ProfilerActivity, profile

from draftsmith.eval.documents import cpu_model, write_document
from draftsmith.eval.latency import forward_seconds, mt_bench_context
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import kernel_isa
from draftsmith.models.target import TargetModel

WIDTHS, ROUNDS, WARMUP, CONTEXT = (1, 4, 8, 9, 12, 16), 12, 2, 256
PARTS = {"draftsmith::linear": "linear layers", "draftsmith::greedy_head": "greedy head",
         "draftsmith::attention": "attention", "aten::empty": "allocations"}
ORDER = ("linear layers", "greedy head", "attention", "generated kernels", "allocations", "other ops", "rest")


def part_of(name: str) -> str:
    return PARTS.get(name, "generated kernels" if name.startswith("graph_") else "other ops")


def forward_ms(target: TargetModel, cache, past: int, ids: torch.Tensor) -> float:
    """Milliseconds of one forward of `ids` (the cache restored afterwards)."""
    seconds = forward_seconds(target, cache, ids)
    target.truncate(cache, past)
    return 1000 * seconds


def profiled_parts(target: TargetModel, cache, past: int, ids: torch.Tensor) -> dict[str, float]:
    """Milliseconds per part of one forward of `ids` (the cache restored afterwards)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = forward_ms(target, cache, past, ids)
    parts = collections.Counter()
    for event in prof.events():
        parts[part_of(event.name)] += event.self_cpu_time_total / 1000
    parts["rest"] = wall - sum(parts.values())
    return {"unprofiled": forward_ms(target, cache, past, ids), "wall": wall, **parts}


def widths_of(argv: list[str]) -> tuple[int, ...]:
    """The widths argv[2] names (WIDTHS where none), or exit in one line."""
    if len(argv) < 3:
        return WIDTHS
    if len(argv) > 3 or not all(part.isdigit() and 1 <= int(part) <= 64 for part in argv[2].split(",")):
        sys.exit("usage: python scripts/jobs/verify_parts_probe.py [output.json [WIDTHS: e.g. 1,2,3,4, each 1-64]]")
    return tuple(int(part) for part in argv[2].split(","))


def compiled_with_cache(base: TargetModel, kernel_profile: bool,
                        widths: tuple[int, ...]) -> tuple[TargetModel, object, int]:
    """The compiled target (its kernels profiled or not), a cache holding the context, and the context's length."""
    target = base.with_backend(Backend.COMPILED, CompileSettings(buckets=sorted(widths), capacity=1024,
                                                                 kernel_profile=kernel_profile))
    target.prepare(widths)
    cache = target.new_cache(CONTEXT + max(widths))
    target.forward(mt_bench_context(base.tokenizer, CONTEXT), cache)
    return target, cache, target.cache_length(cache)


@torch.inference_mode()
def main() -> None:
    output, widths = probe_output(sys.argv), widths_of(sys.argv)
    torch.set_num_threads(2)
    base = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=torch.float32)
    profiled, engine = compiled_with_cache(base, True, widths), compiled_with_cache(base, False, widths)
    vocab = base.model.get_output_embeddings().out_features
    runs = {width: [] for width in widths}
    for round_ in range(WARMUP + ROUNDS):
        for width in widths:
            ids = torch.randint(0, vocab, (1, width))
            parts = profiled_parts(*profiled, ids) | {"engine": forward_ms(*engine, ids)}
            if round_ >= WARMUP:
                runs[width].append(parts)
    keys = ("engine", "unprofiled", "wall", *ORDER)
    table = {width: {key: statistics.median(run.get(key, 0.0) for run in rows) for key in keys}
             for width, rows in runs.items()}
    head = (f"{cpu_model()} (kernels {kernel_isa()}, 2 threads), {CONTEXT} cached tokens, medians of {ROUNDS}: the "
            "engine's package (T(w)), the profiling build unprofiled and profiled (its parts), ms")
    lines = [head, "", "| w | T(w) | T(w)/T(1) | profiling build | profiled | " + " | ".join(ORDER) + " |",
             "|---|---|---|---|---|" + "---|" * len(ORDER)]
    for width, row in table.items():
        ratio = row["engine"] / table[widths[0]]["engine"]
        lines.append(f"| {width} | {row['engine']:.1f} | {ratio:.2f} | {row['unprofiled']:.1f} | {row['wall']:.1f} | "
                     + " | ".join(f"{row[key]:.2f}" for key in ORDER) + " |")
    write_document(output, {"cpu": cpu_model(), "kernel_isa": str(kernel_isa()), "context": CONTEXT, "rounds": ROUNDS,
                            "ms": table}, "\n".join(lines))


if __name__ == "__main__":
    main()
