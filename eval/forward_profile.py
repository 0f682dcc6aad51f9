"""Where one verification forward spends its time: GEMMs (the LM head apart), attention, other kernels
(norms, rotary, elementwise, copies) and Python/dispatch, eager vs compiled.

    python -m draftsmith.eval.forward_profile target=qwen2.5-coder-1.5b-instruct width=8 \\
        output=results/latency/forward_profile_qwen1.5b.json

One causal forward of `width` new tokens over a `context_tokens` cache (as eval.latency), run under
torch.profiler `repeats` times. Eager: every aten op's self time, classified by name (mm/addmm/linear:
GEMM; an operand with the vocabulary's size, or packed in panels that cover it: LM head; scaled_dot_product*:
attention). Compiled: the package is built with inductor's kernel profiling (every generated kernel is a
profiler event; `gemm_*` templates and `linear_pointwise`/`mm` calls are GEMMs, `n<vocab>` names the LM head).
Python/dispatch = the forward's wall time minus the ops' self time (2 threads: self time is wall
time on the calling thread). On the compiled engine with the batch-invariant kernels that remainder is mostly
not Python: the events of the kernels' ops called from inside the package leave part of their time out (a
SmolLM2 step: 4.4 ms of ~15-21 unattributed, where the Python around the package, timed directly, is ~0.3 ms and
the package's own wall matches the linear layers' time measured alone). Writes JSON and a markdown table.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from draftsmith.config import check_config, config_to_dict, option
from draftsmith.errors import exit_with
from draftsmith.eval.documents import cpu_model, parse_document_command, write_document
from draftsmith.eval.latency import forward_seconds, mt_bench_context
from draftsmith.models.bundled import DEFAULT_TARGET
from draftsmith.models.engine import Backend
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.target import TargetModel

CATEGORIES = ("gemm", "lm_head", "attention", "other_kernels", "python_dispatch")


@dataclass
class ForwardProfileConfig:
    target: str = option(DEFAULT_TARGET, "the target: registry name, model directory, hub id or tiny:<family>")
    backends: list[Backend] = option(factory=lambda: list(Backend), help="engines")
    dtype: str = option("float32", "dtype of the target")
    width: int = option(8, "new tokens in the profiled forward", ge=1, le=64)
    context_tokens: int = option(256, "KV-cache length the forward attends over", ge=1)
    repeats: int = option(5, "profiled forwards (after 2 warm-up ones)", ge=1)
    threads: int = option(0, "torch CPU threads (0: torch's default)", ge=0)
    capacity: int = option(1024, "compiled: KV-cache slots", ge=2)
    output: str | None = option(None, "JSON path (a markdown table is written beside it); null: print only")

    def __post_init__(self):
        check_config(self)


def classify(name: str, shapes: list, vocab: int) -> str:
    """The category of one profiler event (an aten op or a generated kernel)."""
    lowered = name.lower()
    if "scaled_dot_product" in lowered or "attention" in lowered:
        return "attention"
    if "greedy_head" in lowered:  # the compiled engine's LM head in greedy decoding (models.kernels.GreedyHead)
        return "lm_head"
    gemm = any(key in lowered for key in ("gemm", "linear", "aten::mm", "aten::addmm", "aten::bmm", "_mm"))
    if not gemm:
        return "other_kernels"
    shapes = [shape for shape in shapes if isinstance(shape, (list, tuple))]
    dims = [d for shape in shapes for d in shape]
    # The batch-invariant kernels' weights are packed (panels, K, columns per panel), bf16 pairs and int8 quads with
    # a last axis of 2 or 4: (panels, K / 2 or 4, columns per panel, 2 or 4). The head's panels cover the vocabulary.
    packed_columns = [shape[0] * shape[2] for shape in shapes if len(shape) in (3, 4) and "draftsmith" in lowered]
    head = vocab in dims or f"n{vocab}" in lowered or any(columns >= vocab for columns in packed_columns)
    return "lm_head" if head else "gemm"


def profiled_forward(target: TargetModel, cache, past: int, width: int, vocab: int) -> dict[str, float]:
    """Seconds per category of one forward (its cache restored afterwards)."""
    ids = torch.randint(0, vocab, (1, width)).to(target.device)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        wall = forward_seconds(target, cache, ids)
    target.truncate(cache, past)
    seconds = {category: 0.0 for category in CATEGORIES}
    for event in prof.events():
        if event.self_cpu_time_total > 0:
            seconds[classify(event.name, event.input_shapes, vocab)] += event.self_cpu_time_total / 1e6
    seconds["python_dispatch"] = max(0.0, wall - sum(seconds.values()))
    seconds["wall"] = wall
    return seconds


@torch.inference_mode()
def profile_backend(config: ForwardProfileConfig, base: TargetModel, backend: Backend) -> dict:
    settings = CompileSettings(buckets=[config.width], capacity=config.capacity, kernel_profile=True)
    target = base.with_backend(backend, settings)
    target.prepare((config.width,))
    context = mt_bench_context(base.tokenizer, config.context_tokens)
    cache = target.new_cache(context.shape[1] + config.width)
    target.forward(context.to(target.device), cache)
    past, vocab = target.cache_length(cache), base.model.get_output_embeddings().weight.shape[0]
    runs = [profiled_forward(target, cache, past, config.width, vocab) for _ in range(2 + config.repeats)][2:]
    untimed = untimed_forward(target, cache, past, config.width, vocab)
    target.release()
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    return {"ms": {key: 1000 * value for key, value in medians.items()}, "wall_without_profiler_ms": 1000 * untimed,
            **target.engine.build_seconds()}


def untimed_forward(target: TargetModel, cache, past: int, width: int, vocab: int) -> float:
    """Median seconds of the same forward without the profiler (its overhead is in the profiled wall)."""
    ids = torch.randint(0, vocab, (1, width)).to(target.device)
    times = []
    for _ in range(5):
        times.append(forward_seconds(target, cache, ids))
        target.truncate(cache, past)
    return statistics.median(times[1:])


def format_profile(document: dict) -> str:
    config = document["config"]
    lines = [f"One forward of {config['width']} tokens over {config['context_tokens']} cached tokens, "
             f"{document['target']} {config['dtype']}, {document['machine']}; medians of {config['repeats']} "
             "profiled forwards, ms (share of the profiled wall time).", "",
             "| backend | wall (no profiler) | profiled wall | " + " | ".join(CATEGORIES) + " |",
             "|---|---|---|" + "---|" * len(CATEGORIES)]
    for backend, entry in document["backends"].items():
        ms = entry["ms"]
        cells = " | ".join(f"{ms[c]:.1f} ({100 * ms[c] / ms['wall']:.0f}%)" for c in CATEGORIES)
        lines.append(f"| {backend} | {entry['wall_without_profiler_ms']:.1f} | {ms['wall']:.1f} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str]) -> dict:
    config, out = parse_document_command("draftsmith.eval.forward_profile", __doc__, ForwardProfileConfig, argv)
    if config.threads:
        torch.set_num_threads(config.threads)
    base = TargetModel.from_pretrained(config.target, dtype=config.dtype)
    document = {"format": "draftsmith.forward_profile/1", "config": config_to_dict(config), "target": config.target,
                "machine": f"{cpu_model()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
                "backends": {backend: profile_backend(config, base, backend) for backend in config.backends}}
    write_document(out, document, format_profile(document))
    return document


if __name__ == "__main__":
    exit_with(main)
