"""Forward-latency curves T(w): one target forward of w new tokens over a fixed KV context, per backend
(eager, compiled) and dtype - the numbers that decide whether verifying w tokens can pay.

    python -m draftsmith.eval.latency target=qwen2.5-coder-0.5b-instruct backends="eager compiled" \\
        dtypes="float32 bfloat16" output=results/latency/qwen0.5b.json

Each forward is causal over w random tokens appended to a `context_tokens`-long cache (an MT-Bench
prompt in its chat template, repeated), then truncated back, with the LM head greedy decoding reads (the compiled
engine's greedy head where `compile.head` gives one; `compile.head=model`: the model's head); medians of
`repeats`, the widths interleaved so that load changes hit them alike. Compiled graphs are built or loaded before anything
is timed (their seconds are reported apart). `release=true` frees each compiled graph after the widths it
runs are measured (one frozen weight copy in memory at a time: how per-bucket graphs of the 1.5B fit in
24 GB); the widths of one graph are interleaved, graphs are measured one after another (the shared-width
graph runs every width: one group). Writes JSON and a markdown table.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from draftsmith.config import Unread, check_config, config_to_dict, option, refuse_unread, section
from draftsmith.data.chat import prompt_ids
from draftsmith.data.sources import load_source
from draftsmith.errors import UserError, exit_with
from draftsmith.eval.documents import cpu_model, machine_line, parse_document_command, write_document
from draftsmith.models.bundled import DEFAULT_TARGET
from draftsmith.models.compiled import CompileSettings, compile_unread
from draftsmith.models.engine import Backend, sync
from draftsmith.models.target import TargetModel, resolve_dtype

DEFAULT_WIDTHS = [1, 2, 4, 8, 16, 32, 64]


@dataclass
class LatencyConfig:
    target: str = option(DEFAULT_TARGET, "the target: registry name, model directory, hub id or tiny:<family>")
    backends: list[Backend] = option(factory=lambda: list(Backend),
                                                           help="engines measured")
    dtypes: list[str] = option(factory=lambda: ["float32"], help="dtypes measured (float32 | bfloat16; float16 on "
                               "the eager backend or compile.kernels=inductor)")
    widths: list[int] = option(factory=lambda: list(DEFAULT_WIDTHS), help="new tokens per forward", ge=1)
    context_tokens: int = option(256, "KV-cache length each forward attends over", ge=1)
    repeats: int = option(10, "timed forwards per width", ge=1)
    warmup: int = option(2, "untimed forwards per width first", ge=0)
    threads: int = option(0, "torch CPU threads (0: torch's default)", ge=0)
    device: str = option("cpu", "cpu | cuda | auto")
    release: bool = option(False, "compiled: free each width's graph after measuring it (big models)")
    compile: CompileSettings = section(CompileSettings, "the compiled backend's buckets, KV capacity, autotuning")
    output: str | None = option(None, "JSON path (a markdown table is written beside it); null: print only")

    def __post_init__(self):
        check_config(self)
        if max(self.widths) > max(self.compile.buckets) and Backend.COMPILED in self.backends:
            raise UserError(f"widths: {max(self.widths)} exceeds the largest compiled bucket "
                            f"{max(self.compile.buckets)}")
        needed = self.compile.slots_for(self.context_tokens + max(self.widths))
        if Backend.COMPILED in self.backends and needed > self.compile.capacity:
            raise UserError(f"context_tokens={self.context_tokens}: the compiled engine needs compile.capacity >= "
                            f"{needed} (the context, the widest forward, one padded bucket); it is "
                            f"{self.compile.capacity}")
        eager_only = lambda c: Backend.COMPILED not in c.backends  # noqa: E731
        reader = "read with the compiled backend in backends"
        refuse_unread(self, [Unread("release", eager_only, reader), *compile_unread(eager_only, reader)])


def context_ids(prompt: torch.Tensor, length: int) -> torch.Tensor:
    """(1, T) prompt repeated/cut to `length` tokens (at least the prompt itself when length <= 0)."""
    if length <= 0:
        return prompt
    reps = -(-length // prompt.shape[1])
    return prompt.repeat(1, reps)[:, :length]


def mt_bench_context(tokenizer, length: int) -> torch.Tensor:
    first = load_source("mt-bench")[0]
    return context_ids(torch.tensor([prompt_ids(tokenizer, first.messages)]), length)


def forward_seconds(target: TargetModel, cache, ids: torch.Tensor, argmax_only: bool = True) -> float:
    """Wall seconds of one forward of `ids` over `cache` (device synchronised on both sides); `argmax_only` as
    greedy decoding asks (TargetModel.forward)."""
    sync(target.device)
    start = time.perf_counter()
    target.forward(ids, cache, argmax_only=argmax_only)
    sync(target.device)
    return time.perf_counter() - start


def time_forward(target: TargetModel, cache, past: int, width: int, generator: torch.Generator,
                 argmax_only: bool = True) -> float:
    """Seconds of one causal forward of `width` random tokens after `past` cached ones (cache restored)."""
    vocab = target.model.get_output_embeddings().out_features
    ids = torch.randint(0, vocab, (1, width), generator=generator).to(target.device)
    seconds = forward_seconds(target, cache, ids, argmax_only)
    target.truncate(cache, past)
    return seconds


def interleaved_seconds(seconds_of: Callable[[int], float], widths: Sequence[int], repeats: int,
                        warmup: int = 2) -> dict[int, list[float]]:
    """{width: [seconds, ...]}: `repeats` rounds over every width in turn (load changes hit all widths alike), after
    `warmup` untimed rounds; `seconds_of(width)` times one forward."""
    times: dict[int, list[float]] = {width: [] for width in widths}
    for rep in range(warmup + repeats):
        for width in widths:
            seconds = seconds_of(width)
            if rep >= warmup:
                times[width].append(seconds)
    return times


@torch.inference_mode()
def measure_forward_latency(target: TargetModel, context: torch.Tensor, widths: list[int], repeats: int,
                            warmup: int = 2, release: bool = False, seed: int = 0,
                            argmax_only: bool = True) -> dict[int, list[float]]:
    """{width: [seconds, ...]} over the cache of `context` (1, T); see the module docstring (`argmax_only` false:
    every forward reads the model's head)."""
    cache = target.new_cache(context.shape[1] + max(widths))
    target.forward(context.to(target.device), cache)
    past = target.cache_length(cache)
    generator = torch.Generator().manual_seed(seed)
    times: dict[int, list[float]] = {w: [] for w in widths}  # in the order of `widths`, whatever the groups
    groups = target.graph_groups(tuple(widths)) if release else [tuple(widths)]  # interleaved within a graph
    for group in groups:
        target.prepare(tuple(group))
        times.update(interleaved_seconds(lambda width: time_forward(target, cache, past, width, generator,
                                                                    argmax_only), group, repeats, warmup))
        if release:
            target.release(tuple(group))
            gc.collect()
    return times


def curve_summary(times: dict[int, list[float]]) -> dict:
    medians = {w: statistics.median(t) for w, t in times.items()}
    first = medians[min(medians)]
    return {"ms": {w: 1000 * m for w, m in medians.items()}, "ratio": {w: m / first for w, m in medians.items()},
            "all_s": times}


def measure_curves(config: LatencyConfig, say) -> dict:
    """{"<backend>/<dtype>": summary} for every backend and dtype of the config."""
    curves = {}
    for dtype in config.dtypes:
        base = TargetModel.from_pretrained(config.target, dtype=dtype, device=config.device)
        context = mt_bench_context(base.tokenizer, config.context_tokens)
        for backend in config.backends:
            target = base.with_backend(backend, config.compile)
            start = time.perf_counter()
            if not config.release:
                target.prepare(tuple(config.widths))
            say(f"[latency] {backend}/{dtype}: graphs ready in {time.perf_counter() - start:.1f} s; measuring "
                f"widths {config.widths} over {context.shape[1]} cached tokens ...")
            times = measure_forward_latency(target, context, config.widths, config.repeats, config.warmup,
                                            config.release)
            summary = curve_summary(times)
            summary.update(target.engine.build_seconds())
            curves[f"{backend}/{dtype}"] = summary
            say("  " + "  ".join(f"T({w})={ms:.1f}ms" for w, ms in summary["ms"].items()))
            target.release()
        del base
        gc.collect()
    return curves


def format_curves(document: dict) -> str:
    widths = document["config"]["widths"]
    lines = [f"Forward latency over {document['config']['context_tokens']} cached tokens, "
             f"{document['machine']}, median of {document['config']['repeats']}.", "",
             "| backend/dtype | T(1) ms | " + " | ".join(f"T({w})/T(1)" for w in widths[1:]) + " | compile s |",
             "|---|---|" + "---|" * (len(widths) - 1) + "---|"]
    for label, curve in document["curves"].items():
        ratios = " | ".join(f"{curve['ratio'][w]:.2f}" for w in widths[1:])
        lines.append(f"| {label} | {curve['ms'][widths[0]]:.1f} | {ratios} | {curve['compile_s']:.0f} |")
    lines.append("")
    lines.append("| backend/dtype | " + " | ".join(f"T({w}) ms" for w in widths) + " |")
    lines.append("|---|" + "---|" * len(widths))
    for label, curve in document["curves"].items():
        lines.append(f"| {label} | " + " | ".join(f"{curve['ms'][w]:.1f}" for w in widths) + " |")
    return "\n".join(lines)


def run_latency(config: LatencyConfig, progress: bool = True) -> dict:
    if config.threads:
        torch.set_num_threads(config.threads)

    def say(text: str) -> None:
        if progress:
            print(text, flush=True)

    for dtype in config.dtypes:
        config.compile.check_dtype(resolve_dtype(dtype), config.backends)
    info = {"processor": cpu_model(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "platform": platform.platform(),
            "device": config.device}
    curves = measure_curves(config, say)
    return {"format": "draftsmith.latency/1", "config": config_to_dict(config), "machine": machine_line(info),
            "machine_info": info, "curves": curves}


def main(argv: list[str]) -> dict:
    config, out = parse_document_command("draftsmith.eval.latency", __doc__, LatencyConfig, argv)
    document = run_latency(config)
    write_document(out, document, format_curves(document))
    return document


if __name__ == "__main__":
    exit_with(main)
