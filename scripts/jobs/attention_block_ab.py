"""In-process A/B of attention's key blocks for rows that see more than 512 keys (the kernels' run-time
set_attention_long_block): 512 keys a block (today's), against smaller blocks whose values are still in L1 when
they are weighed. The compiled SmolLM2-135M-Instruct float32
forward of w new tokens over 256 and over 2,000 cached tokens (MT-Bench's first prompt repeated; one engine of one
capacity, as scripts/jobs/context_step_probe.py), arms, contexts and widths interleaved round after round; medians,
each arm's T(1) over 2,000 tokens against over 256 (the goal: <= 1.2), and whether both arms' logits are the same bits.
    scripts/jobs/quiet.sh python scripts/jobs/attention_block_ab.py [output.json]   (a markdown table beside it; an
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
import contextlib

from draftsmith.models.kernels import kernel_isa, load_kernels
from draftsmith.models.target import TargetModel

TARGET, CONTEXTS, WIDTHS, CAPACITY = "smollm2-135m-instruct", (256, 2000), (1, 4, 8), 2176
ARMS, ROUNDS, WARMUP = (512, 256, 128, 64), 20, 2


def label(arm: int) -> str:
    return f"blocks of {arm} keys"


@contextlib.contextmanager
def attention_keys_ahead(keys: int):
    module = load_kernels()
    previous = module.set_attention_long_block(keys)
    try:
        yield
    finally:
        module.set_attention_long_block(previous)


@torch.inference_mode()
def measure() -> tuple[dict, bool]:
    """((arm, context, width) -> seconds of each timed forward, both arms' logits the same bits)."""
    base = TargetModel.from_pretrained(TARGET)
    target = base.with_backend(Backend.COMPILED, CompileSettings(capacity=CAPACITY))
    target.prepare(WIDTHS)
    caches = {}
    for context in CONTEXTS:
        cache = target.new_cache(context + max(WIDTHS))
        target.forward(mt_bench_context(base.tokenizer, context), cache)
        caches[context] = (cache, target.cache_length(cache))
    probe = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(1))
    logits = []
    for arm in ARMS:
        with attention_keys_ahead(arm):
            logits.append(target.forward(probe, caches[CONTEXTS[1]][0]).logits)
        target.truncate(*caches[CONTEXTS[1]])
    generator = torch.Generator().manual_seed(0)

    def seconds_of(key: tuple) -> float:
        arm, context, width = key
        with attention_keys_ahead(arm):
            return time_forward(target, *caches[context], width, generator)

    keys = [(arm, context, width) for context in CONTEXTS for width in WIDTHS for arm in ARMS]
    return interleaved_seconds(seconds_of, keys, ROUNDS, WARMUP), max((x - logits[0]).abs().max().item() for x in logits)


def main(argv: list[str]) -> None:
    output = probe_output(argv)  # refused before the minutes of timing
    torch.set_num_threads(2)
    seconds, same = measure()
    ms = {key: statistics.median(values) * 1e3 for key, values in seconds.items()}
    ratios = {arm: ms[(arm, CONTEXTS[1], 1)] / ms[(arm, CONTEXTS[0], 1)] for arm in ARMS}
    lines = [f"The greedy forward of {TARGET} (compiled, float32, capacity {CAPACITY}) on {cpu_model()} (kernels "
             f"{kernel_isa()}, 2 threads), arms, contexts and widths interleaved, median of {ROUNDS}; logits of a "
             f"forward of 8 over {CONTEXTS[1]} tokens, largest difference from the first arm's: {same}", "",
             "| attention | cached tokens | " + " | ".join(f"T({w}) ms" for w in WIDTHS) + " | T(1) / T(1) over "
             f"{CONTEXTS[0]} |", "|---|---|" + "---|" * (len(WIDTHS) + 1)]
    for arm in ARMS:
        for context in CONTEXTS:
            ratio = ms[(arm, context, 1)] / ms[(arm, CONTEXTS[0], 1)]
            lines.append(f"| {label(arm)} | {context} | " + " | ".join(f"{ms[(arm, context, w)]:.2f}" for w in WIDTHS)
                         + f" | {ratio:.3f} |")
    lines += ["", "T(1) over 2,000 tokens / over 256 (goal <= 1.2): "
              + ", ".join(f"{label(arm)} **{ratios[arm]:.3f}**" for arm in ARMS)]
    document = {"cpu": cpu_model(), "kernel_isa": kernel_isa(), "target": TARGET, "capacity": CAPACITY,
                "same_logits": same, "t1_ratio": {label(arm): ratios[arm] for arm in ARMS},
                "ms": {f"{label(a)}/{c}/{w}": value for (a, c, w), value in ms.items()},
                "seconds": {f"{label(a)}/{c}/{w}": values for (a, c, w), values in seconds.items()}}
    write_document(output, document, "\n".join(lines))


if __name__ == "__main__":
    main(sys.argv)
