"""In-process A/B of the greedy tokens' argmax: torch's (`x.argmax(-1)`, element by element) against the kernels'
draftsmith::argmax (models.kernels.argmax_last: the same indices), wherever the decode loop reads a greedy token from
logits (the verify's rows, the prefill's first token, a drafter's greedy chain). SmolLM2-135M-Instruct float32 on
the compiled engine, plain decoding and the bundled drafter with int8 weights as its dynamic tree, MT-Bench first
turns, 128 new tokens; per prompt both arms in alternating order, each arm's speedup over its own plain, and each arm's
argmax calls timed apart (microseconds a call, in the loop). Same tokens in every arm and method (checked).
    scripts/jobs/quiet.sh python scripts/jobs/argmax_ab.py [float32] [prompts] [output.json]
"""
import sys
import time
from collections import Counter

import torch
from ab_arguments import alternating_rates, float32_arguments, int8_tree_decoders, write_result

from draftsmith.eval.decode import decoder as decoder_module
from draftsmith.eval.decode import verify
from draftsmith.models import compiled, dgf, engine, kernels

READERS = (decoder_module, verify, compiled, dgf, engine)  # the modules that read greedy tokens with argmax_last
ARMS = {"torch argmax": lambda x: x.argmax(-1), "draftsmith::argmax": kernels.argmax_last}
CALLS, SECONDS = Counter(), Counter()


def timed(arm: str):
    """ARMS[arm], its calls counted and timed."""
    def argmax(x):
        start = time.perf_counter()
        try:
            return ARMS[arm](x)
        finally:
            SECONDS[arm] += time.perf_counter() - start
            CALLS[arm] += 1
    return argmax


@torch.inference_mode()
def main(argv: list[str]) -> None:
    count, output = float32_arguments(argv, "argmax_ab.py", "argmax_ab.py times the float32 target")
    _, decoders, prompts = int8_tree_decoders(count)

    def set_arm(arm: str) -> None:
        for module in READERS:
            module.argmax_last = timed(arm)
    CALLS.clear()
    SECONDS.clear()
    rate = alternating_rates(prompts, tuple(ARMS), set_arm, decoders)
    per_call = {arm: 1e6 * SECONDS[arm] / CALLS[arm] for arm in ARMS}
    speedup = {arm: rate[arm, "tree"] / rate[arm, "plain"] for arm in ARMS}
    print(f"float32, {count} MT-Bench first turns, tokens/s (same tokens in every arm and method):")
    for arm in ARMS:
        print(f"  {arm}: plain {rate[arm, 'plain']:.2f}, int8 tree {rate[arm, 'tree']:.2f} ({speedup[arm]:.3f}x); "
              f"{CALLS[arm]} calls, {per_call[arm]:.1f} us a call")
    write_result(output, count, rate, speedup=speedup, us_per_call=per_call, calls=dict(CALLS))


if __name__ == "__main__":
    main(sys.argv[1:])
