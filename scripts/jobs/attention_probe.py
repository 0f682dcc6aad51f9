"""The batch-invariant attention op alone (draftsmith::attention), SmolLM2-135M's shapes (9 query heads, 3 kv heads,
head_dim 64, 30 layers each over its own cache, so the caches stream from memory as in a forward), a forward of w
query rows over `context` visible keys at capacity 2304, per thread count: prints a table and writes JSON.

    python scripts/jobs/attention_probe.py OUT.json

The FLOP bound of a row: 30 layers x 9 heads x keys x 64 x 4 (the score and the weighted sum of values).
"""

import json
import sys
import time

import torch

from draftsmith.eval.documents import cpu_isa, cpu_model
from draftsmith.models.kernels import kernel_isa, load_kernels

HEADS, KV_HEADS, HEAD_DIM, LAYERS, CAPACITY = 9, 3, 64, 30, 2304


def forward_ms(context: int, rows: int, repeats: int = 20) -> float:
    """Milliseconds of the op over every layer (the mean of `repeats` calls after one warm-up)."""
    queries = [torch.randn(1, HEADS, rows, HEAD_DIM) for _ in range(LAYERS)]
    caches = [(torch.randn(1, KV_HEADS, CAPACITY, HEAD_DIM), torch.randn(1, KV_HEADS, CAPACITY, HEAD_DIM))
              for _ in range(LAYERS)]
    mask = torch.full((1, 1, rows, CAPACITY), float("-inf"))
    mask[..., :context] = 0
    for row in range(rows):  # a chain: row r sees the context and rows 0..r
        mask[0, 0, row, context:context + row + 1] = 0

    def forward():
        for q, (k, v) in zip(queries, caches):
            torch.ops.draftsmith.attention(q, k, v, mask, 0.125)

    forward()
    start = time.perf_counter()
    for _ in range(repeats):
        forward()
    return (time.perf_counter() - start) / repeats * 1e3


def main(argv: list[str]) -> int:
    load_kernels()
    rows_list, contexts = (1, 4, 8, 16), (256, 2000)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for context in contexts:
            for rows in rows_list:
                results.append({"threads": threads, "context": context, "rows": rows, "ms": forward_ms(context, rows),
                                "gflop": LAYERS * HEADS * rows * context * HEAD_DIM * 4 / 1e9})
    print(f"draftsmith::attention alone, {cpu_model()} ({cpu_isa()}; kernels {kernel_isa()}), {LAYERS} layers, "
          f"ms per forward\n\n| threads | context | " + " | ".join(f"w={r}" for r in rows_list) + " |")
    print("|---|---|" + "---|" * len(rows_list))
    for threads in (1, 2):
        for context in contexts:
            cells = [f"{r['ms']:.1f}" for r in results if r["threads"] == threads and r["context"] == context]
            print(f"| {threads} | {context} | " + " | ".join(cells) + " |")
    if argv:
        with open(argv[0], "w") as f:
            json.dump({"cpu": cpu_model(), "isa": cpu_isa(), "kernels": kernel_isa(), "results": results}, f, indent=1)
        print(f"wrote {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
