"""What a linear layer costs per precision where its weights stream from memory and where they sit in cache: 60
layers of SmolLM2's 576 -> 1536 shape (212 MB in float32, more than the cache) called in turn, and one such layer
(3.5 MB) called again and again, at 1 / 4 / 8 / 16 rows, in float32 (the tile), as split bf16 pairs on AMX
(draftsmith::linear_split, the same 4 bytes a weight) and in bf16 (AMX), the precisions and row counts interleaved
round after round; medians. Shows whether a precision's arithmetic at one row hides under its weight stream.
    python scripts/jobs/split_bf16_probe.py [output.json]   (a markdown table beside it; AMX CPUs)
"""
import statistics
import sys
import time
from pathlib import Path

import torch

from draftsmith.eval.documents import cpu_model, write_document
from draftsmith.models.kernels import KernelIsa, kernel_isa, load_kernels, pack_weight, split_bf16

INPUTS, OUTPUTS, LAYERS = 576, 1536, 60
ROWS = [1, 4, 8, 16]
ROUNDS = {"stream": 25, "cache": 300}  # rounds of each (precision, rows) a placement


def precisions(weights: list[torch.Tensor]) -> dict:
    """name -> (packed weights, the call of one layer on inputs x)."""
    return {"float32": ([pack_weight(w) for w in weights],
                        lambda x, p: torch.ops.draftsmith.linear(x, p, None, None, OUTPUTS)),
            "split_bf16": ([pack_weight(split_bf16(w)) for w in weights],
                           lambda x, p: torch.ops.draftsmith.linear_split(x, p, None, OUTPUTS)),
            "bfloat16": ([pack_weight(w.bfloat16()) for w in weights],
                         lambda x, p: torch.ops.draftsmith.linear(x.bfloat16(), p, None, None, OUTPUTS))}


def timed(layers: dict, rounds: int, generator: torch.Generator) -> dict:
    """(precision, rows) -> median ms of one pass over its packed layers."""
    inputs = {m: torch.randn(m, INPUTS, generator=generator) for m in ROWS}
    seconds = {(name, m): [] for name in layers for m in ROWS}
    for _ in range(rounds):
        for m in ROWS:
            for name, (packed, call) in layers.items():
                start = time.perf_counter()
                for p in packed:
                    call(inputs[m], p)
                seconds[(name, m)].append(time.perf_counter() - start)
    return {key: statistics.median(values[2:]) * 1e3 for key, values in seconds.items()}


def main(argv: list[str]) -> None:
    torch.set_num_threads(2)
    load_kernels()
    if kernel_isa() != KernelIsa.AVX512_AMX:
        sys.exit(f"split_bf16_probe: split bf16 runs on AMX tiles and the kernels here run {kernel_isa()}")
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(OUTPUTS, INPUTS, generator=generator) * 0.05 for _ in range(LAYERS)]
    results = {"stream": timed(precisions(weights), ROUNDS["stream"], generator),
               "cache": timed(precisions(weights[:1]), ROUNDS["cache"], generator)}
    lines = [f"Linear layers of {INPUTS} -> {OUTPUTS} on {cpu_model()} (kernels {kernel_isa()}, 2 threads): "
             f"{LAYERS} layers streamed, one layer in cache; median ms a pass, T(w)/T(1) in brackets", "",
             "| placement, precision | " + " | ".join(f"{m} rows" for m in ROWS) + " |", "|---|" + "---|" * len(ROWS)]
    for placement, times in results.items():
        for name in ("float32", "split_bf16", "bfloat16"):
            cells = [f"{times[(name, m)]:.3f} ({times[(name, m)] / times[(name, 1)]:.2f})" for m in ROWS]
            lines.append(f"| {placement}, {name} | " + " | ".join(cells) + " |")
    document = {"cpu": cpu_model(), "kernel_isa": kernel_isa(), "layers": LAYERS, "inputs": INPUTS,
                "outputs": OUTPUTS, "ms": {placement: {f"{name}/{m}": value for (name, m), value in times.items()}
                                           for placement, times in results.items()}}
    write_document(Path(argv[1]) if len(argv) > 1 else None, document, "\n".join(lines))


if __name__ == "__main__":
    main(sys.argv)
