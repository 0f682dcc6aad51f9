"""A/B of the batch-invariant kernels' sources: the working tree's models/native/ against a git revision's, timed
on one target-shaped step of linear layers (or of attention) in alternating processes.

    python -m draftsmith.eval.kernel_ab baseline=HEAD "isas=[avx512_bf16, avx2]" "precisions=[float32, w8a8]" \\
        output=results/<study>/kernel_ab.json

One step is every Linear of the target's decoder and its LM head as the engine runs them (the target built from its
config with random weights, then models.kernels.invariant_model: q/k/v and gate/up joined, one weight arena; the
linears eval.roofline times as its "linear" and "LM head" parts), called in order for w rows: the part of T(w) that
the kernels decide, with no attention, norms or graph around it. `parts=[attention]` times instead the step's
attention calls: one per decoder layer, w query rows (a chain: each sees the context and the rows before it) over
`context_tokens` cached keys, each layer with its own cache of the engine's capacity, all in one huge-page arena as
the engine's (models.kernels.arena_zeros). Each (sources, instruction set, part, precision) runs in a fresh process,
the two sources alternating `rounds` times, because these VMs' memory bandwidth moves by minutes: compare a baseline
cell with the candidate cell of the same round. Medians of `repeats` steps per width, the widths interleaved.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import transformers

from draftsmith.config import ConfigError, TextEnum, check_config, config_to_dict, option
from draftsmith.errors import UserError, exit_with
from draftsmith.eval.documents import cpu_model, parse_document_command, write_document
from draftsmith.eval.roofline import head_dim, model_linears
from draftsmith.models import kernels
from draftsmith.models.kernels import KernelIsa
from draftsmith.models.bundled import DEFAULT_TARGET
from draftsmith.models.registry import resolve_model_path

REPOSITORY = Path(__file__).resolve().parents[1]


class StepPrecision(TextEnum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    INT8 = "int8"  # weight-only, float32 activations
    W8A8 = "w8a8"


class StepPart(TextEnum):
    LINEARS = "linears"  # every Linear of the decoder and the LM head
    ATTENTION = "attention"  # every layer's attention over the cache


# activations' dtype and the InvariantLinear's stored weights, per precision
PRECISION_PARTS = {StepPrecision.FLOAT32: (torch.float32, kernels.WeightPrecision.MODEL),
                   StepPrecision.BFLOAT16: (torch.bfloat16, kernels.WeightPrecision.MODEL),
                   StepPrecision.INT8: (torch.float32, kernels.WeightPrecision.INT8),
                   StepPrecision.W8A8: (torch.float32, kernels.WeightPrecision.W8A8)}


@dataclass
class KernelABConfig:
    baseline: str = option("HEAD", "the git revision whose models/native/ is the baseline (the candidate: the "
                                   "working tree's)")
    target: str = option(DEFAULT_TARGET, "the model whose shapes make the step (its config.json; weights random)")
    precisions: list[StepPrecision] = option(factory=lambda: [StepPrecision.FLOAT32], help="precisions timed")
    isas: list[KernelIsa] = option(factory=list, help="instruction sets forced (DRAFTSMITH_KERNEL_ISA; at most the "
                                                     "CPU's own); empty: the CPU's best")
    parts: list[StepPart] = option(factory=lambda: [StepPart.LINEARS], help="the step's parts timed")
    context_tokens: int = option(256, "attention: cached keys each row sees before the step's own", ge=1)
    capacity: int = option(1024, "attention: KV-cache slots per layer (the compiled engine's default)", ge=2)
    widths: list[int] = option(factory=lambda: [1, 4, 8, 16], help="rows per step", ge=1)
    repeats: int = option(10, "timed steps per width (the median is reported)", ge=1)
    rounds: int = option(2, "alternations of the baseline and candidate processes", ge=1)
    threads: int = option(2, "torch CPU threads", ge=1)
    output: str | None = option(None, "JSON path (a markdown table is written beside it); null: print only")

    def __post_init__(self):
        check_config(self)
        if self.context_tokens + max(self.widths) > self.capacity:
            raise ConfigError(f"context_tokens={self.context_tokens} + the widest step ({max(self.widths)}) exceed "
                            f"capacity={self.capacity}")


def step_linears(model_directory: str, precision: StepPrecision) -> list[kernels.InvariantLinear]:
    """The decoder's InvariantLinears in order, then the LM head, of the model at `model_directory` built from its
    config with random weights, on the kernels in `precision`."""
    dtype, weights = PRECISION_PARTS[precision]
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_directory))
    linears, head = model_linears(kernels.invariant_model(model.to(dtype), weights))
    return [*linears, head]


def baseline_sources(revision: str, into: Path) -> Path:
    """models/native/ at `revision`, written under `into`."""
    directory = into / "native"
    directory.mkdir(parents=True)
    for name in kernels.SOURCES:
        shown = subprocess.run(["git", "-C", str(REPOSITORY), "show", f"{revision}:models/native/{name}"],
                               capture_output=True)
        if shown.returncode:
            raise UserError(f"baseline={revision}: git has no models/native/{name} there "
                            f"({shown.stderr.decode().strip().splitlines()[-1] if shown.stderr else 'no git'})")
        (directory / name).write_bytes(shown.stdout)
    return directory


def same_sources(first: Path, second: Path) -> bool:
    return all((first / name).read_bytes() == (second / name).read_bytes() for name in kernels.SOURCES)


def linears_step(spec: dict) -> Callable[[int], None]:
    """The step of linear layers of w rows."""
    precision = StepPrecision(spec["precision"])
    linears = step_linears(spec["model"], precision)
    dtype = PRECISION_PARTS[precision][0]
    inputs = {w: {k: torch.randn(w, k, dtype=dtype) for k in {m.in_features for m in linears}} for w in spec["widths"]}

    def step(w: int) -> None:
        for linear in linears:
            linear(inputs[w][linear.in_features])
    return step


def attention_step(spec: dict) -> Callable[[int], None]:
    """The step's attention calls for w rows of a chain over spec['context_tokens'] cached keys, layer by layer."""
    config = transformers.AutoConfig.from_pretrained(spec["model"])
    dtype = PRECISION_PARTS[StepPrecision(spec["precision"])][0]
    heads, kv_heads, dim = config.num_attention_heads, config.num_key_value_heads, head_dim(config)
    generator = torch.Generator().manual_seed(0)
    shape = (2, 1, kv_heads, spec["capacity"], dim)
    caches = kernels.arena_zeros([torch.empty(shape, dtype=dtype) for _ in range(config.num_hidden_layers)])
    for cache in caches:
        cache.copy_(torch.randn(shape, generator=generator))
    queries = {w: torch.randn(1, heads, w, dim, generator=generator).to(dtype) for w in spec["widths"]}
    context, masks = spec["context_tokens"], {}
    for w in spec["widths"]:
        visible = torch.arange(spec["capacity"]) < context + torch.arange(1, w + 1)[:, None]
        masks[w] = torch.where(visible, 0.0, torch.finfo(torch.float32).min)[None, None]

    def step(w: int) -> None:
        for keys, values in caches:
            torch.ops.draftsmith.attention(queries[w], keys, values, masks[w], dim ** -0.5)
    return step


STEPS = {StepPart.LINEARS: linears_step, StepPart.ATTENTION: attention_step}
PART_WORDS = {StepPart.LINEARS: "linear layers", StepPart.ATTENTION: "attention calls"}


def time_step(spec: dict) -> dict:
    """In a fresh process: the kernels' instruction set and the median ms of one step per width, on the kernels built
    from spec['sources']."""
    kernels.use_sources(Path(spec["sources"]))
    kernels.load_kernels()
    torch.set_num_threads(spec["threads"])
    run = STEPS[StepPart(spec["part"])](spec)

    def step(w: int) -> float:
        tick = time.perf_counter()
        run(w)
        return time.perf_counter() - tick

    seconds = {w: [] for w in spec["widths"]}
    with torch.inference_mode():
        for w in spec["widths"]:
            step(w)
        for _ in range(spec["repeats"]):
            for w in spec["widths"]:
                seconds[w].append(step(w))
    medians = {str(w): 1000 * statistics.median(values) for w, values in seconds.items()}
    return {"isa": kernels.kernel_isa(), "ms": medians}


def child_main() -> None:
    print(json.dumps(time_step(json.loads(sys.argv[1]))))


def run_child(spec: dict, isa: KernelIsa | None) -> dict:
    env = dict(os.environ) | ({"DRAFTSMITH_KERNEL_ISA": str(isa)} if isa else {})
    command = [sys.executable, "-c", "from draftsmith.eval.kernel_ab import child_main; child_main()", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"the {spec['label']} kernels did not run ({last[:200]})")
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_ab(document: dict) -> str:
    widths = document["config"]["widths"]
    parts = " / ".join(PART_WORDS[StepPart(part)] for part in document["config"].get("parts", [StepPart.LINEARS]))
    lines = [f"Kernel A/B on {document['cpu']}: a {document['target']}-shaped step of {parts}, median ms "
             f"(T(w)/T(1)); baseline = models/native/ at {document['config']['baseline']}, candidate = the working "
             "tree; one fresh process per cell, the two alternating each round.", "",
             "| isa | part | precision | round | sources | " + " | ".join(f"T({w})" for w in widths) + " |",
             "|---|---|---|---|---|" + "---|" * len(widths)]
    for cell in document["cells"]:
        first = cell["ms"][str(widths[0])]
        times = " | ".join(f"{cell['ms'][str(w)]:.2f} ({cell['ms'][str(w)] / first:.2f})" for w in widths)
        lines.append(f"| {cell['isa']} | {cell.get('part', StepPart.LINEARS)} | {cell['precision']} | {cell['round']} "
                     f"| {cell['sources']} | {times} |")
    return "\n".join(lines)


def main(argv: list[str]) -> dict:
    config, out = parse_document_command("draftsmith.eval.kernel_ab", __doc__, KernelABConfig, argv)
    model_directory = Path(resolve_model_path(config.target))
    if not (model_directory / "config.json").is_file():
        raise UserError(f"target={config.target}: no config.json at {model_directory}")
    cells = []
    with tempfile.TemporaryDirectory() as scratch:
        baseline = baseline_sources(config.baseline, Path(scratch))
        if same_sources(baseline, kernels.SOURCE_DIRECTORY):  # one build serves both (its directory is the digest's)
            baseline = kernels.SOURCE_DIRECTORY
        sources = {"baseline": baseline, "candidate": kernels.SOURCE_DIRECTORY}
        for isa, part, precision, round_index, (label, directory) in itertools.product(
                config.isas or [None], config.parts, config.precisions, range(1, config.rounds + 1), sources.items()):
            spec = {"label": label, "sources": str(directory), "threads": config.threads, "precision": str(precision),
                    "model": str(model_directory), "widths": config.widths, "repeats": config.repeats,
                    "part": str(part), "context_tokens": config.context_tokens, "capacity": config.capacity}
            cells.append({"part": str(part), "precision": str(precision), "round": round_index, "sources": label}
                         | run_child(spec, isa))
    document = {"format": "draftsmith.kernel_ab/1", "config": config_to_dict(config), "cpu": cpu_model(),
                "target": config.target, "cells": cells}
    write_document(out, document, format_ab(document))
    return document


if __name__ == "__main__":
    exit_with(main)
