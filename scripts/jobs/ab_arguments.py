"""What the in-process A/B scripts share: their arguments, [float32 | bfloat16] [prompts] [output.json], checked in
one line each (an existing output file is refused: nothing is overwritten; new_output, which the probes beside them
call too), their alternating loop, their JSON output, the goal bench's dynamic tree of the bundled drafter and the
float32 target decoding plain and with that tree in int8, the goal cells' best method, and a bench method's drafter."""
import json
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from draftsmith.eval.bench.build_context import BuildContext
from draftsmith.eval.bench.methods import build_method, inner_drafter
from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.base import Drafter
from draftsmith.eval.decode.drafters.dgf import load_dgf_drafter
from draftsmith.eval.documents import cpu_model
from draftsmith.eval.prompts import load_prompts
from draftsmith.models.bundled import bundled_drafter
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import WeightPrecision
from draftsmith.models.target import TargetModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# The bundled drafter's dynamic tree as eval/configs/goal_bench_smollm2.yaml runs it (load_dgf_drafter's keywords)
GOAL_TREE = {"depth": 6, "topk": 2, "budget": 8, "stop_below": 0.2, "keep_above": 0.1}
# The goal cells' best method (eval/configs/goal_cells_smollm2.yaml): lookup, else the DFlash 40M + 0.75M tree
BEST = ("cascade:drafters=[(ngram:min_n=3,budget=8), (dflash:drafters/dflash_smollm2_human40m_then_regen/"
        "loss_tokens_750000,vocab=models/bundled/smollm2-135m-instruct-dgf,weights=int8,budget=4,topk=3,"
        "keep_above=0.05,prior=drafters/dflash_smollm2_human_then_regen/ngram_prior,context_weight=1.0)]")


def ab_arguments(argv: list[str], script: str) -> tuple[str, int, str | None]:
    """(dtype name, prompts, output path or None) of `argv`, or exit with the usage line of `script`."""
    if len(argv) > 3 or (argv and argv[0] not in DTYPES) or (len(argv) > 1 and not argv[1].isdigit()):
        sys.exit(f"usage: python scripts/jobs/{script} [{' | '.join(DTYPES)}] [prompts] [output.json]")
    return (argv[0] if argv else "float32", int(argv[1]) if len(argv) > 1 else 12,
            new_output(argv[2] if len(argv) > 2 else None))


def float32_arguments(argv: list[str], script: str, refusal: str) -> tuple[int, str | None]:
    """(prompts, output path or None) of a float32-only A/B script's `argv`, torch on the 2 threads the runs use; any
    other dtype exits with `refusal`, one line."""
    name, count, output = ab_arguments(argv, script)
    if name != "float32":
        sys.exit(f"error: {refusal}")
    torch.set_num_threads(2)
    return count, output


def new_output(path: str | None) -> str | None:
    """`path` (None: no output), or exit in one line where it exists: nothing is overwritten."""
    if path is not None and Path(path).exists():
        sys.exit(f"error: {path} exists: give a new output path (nothing is overwritten)")
    return path


def probe_output(argv: list[str]) -> Path | None:
    """A probe's output path, argv[1] (None where none is given: the table is only printed), or exit in one line where
    it exists (new_output)."""
    path = new_output(argv[1] if len(argv) > 1 else None)
    return Path(path) if path else None


def alternating_rates(prompts: list, arms: tuple[str, ...], set_arm: Callable[[str], None],
                      decoders: dict) -> dict[tuple[str, str], float]:
    """Tokens/s of every (arm, method): first each decoder once on the first prompt (a warm-up: it loads every package
    a round uses), then per prompt each arm in turn (the order reversed every other prompt), each running every decoder
    on it; every output the same tokens (checked: the arms and methods are lossless)."""
    for decoder in decoders.values():
        decoder.generate(prompts[0])
    seconds = {(arm, method): 0.0 for arm in arms for method in decoders}
    tokens = dict.fromkeys(seconds, 0)
    for index, ids in enumerate(prompts):
        outputs = {}
        for arm in arms if index % 2 == 0 else arms[::-1]:
            set_arm(arm)
            for method, decoder in decoders.items():
                start = time.perf_counter()
                outputs[arm, method] = decoder.generate(ids).tokens
                seconds[arm, method] += time.perf_counter() - start
                tokens[arm, method] += len(outputs[arm, method])
        assert len({tuple(out) for out in outputs.values()}) == 1, f"prompt {index}: the outputs' tokens differ"
    return {key: tokens[key] / seconds[key] for key in seconds}


def method_drafter(base: TargetModel, spec: str = BEST) -> Drafter:
    """The drafter of bench method `spec` (a drafter method: lm-chain, dflash, cascade, ...) on the compiled backend,
    built as the bench builds it for the target `base`."""
    return inner_drafter(build_method(spec, BuildContext(base, backend=Backend.COMPILED)), spec)


def float32_targets() -> tuple[TargetModel, TargetModel]:
    """SmolLM2-135M-Instruct in float32: the model as loaded (a bench method's builds read it) and on the compiled
    engine."""
    base = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=torch.float32)
    return base, base.with_backend(Backend.COMPILED, CompileSettings())


def int8_tree_decoders(count: int) -> tuple[TargetModel, dict, list]:
    """(SmolLM2-135M-Instruct float32 on the compiled engine, {"plain", "tree": the bundled drafter with int8 weights as
    GOAL_TREE} decoders of 128 new tokens, the first `count` MT-Bench first turns)."""
    base, target = float32_targets()
    config = DecodeConfig(max_new_tokens=128)
    drafter = load_dgf_drafter(bundled_drafter("smollm2-135m-instruct"), target, backend=Backend.COMPILED,
                               settings=CompileSettings(weights=WeightPrecision.INT8), **GOAL_TREE)
    decoders = {"plain": SpeculativeDecoder(target, None, config), "tree": SpeculativeDecoder(target, drafter, config)}
    return target, decoders, [p["input_ids"] for p in load_prompts("mt-bench", count, 0, base.tokenizer)]


def write_result(output: str | None, prompts: int, rate: dict[tuple[str, str], float], **fields) -> None:
    """The machine, the prompts, `fields` and every (arm, method)'s tokens/s as JSON at `output` (new_output's path;
    None: printed only)."""
    if output:
        result = {"machine": cpu_model(), "prompts": prompts, **fields,
                  "tokens_per_s": {f"{arm} {method}": value for (arm, method), value in rate.items()}}
        with open(output, "w") as handle:
            json.dump(result, handle, indent=1)
