"""In-process A/B of how a greedy verify reads the greedy head: every row in one pass (`together`) against each row of
the accepted path in a pass of its own, asked for as the walk goes (`apart`: models.engine.GreedyRows, the default
where GreedyHead.rows_apart). SmolLM2-135M-Instruct float32 on the compiled engine, plain decoding and the bundled
drafter with int8 weights as the goal bench runs it (its chain of 3 and its dynamic tree) and the goal cells' best
method (lookup, else the DFlash tree: BEST), MT-Bench first turns, 128 new tokens; per prompt both arms in
alternating order, each arm's speedup over its own plain. Same tokens in every arm and method (checked). The float32
target only: a bf16 target reads the model's head. (A third arm, each pass with the row of its first drafted child,
is in the history: commit 5dac9b4.)
    scripts/jobs/quiet.sh python scripts/jobs/greedy_rows_ab.py [float32] [prompts] [output.json]
"""
import sys

import torch
from ab_arguments import (GOAL_TREE, alternating_rates, float32_arguments, float32_targets, method_drafter,
                          write_result)

from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.dgf import load_dgf_drafter
from draftsmith.eval.prompts import load_prompts
from draftsmith.models.bundled import bundled_drafter
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import GreedyHead, WeightPrecision

ARMS = ("together", "apart")
METHODS = ("chain", "tree", "best")


def set_arm(arm: str) -> None:
    GreedyHead.rows_apart = property(lambda self: arm == "apart")


@torch.inference_mode()
def main(argv: list[str]) -> None:
    count, output = float32_arguments(argv, "greedy_rows_ab.py",
                                      "the greedy head serves float32 targets: run with float32")
    base, target = float32_targets()
    int8 = CompileSettings(weights=WeightPrecision.INT8)
    path = bundled_drafter("smollm2-135m-instruct")
    config = DecodeConfig(max_new_tokens=128)
    decoders = {"plain": SpeculativeDecoder(target, None, config),
                "chain": SpeculativeDecoder(target, load_dgf_drafter(path, target, backend=Backend.COMPILED,
                                                                     settings=int8), config),
                "tree": SpeculativeDecoder(target, load_dgf_drafter(path, target, backend=Backend.COMPILED,
                                                                    settings=int8, **GOAL_TREE), config),
                "best": SpeculativeDecoder(target, method_drafter(base), config)}
    prompts = [p["input_ids"] for p in load_prompts("mt-bench", count, 0, base.tokenizer)]
    rate = alternating_rates(prompts, ARMS, set_arm, decoders)
    speedup = {f"{arm} {method}": rate[arm, method] / rate[arm, "plain"]
               for arm in ARMS for method in METHODS}
    print(f"float32, {count} MT-Bench first turns, tokens/s (same tokens in every arm and method):")
    for arm in ARMS:
        print(f"  {arm}: plain {rate[arm, 'plain']:.2f}, " + ", ".join(
            f"{method} {rate[arm, method]:.2f} ({speedup[f'{arm} {method}']:.3f}x)" for method in METHODS))
    write_result(output, count, rate, speedup=speedup)


if __name__ == "__main__":
    main(sys.argv[1:])
