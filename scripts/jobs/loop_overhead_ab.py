"""In-process A/B of the decode loop's bookkeeping: the static masks spelled out (a bool mask, then filled: ~9 ops a
forward) and the drafter's chain grown as a tree (Growth), against the masks cut from a precomputed window and the
chain drafted by causal steps (models/compiled.py static_mask, DGFDrafter._chain). SmolLM2-135M-Instruct on the
compiled engine, the bundled drafter's chain of 3 and plain decoding, MT-Bench first turns, 128 new tokens; per
prompt both arms in alternating order, each arm's speedup over its own plain. Same tokens in both arms (checked).
    scripts/jobs/quiet.sh python scripts/jobs/loop_overhead_ab.py [float32 | bfloat16] [prompts] [output.json]
"""
import sys
import types

import torch
from ab_arguments import DTYPES, ab_arguments, alternating_rates, write_result

from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.dgf import load_dgf_drafter
from draftsmith.eval.prompts import load_prompts
from draftsmith.models.bundled import bundled_drafter
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend, additive_mask
from draftsmith.models.target import TargetModel

ARMS = ("before", "after")


def spelled_out_mask(self, allowed, past, n, bucket):
    """The static mask as it was built before the window: a bool mask of what each row sees, then filled."""
    sees = torch.zeros(bucket, self.capacity, dtype=torch.bool, device=self.device)
    if allowed is None:
        sees[:n, :past + n] = torch.ones(n, past + n, dtype=torch.bool, device=self.device).tril(past)
    else:
        sees[:n, :past + n] = allowed.reshape(n, past + n)
    pad = torch.arange(n, bucket, device=self.device)
    sees[pad, past + pad] = True
    return additive_mask(sees, self.dtype)[None, None]


def set_arm(arm: str, engines, drafter) -> None:
    for engine in engines:
        if arm == "before":
            engine.static_mask = types.MethodType(spelled_out_mask, engine)
        else:
            engine.__dict__.pop("static_mask", None)
    drafter.chain_steps = arm == "after"


@torch.inference_mode()
def main(argv: list[str]) -> None:
    name, count, output = ab_arguments(argv, "loop_overhead_ab.py")
    torch.set_num_threads(2)
    base = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=DTYPES[name])
    target = base.with_backend(Backend.COMPILED, CompileSettings())
    drafter = load_dgf_drafter(bundled_drafter("smollm2-135m-instruct"), target, backend=Backend.COMPILED,
                               settings=CompileSettings())
    config = DecodeConfig(max_new_tokens=128)
    decoders = {"plain": SpeculativeDecoder(target, None, config), "chain": SpeculativeDecoder(target, drafter, config)}
    prompts = [p["input_ids"] for p in load_prompts("mt-bench", count, 0, base.tokenizer)]
    rate = alternating_rates(prompts, ARMS, lambda arm: set_arm(arm, (target.engine, drafter.engine), drafter),
                             decoders)
    chain_speedup = {arm: rate[arm, "chain"] / rate[arm, "plain"] for arm in ARMS}
    print(f"{name}, {count} MT-Bench first turns, tokens/s (same tokens in both arms):")
    for arm in ARMS:
        print(f"  {arm}: plain {rate[arm, 'plain']:.2f}, chain of 3 {rate[arm, 'chain']:.2f} "
              f"({chain_speedup[arm]:.3f}x its plain)")
    write_result(output, count, rate, dtype=name, chain_speedup=chain_speedup)


if __name__ == "__main__":
    main(sys.argv[1:])
