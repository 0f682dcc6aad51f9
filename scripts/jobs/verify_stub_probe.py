"""What each part of SmolLM2-135M-Instruct's compiled fp32 forward costs inside the forward, at one row and at a
verify's rows: T(w) with the kernels' ops as they are, and with one op at a time (or all of them) replaced by a stub
that returns zeros of the op's shape at once. T(w) - T(w, op stubbed) is what that op costs in the forward, its
memory traffic and thread hand-offs included, which the roofline's parts timed alone cannot see; T(w, all stubbed)
is everything else (norms, rotary, cache writes, the package's glue, dispatch, Python). The stubs are Python
kernels registered over the ops' CPU kernels and removed after (the package calls the ops through the
dispatcher); a stub's own dispatch is the same at every width, so the differences between widths hold. Widths and
variants interleaved, the greedy forward as the decode loop runs it (argmax_only), 256 cached tokens of an MT-Bench
prompt. Prints a table; writes JSON where an output path is given.
    scripts/jobs/quiet.sh python scripts/jobs/verify_stub_probe.py [output.json]
"""
import json
import statistics
import sys

import torch

from draftsmith.eval.documents import cpu_model
from draftsmith.eval.latency import mt_bench_context, time_forward
from draftsmith.eval.roofline import model_linears, stream_roofs
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import kernel_isa
from draftsmith.models.target import TargetModel

WIDTHS, REPEATS, CONTEXT = (1, 4, 8), 40, 256
OPS = ("linear", "greedy_head", "attention")  # linear_i8: int8 weights only, not in a float32 target's forward
# each variant: the ops it stubs; the ones named "only ..." keep one op and stub the others
VARIANTS = {"none": (), **{f"no {op}": (op,) for op in OPS}, **{f"only {op}": tuple(o for o in OPS if o != op)
                                                                 for op in OPS}, "all stubbed": OPS}


def stub_of(op: str):
    """A kernel returning zeros of `op`'s output shape (as the op's fake kernel says it)."""
    if op == "greedy_head":
        return lambda x, packed, scale, weight: x.new_zeros((*x.shape[:-1], weight.shape[0]), dtype=torch.float32)
    if op == "attention":
        return lambda q, k, v, mask, scaling: q.new_zeros((q.shape[0], q.shape[2], q.shape[1], q.shape[3]))
    return lambda x, packed, scale, bias, out_features: x.new_zeros((*x.shape[:-1], out_features))


def stubbed(ops: tuple) -> torch.library.Library | None:
    """The `ops` replaced by stubs while the returned library lives (None: nothing replaced)."""
    if not ops:
        return None
    library = torch.library.Library("draftsmith", "IMPL")
    for op in ops:
        library.impl(op, stub_of(op), "CPU")
    return library


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(2)
    base = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=torch.float32)
    target = base.with_backend(Backend.COMPILED, CompileSettings())
    target.prepare(WIDTHS)
    context = mt_bench_context(base.tokenizer, CONTEXT)
    cache = target.new_cache(CONTEXT + max(WIDTHS))
    target.forward(context, cache)
    past = target.cache_length(cache)
    generator = torch.Generator().manual_seed(0)
    stream_before = stream_roofs()["stream_gbs"]
    times = {(variant, width): [] for variant in VARIANTS for width in WIDTHS}
    for repeat in range(REPEATS + 2):
        for variant in VARIANTS:
            library = stubbed(VARIANTS[variant])
            for width in WIDTHS:
                seconds = time_forward(target, cache, past, width, generator)
                if repeat >= 2:
                    times[variant, width].append(seconds)
            if library is not None:
                library._destroy()
    ms = {variant: {width: 1000 * statistics.median(times[variant, width]) for width in WIDTHS}
          for variant in VARIANTS}
    print(f"{cpu_model()} ({kernel_isa()}), {torch.get_num_threads()} threads: compiled fp32 greedy forward over "
          f"{past} cached tokens, median of {REPEATS}")
    stream_after = stream_roofs()["stream_gbs"]
    params = sum(m.in_features * m.out_features for m in model_linears(target.engine.runs)[0])
    rest = ms["all stubbed"]
    print("| variant | " + " | ".join(f"T({w}) ms" for w in WIDTHS) + " | " + " | ".join(
        f"T({w}) - T(1)" for w in WIDTHS[1:]) + " |")
    print("|---" * (2 * len(WIDTHS)) + "|")
    for variant in VARIANTS:
        row = ms[variant]
        print(f"| {variant} | " + " | ".join(f"{row[w]:.2f}" for w in WIDTHS) + " | " + " | ".join(
            f"{row[w] - row[1]:+.2f}" for w in WIDTHS[1:]) + " |")
    print("what each op adds to the forward: alone over all stubbed (only op - all stubbed) / removed from the whole "
          "(none - no op), ms at " + ", ".join(str(w) for w in WIDTHS) + " rows")
    for op in OPS:
        alone = ", ".join(f"{ms[f'only {op}'][w] - rest[w]:.2f}" for w in WIDTHS)
        removed = ", ".join(f"{ms['none'][w] - ms[f'no {op}'][w]:.2f}" for w in WIDTHS)
        print(f"  {op}: alone {alone} / removed {removed}")
    linear_rate = {w: 2 * params * w / (ms["only linear"][w] - rest[w]) / 1e6 for w in WIDTHS}
    print(f"weight stream {stream_before:.1f} GB/s before, {stream_after:.1f} after; the decoder's linear layers "
          f"({params / 1e6:.0f}M weights) in the forward: " + ", ".join(
              f"{linear_rate[w]:.0f} GFLOPS at {w} rows" for w in WIDTHS))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as file:
            json.dump({"cpu": cpu_model(), "kernel_isa": kernel_isa(), "cached_tokens": past, "repeats": REPEATS,
                       "stream_gbs_before": stream_before, "stream_gbs_after": stream_after,
                       "decoder_linear_weights": params, "variants": {v: list(ops) for v, ops in VARIANTS.items()},
                       "linear_gflops_in_forward": {str(w): r for w, r in linear_rate.items()},
                       "median_ms": {v: {str(w): t for w, t in row.items()} for v, row in ms.items()}}, file, indent=1)


if __name__ == "__main__":
    main()
