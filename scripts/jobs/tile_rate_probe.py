"""How fast the batch-invariant float32 tile multiplies where its weights do not come from memory: SmolLM2's linear
shapes (576 x 576, 576 x 1536, 1536 x 576; 1.3-3.5 MB, inside L2 or near it) called alone, again and again, at 1-64
rows, beside torch's own fp32 Linear (oneDNN) on the same shapes. The step's bound counts the weight stream and the
FLOPs at the machine's large-matmul peak; this measures the FLOP rate the tile reaches at a verify's row counts,
which is what a verify costs once its weights are streamed. Best of 3 trials of `reps` calls, 2 threads.
    python scripts/jobs/tile_rate_probe.py [output.json]   (a markdown table beside it)
"""
import sys
import time

import torch
from ab_arguments import probe_output

from draftsmith.eval.documents import cpu_model, write_document
from draftsmith.models.kernels import kernel_isa, load_kernels, pack_weight

SHAPES = [(576, 576, 400), (576, 1536, 150), (1536, 576, 150)]  # (inputs K, outputs N, calls a trial)
ROWS = [1, 4, 8, 9, 10, 16, 32, 64]


def best_seconds(call, reps: int) -> float:
    for _ in range(10):
        call()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        best = min(best, (time.perf_counter() - start) / reps)
    return best


def main(argv: list[str]) -> None:
    output = probe_output(argv)  # an existing output is refused
    torch.set_num_threads(2)
    load_kernels()
    generator = torch.Generator().manual_seed(0)
    rows = []
    with torch.no_grad():
        for k, n, reps in SHAPES:
            weight = torch.randn(n, k, generator=generator)
            packed, linear = pack_weight(weight), torch.nn.Linear(k, n, bias=False)
            linear.weight.data = weight
            for m in ROWS:
                x = torch.randn(m, k, generator=generator)
                tile = best_seconds(lambda: torch.ops.draftsmith.linear(x, packed, None, None, n), reps)
                onednn = best_seconds(lambda: linear(x), reps)
                rows.append({"inputs": k, "outputs": n, "rows": m, "tile_gflops": 2 * m * k * n / tile / 1e9,
                             "torch_gflops": 2 * m * k * n / onednn / 1e9})
    lines = [f"float32 GFLOPS with the weights in cache on {cpu_model()} (kernels {kernel_isa()}, 2 threads)", "",
             "| shape | " + " | ".join(f"{m} rows" for m in ROWS) + " |", "|---|" + "---|" * len(ROWS)]
    for k, n, _ in SHAPES:
        cells = [r for r in rows if (r["inputs"], r["outputs"]) == (k, n)]
        lines.append(f"| {k} x {n}: tile / torch | "
                     + " | ".join(f"{r['tile_gflops']:.0f} / {r['torch_gflops']:.0f}" for r in cells) + " |")
    document = {"cpu": cpu_model(), "kernel_isa": kernel_isa(), "rows": rows}
    write_document(output, document, "\n".join(lines))


if __name__ == "__main__":
    main(sys.argv)
