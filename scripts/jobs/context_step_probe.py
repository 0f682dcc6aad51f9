"""The long-context goal measured in one process: the compiled target's forward of w new tokens over 256 and over
2,000 cached tokens (MT-Bench's first prompt repeated), the two caches in one engine of one capacity, the contexts and
widths interleaved round after round (this VM's rate moves by the minute, so two runs apart are not compared);
medians, and T(1) over 2,000 tokens against T(1) over 256 (the goal: <= 1.2).
    scripts/jobs/quiet.sh python scripts/jobs/context_step_probe.py [output.json]   (a markdown table beside it; an
    existing output is refused)
"""
import statistics
import sys

import torch
from ab_arguments import probe_output

from draftsmith.eval.documents import cpu_model, write_document
from draftsmith.eval.latency import interleaved_seconds, mt_bench_context, time_forward
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import kernel_isa
from draftsmith.models.target import TargetModel

TARGET, CONTEXTS, WIDTHS, CAPACITY = "smollm2-135m-instruct", (256, 2000), (1, 4, 8), 2176
ROUNDS, WARMUP = 20, 2


@torch.inference_mode()
def measure() -> dict:
    """(context, width) -> seconds of each timed forward."""
    base = TargetModel.from_pretrained(TARGET)
    target = base.with_backend(Backend.COMPILED, CompileSettings(capacity=CAPACITY))
    target.prepare(WIDTHS)
    caches = {}
    for context in CONTEXTS:
        cache = target.new_cache(context + max(WIDTHS))
        target.forward(mt_bench_context(base.tokenizer, context), cache)
        caches[context] = (cache, target.cache_length(cache))
    generator = torch.Generator().manual_seed(0)
    keys = [(context, width) for context in CONTEXTS for width in WIDTHS]
    return interleaved_seconds(lambda key: time_forward(target, *caches[key[0]], key[1], generator), keys, ROUNDS,
                               WARMUP)


def main(argv: list[str]) -> None:
    output = probe_output(argv)  # refused before the minutes of timing
    torch.set_num_threads(2)
    seconds = measure()
    ms = {key: statistics.median(values) * 1e3 for key, values in seconds.items()}
    ratio = ms[(CONTEXTS[1], 1)] / ms[(CONTEXTS[0], 1)]
    lines = [f"The greedy forward of {TARGET} (compiled, float32, capacity {CAPACITY}) on {cpu_model()} (kernels "
             f"{kernel_isa()}, 2 threads), contexts and widths interleaved, median of {ROUNDS}", "",
             "| cached tokens | " + " | ".join(f"T({w}) ms" for w in WIDTHS) + " |", "|---|" + "---|" * len(WIDTHS)]
    for context in CONTEXTS:
        lines.append(f"| {context} | " + " | ".join(f"{ms[(context, w)]:.1f}" for w in WIDTHS) + " |")
    lines += ["", f"T(1) over {CONTEXTS[1]} tokens / over {CONTEXTS[0]}: **{ratio:.3f}** (goal <= 1.2)"]
    document = {"cpu": cpu_model(), "kernel_isa": kernel_isa(), "target": TARGET, "capacity": CAPACITY,
                "ms": {f"{context}/{width}": value for (context, width), value in ms.items()},
                "seconds": {f"{context}/{width}": values for (context, width), values in seconds.items()},
                "t1_ratio": ratio}
    write_document(output, document, "\n".join(lines))


if __name__ == "__main__":
    main(sys.argv)
