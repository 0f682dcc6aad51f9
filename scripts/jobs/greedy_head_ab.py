"""In-process A/B of the target's LM head in greedy decoding: the model's head (every logit from the float32 or
bfloat16 weights) against the greedy head (models.kernels.GreedyHead: an int8 copy streamed, the logits that could be
the largest recomputed exactly). SmolLM2-135M-Instruct on the compiled engine; plain decoding, the bundled drafter's
chain of 3 and its dynamic tree; MT-Bench first turns, 128 new tokens; per prompt both arms in alternating order, each
arm's speedups over its own plain. Within each arm every method's tokens equal its plain's (checked); across the arms
the tokens differ only where two logits are closer than float32's rounding (counted).
    scripts/jobs/quiet.sh python scripts/jobs/greedy_head_ab.py [float32 | bfloat16] [prompts] [output.json]
"""
import json
import sys
import time

import torch
from ab_arguments import DTYPES, GOAL_TREE, ab_arguments

from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.dgf import load_dgf_drafter
from draftsmith.eval.documents import cpu_model
from draftsmith.eval.prompts import load_prompts
from draftsmith.models.bundled import bundled_drafter
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import HeadLogits
from draftsmith.models.target import TargetModel

ARMS = ("model head", "greedy head")


def decoders(target, drafters) -> dict:
    config = DecodeConfig(max_new_tokens=128)
    return {"plain": SpeculativeDecoder(target, None, config),
            **{name: SpeculativeDecoder(target, drafter, config) for name, drafter in drafters.items()}}


@torch.inference_mode()
def main(argv: list[str]) -> None:
    name, count, output = ab_arguments(argv, "greedy_head_ab.py")
    torch.set_num_threads(2)
    base = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=DTYPES[name])
    target = base.with_backend(Backend.COMPILED, CompileSettings(head=HeadLogits.GREEDY))  # (bf16's default: model)
    greedy_head = target.engine.greedy_head
    bundled = bundled_drafter("smollm2-135m-instruct")
    drafters = {"chain": load_dgf_drafter(bundled, target, backend=Backend.COMPILED, settings=CompileSettings()),
                "tree": load_dgf_drafter(bundled, target, backend=Backend.COMPILED, settings=CompileSettings(),
                                         **GOAL_TREE)}
    methods = decoders(target, drafters)
    prompts = [p["input_ids"] for p in load_prompts("mt-bench", count, 0, base.tokenizer)]
    for decoder in methods.values():
        decoder.generate(prompts[0])  # warm-up: loads every package
    seconds = {(arm, method): 0.0 for arm in ARMS for method in methods}
    tokens, differing = dict.fromkeys(seconds, 0), 0
    rounds, emitted, verify_s = dict.fromkeys(seconds, 0), dict.fromkeys(seconds, 0), dict.fromkeys(seconds, 0.0)
    for index, ids in enumerate(prompts):
        outputs = {}
        for arm in ARMS if index % 2 == 0 else ARMS[::-1]:
            target.engine.greedy_head = greedy_head if arm == "greedy head" else None
            for method, decoder in methods.items():
                start = time.perf_counter()
                result = decoder.generate(ids)
                seconds[arm, method] += time.perf_counter() - start
                outputs[arm, method] = result.tokens
                tokens[arm, method] += len(result.tokens)
                rounds[arm, method] += result.stats.verify_forwards
                emitted[arm, method] += result.stats.round_tokens
                verify_s[arm, method] += result.stats.verify_s
            assert len({tuple(outputs[arm, m]) for m in methods}) == 1, f"prompt {index}, {arm}: a method left plain"
        differing += outputs[ARMS[0], "plain"] != outputs[ARMS[1], "plain"]
    rate = {key: tokens[key] / seconds[key] for key in seconds}
    tau = {key: emitted[key] / max(rounds[key], 1) for key in seconds}
    verify_ms = {key: 1e3 * verify_s[key] / max(rounds[key], 1) for key in seconds}
    result = {"machine": cpu_model(), "dtype": name, "prompts": count, "tree": GOAL_TREE,
              "tokens_per_s": {f"{a} {m}": r for (a, m), r in rate.items()},
              "tau": {f"{a} {m}": r for (a, m), r in tau.items()},
              "verify_ms_per_round": {f"{a} {m}": r for (a, m), r in verify_ms.items()},
              "speedup": {f"{a} {m}": rate[a, m] / rate[a, "plain"] for a in ARMS for m in methods if m != "plain"},
              "prompts_whose_plain_tokens_differ_between_arms": differing}
    print(f"{name}, {count} MT-Bench first turns, tokens/s (each arm lossless against its own plain; "
          f"{differing} of {count} prompts' plain tokens differ between the arms):")
    for arm in ARMS:
        print(f"  {arm}: " + ", ".join(f"{m} {rate[arm, m]:.2f}" + ("" if m == "plain" else
                                        f" ({rate[arm, m] / rate[arm, 'plain']:.3f}x, tau {tau[arm, m]:.2f})")
                                        + f" [verify {verify_ms[arm, m]:.1f} ms]" for m in methods))
    if output:
        with open(output, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
