"""What a decode loop's small torch ops cost right after a forward has streamed its weights past the caches: the ops a
draft tree's level ran (log_softmax, topk, logsumexp over a drafter's logits, a small tensor), each timed alone, in
order, after a 100 MB read on the torch threads, against the same sequence repeated at once (warm); and
draftsmith::top_log_probs, which gives the first three in one call, after the same read. Medians of ROUNDS.
    scripts/jobs/quiet.sh python scripts/jobs/cold_ops_probe.py [output.json]   (a markdown table beside it; an
    existing output is refused)
"""
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from ab_arguments import new_output

from draftsmith.eval.documents import cpu_model, write_document
from draftsmith.models.kernels import kernel_isa, load_kernels, top_log_probs

ROUNDS, STREAM_FLOATS, VOCAB, CANDIDATES = 200, 25 << 20, 8192, 10


def sequences() -> dict[str, list[tuple[str, Callable[[], object]]]]:
    """The two ways a tree's level gets its candidates: torch's three ops (and a small tensor after), or one call."""
    logits = torch.randn(2, VOCAB)
    holder = {}

    def log_softmax():
        holder["logp"] = torch.log_softmax(logits, -1)

    def topk():
        holder["top"] = torch.topk(holder["logp"], CANDIDATES, dim=-1)

    torch_ops = [("log_softmax", log_softmax), ("topk", topk),
                 ("logsumexp", lambda: torch.logsumexp(holder["top"].values, -1)),
                 ("tensor", lambda: torch.tensor([[1, 2]]))]
    one_call = [("top_log_probs", lambda: top_log_probs(logits, CANDIDATES)),
                ("tensor", lambda: torch.tensor([[1, 2]]))]
    return {"torch ops": torch_ops, "one call": one_call}


def measure() -> dict[tuple[str, str, int], list[float]]:
    """((sequence, state, op index) -> seconds), states 'after the read' and 'warm', interleaved round by round."""
    weights = torch.randn(STREAM_FLOATS)
    seconds: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(ROUNDS):
        for name, ops in sequences().items():
            for state in ("after the read", "warm"):
                if state == "after the read":
                    weights.sum()
                else:
                    for _, op in ops:
                        op()
                for index, (_, op) in enumerate(ops):
                    start = time.perf_counter()
                    op()
                    seconds.setdefault((name, state, index), []).append(time.perf_counter() - start)
    return seconds


def main(argv: list[str]) -> None:
    output = new_output(argv[0] if argv else None)
    torch.set_num_threads(2)
    load_kernels()
    seconds = measure()
    us = {key: 1e6 * statistics.median(values) for key, values in seconds.items()}
    lines = [f"Small ops after a {STREAM_FLOATS * 4 >> 20} MB read on {cpu_model()} (kernels {kernel_isa()}, 2 "
             f"threads), each alone, in order, median us of {ROUNDS}; warm: the same sequence run just before", "",
             "| sequence | op | after the read | warm |", "|---|---|---|---|"]
    for name, ops in sequences().items():
        for index, (op, _) in enumerate(ops):
            cold, warm = us[(name, "after the read", index)], us[(name, "warm", index)]
            lines.append(f"| {name} | {op} | {cold:.1f} | {warm:.1f} |")
        totals = [sum(us[(name, state, i)] for i in range(len(ops))) for state in ("after the read", "warm")]
        lines.append(f"| {name} | **all** | **{totals[0]:.1f}** | {totals[1]:.1f} |")
    document = {"cpu": cpu_model(), "kernel_isa": kernel_isa(), "rounds": ROUNDS,
                "us": {f"{n}/{s}/{i}": value for (n, s, i), value in us.items()}}
    write_document(Path(output) if output else None, document, "\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
