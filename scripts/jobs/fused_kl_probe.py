"""What the distillation loss against a full teacher costs, fused (train.losses.FusedForwardKL: one chunked pass
with its gradient) against the generic path (log-softmaxes, the divergence, autograd's backward), forward and
backward together, at a SmolLM2 student batch's size (2,000 rows x 49,152 logits), the student's logits in float32
and bfloat16 (as under bf16 autocast), interleaved, 7 calls each after a warm-up, median and minimum. Prints a table;
writes JSON where an output path is given.
    scripts/jobs/quiet.sh python scripts/jobs/fused_kl_probe.py [output.json]
"""
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from draftsmith.train.losses import FusedForwardKL, divergence_from_logprobs

ROWS, VOCAB, CALLS = 2000, 49152, 7


def generic(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    log_q = F.log_softmax(student.float(), dim=-1)
    log_p = F.log_softmax(teacher.float(), dim=-1)
    return divergence_from_logprobs(log_p, log_q, "fkl")


def fused(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    return FusedForwardKL.apply(student, teacher, 1.0)


def seconds(loss_of, student: torch.Tensor, teacher: torch.Tensor) -> float:
    leaf = student.detach().requires_grad_(True)
    start = time.perf_counter()
    loss_of(leaf, teacher).mean().backward()
    return time.perf_counter() - start


def main() -> None:
    torch.set_num_threads(2)
    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(ROWS, VOCAB, generator=generator) * 3
    students = {dtype: (teacher + torch.randn(ROWS, VOCAB, generator=generator)).to(dtype)
                for dtype in (torch.float32, torch.bfloat16)}
    paths = {"generic": generic, "fused": fused}
    times = {(path, dtype): [] for path in paths for dtype in students}
    for call in range(CALLS + 1):
        for path, dtype in times:
            elapsed = seconds(paths[path], students[dtype], teacher)
            if call:
                times[path, dtype].append(elapsed)
    rows = [{"path": path, "student_dtype": str(dtype).removeprefix("torch."),
             "median_ms": 1e3 * statistics.median(values), "min_ms": 1e3 * min(values)}
            for (path, dtype), values in times.items()]
    print(f"forward KL, {ROWS} x {VOCAB} logits, forward + backward, {torch.get_num_threads()} threads")
    print("| path | student logits | median ms | min ms |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['path']} | {row['student_dtype']} | {row['median_ms']:.0f} | {row['min_ms']:.0f} |")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as out:
            json.dump({"rows": ROWS, "vocab": VOCAB, "calls": CALLS, "threads": torch.get_num_threads(),
                       "results": rows}, out, indent=1)


if __name__ == "__main__":
    main()
