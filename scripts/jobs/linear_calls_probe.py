"""What a call of the batch-invariant linear kernel costs beyond its bytes: ~425 MB of float32 weights (a SmolLM2
step's decoder linears) in one weight arena, one input row, run as 10 or 120 calls of equal panels (the engine's step
makes 120 such calls plus its head), in arena order and shuffled, on 1 and 2 threads; median of 7 timings each.
(120 calls - 10 calls) / 110 is the cost of a call; order says whether the weight stream's continuity across calls
matters, the thread counts whether the threads' start and finish do; a call on one panel of weights that stay in cache
says what the call itself costs from Python.
    scripts/jobs/quiet.sh python scripts/jobs/linear_calls_probe.py
"""
import random
import statistics
import time

import torch
from torch import nn

from draftsmith.models.kernels import PANEL, InvariantLinear, gather_weights, load_kernels

INPUTS = 576
TOTAL_BYTES = 425_000_000


def arena_weights(calls: int) -> list[tuple[torch.Tensor, int]]:
    """(packed weight, output columns) of `calls` equal linears, placed one after another in one arena."""
    panels = TOTAL_BYTES // 4 // INPUTS // PANEL // calls
    linears = [InvariantLinear(nn.Linear(INPUTS, panels * PANEL, bias=False)) for _ in range(calls)]
    gather_weights(*linears)
    return [(linear.packed, linear.out_features) for linear in linears]


def median_seconds(weights: list[tuple[torch.Tensor, int]], x: torch.Tensor) -> float:
    timings = []
    for _ in range(7):
        start = time.perf_counter()
        for packed, columns in weights:
            torch.ops.draftsmith.linear(x, packed, None, None, columns)
        timings.append(time.perf_counter() - start)
    return statistics.median(timings)


def main() -> None:
    load_kernels()
    x = torch.randn(1, INPUTS)
    few, many = arena_weights(10), arena_weights(120)
    cached = [(InvariantLinear(nn.Linear(INPUTS, PANEL, bias=False)).packed, PANEL)] * 1000  # 1000 calls, in cache
    shuffled = list(many)
    random.Random(0).shuffle(shuffled)
    for threads in (1, 2, 1, 2):
        torch.set_num_threads(threads)
        few_s, many_s, shuffled_s = (median_seconds(w, x) for w in (few, many, shuffled))
        print(f"{threads} thread(s): 10 calls {1e3 * few_s:.2f} ms, 120 calls {1e3 * many_s:.2f} ms in arena order, "
              f"{1e3 * shuffled_s:.2f} ms shuffled: {1e6 * (many_s - few_s) / 110:.1f} us a call; a one-panel call "
              f"in cache {1e3 * median_seconds(cached, x):.1f} us")


if __name__ == "__main__":
    main()
