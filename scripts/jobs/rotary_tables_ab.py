"""In-process A/B of the compiled target's rotary cos and sin: read from tables of every cache position
(models.compiled.RotaryTables) against computed inside every layer's rotary kernel (inductor inlines them: the
graph before the tables, built in a scratch cache). SmolLM2-135M-Instruct float32 on the kernels, 256 cached tokens
of an MT-Bench prompt, forwards of 1 / 4 / 8 / 16 new tokens, arms and widths interleaved, medians; and whether the
two arms' logits are the same bits.
    scripts/jobs/quiet.sh python scripts/jobs/rotary_tables_ab.py [output.json]   (a markdown table beside it; an
    existing output is refused)
"""
import statistics
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
from ab_arguments import probe_output

from draftsmith.eval.documents import cpu_model, write_document
from draftsmith.eval.latency import interleaved_seconds, mt_bench_context, time_forward
from draftsmith.models import compiled
from draftsmith.models.compiled import CompiledEngine, CompileSettings
from draftsmith.models.kernels import kernel_isa
from draftsmith.models.target import TargetModel

TARGET, CONTEXT, WIDTHS, ROUNDS, WARMUP = "smollm2-135m-instruct", 256, (1, 4, 8, 16), 30, 3
ARMS = ("computed in each layer", "tables")


@torch.inference_mode()
def measure(scratch: Path) -> tuple[dict, bool]:
    base = TargetModel.from_pretrained(TARGET)
    settings = CompileSettings()
    with mock.patch.object(compiled.RotaryTables, "of", staticmethod(lambda model, capacity: None)):
        before = TargetModel(base.model, base.tokenizer, engine=CompiledEngine(base.model, settings, scratch))
        before.prepare(WIDTHS)
    targets = {ARMS[0]: before, ARMS[1]: base.with_backend(compiled.Backend.COMPILED, settings)}
    targets[ARMS[1]].prepare(WIDTHS)
    context = mt_bench_context(base.tokenizer, CONTEXT)
    caches = {}
    for arm, target in targets.items():
        cache = target.new_cache(CONTEXT + max(WIDTHS))
        target.forward(context, cache)
        caches[arm] = (cache, target.cache_length(cache))
    probe = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(1))
    logits = []
    for arm, target in targets.items():
        logits.append(target.forward(probe, caches[arm][0]).logits)
        target.truncate(caches[arm][0], caches[arm][1])
    generator = torch.Generator().manual_seed(0)
    keys = [(arm, width) for width in WIDTHS for arm in ARMS]
    seconds = interleaved_seconds(lambda key: time_forward(targets[key[0]], *caches[key[0]], key[1], generator), keys,
                                  ROUNDS, WARMUP)
    return seconds, torch.equal(*logits)


def main(argv: list[str]) -> None:
    output = probe_output(argv)  # refused before the minutes of building and timing
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as scratch:
        seconds, same = measure(Path(scratch))
    ms = {key: statistics.median(values) * 1e3 for key, values in seconds.items()}
    lines = [f"The greedy forward of {TARGET} (compiled, float32) on {cpu_model()} (kernels {kernel_isa()}, 2 threads) "
             f"over {CONTEXT} cached tokens, the rotary's cos and sin two ways, arms and widths interleaved, median of "
             f"{ROUNDS}; logits of a forward of 8 the same bits in both: {same}", "",
             "| cos and sin | " + " | ".join(f"T({w}) ms" for w in WIDTHS) + " |", "|---|" + "---|" * len(WIDTHS)]
    for arm in ARMS:
        lines.append(f"| {arm} | " + " | ".join(f"{ms[(arm, w)]:.2f}" for w in WIDTHS) + " |")
    document = {"cpu": cpu_model(), "kernel_isa": kernel_isa(), "target": TARGET, "context": CONTEXT,
                "same_logits": same, "ms": {f"{arm}/{width}": value for (arm, width), value in ms.items()},
                "seconds": {f"{arm}/{width}": values for (arm, width), values in seconds.items()}}
    write_document(output, document, "\n".join(lines))


if __name__ == "__main__":
    main(sys.argv)
