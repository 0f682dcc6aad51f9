"""The bench in llama.cpp: its plain decoding, n-gram modes, draft models and this toolkit's drafters (EAGLE-3
exports, students), on the PyTorch bench's prompts and chat template, greedy, the same thread count.

    python -m draftsmith.eval.engines.llamacpp_bench target=smollm2-135m-instruct target_type=q8_0 \\
        methods="ngram ngram:kind=ngram-map-k draft:qwen2.5-coder-0.5b-instruct,type=q8_0" \\
        num_prompts=10 output=results/llamacpp/smollm2_q8_0.json

Every method is one `llama-server` on loopback (one slot, `threads` threads) over the target's GGUF (converted once
into the cache by llama.cpp's own converter). The prompts go in as token ids rendered by our chat template, so both
engines see the same ids. Methods run back to back on each prompt turn (interleaved, after a warm-up request each);
when the servers do not fit in memory together they run one after another, and the table says so. Time is the
server's own prompt + generation time (no HTTP). Per method: tokens/s, speedup against llama.cpp's plain decoding of
the same GGUF in the same run (ratio of total times, and the mean of per-prompt ratios with a 95% interval),
drafted and accepted tokens, the mean accepted length (tokens per target step: generated / (generated - accepted))
and whether each output equals llama.cpp's plain output token for token (a quantized target may differ; the
table counts it per method and the JSON lists the prompts). With `pytorch_baselines=true` the toolkit's plain
decoding on its compiled engine runs on each prompt turn beside llama.cpp's (its row's speedup is against llama.cpp
plain, timed in the same minutes), and HF `generate` with `pytorch_methods` run on the same prompts after.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from draftsmith.config import ConfigError, option
from draftsmith.errors import UserError, exit_with
from draftsmith.eval.bench.methods import MethodEntry, MethodSpec
from draftsmith.eval.engines.common import (EngineBenchConfig, PlainOptions, bench_document, engine_main,
                                            engine_table, fits_in_memory, run_groups)
from draftsmith.models.bundled import DEFAULT_TARGET
from draftsmith.models.engines import llamacpp
from draftsmith.models.registry import resolve_model_path
from draftsmith.models.target import load_tokenizer

# ---------------------------------------------------------------------------------------------
# Methods: one table, the same spec grammar as the PyTorch bench's
# ---------------------------------------------------------------------------------------------

NgramKind = Literal["ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache"]  # llama.cpp's modes


@dataclass
class NgramOptions:
    kind: NgramKind = option(
        "ngram-simple", "llama.cpp's n-gram mode (--spec-type)")
    n: int = option(3, "ngram-simple: the length of the looked-up n-gram (--spec-ngram-simple-size-n)", ge=1)
    m: int = option(5, "ngram-simple: the length of the drafted m-gram (--spec-ngram-simple-size-m)", ge=1)


def n_max_option():  # the draft-length options of `draft` and `eagle3`, declared once
    return option(16, "most draft tokens per step (--spec-draft-n-max)", ge=1)


def p_min_option():
    return option(0.0, "stop a draft at a token the drafter gives less than this probability (--spec-draft-p-min; "
                       "0 drafts n_max tokens)", ge=0.0, lt=1.0)


def n_min_option():
    return option(0, "drop a draft shorter than this, and decode the step plainly (--spec-draft-n-min; a verify of "
                     "one drafted token costs most of a second step on a small CPU target)", ge=0)


class DraftLengthCheck:
    """n_min and n_max checked together, for the options classes that declare both."""

    n_min: int
    n_max: int

    def __post_init__(self) -> None:
        if self.n_min > self.n_max:
            raise ConfigError(f"n_min={self.n_min} is above n_max={self.n_max}: no draft would ever be verified")


@dataclass
class DraftOptions(DraftLengthCheck):
    path: str = option(help="draft model: registry name, HF model directory or .gguf file")
    type: str = option("float32", "GGUF type the draft is converted to (not read for a .gguf path)")
    n_max: int = n_max_option()
    p_min: float = p_min_option()
    n_min: int = n_min_option()


@dataclass
class Eagle3Options(DraftLengthCheck):
    path: str = option(help="an EAGLE-3 export (scripts/export.py dgf ... --layout speculators) or its .gguf")
    type: Literal["float32", "bfloat16", "float16", "q8_0"] = option(
        "float32", "GGUF type the drafter is converted to (the target verifies in its own type, so the output is "
                   "unchanged; not read for a .gguf)")
    n_max: int = n_max_option()
    p_min: float = p_min_option()
    n_min: int = n_min_option()
    ngram: Literal["none", NgramKind] = option(
        "none", "a cascade in llama.cpp: this n-gram mode (its default settings) drafts first, the EAGLE-3 drafter "
                "where it finds nothing (--spec-type <mode>,draft-eagle3; each keeps its own draft length)")


@dataclass
class DFlashOptions(Eagle3Options):
    path: str = option(help="a DFlash export (scripts/export.py dflash ..., z-lab's layout) or its .gguf")
    n_max: int = option(7, "most draft tokens per step (--spec-draft-n-max; llama.cpp clamps it to the block - 1)",
                        ge=1)


def ngram_arguments(options: NgramOptions, ctx: "RunContext") -> tuple[str, ...]:
    args = ("--spec-type", options.kind)
    if options.kind == "ngram-simple":
        args += ("--spec-ngram-simple-size-n", str(options.n), "--spec-ngram-simple-size-m", str(options.m))
    elif (options.n, options.m) != (3, 5):
        raise UserError(f"ngram:kind={options.kind}: n and m are read only by kind=ngram-simple")
    return args


def given_gguf(method: str, options: DraftOptions | Eagle3Options) -> Path | None:
    """The .gguf file a draft or eagle3 method names (None: it names a model directory to convert); a type given
    for it is refused, since nothing converts it."""
    if not options.path.endswith(".gguf"):
        return None
    if options.type != "float32":
        raise UserError(f"{method}:{options.path}: type is not read for a .gguf file (it is already converted)")
    return Path(options.path)


def draft_length_arguments(options: DraftOptions | Eagle3Options) -> tuple[str, ...]:
    """How long a draft may grow: at most n_max tokens, and (p_min > 0) no token the drafter is less sure of; one
    shorter than n_min is not verified at all."""
    return ("--spec-draft-n-max", str(options.n_max), "--spec-draft-p-min", str(options.p_min),
            "--spec-draft-n-min", str(options.n_min))


def draft_arguments(options: DraftOptions, ctx: "RunContext") -> tuple[str, ...]:
    gguf = given_gguf("draft", options)
    if gguf is None:
        directory = Path(resolve_model_path(options.path))
        gguf = llamacpp.cached_gguf(directory, directory.name, options.type)
    return ("-md", str(gguf), "--spec-type", "draft-simple", *draft_length_arguments(options))


def feature_drafter_arguments(kind: str, options: Eagle3Options, ctx: "RunContext") -> tuple[str, ...]:
    """An EAGLE-3 or DFlash export (converted once into the cache, decoded by llama.cpp before it is kept)."""
    gguf = given_gguf(kind, options)
    if gguf is None:
        suffix = "" if options.type == "float32" else f"-{options.type}"
        key = llamacpp.model_dir_key(Path(options.path))
        gguf = llamacpp.draftsmith_cache() / "gguf" / f"{kind}-{key}{suffix}.gguf"
        if not gguf.is_file():
            llamacpp.export_gguf(Path(options.path), gguf, options.type, ctx.target_dir)
    return ("-md", str(gguf), *cascade_type_arguments(options.ngram, f"draft-{kind}", ctx),
            *draft_length_arguments(options))


def cascade_type_arguments(ngram_kind: str, draft_type: str, ctx: "RunContext") -> tuple[str, ...]:
    """`--spec-type` for a draft alone, or (ngram_kind not "none") for llama.cpp's cascade: it tries its types in
    a fixed order, n-gram modes before drafters, and drafts with the first that proposes anything."""
    if ngram_kind == "none":
        return ("--spec-type", draft_type)
    _, _, *ngram_settings = ngram_arguments(NgramOptions(kind=ngram_kind), ctx)
    return ("--spec-type", f"{ngram_kind},{draft_type}", *ngram_settings)


LLAMACPP_METHODS: dict[str, MethodEntry] = {
    "plain": MethodEntry(PlainOptions, lambda options, ctx: (), "llama.cpp's plain greedy decoding (the baseline)"),
    "ngram": MethodEntry(NgramOptions, ngram_arguments, "llama.cpp's training-free n-gram drafting"),
    "draft": MethodEntry(DraftOptions, draft_arguments, "a draft model (draft-simple): the 0.5B, a student"),
    "eagle3": MethodEntry(Eagle3Options, lambda options, ctx: feature_drafter_arguments("eagle3", options, ctx),
                          "an EAGLE-3 drafter trained here (draft-eagle3)"),
    "dflash": MethodEntry(DFlashOptions, lambda options, ctx: feature_drafter_arguments("dflash", options, ctx),
                          "a DFlash block drafter trained here (draft-dflash)"),
}


class LlamaCppMethodSpec(MethodSpec):
    """A llama.cpp bench method: `plain`, `ngram[:kind=..,n=..,m=..]`, `draft:<model>[,type=..]`,
    `eagle3:<dir>[,ngram=<mode>]`, `dflash:<dir>[,ngram=<mode>]`."""

    @classmethod
    def entry(cls, name: str, path: str) -> MethodEntry:
        if name not in LLAMACPP_METHODS:
            raise ConfigError(f"{path}: unknown llama.cpp method {name!r}; methods: {', '.join(LLAMACPP_METHODS)}")
        return LLAMACPP_METHODS[name]


PLAIN = LlamaCppMethodSpec.from_config("plain")  # the baseline every method is measured and checked against


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@dataclass
class LlamaCppBenchConfig(EngineBenchConfig):
    plain: ClassVar[MethodSpec] = PLAIN
    target: str = option(DEFAULT_TARGET, "the target: registry name or HF model directory")
    target_type: str = option("float32", f"the target's GGUF type: {', '.join(llamacpp.GGUF_TYPES)}")
    methods: list[LlamaCppMethodSpec] = option(factory=lambda: [LlamaCppMethodSpec.from_config("ngram")],
                                               help="methods beside plain (always run): plain | ngram | draft | eagle3 | dflash")
    threads: int = option(2, "llama.cpp threads (generation and prompt)", ge=1)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target_type not in llamacpp.GGUF_TYPES:
            raise ConfigError(f"target_type: {self.target_type!r} is not one of {list(llamacpp.GGUF_TYPES)}")


@dataclass
class RunContext:
    target_dir: Path
    target_gguf: Path


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


SLOT_CONTEXT = 4096  # tokens one server slot holds: the longest bench turn (MT-Bench turn 2) plus its answer


def server_settings(config: LlamaCppBenchConfig, ctx: RunContext, spec: LlamaCppMethodSpec) -> llamacpp.ServerSettings:
    extra = LLAMACPP_METHODS[spec.name].build(spec.options, ctx)
    return llamacpp.ServerSettings(model=ctx.target_gguf, slots=1, context_per_slot=SLOT_CONTEXT,
                                   threads=config.threads, extra_arguments=tuple(extra))


def fits_together(settings: list[llamacpp.ServerSettings]) -> bool:
    """Whether every server's files fit in memory at once, so methods can interleave: each file once in the page
    cache that all servers share, and again per server where llama.cpp repacks it."""
    per_server = [[s.model] + [Path(a) for a in s.extra_arguments if a.endswith(".gguf")] for s in settings]
    mapped = {file for files in per_server for file in files}
    copies = [file for files in per_server for file in files if llamacpp.repacked_per_server(file)]
    return fits_in_memory(sum(file.stat().st_size for file in [*mapped, *copies]) * 1.3)


def run_methods(config: LlamaCppBenchConfig, ctx: RunContext, tokenizer, log_dir: Path) -> tuple[list, bool]:
    """(rows, interleaved): all servers at once when they fit in memory, else one method after another."""
    settings = {spec: server_settings(config, ctx, spec) for spec in config.methods}
    interleaved = fits_together(list(settings.values()))
    logs = {spec: log_dir / f"server-{index}.log" for index, spec in enumerate(settings)}

    def open_server(spec: LlamaCppMethodSpec) -> llamacpp.LlamaServer:  # a fresh port each time it is opened
        return llamacpp.LlamaServer(settings[spec], log_path=logs[spec])

    return run_groups(config, interleaved, open_server, tokenizer), interleaved


def run_llamacpp_bench(config: LlamaCppBenchConfig, log_dir: Path) -> dict:
    llamacpp.require_built()
    target_dir = Path(resolve_model_path(config.target))
    ctx = RunContext(target_dir, llamacpp.cached_gguf(target_dir, target_dir.name, config.target_type))
    tokenizer = load_tokenizer(config.target)
    started = time.time()
    rows, interleaved = run_methods(config, ctx, tokenizer, log_dir)
    return bench_document(config, rows, interleaved, started, {"llama_cpp": llamacpp.build_info()},
                          {"target_gguf": str(ctx.target_gguf)})


def format_table(document: dict) -> str:
    config = document["config"]
    return engine_table(document, f"llama.cpp {document['llama_cpp']['release']}", "llama.cpp",
                        f"{config['target']} ({config['target_type']})")


def main(argv: list[str]) -> dict:
    return engine_main("draftsmith.eval.engines.llamacpp_bench", __doc__, LlamaCppBenchConfig, run_llamacpp_bench,
                       llamacpp.home() / "bench-logs", format_table, argv)


if __name__ == "__main__":
    exit_with(main)
