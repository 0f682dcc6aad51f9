"""What the engine benches (llama.cpp's, OpenVINO's) share: the config of prompts, PyTorch baselines and output,
running every method on every prompt turn (interleaved, or each beside its own plain baseline when they do not fit
in memory together), the summary per method and per suite, the JSON document and the table. Each engine's bench
adds its target, methods and how it opens a server or worker (anything with `complete(ids, max_new_tokens)`).

With `pytorch_baselines`, the toolkit's plain decoding on its compiled engine answers like one more server, in this
process, on each prompt turn beside the engine's plain decoding (in the first group), so the two engines are timed in
the same minutes; HF `generate` and `pytorch_methods` then run on the same prompts after (tau, lossless)."""

from __future__ import annotations

import contextlib
import gc
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Literal

import torch

from draftsmith.config import check_config, config_to_dict, option
from draftsmith.data.chat import prompt_ids
from draftsmith.eval.bench.methods import MethodSpec, check_labels, parse_method
from draftsmith.eval.bench.run import WARMUP_MESSAGES, BenchConfig, carryover_balanced, mean_ci, run_benchmark
from draftsmith.eval.documents import cpu_isa, cpu_model, parse_document_command, write_document
from draftsmith.eval.prompts import (PromptSettings, check_suites, num_turns, prompt_options, select_conversations,
                                    turn_input_ids)
from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.models.compiled import CompileSettings, machine_load
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import WeightPrecision
from draftsmith.models.target import TargetModel

PLAIN_LABEL = "plain"  # every engine's plain decoding: the baseline each method is measured and checked against


@dataclass
class PlainOptions:
    pass


@dataclass
class EngineBenchConfig(PromptSettings):
    """What every engine's bench (llama.cpp's, OpenVINO's) shares: the prompts, their lengths, the PyTorch baselines
    beside them and the output; each engine adds its target, methods and threads. `plain` is the engine's baseline
    spec, run first whether named or not."""

    plain: ClassVar[MethodSpec]
    pytorch_baselines: bool = option(True, "also time the toolkit's plain decoding (compiled: on each prompt turn "
                                           "beside the engine's; HF generate: after) on the same prompts")
    pytorch_dtype: Literal["float32", "bfloat16"] = option("float32", "the PyTorch target's dtype")
    pytorch_weights: WeightPrecision = option(WeightPrecision.MODEL, "the compiled PyTorch target's weights: model "
                                              "(its dtype), int8 (weight-only) or w8a8 (int8 weights and inputs)")
    pytorch_methods: list[MethodSpec] = option(factory=list, help="the toolkit's methods run beside its baselines "
                                                                  "(bench specs, e.g. a cascade)")
    output: str | None = option(None, "where the JSON goes (the table beside it as .md); null: print only")

    def __post_init__(self) -> None:
        check_config(self)
        check_suites(self.suites)
        check_labels(self.methods)
        if self.plain not in self.methods:
            self.methods.insert(0, self.plain)


def fits_in_memory(need_bytes: float) -> bool:
    """Whether an engine's processes needing this much fit in memory with room to spare."""
    available = machine_load()["available_memory_gb"] * 2 ** 30  # MemAvailable: the page cache counts as free
    if available < 0:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return need_bytes < 0.7 * available


def one_request(server, ids: list[int], max_new_tokens: int) -> dict:
    reply = server.complete(ids, max_new_tokens)
    timings = reply.get("timings", {})
    seconds = (timings.get("prompt_ms", 0.0) + timings.get("predicted_ms", 0.0)) / 1000
    run = {"tokens": reply["tokens"], "seconds": seconds, "new_tokens": timings.get("predicted_n", len(reply["tokens"])),
           "drafted": timings.get("draft_n", 0), "accepted": timings.get("draft_n_accepted", 0)}
    if "target_steps" in timings:  # an engine that counts its target steps (OpenVINO) gives the exact mean length
        run["target_steps"] = timings["target_steps"]
    return run


def prompt_turns(config: EngineBenchConfig) -> list[tuple[str, object]]:
    return [(suite, conv) for suite in config.suites
            for conv in select_conversations(suite, config.num_prompts, config.seed)]


def run_turns(config: EngineBenchConfig, servers: dict, tokenizer, rows: list) -> None:
    """Each method on each prompt turn, back to back in a carryover-balanced order (each runs right after each other
    one equally often: `carryover_balanced`); turn k + 1 continues from the engine's plain answer."""
    for suite, conv in prompt_turns(config):
        answers: list[str] = []
        for turn in range(1, num_turns(conv, config.turns) + 1):
            ids = turn_input_ids(tokenizer, conv, answers)[0].tolist()
            specs = list(servers)
            replies = {specs[i]: one_request(servers[specs[i]], ids, config.max_new_tokens)
                       for i in carryover_balanced(len(specs), len(rows))}
            row = {"suite": suite, "id": conv.id, "turn": turn, "prompt_tokens": len(ids),
                   "runs": {str(spec): replies[spec] for spec in specs}}
            rows.append(row)
            plain = row["runs"][PLAIN_LABEL]["tokens"]
            answers.append(tokenizer.decode(plain, skip_special_tokens=True).strip())


def warm_up(server, tokenizer) -> None:
    server.complete(prompt_ids(tokenizer, WARMUP_MESSAGES), 16)  # the PyTorch bench's warm-up prompt


def toolkit_label(config: EngineBenchConfig) -> str:
    """The toolkit's plain decoding's row: its engine and precision."""
    weights = config.pytorch_weights.label
    return f"toolkit plain-compiled ({config.pytorch_dtype}{', ' + weights if weights else ''})"


class ToolkitPlain:
    """The toolkit's plain decoding on its compiled engine (`pytorch_dtype`, `pytorch_weights`, `threads` torch
    threads), answering like an engine's server: the reply's tokens end with the end-of-sequence token where one
    came, as llama.cpp's do, and its timings are the prefill and the decoding after it."""

    def __init__(self, config: EngineBenchConfig):
        torch.set_num_threads(config.threads)
        self.target = TargetModel.from_pretrained(config.target, dtype=config.pytorch_dtype, backend=Backend.COMPILED,
                                                  settings=CompileSettings(weights=config.pytorch_weights))
        self.target.prepare()
        gc.freeze()  # as the PyTorch bench does after its warm-up: the model and graphs leave the collector's scans

    def __enter__(self) -> "ToolkitPlain":
        return self

    def __exit__(self, *exc) -> None:
        self.target.release()

    def complete(self, ids: list[int], max_new_tokens: int) -> dict:
        config = DecodeConfig(max_new_tokens=max_new_tokens, prefix_cache=False)  # as the servers' cache_prompt
        decoder = SpeculativeDecoder(self.target, config=config)
        result = decoder.generate(torch.tensor([ids]))
        stats = result.stats
        return {"tokens": result.tokens, "timings": {"prompt_ms": 1000 * stats.prefill_s,
                                                     "predicted_n": len(result.tokens),
                                                     "predicted_ms": 1000 * (stats.total_s - stats.prefill_s)}}


def run_groups(config: EngineBenchConfig, interleaved: bool, open_method, tokenizer) -> list:
    """Every method at once (interleaved), else each method beside its own plain baseline in turn. `open_method`
    gives a method's server or worker as a context manager; each is warmed up, then every prompt turn goes through
    the group's methods in turn (the first group's with the toolkit's plain decoding, under `pytorch_baselines`)."""
    methods = config.methods
    groups = [list(methods)] if interleaved else [[config.plain, spec] for spec in methods if spec != config.plain]
    rows: list = []
    for index, group in enumerate(groups or [[config.plain]]):
        with contextlib.ExitStack() as stack:
            running = {spec: stack.enter_context(open_method(spec)) for spec in group}
            if config.pytorch_baselines and index == 0:
                running[toolkit_label(config)] = stack.enter_context(ToolkitPlain(config))
            for server in running.values():
                warm_up(server, tokenizer)
            group_rows: list = []
            run_turns(config, running, tokenizer, group_rows)
        rows = merge_rows(rows, group_rows)
    return rows


def merge_rows(rows: list, more: list) -> list:
    """One method's group (run beside its own plain server) into the rows; its plain runs are kept as the
    `paired_plain` its speedup is measured against."""
    if not rows:
        return more
    for row, extra in zip(rows, more):
        for label, run in extra["runs"].items():
            if label != PLAIN_LABEL:
                row["runs"][label] = run
                row.setdefault("paired_plain", {})[label] = extra["runs"][PLAIN_LABEL]
    return rows


def mean_accepted_length(runs: list[dict]) -> float | None:
    """Tokens per target step: counted steps where the engine reports them, else generated / (generated -
    accepted) (llama.cpp: each step yields one token beyond the accepted drafts)."""
    new, accepted = sum(r["new_tokens"] for r in runs), sum(r["accepted"] for r in runs)
    if all("target_steps" in r for r in runs):
        return new / sum(r["target_steps"] for r in runs)
    return new / (new - accepted) if new > accepted else None


def suite_speedups(rows: list, runs: list[dict], plain: list[dict]) -> dict[str, float]:
    """Per suite (in the rows' order): the plain runs' seconds over the method's, on that suite's prompt turns."""
    out = {}
    for suite in dict.fromkeys(row["suite"] for row in rows):
        pairs = [(run, base) for row, run, base in zip(rows, runs, plain) if row["suite"] == suite]
        seconds = sum(run["seconds"] for run, _ in pairs)
        out[suite] = sum(base["seconds"] for _, base in pairs) / seconds if seconds else float("nan")
    return out


def summarize(rows: list, labels: list[str]) -> dict:
    summary = {}
    for label in labels:
        runs = [row["runs"][label] for row in rows]
        plain = [row.get("paired_plain", {}).get(label, row["runs"][PLAIN_LABEL]) for row in rows]
        seconds, new = sum(r["seconds"] for r in runs), sum(r["new_tokens"] for r in runs)
        drafted, accepted = sum(r["drafted"] for r in runs), sum(r["accepted"] for r in runs)
        ratio, half = mean_ci([p["seconds"] / r["seconds"] for r, p in zip(runs, plain) if r["seconds"] > 0])
        differs = [f"{row['suite']}/{row['id']}/t{row['turn']}" for row, run, base in zip(rows, runs, plain)
                   if run["tokens"] != base["tokens"]]
        summary[label] = {"tokens_per_s": new / seconds if seconds else float("nan"),
                          "speedup": sum(p["seconds"] for p in plain) / seconds if seconds else float("nan"),
                          "speedup_per_prompt": ratio, "speedup_ci95": half, "drafted": drafted, "accepted": accepted,
                          "acceptance": accepted / drafted if drafted else None,
                          "mean_accepted_length": mean_accepted_length(runs),
                          "speedup_per_suite": suite_speedups(rows, runs, plain),
                          "differs_from_plain": differs, "prompts": len(runs)}
    return summary


def pytorch_baselines(config: EngineBenchConfig) -> dict:
    """tokens/s (and tau, lossless) of the toolkit's plain baselines and `pytorch_methods` on the same prompts, in
    `pytorch_dtype` with `pytorch_weights` on the compiled engine."""
    bench = BenchConfig(target=config.target, methods=[parse_method("plain"), *config.pytorch_methods],
                        **prompt_options(config), threads=config.threads, plots=False,
                        dtype=config.pytorch_dtype, compile=CompileSettings(weights=config.pytorch_weights))
    results = run_benchmark(bench, progress=False)
    return {label: {"tokens_per_s": entry["tokens_per_s"], "tau": entry["tau"],
                    "lossless": not entry["mismatches"], "dtype": config.pytorch_dtype,
                    "weights": config.pytorch_weights.value} for label, entry in results["summary"].items()}


def document_config(config: EngineBenchConfig) -> dict:
    """The config as the JSON records it: plain values, every method (the engine's and PyTorch's) as its spec."""
    return config_to_dict(config) | {"methods": [str(spec) for spec in config.methods]}


def bench_document(config: EngineBenchConfig, rows: list, interleaved: bool, started: float, engine: dict,
                   target_file: dict) -> dict:
    """An engine bench's JSON: its config, the engine's pins, the machine, the summary and the rows, and the
    PyTorch baselines on the same prompts when asked for."""
    labels = [str(spec) for spec in config.methods]
    if config.pytorch_baselines:  # run_groups ran it on every prompt turn
        labels.append(toolkit_label(config))
    document = {"config": document_config(config), **engine,
                "machine": {"cpu": cpu_model(), "isa": cpu_isa(), "threads": config.threads, **target_file},
                "interleaved": interleaved, "seconds": round(time.time() - started, 1),
                "summary": summarize(rows, labels), "rows": rows}
    if config.pytorch_baselines:
        document["pytorch"] = pytorch_baselines(config)
    return document


def engine_table(document: dict, engine: str, baseline: str, target: str) -> str:
    """The table of an engine's bench (llama.cpp's, OpenVINO's): one row per method against `baseline` plain."""
    config, machine = document["config"], document["machine"]
    order = "interleaved per prompt turn" if document["interleaved"] else "one method after another (memory)"
    isa = f" ({machine['isa']})" if machine.get("isa") else ""
    lines = [f"{engine} | target {target} | {machine['cpu']}{isa}, {machine['threads']} threads | "
             f"{document['summary'][PLAIN_LABEL]['prompts']} prompt turns, {config['max_new_tokens']} new tokens, "
             f"greedy | {order}", "",
             f"| method | tokens/s | speedup vs {baseline} plain | per-prompt (95% CI) | accepted / drafted | "
             "mean accepted length | outputs = plain |", "|---|---|---|---|---|---|---|"]
    for label, entry in document["summary"].items():
        rate = ("-" if entry["acceptance"] is None
                else f"{entry['accepted']}/{entry['drafted']} ({entry['acceptance']:.2f})")
        length = "-" if entry["mean_accepted_length"] is None else f"{entry['mean_accepted_length']:.2f}"
        same = f"{entry['prompts'] - len(entry['differs_from_plain'])}/{entry['prompts']}"
        lines.append(f"| {label} | {entry['tokens_per_s']:.1f} | {entry['speedup']:.2f}x | "
                     f"{entry['speedup_per_prompt']:.2f}x ± {entry['speedup_ci95']:.2f} | {rate} | {length} | "
                     f"{same} |")
    for label, entry in document.get("pytorch", {}).items():
        precision = {"float32": "fp32", "bfloat16": "bf16"}[entry.get("dtype", "float32")]
        weights = WeightPrecision(entry.get("weights", WeightPrecision.MODEL.value)).label
        precision += f", {weights}" if weights else ""
        tau = f"{entry['tau']:.2f} (tau)" if entry.get("tau") else "-"
        lossless = {True: "lossless", False: "NOT lossless"}.get(entry.get("lossless"), "-")  # written with tau
        lines.append(f"| PyTorch {label} ({precision}, this toolkit) | {entry['tokens_per_s']:.1f} | - | - | - | "
                     f"{tau} | {lossless} |")
    return "\n".join(lines + suite_table(document["summary"], baseline))


def suite_table(summary: dict, baseline: str) -> list[str]:
    """Speedup per suite against the engine's plain decoding (the PyTorch bench's per-suite columns)."""
    suites = list(dict.fromkeys(suite for entry in summary.values() for suite in entry.get("speedup_per_suite", {})))
    if not suites:
        return []
    lines = ["", f"Per suite (speedup vs {baseline} plain):", "", "| method | " + " | ".join(suites) + " |",
             "|---|" + "---|" * len(suites)]
    for label, entry in summary.items():
        cells = [f"{entry['speedup_per_suite'][suite]:.2f}x" if suite in entry.get("speedup_per_suite", {}) else "-"
                 for suite in suites]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def engine_main(module: str, doc: str, config_cls: type, run: Callable, log_dir: Path, table: Callable,
                argv: list[str]) -> dict:
    """An engine bench's command: its config from the command line, the run (server logs in `log_dir`), then the
    JSON and the table."""
    config, out = parse_document_command(module, doc, config_cls, argv)
    document = run(config, log_dir)
    write_document(out, document, table(document))
    return document
