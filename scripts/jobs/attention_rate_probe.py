"""The batch-invariant attention op alone on SmolLM2's shapes (9 query heads, 3 kv heads, head_dim 64; a chain of
`rows` new tokens after 256 cached ones in a 1024-slot cache), float32 and bfloat16, 2 threads: median of 7 timings of
200 calls each (results/engine_kernels_zen4/README.md, the sixth run).
    scripts/jobs/quiet.sh python scripts/jobs/attention_rate_probe.py
"""
import statistics
import time

import torch

from draftsmith.models.kernels import load_kernels

CAPACITY, PAST, ROWS = 1024, 256, (1, 4, 9)


def chain_case(rows: int, dtype: torch.dtype, generator: torch.Generator):
    q = torch.randn(1, 9, rows, 64, generator=generator).to(dtype)
    k = torch.randn(1, 3, CAPACITY, 64, generator=generator).to(dtype)
    v = torch.randn(1, 3, CAPACITY, 64, generator=generator).to(dtype)
    mask = torch.full((1, 1, rows, CAPACITY), torch.finfo(torch.float32).min)
    for row in range(rows):
        mask[0, 0, row, :PAST + row + 1] = 0
    return q, k, v, mask


def main() -> None:
    torch.set_num_threads(2)
    load_kernels()
    generator = torch.Generator().manual_seed(0)
    print("| dtype | rows | us per call |\n|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in ROWS:
            case = chain_case(rows, dtype, generator)
            for _ in range(20):
                torch.ops.draftsmith.attention(*case, 0.125)
            timings = []
            for _ in range(7):
                start = time.perf_counter()
                for _ in range(200):
                    torch.ops.draftsmith.attention(*case, 0.125)
                timings.append((time.perf_counter() - start) / 200)
            print(f"| {str(dtype).removeprefix('torch.')} | {rows} | {1e6 * statistics.median(timings):.1f} |")


if __name__ == "__main__":
    main()
