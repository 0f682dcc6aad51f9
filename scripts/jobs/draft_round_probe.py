"""Where a speculative round's time goes outside the two models' compiled packages: the bundled drafter's chain of 3
(or its dynamic tree) decoding SmolLM2-135M-Instruct on the compiled engine, with every package call, every mask
build and the drafter's observe timed apart (in-process wrappers, nothing else changed). Reports per round: the
drafter's time in propose (its package calls, its masks, the rest: Python and small tensor ops), observe, and the
verify (the target's package call, its mask, the rest: the LM head, verification, commit).
    scripts/jobs/quiet.sh python scripts/jobs/draft_round_probe.py [float32 | bfloat16 | int8] [chain | tree | SPEC] \
      [prompts]
int8: the float32 target, the drafter with weight-only int8 weights (the goal bench's `dgf:weights=int8`). SPEC: an
LM drafter's or a DFlash drafter's bench method instead of the bundled drafter (an `lm-chain:...` or `dflash:...` spec,
built as the bench builds it: a distilled student's round split the same way; a DFlash round's block graph counted in
the draft, its context graph in observe), the target in the first argument's dtype.
"""
import sys
import time
from collections import defaultdict

import torch
from ab_arguments import GOAL_TREE, method_drafter

from draftsmith.eval.decode.decoder import DecodeConfig, Generation, SpeculativeDecoder
from draftsmith.eval.decode.drafters.dgf import load_dgf_drafter
from draftsmith.eval.decode.drafters.lm import LMDrafter
from draftsmith.eval.prompts import load_prompts
from draftsmith.models.bundled import bundled_drafter
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.compiled_dflash import CompiledDFlashEngine
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import WeightPrecision
from draftsmith.models.target import TargetModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.float32}
DRAFT_WEIGHTS = {"int8": WeightPrecision.INT8}  # the rest: the model's own
SHAPES = {"chain": {}, "tree": GOAL_TREE}
TOTALS: dict[str, float] = defaultdict(float)
CALLS: dict[str, int] = defaultdict(int)
INSIDE: set[str] = set()  # the timed calls under way: the target's parts count inside a verify only (not the prefill)


def timed(name: str, function, within: str | None = None):
    def wrapper(*args, **kwargs):
        INSIDE.add(name)
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            INSIDE.discard(name)
            if within is None or within in INSIDE:
                TOTALS[name] += time.perf_counter() - start
                CALLS[name] += 1
    return wrapper


def instrument(engine, label: str, within: str) -> None:
    """Time `engine`'s package calls and mask builds under `label`, inside `within` (its runners are loaded by then)."""
    for graph, runner in list(engine.runners.items()):  # each package call counted in all and in its graph's own
        engine.runners[graph] = timed(f"{label} package", timed(f"{label} package {graph.name}", runner, within),
                                      within)
    engine.static_mask = timed(f"{label} mask", engine.static_mask, within)


def instrument_dflash(engine: CompiledDFlashEngine) -> None:
    """Time a DFlash drafter's block graph inside its propose and its context graph inside its observe."""
    for graph, runner in list(engine.block.runners.items()):
        engine.block.runners[graph] = timed("draft package", timed("draft package block", runner, "draft all"),
                                            "draft all")
    for graph, runner in list(engine.context.runners.items()):
        engine.context.runners[graph] = timed("observe package", runner, "observe all")


def bundled_chain_or_tree(target: TargetModel, precision: str, shape_name: str):
    """The bundled feature drafter as a chain of 3 or its goal-bench tree, its weights as `precision` says."""
    settings = CompileSettings(weights=DRAFT_WEIGHTS.get(precision, WeightPrecision.MODEL))
    return load_dgf_drafter(bundled_drafter("smollm2-135m-instruct"), target, backend=Backend.COMPILED,
                            settings=settings, **SHAPES[shape_name])


def report(what: str, rounds: int, tokens: int) -> None:
    """Per round: the draft's parts, its package calls (by graph), observe and the verify's parts."""
    per_round = defaultdict(float, {name: 1000 * seconds / rounds for name, seconds in TOTALS.items()})
    print(f"{what}: {rounds} rounds, {tokens / rounds:.2f} tokens a round")
    draft_rest = per_round["draft all"] - sum(per_round[f"draft {part}"] for part in ("package", "head", "mask"))
    print(f"  draft:  {per_round['draft all']:.3f} ms a round = package {per_round['draft package']:.3f} + head "
          f"{per_round['draft head']:.3f} + mask {per_round['draft mask']:.3f} + rest {draft_rest:.3f}")
    print(f"  draft package calls: {CALLS['draft package'] / rounds:.2f} a round, "
          f"{1000 * TOTALS['draft package'] / max(CALLS['draft package'], 1):.3f} ms a call")
    for name in sorted(CALLS):
        if name.startswith("draft package "):
            print(f"    {name.removeprefix('draft package ')}: {CALLS[name] / rounds:.2f} calls a round, "
                  f"{1000 * TOTALS[name] / CALLS[name]:.3f} ms a call")
    print(f"  observe: {per_round['observe all']:.3f} ms a round = package {per_round['observe package']:.3f} "
          f"({CALLS['observe package'] / rounds:.2f} calls a round) + rest "
          f"{per_round['observe all'] - per_round['observe package']:.3f}")
    parts = ("package", "head", "mask", "commit")
    rest = per_round["verify all"] - sum(per_round[f"verify {part}"] for part in parts)
    print(f"  verify: {per_round['verify all']:.3f} ms a round = "
          + " + ".join(f"{part} {per_round[f'verify {part}']:.3f}" for part in parts) + f" + rest {rest:.3f}")


@torch.inference_mode()
def main(argv: list[str]) -> None:
    if len(argv) > 3 or (argv and argv[0] not in DTYPES) or (len(argv) > 2 and not argv[2].isdigit()):
        sys.exit(f"usage: python scripts/jobs/draft_round_probe.py [{' | '.join(DTYPES)}] [{' | '.join(SHAPES)} | "
                 "SPEC] [prompts]")
    precision, shape_name = argv[0] if argv else "float32", argv[1] if len(argv) > 1 else "chain"
    count = int(argv[2]) if len(argv) > 2 else 6
    torch.set_num_threads(2)
    base = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=DTYPES[precision])
    target = base.with_backend(Backend.COMPILED, CompileSettings())
    drafter = (bundled_chain_or_tree(target, precision, shape_name) if shape_name in SHAPES
               else method_drafter(base, shape_name))
    decoder = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=128))
    prompts = [p["input_ids"] for p in load_prompts("mt-bench", count, 0, base.tokenizer)]
    decoder.generate(prompts[0])  # warm-up: loads every package the rounds use
    instrument(target.engine, "verify", "verify all")
    draft_engine = drafter.lm.engine if isinstance(drafter, LMDrafter) else drafter.engine
    if isinstance(draft_engine, CompiledDFlashEngine):
        instrument_dflash(draft_engine)
    else:
        instrument(draft_engine, "draft", "draft all")
    if isinstance(drafter, LMDrafter):  # an LM drafter's head runs after its package, as the target's
        draft_engine.head = timed("draft head", draft_engine.head, "draft all")
    drafter.propose = timed("draft all", drafter.propose)
    drafter.observe = timed("observe all", drafter.observe)
    target.commit = timed("verify commit", target.commit)
    target.engine.head = timed("verify head", target.engine.head, "verify all")
    greedy_head = target.engine.greedy_head
    if greedy_head is not None:  # a float32 target's greedy forwards read it (all rows, or the path's row by row)
        greedy_head.forward = timed("verify head", greedy_head.forward, "verify all")
    Generation.verify = timed("verify all", Generation.verify)
    rounds = tokens = 0
    TOTALS.clear()
    CALLS.clear()
    for ids in prompts:
        stats = decoder.generate(ids).stats
        rounds, tokens = rounds + stats.verify_forwards, tokens + stats.new_tokens
    report(f"{precision} {shape_name}", rounds, tokens)


if __name__ == "__main__":
    main(sys.argv[1:])
