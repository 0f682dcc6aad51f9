"""What SmolLM2-135M-Instruct's greedy head (models.kernels.GreedyHead, as the compiled float32 engine places it)
costs at 1-8 rows, cold as in the decode loop (a 256 MB read before each call evicts it, as the decoder layers'
stream does), on final hidden states of a real prompt; widths interleaved, 60 calls each, median and 10th percentile.
Says whether the rows cost less apart (GreedyHead.rows_apart, read by a greedy verify: models.engine.GreedyRows).
    scripts/jobs/quiet.sh python scripts/jobs/greedy_head_rows_probe.py
"""
import statistics
import time

import torch

from draftsmith.eval.documents import cpu_model
from draftsmith.eval.prompts import load_prompts
from draftsmith.models.compiled import placed_greedy_head
from draftsmith.models.target import TargetModel

WIDTHS, CALLS = (1, 2, 3, 4, 6, 8), 60


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(2)
    base = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=torch.float32)
    head = placed_greedy_head(base.model)
    ids = load_prompts("mt-bench", 1, 0, base.tokenizer)[0]["input_ids"]
    final = base.model(ids, output_hidden_states=True).hidden_states[-1][0]  # after the final norm: the head's input
    evict = torch.ones(64 * 1024 * 1024)
    times = {width: [] for width in WIDTHS}
    for call in range(CALLS):
        for width in WIDTHS:
            evict.sum()
            rows = final[10 + call % 20:10 + call % 20 + width][None].contiguous()
            start = time.perf_counter()
            head(rows)
            times[width].append(time.perf_counter() - start)
    print(f"{cpu_model()}: the greedy head, cold (rows_apart: {head.rows_apart})")
    for width, seconds in times.items():
        print(f"  {width} rows: median {1000 * statistics.median(seconds):.2f} ms, "
              f"10th percentile {1000 * sorted(seconds)[CALLS // 10]:.2f} ms")


if __name__ == "__main__":
    main()
