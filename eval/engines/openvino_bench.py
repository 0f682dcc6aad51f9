"""The bench in OpenVINO GenAI: its plain decoding, prompt lookup and draft-model speculative decoding, on the
PyTorch bench's prompts and chat template, greedy, the same thread count; the same table as the llama.cpp bench.

    python -m draftsmith.models.engines.openvino install        # once
    python -m draftsmith.eval.engines.openvino_bench target=qwen2.5-coder-1.5b-instruct \\
        methods="lookup draft:qwen2.5-coder-0.5b-instruct,format=int8 draft:qwen2.5-coder-0.5b-instruct,p_min=0.4" \\
        num_prompts=3 output=results/openvino/qwen1.5b_fp32.json
    python scripts/export.py dgf <drafter final/> exports/eagle3_sglang --layout sglang
    python -m draftsmith.eval.engines.openvino_bench methods="lookup eagle3:exports/eagle3_sglang,k=3" num_prompts=3

Every method is one OpenVINO GenAI `LLMPipeline` on the CPU in a worker process (models/engines/openvino.py) over
the target's IR (exported once into the cache by optimum-intel). Prompts go in as token ids rendered by our chat
template; time is the worker's wall time around `generate`. Methods run back to back on each prompt turn
(interleaved, after a warm-up request each; when their weights do not fit in memory together, each method runs
beside its own plain worker in turn, and the table says so); every speculative output is compared with OpenVINO's
plain output, and the speedup is against OpenVINO's plain decoding of the same IR in the same run (the summary, JSON
and table every engine bench shares: eval/engines/common.py). With `pytorch_baselines=true` the toolkit's plain
decoding on its compiled engine runs on each prompt turn beside OpenVINO's (its row's speedup is against OpenVINO
plain, timed in the same minutes), and HF `generate` with `pytorch_methods` run on the same prompts after.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from draftsmith.config import ConfigError, option
from draftsmith.errors import exit_with
from draftsmith.eval.engines.common import (EngineBenchConfig, PlainOptions, bench_document, engine_main,
                                            engine_table, fits_in_memory, run_groups)
from draftsmith.eval.bench.methods import MethodEntry, MethodSpec
from draftsmith.models.engines import openvino
from draftsmith.models.bundled import DEFAULT_TARGET
from draftsmith.models.target import load_tokenizer
from draftsmith.models.registry import resolve_model_path

# ---------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------


@dataclass
class LookupOptions:
    k: int = option(5, "tokens proposed per step (num_assistant_tokens)", ge=1)
    n: int = option(3, "the longest n-gram looked up in the context (max_ngram_size)", ge=1)


@dataclass
class DraftOptions:
    path: str = option(help="draft model: registry name or HF model directory")
    format: str = option("fp32", f"the draft's IR weight format: {', '.join(openvino.WEIGHT_FORMATS)} (the target "
                                 "verifies in its own format, so the output is unchanged)")
    k: int = option(5, "tokens drafted per step (num_assistant_tokens; not read with p_min)", ge=1)
    p_min: float = option(0.0, "draft while the drafter's probability stays at or above this "
                               "(assistant_confidence_threshold; 0: k tokens a step)", ge=0.0, lt=1.0)


@dataclass
class Eagle3Options:
    path: str = option(help="an EAGLE-3 drafter exported in the SGLang layout (scripts/export.py dgf ... --layout "
                            "sglang)")
    format: str = option("fp32", f"the drafter's IR weight format: {', '.join(openvino.WEIGHT_FORMATS)}")
    k: int = option(5, "tokens drafted per step: a chain's length, or a tree's candidate tokens "
                       "(num_assistant_tokens; OpenVINO's EAGLE-3 has no confidence stop)", ge=1)
    depth: int = option(0, "0: a chain of k tokens; else a tree of this depth (tree_depth: the drafter runs depth "
                           "times, keeping the best k candidates). Not lossless in OpenVINO 2026.4.1: on SmolLM2 no "
                           "tree output equalled greedy (the table's last column says so)", ge=0)
    topk: int = option(1, "tree only: candidates kept per node and per tree layer (branching_factor)", ge=1)

    def __post_init__(self) -> None:
        if self.depth == 0 and self.topk != 1:
            raise ConfigError("eagle3: topk is read only by a tree (depth > 0)")
        if self.depth > self.k:
            raise ConfigError(f"eagle3: a tree of depth {self.depth} needs at least that many candidates (k={self.k})")


def pipeline_settings(ctx: "RunContext", **method: object) -> openvino.PipelineSettings:
    """Every method's pipeline: the target's IR, the run's threads and arithmetic, and what the method adds."""
    return openvino.PipelineSettings(ctx.target_ir, ctx.threads, precision=ctx.precision, **method)


def plain_settings(options: PlainOptions, ctx: "RunContext") -> openvino.PipelineSettings:
    return pipeline_settings(ctx)


def lookup_settings(options: LookupOptions, ctx: "RunContext") -> openvino.PipelineSettings:
    return pipeline_settings(ctx, prompt_lookup=True,
                             generation={"num_assistant_tokens": options.k, "max_ngram_size": options.n})


def draft_settings(options: DraftOptions, ctx: "RunContext") -> openvino.PipelineSettings:
    draft_ir = openvino.cached_ir(Path(resolve_model_path(options.path)), options.format)
    length = ({"num_assistant_tokens": 0, "assistant_confidence_threshold": options.p_min} if options.p_min > 0
              else {"num_assistant_tokens": options.k})
    return pipeline_settings(ctx, draft=draft_ir, generation=length)


def eagle3_settings(options: Eagle3Options, ctx: "RunContext") -> openvino.PipelineSettings:
    draft_ir = openvino.cached_eagle3_ir(Path(options.path), ctx.target_dir, options.format)
    tree = {"tree_depth": options.depth, "branching_factor": options.topk} if options.depth else {}
    return pipeline_settings(ctx, draft=draft_ir,
                             generation={"num_assistant_tokens": options.k, **tree})


OPENVINO_METHODS: dict[str, MethodEntry] = {
    "plain": MethodEntry(PlainOptions, plain_settings, "OpenVINO GenAI's plain greedy decoding (the baseline)"),
    "lookup": MethodEntry(LookupOptions, lookup_settings, "its prompt lookup decoding (training-free)"),
    "draft": MethodEntry(DraftOptions, draft_settings, "a draft model (speculative decoding): the 0.5B, a student"),
    "eagle3": MethodEntry(Eagle3Options, eagle3_settings, "an EAGLE-3 drafter trained here (OpenVINO's EAGLE-3 "
                                                          "pipeline)"),
}


class OpenVinoMethodSpec(MethodSpec):
    """An OpenVINO bench method: `plain`, `lookup[:k=..,n=..]`, `draft:<model>[,format=..,k=..,p_min=..]`,
    `eagle3:<dir>[,format=..,k=..,depth=..,topk=..]`."""

    @classmethod
    def entry(cls, name: str, path: str) -> MethodEntry:
        if name not in OPENVINO_METHODS:
            raise ConfigError(f"{path}: unknown OpenVINO method {name!r}; methods: {', '.join(OPENVINO_METHODS)}")
        return OPENVINO_METHODS[name]


PLAIN = OpenVinoMethodSpec.from_config("plain")


@dataclass
class OpenVinoBenchConfig(EngineBenchConfig):
    plain: ClassVar[MethodSpec] = PLAIN
    target: str = option(DEFAULT_TARGET, "the target: registry name or HF model directory")
    target_format: str = option("fp32", f"the target's IR weight format: {', '.join(openvino.WEIGHT_FORMATS)}")
    methods: list[OpenVinoMethodSpec] = option(factory=lambda: [OpenVinoMethodSpec.from_config("lookup")],
                                               help="methods beside plain (always run): plain | lookup | draft | eagle3")
    threads: int = option(2, "OpenVINO inference threads (INFERENCE_NUM_THREADS)", ge=1)
    precision: Literal["f32", "bf16"] = option(
        "f32", "the arithmetic of target and drafter (INFERENCE_PRECISION_HINT): f32 computes the fp32 IR in fp32; "
               "bf16 is OpenVINO's default on a CPU with AVX512-BF16 or AMX (faster, and a speculative output may "
               "then part from plain at a near-tie)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target_format not in openvino.WEIGHT_FORMATS:
            raise ConfigError(f"target_format: {self.target_format!r} is not one of {list(openvino.WEIGHT_FORMATS)}")


@dataclass
class RunContext:
    target_dir: Path
    target_ir: Path
    threads: int
    precision: str


def fits_together(workers: list[openvino.OpenVinoWorker]) -> bool:
    """Whether every worker's weights fit in memory at once (each process holds its own copy)."""
    return fits_in_memory(sum(worker.memory_bytes() for worker in workers) * 1.2)


def run_methods(config: OpenVinoBenchConfig, ctx: RunContext, tokenizer, log_dir: Path) -> tuple[list, bool]:
    """(rows, interleaved): every method's worker at once when they fit in memory, else each method beside its own
    plain worker in turn."""
    workers = {spec: openvino.OpenVinoWorker(OPENVINO_METHODS[spec.name].build(spec.options, ctx),
                                             log_path=log_dir / f"worker-{index}.log")
               for index, spec in enumerate(config.methods)}
    interleaved = fits_together(list(workers.values()))
    return run_groups(config, interleaved, workers.__getitem__, tokenizer), interleaved


def run_openvino_bench(config: OpenVinoBenchConfig, log_dir: Path) -> dict:
    openvino.require_installed()
    target_dir = Path(resolve_model_path(config.target))
    ctx = RunContext(target_dir, openvino.cached_ir(target_dir, config.target_format), config.threads,
                     config.precision)
    tokenizer = load_tokenizer(config.target)
    started = time.time()
    rows, interleaved = run_methods(config, ctx, tokenizer, log_dir)
    return bench_document(config, rows, interleaved, started,
                          {"openvino": {"release": openvino.RELEASE, "pins": list(openvino.PINS)}},
                          {"target_ir": str(ctx.target_ir)})


def format_table(document: dict) -> str:
    config = document["config"]
    return engine_table(document, f"OpenVINO GenAI {document['openvino']['release']}", "OpenVINO",
                        f"{config['target']} ({config['target_format']} IR, computed in "
                        f"{config.get('precision', 'the CPU default')})")


def main(argv: list[str]) -> dict:
    return engine_main("draftsmith.eval.engines.openvino_bench", __doc__, OpenVinoBenchConfig, run_openvino_bench,
                       openvino.home() / "bench-logs", format_table, argv)


if __name__ == "__main__":
    exit_with(main)
