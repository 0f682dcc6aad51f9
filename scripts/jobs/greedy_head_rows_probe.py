"""What SmolLM2-135M-Instruct's greedy head (models.kernels.GreedyHead, as the compiled float32 engine places it)
costs at 1-16 rows from each of its copies (int8 rows; bf16 rows where the CPU has a bf16 dot product; int8 rows in
pairs and in quads on AMX tiles), cold as in the decode loop (a 640 MB read before each call evicts it, as the decoder
layers' stream does; more than the largest L3 these machines report, the Xeon's 300 MB), on final hidden states of a
real prompt; widths and copies interleaved, 60 calls each, median and 10th percentile. Says whether the rows cost
less apart (GreedyHead.rows_apart, read by a greedy verify: models.engine.GreedyRows) and from how many rows the wide
copies cost less (GREEDY_WIDE). Prints a table; writes JSON where an output path is given.
    scripts/jobs/quiet.sh python scripts/jobs/greedy_head_rows_probe.py [output.json]
"""
import json
import statistics
import sys
import time

import torch

from draftsmith.eval.documents import cpu_model
from draftsmith.eval.prompts import load_prompts
from draftsmith.models.compiled import placed_greedy_head
from draftsmith.models.kernels import WideCopy, kernel_isa, quantize_int8, wide_copy
from draftsmith.models.target import TargetModel

WIDE_COPIES = {"avx512_bf16": (WideCopy.BF16,),
               "avx512_amx": (WideCopy.BF16, WideCopy.INT8_PAIRS, WideCopy.INT8_QUADS)}
WIDTHS, CALLS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 16), 60


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(2)
    base = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=torch.float32)
    head = placed_greedy_head(base.model.get_output_embeddings())
    ids = load_prompts("mt-bench", 1, 0, base.tokenizer)[0]["input_ids"]
    final = base.model(ids, output_hidden_states=True).hidden_states[-1][0]  # after the final norm: the head's input
    evict = torch.ones(160 * 1024 * 1024)
    quantized = quantize_int8(head.weight)[0]
    copies = {"int8": head.packed} | {str(wide): wide_copy(wide, head.weight, quantized) for wide in WIDE_COPIES.get(
        kernel_isa(), ())}
    times = {(name, width): [] for name in copies for width in WIDTHS}
    for call in range(CALLS):
        for name, width in times:
            evict.sum()
            rows = final[10 + call % 20:10 + call % 20 + width][None].contiguous()
            start = time.perf_counter()
            torch.ops.draftsmith.greedy_head(rows, copies[name], head.scale, head.weight)
            times[name, width].append(time.perf_counter() - start)
    print(f"{cpu_model()}: the greedy head, cold (rows_apart: {head.rows_apart}, "
          f"wide copy from {head.wide_from_rows} rows)")
    table = {f"{name} {width}": {"median_ms": 1000 * statistics.median(seconds),
                                  "p10_ms": 1000 * sorted(seconds)[CALLS // 10]}
             for (name, width), seconds in times.items()}
    for key, row in table.items():
        print(f"  {key} rows: median {row['median_ms']:.2f} ms, 10th percentile {row['p10_ms']:.2f} ms")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as file:
            json.dump({"cpu": cpu_model(), "wide_from_rows": head.wide_from_rows, "rows_apart": head.rows_apart,
                       "calls": CALLS, "cold_ms": table}, file, indent=1)


if __name__ == "__main__":
    main()
