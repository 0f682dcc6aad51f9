"""Reports of eval.bench runs: the markdown tables, PNG plots (matplotlib, Agg backend) and W&B logging.

    python -m draftsmith.eval.bench.report <run>/bench.json   # print a finished run's tables (this version's)

Plots, written beside the run's JSON (`x.json` -> `x_<name>.png`):
  acceptance     per-depth acceptance a_k of every method with a drafter (one line per method)
  category_tps   tokens/s per category (MT-Bench categories, GSM8K, ...), one bar per method
  speedup_budget speedup vs tree size (mean draft tokens verified per round), one line per method
                 family, drawn only when some family (e.g. lm-tree, medusa, dgf) appears with several
                 budgets in the run
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from draftsmith.config import flatten_dict
from draftsmith.errors import UserError, exit_with
from draftsmith.eval.bench.methods import PLAIN_COMPILED
from draftsmith.tracking import prepare_wandb_env


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only (pyplot is imported after choosing the backend)
    import matplotlib.pyplot as plt

    return plt


def budget_series(summary: dict) -> dict[str, list[tuple[float, float, str]]]:
    """{family: [(tree tokens per round, speedup, spec), ...]} for families with >= 2 sizes (the bench
    records each method's family: its spec without size options)."""
    series: dict[str, list] = {}
    for spec, entry in summary.items():
        width, speedup = entry.get("tree_tokens_per_round"), entry.get("speedup")
        if width is None or speedup is None or spec in ("plain", "loop-plain"):
            continue
        series.setdefault(entry.get("family", spec), []).append((width, speedup, spec))
    return {family: sorted(points) for family, points in series.items()
            if len({round(p[0], 6) for p in points}) >= 2}


def write_plots(results: dict, out: str | Path) -> list[Path]:
    """Write the PNG plots of a bench result next to `out` (a .json path); returns the files."""
    plt = _pyplot()
    out = Path(out)
    stem = out.with_suffix("")
    summary = results["summary"]
    config = results["config"]
    target = results["models"]["target"]
    title = f"{target} | {' '.join(results['suites'])} | T={config.get('temperature', 0.0)}"
    written = []

    figure, axes = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for method, entry in summary.items():
        depths = entry.get("depth_acceptance") or {}
        if depths:
            x = [int(k) for k in depths]
            axes.plot(x, list(depths.values()), marker="o", label=method)
            drawn += 1
    axes.set_xlabel("draft depth k")
    axes.set_ylabel("acceptance a_k = P(depth k accepted | depth k-1 accepted)")
    axes.set_ylim(0, 1.05)
    axes.set_title(f"Per-depth acceptance\n{title}", fontsize=9)
    if drawn:
        axes.legend(fontsize=7)
        axes.xaxis.get_major_locator().set_params(integer=True)
    else:
        axes.text(0.5, 0.5, "no drafter in this run", ha="center", transform=axes.transAxes)
    written.append(_save(figure, plt, f"{stem}_acceptance.png"))

    categories = list(next(iter(summary.values()), {}).get("by_category", {}))
    figure, axes = plt.subplots(figsize=(max(7, 0.9 * len(categories) * max(len(summary), 1) ** 0.5 + 3), 4.5))
    bar_width = 0.8 / max(len(summary), 1)
    for index, (method, entry) in enumerate(summary.items()):
        values = [entry["by_category"].get(c, {}).get("tokens_per_s", math.nan) for c in categories]
        axes.bar([i + index * bar_width for i in range(len(categories))], values, bar_width, label=method)
    axes.set_xticks([i + 0.4 - bar_width / 2 for i in range(len(categories))])
    axes.set_xticklabels(categories, rotation=30, ha="right", fontsize=8)
    axes.set_ylabel("tokens/s")
    axes.set_title(f"Tokens/s per category\n{title}", fontsize=9)
    axes.legend(fontsize=7)
    written.append(_save(figure, plt, f"{stem}_category_tps.png"))

    series = budget_series(summary)
    if series:
        figure, axes = plt.subplots(figsize=(7, 4.5))
        for family, points in series.items():
            axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=family)
        axes.axhline(1.0, color="gray", linestyle="--", linewidth=0.8)
        axes.set_xlabel("tree size (mean draft tokens verified per round)")
        axes.set_ylabel("speedup vs plain")
        axes.set_title(f"Speedup vs budget\n{title}", fontsize=9)
        axes.legend(fontsize=7)
        written.append(_save(figure, plt, f"{stem}_speedup_budget.png"))
    return written


def _save(figure, plt, path: str) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return Path(path)


def log_wandb(results: dict, project: str, output_dir: str | None, files: list[Path] = ()) -> str:
    """One W&B run per bench run: config, a summary table, per-method metrics, plots as images and
    all files as an artifact. Offline mode when there is no network (an explicit WANDB_MODE wins);
    returns the run directory."""
    import wandb

    out_dir = Path(os.environ.get("WANDB_DIR") or "outputs")  # W&B's files stay out of results/
    out_dir.mkdir(parents=True, exist_ok=True)
    mode = prepare_wandb_env(out_dir)
    name = Path(output_dir).name if output_dir else None
    run = wandb.init(project=project, name=name, dir=str(out_dir), mode=mode, job_type="bench",
                     config=flatten_dict({"bench": results["config"], "machine": results["machine"]}))
    try:
        columns = ["method", "tokens_per_s", "tau", "speedup", "speedup_ci95", "tree_tokens_per_round", "mismatches"]
        table = wandb.Table(columns=columns)
        metrics = {}
        for method, entry in results["summary"].items():
            table.add_data(method, entry["tokens_per_s"], entry["tau"], entry.get("speedup"),
                           entry.get("speedup_ci95"), entry.get("tree_tokens_per_round"), len(entry["mismatches"]))
            for key in ("tokens_per_s", "tau", "speedup", "speedup_ci95", "tree_tokens_per_round"):
                if entry.get(key) is not None:
                    metrics[f"{method}/{key}"] = entry[key]
            for depth, value in entry["depth_acceptance"].items():
                metrics[f"{method}/acceptance_depth{depth}"] = value
            for category, sub in entry.get("by_category", {}).items():
                metrics[f"{method}/tokens_per_s/{category}"] = sub["tokens_per_s"]
        metrics["summary"] = table
        for file in files:
            if file.suffix == ".png":
                metrics[f"plots/{file.stem}"] = wandb.Image(str(file))
        run.log(metrics)
        run.summary.update({k: v for k, v in metrics.items() if isinstance(v, (int, float))})
        if files:
            artifact = wandb.Artifact(name=f"bench-{name or run.id}".replace("/", "_"), type="bench-results")
            for file in files:
                artifact.add_file(str(file))
            run.log_artifact(artifact)
        return str(Path(run.dir).parent)
    finally:
        run.finish()


def _speed_text(entry: dict) -> str:
    if "speedup" not in entry:
        return "-"
    ci = entry["speedup_ci95"]
    return f"{entry['speedup']:.2f}x" + ("" if math.isnan(ci) else f" (±{ci:.2f})")


def format_table(results: dict) -> str:
    """Markdown: the summary table, then (for several suites / turns / categories) breakdowns, the compiled
    engines, and the run's settings and machine."""
    summary = results["summary"]
    return "\n".join(summary_lines(results) + label_lines(results) + breakdown_lines(summary)
                     + verify_width_lines(summary) + prefill_lines(results) + policy_lines(results)
                     + compile_lines(results) + ["", run_line(results)])


def label_lines(results: dict) -> list[str]:
    """The spec behind each label the config gave a method ({method: ..., label: ...})."""
    labelled = [entry for entry in results["config"].get("methods") or [] if isinstance(entry, dict)]
    if not labelled:
        return []
    return ["", "Labelled methods:", ""] + [f"- **{entry['label']}**: `{entry['method']}`" for entry in labelled]


def prefill_lines(results: dict) -> list[str]:
    """Greedy runs with plain-compiled: each method's prompt prefill (the target's forward over the prompt: the same
    work for every method, which no drafter shortens) and its speedup over plain-compiled without it."""
    summary = results["summary"]
    base = summary.get(str(PLAIN_COMPILED))
    if results["config"].get("temperature", 0.0) > 0 or not base or not base.get("prefill_s"):
        return []
    base_decode = base["seconds"] - base["prefill_s"]
    rows = [f"| {method} | {entry['prefill_s']:.1f} | {entry.get('reused_tokens', 0):,} | "
            f"{entry['prefill_s'] / entry['seconds']:.0%} | "
            f"{base_decode / (entry['seconds'] - entry['prefill_s']):.2f}x |"
            for method, entry in summary.items() if entry.get("prefill_s")]
    prompt_tokens = sum(row["prompt_tokens"] for row in results.get("per_prompt") or [])
    return ["", f"The prompts' prefill (the target's forward over each prompt's tokens, {prompt_tokens:,} in all, but "
            "those a method's prefix cache held from its last prompt; the speedups above include it) and the speedup "
            "over plain-compiled without it:", "",
            "| method | prefill s | prompt tokens reused | share of its time | decode-only speedup |",
            "|---|---|---|---|---|"] + rows


def verify_width_lines(summary: dict, share: float = 0.05) -> list[str]:
    """The decode loop's verify cost by width (the widths holding at least `share` of a method's rounds)."""
    rows = []
    for method, entry in summary.items():
        rounds, ms = entry.get("verify_rounds_by_width") or {}, entry.get("verify_ms_by_width") or {}
        ratios, total = entry.get("verify_step_ratio_by_width") or {}, sum(rounds.values())
        cells = [f"{w}: {ms[w]:.1f} ms" + (f" ({ratios[w]:.2f}x)" if w in ratios else "") + f", {n / total:.0%}"
                 for w, n in rounds.items() if n >= share * total]
        if cells:
            rows.append(f"| {method} | " + "; ".join(cells) + " |")
    if not rows:
        return []
    return ["", "Verify forwards in the decode loop by width (tokens in the forward, root included): mean ms, x the "
            "same backend's plain step in the loop, share of the method's rounds:", "", "| method | by width |",
            "|---|---|"] + rows


def policy_lines(results: dict) -> list[str]:
    """The end-of-run state of the adaptive and composite methods (weights, lengths, which sub-drafter's
    tokens were accepted), as their `summary()` reported it."""
    policies = results.get("policies") or {}
    if not policies:
        return []
    lines = ["", "Method state at the end of the run:", ""]
    for label, info in policies.items():
        lines.append(f"- {label}: " + "; ".join(f"{key} {json.dumps(value)}" for key, value in info.items()))
    return lines


def summary_lines(results: dict) -> list[str]:
    sampled = results["config"].get("temperature", 0.0) > 0
    last = "lossless" if not sampled else "output check"
    compiled = any("speedup_compiled" in entry for entry in results["summary"].values())
    versus = " | vs plain-compiled | headline" if compiled else ""
    lines = [f"| method | backend | tokens/s | tau | speedup vs plain (95% CI){versus} | per-depth acceptance | "
             f"draft ms/round (x target step) | {last} |", "|---|---|---|---|---|" + ("---|---|" if compiled else "")
             + "---|---|---|"]
    for method, entry in results["summary"].items():
        tau = "-" if entry["tau"] is None else f"{entry['tau']:.2f}"
        depths = " ".join(f"{v:.2f}" for v in entry["depth_acceptance"].values()) or "-"
        if sampled:
            lossless = "sampled (not compared)"
        elif "other_kernels_differ" in entry:  # a plain baseline on other kernels: another arithmetic
            differ = len(entry["other_kernels_differ"])
            lossless = f"baseline on {entry['kernel_isa']}: " + (f"{differ} prompts differ" if differ else
                                                                 "same tokens")
        else:
            lossless = "yes" if not entry["mismatches"] else f"NO ({len(entry['mismatches'])} prompts)"
        draft = "-" if not entry.get("draft_ms_per_round") else \
            f"{entry['draft_ms_per_round']:.1f} ({entry.get('draft_step_ratio', float('nan')):.2f}x)"
        extra = ""
        if compiled:
            ci = entry.get("speedup_compiled_ci95", float("nan"))
            extra = (f" | {entry['speedup_compiled']:.2f}x" + ("" if math.isnan(ci) else f" (±{ci:.2f})")
                     + f" | **{entry['headline_speedup']:.2f}x** vs {entry['headline_baseline']}")
        lines.append(f"| {method} | {entry.get('backend', '-')} | {entry['tokens_per_s']:.2f} | {tau} | "
                     f"{_speed_text(entry)}{extra} | {depths} | {draft} | {lossless} |")
    return lines


def breakdown_lines(summary: dict) -> list[str]:
    """Per suite / per turn (tau / speedup) and per category (tokens/s), where there are several."""
    lines = []
    first = next(iter(summary.values()), {})
    for group, title in (("by_suite", "suite"), ("by_turn", "turn")):
        keys = list(first.get(group, {}))
        if len(keys) > 1:
            lines += ["", f"Per {title} (tau / speedup):", "",
                      "| method | " + " | ".join(f"{title} {k}" for k in keys) + " |",
                      "|---|" + "---|" * len(keys)]
            for method, entry in summary.items():
                cells = []
                for key in keys:
                    sub = entry[group].get(key)
                    tau = "-" if sub is None or sub["tau"] is None else f"{sub['tau']:.2f}"
                    cells.append(f"{tau} / {_speed_text(sub) if sub else '-'}")
                lines.append(f"| {method} | " + " | ".join(cells) + " |")
    keys = list(first.get("by_category", {}))
    if len(keys) > 1:
        lines += ["", "Tokens/s per category:", "", "| category | " + " | ".join(summary) + " |",
                  "|---|" + "---|" * len(summary)]
        for key in keys:
            lines.append(f"| {key} | " + " | ".join(
                f"{entry['by_category'][key]['tokens_per_s']:.2f}" if key in entry["by_category"] else "-"
                for entry in summary.values()) + " |")
    return lines


def run_line(results: dict) -> str:
    machine, config, models = results["machine"], results["config"], results["models"]
    sampled = config.get("temperature", 0.0) > 0
    load = machine.get("load_average_at_start")
    mode = f"temperature {config.get('temperature', 0.0)}" if sampled else "greedy"
    return (f"target {models['target']}, draft {models['draft']}, suites {' '.join(results['suites'])} "
            f"({config['num_prompts']} prompts per suite, up to {config.get('turns', 1)} turns, "
            f"{config['max_new_tokens']} new tokens, {mode}), "
            f"{machine['device']} {machine['dtype']}, {machine.get('processor', '')}"
            + (f" ({machine['isa']})" if machine.get("isa") else "")
            + (f", kernels {machine['kernel_isa']}" if machine.get("kernel_isa") else "")
            + f", {machine['cpu_count']} cores, {machine['torch_threads']} torch threads, {machine['platform']}"
            + (f", load average at start {load[0]:.2f}" if load else "") + memory_line(machine))


PAGING_SHARE = 0.01  # memory stalls above this share of the timed loop: its timings include paging


def memory_line(machine: dict) -> str:
    """The memory stalls during the timed loop, flagged where they are large enough to move the timings."""
    stall, loop = machine.get("memory_stall_s"), machine.get("timed_loop_s")
    if stall is None or not loop:
        return ""
    line = f"; memory stalls {stall:.1f} s of the {loop:.0f} s timed loop"
    if stall > PAGING_SHARE * loop:
        line += (" (**the models outgrew the RAM: timings include paging; rerun with fewer methods in one run or on "
                 "a machine with more memory**)")
    return line


def build_line(conditions: dict | None) -> str:
    """When and how busy the machine was while the packages were autotuned (a busy build keeps slow kernels)."""
    if not conditions:
        return ""
    line = (f" Built {conditions['built']} at load average {conditions['load_average_1min']:.1f} "
            f"({conditions['cpu_count']} cores), {conditions['available_memory_gb']:.1f} GB available")
    busy = conditions["load_average_1min"] > 1.5 * conditions["cpu_count"] or 0 <= conditions["available_memory_gb"] < 1
    return line + (": **built on a busy machine; its autotuned kernels may be slow: delete the folder and "
                   "rebuild on a quiet one**." if busy else ".")


def compile_lines(results: dict) -> list[str]:
    """Compile/load time of the compiled engines (never inside tokens/s) and where compiled greedy left
    HF eager greedy (float32 near-ties rounded differently by another kernel, with their margins)."""
    lines = []
    for key, info in (results.get("compile") or {}).items():
        lines.append(f"\nCompiled engine {info['model_type']} ({key}): compile {info['compile_s']:.1f} s "
                     f"(graphs {info['compiled_buckets'] or 'none: all cached'}), load {info['load_s']:.1f} s, "
                     f"buckets {info['buckets']}, capacity {info['capacity']}."
                     + build_line(info.get("build_conditions")))
    differences = results.get("compiled_vs_hf") or []
    if "plain-compiled" in results["summary"] and results["config"].get("temperature", 0) == 0:
        prompts = results["summary"]["plain"]["prompts"]
        lines.append(f"\nplain-compiled vs HF eager greedy: {prompts - len(differences)} of {prompts} prompts "
                     "token-identical" + ("" if not differences else "; first differences (eager logit margin "
                     "between the two tokens): " + "; ".join(
                         f"{d['id']} t{d['turn']} pos {d['position']}: {d['eager_logit_margin']:.2g}"
                         if d["eager_logit_margin"] is not None else f"{d['id']} t{d['turn']}: length"
                         for d in differences)))
    return lines


def main(argv: list[str]) -> str:
    if len(argv) != 1:
        raise UserError("usage: python -m draftsmith.eval.bench.report <bench.json>")
    path = Path(argv[0])
    try:
        results = json.loads(path.read_text())
        table = format_table(results)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UserError(f"{path}: not an eval.bench result ({type(error).__name__}: {error})") from None
    print(table)
    return table


if __name__ == "__main__":
    exit_with(main)
