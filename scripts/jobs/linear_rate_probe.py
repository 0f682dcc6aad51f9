"""The batch-invariant fp32 linear kernel's rate by rows, alone (2 threads): on weights that stay in L2 (192 x 576,
442 KB) and on weights streamed from memory (24576 x 576, 56 MB); median of 7 timings of many calls each. Where a
verify's rows stop hiding under the weight stream (results/engine_kernels_zen4/README.md, the fifth run).
    scripts/jobs/quiet.sh python scripts/jobs/linear_rate_probe.py
"""
import statistics
import time

import torch

from draftsmith.models.kernels import InvariantLinear, load_kernels

CASES = ((192, 576, "in L2", 400), (24576, 576, "streamed, 56 MB", 20))  # (N, K, label, calls per timing)
ROWS = (1, 4, 8, 9, 16, 64)


def seconds_per_call(linear: InvariantLinear, x: torch.Tensor, calls: int) -> float:
    for _ in range(5):
        linear(x)
    timings = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            linear(x)
        timings.append((time.perf_counter() - start) / calls)
    return statistics.median(timings)


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    load_kernels()
    print("| weights | rows | us per call | GFLOPS | weight GB/s |\n|---|---|---|---|---|")
    for n, k, label, calls in CASES:
        linear = InvariantLinear(torch.nn.Linear(k, n, bias=False))
        for rows in ROWS:
            t = seconds_per_call(linear, torch.randn(1, rows, k), calls)
            print(f"| {label} | {rows} | {t * 1e6:.1f} | {2 * rows * n * k / t / 1e9:.0f} | {n * k * 4 / t / 1e9:.1f} |")


if __name__ == "__main__":
    main()
