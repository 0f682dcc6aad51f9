"""The draft-vocabulary / feature-layer ablation table from one bench run.

    python scripts/ablation_table.py results/ablation_vocab_smollm2/bench.json \
        --out results/ablation_vocab_smollm2.md

For every `dgf:path=<run>/final` method of the bench: the drafter's shape (vocabulary, head, layers,
fusion, blocks, trainable parameters, from its manifest), the coverage of its draft vocabulary measured
on the bench's own plain-greedy outputs per suite (held-out text: the share of the target's tokens the
drafter can propose at all), training's held-out accuracy and tau, and per suite the bench's tau, draft
milliseconds per round and their ratio to one target step, and the speedup against both plain
baselines. A JSON with the same rows is written beside the markdown.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from draftsmith.config import option, parse_script
from draftsmith.errors import UserError, exit_with
from draftsmith.models.artifacts import read_json
from draftsmith.models.vocab import VOCAB_FILE, DraftVocab


def drafter_row(final: Path) -> dict:
    manifest = read_json(final / "manifest.json", "drafter manifest")
    drafter, after = manifest["drafter"], (manifest.get("eval") or {}).get("after") or {}
    config = read_json(final / "config.json", "drafter config")
    return {"vocab": config.get("draft_vocab_size") or config["vocab_size"], "head": drafter.get("head"),
            "layers": drafter.get("feature_layers"), "fusion": config["fusion"],
            "layer_fusion": config.get("layer_fusion") if len(drafter.get("feature_layers") or []) > 1 else "-",
            "blocks": drafter["num_blocks"], "parameters_m": drafter["parameters"] / 1e6,
            "train_top1": after.get("eval/step0_top1"), "train_tau": after.get("eval/tau"),
            "steps": (manifest.get("training") or {}).get("steps")}


def coverage(final: Path, rows: list[dict], suite: str) -> float | None:
    """Share of plain greedy's tokens (this suite's prompts) inside the drafter's draft vocabulary."""
    if not (final / VOCAB_FILE).is_file():
        return 1.0
    allowed = set(DraftVocab.load(final).draft_to_target.tolist())
    tokens = [t for row in rows if row["suite"] == suite for t in row["plain"]["tokens"]]
    return sum(t in allowed for t in tokens) / len(tokens) if tokens else None


def table(results: dict) -> tuple[list[dict], list[str]]:
    summary, per_prompt = results["summary"], results["per_prompt"]
    out = []
    for label, entry in summary.items():
        if not label.startswith("dgf:"):
            continue
        final = Path(label.split("path=", 1)[1].split(",", 1)[0])
        row = {"variant": final.parent.name, **drafter_row(final)}
        for suite, sub in entry["by_suite"].items():
            row[suite] = {"coverage": coverage(final, per_prompt, suite), "tau": sub["tau"],
                          "draft_ms": sub.get("draft_ms_per_round"), "speedup_plain": sub.get("speedup"),
                          "speedup_compiled": sub.get("speedup_compiled")}
        row["draft_step_ratio"] = entry.get("draft_step_ratio")
        out.append(row)
    return out, list(results["suites"])


def fmt(value, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def markdown(rows: list[dict], suites: list[str], results: dict) -> str:
    machine = results["machine"]
    head = ["variant", "vocab", "head", "layers", "fusion", "M", "params (M)", "train top1", "train tau"]
    for suite in suites:
        head += [f"{suite} coverage", f"{suite} tau", f"{suite} draft ms", f"{suite} x plain", f"{suite} x compiled"]
    lines = [f"Machine: {json.dumps(machine, default=str)[:300]}", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["variant"], str(row["vocab"]), str(row["head"]), str(row["layers"]),
                 f"{row['fusion']}/{row['layer_fusion']}", str(row["blocks"]), fmt(row["parameters_m"]),
                 fmt(row["train_top1"]), fmt(row["train_tau"])]
        for suite in suites:
            sub = row.get(suite, {})
            cells += [fmt(sub.get("coverage"), ".1%"), fmt(sub.get("tau")), fmt(sub.get("draft_ms"), ".1f"),
                      fmt(sub.get("speedup_plain")), fmt(sub.get("speedup_compiled"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@dataclass
class AblationTableConfig:
    bench_json: str = option(help="a bench.json (also the first bare word)")
    out: str = option(help="markdown path (a .json with the rows goes beside it)")


def main(argv: list[str]) -> int:
    args = parse_script("scripts/ablation_table.py", __doc__, AblationTableConfig, argv, positional=("bench_json",))
    path = Path(args.bench_json)
    if not path.is_file():
        raise UserError(f"{path}: no such bench.json")
    results = json.loads(path.read_text())
    rows, suites = table(results)
    text = markdown(rows, suites, results)
    Path(args.out).write_text(text)
    Path(args.out).with_suffix(".json").write_text(json.dumps({"bench": str(path), "rows": rows}, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    exit_with(main)
