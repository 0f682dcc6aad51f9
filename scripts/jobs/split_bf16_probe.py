"""What a linear layer costs per precision where its weights stream from memory and where they sit in cache: 60
layers of SmolLM2's 576 -> 1536 shape (212 MB in float32, more than the cache) called in turn, one such layer
(3.5 MB: L3) and one 576 -> 576 layer (1.3 MB: L2) called again and again, at 1 / 4 / 8 / 16 rows, in float32 (the
tile), as split bf16 pairs on AMX (draftsmith::linear_split, the same 4 bytes a weight) and in bf16 (AMX), the
precisions and row counts interleaved round after round; medians. Shows whether a precision's arithmetic at one row
hides under its weight stream.
    python scripts/jobs/split_bf16_probe.py [output.json]   (a markdown table beside it; AMX CPUs)
"""
import statistics
import sys
import time

import torch
from ab_arguments import probe_output

from draftsmith.eval.documents import cpu_model, write_document
from draftsmith.eval.latency import interleaved_seconds
from draftsmith.models.kernels import KernelIsa, kernel_isa, load_kernels, pack_weight, split_bf16

INPUTS, OUTPUTS, LAYERS = 576, 1536, 60
ROWS = [1, 4, 8, 16]
PLACEMENTS = {"stream": (OUTPUTS, LAYERS, 25), "L3": (OUTPUTS, 1, 300), "L2": (INPUTS, 1, 600)}  # (N, layers, rounds)
WARMUP = 2  # rounds untimed


def precisions(weights: list[torch.Tensor]) -> dict:
    """name -> (packed weights, the call of one layer on inputs x)."""
    n = weights[0].shape[0]
    return {"float32": ([pack_weight(w) for w in weights],
                        lambda x, p: torch.ops.draftsmith.linear(x, p, None, None, n)),
            "split_bf16": ([pack_weight(split_bf16(w)) for w in weights],
                           lambda x, p: torch.ops.draftsmith.linear_split(x, p, None, n)),
            "bfloat16": ([pack_weight(w.bfloat16()) for w in weights],
                         lambda x, p: torch.ops.draftsmith.linear(x.bfloat16(), p, None, None, n))}


def timed(layers: dict, rounds: int, generator: torch.Generator) -> dict:
    """(precision, rows) -> median ms of one pass over its packed layers (the first WARMUP rounds untimed)."""
    inputs = {m: torch.randn(m, INPUTS, generator=generator) for m in ROWS}

    def pass_seconds(key: tuple[str, int]) -> float:
        (packed, call), x = layers[key[0]], inputs[key[1]]
        start = time.perf_counter()
        for p in packed:
            call(x, p)
        return time.perf_counter() - start

    keys = [(name, m) for m in ROWS for name in layers]
    seconds = interleaved_seconds(pass_seconds, keys, rounds - WARMUP, WARMUP)
    return {key: statistics.median(values) * 1e3 for key, values in seconds.items()}


def main(argv: list[str]) -> None:
    output = probe_output(argv)  # an existing output is refused
    torch.set_num_threads(2)
    load_kernels()
    if kernel_isa() != KernelIsa.AVX512_AMX:
        sys.exit(f"split_bf16_probe: split bf16 runs on AMX tiles and the kernels here run {kernel_isa()}")
    generator = torch.Generator().manual_seed(0)
    results = {}
    for placement, (outputs, layers, rounds) in PLACEMENTS.items():
        weights = [torch.randn(outputs, INPUTS, generator=generator) * 0.05 for _ in range(layers)]
        results[placement] = timed(precisions(weights), rounds, generator)
    lines = [f"Linear layers on {cpu_model()} (kernels {kernel_isa()}, 2 threads): stream = {LAYERS} layers of "
             f"{INPUTS} -> {OUTPUTS} in turn, L3 = one of them, L2 = one of {INPUTS} -> {INPUTS}; median ms a pass, "
             "T(w)/T(1) in brackets", "",
             "| placement, precision | " + " | ".join(f"{m} rows" for m in ROWS) + " |", "|---|" + "---|" * len(ROWS)]
    for placement, times in results.items():
        for name in ("float32", "split_bf16", "bfloat16"):
            cells = [f"{times[(name, m)]:.3f} ({times[(name, m)] / times[(name, 1)]:.2f})" for m in ROWS]
            lines.append(f"| {placement}, {name} | " + " | ".join(cells) + " |")
    ms = {placement: {f"{name}/{m}": value for (name, m), value in times.items()}
          for placement, times in results.items()}
    document = {"cpu": cpu_model(), "kernel_isa": kernel_isa(), "placements": PLACEMENTS, "ms": ms}
    write_document(output, document, "\n".join(lines))


if __name__ == "__main__":
    main(sys.argv)
