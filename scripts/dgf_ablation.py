"""Collect a DGF ablation (trained drafters + eval.bench JSONs) into a Dovetail-Table-III-style report.

    python scripts/dgf_ablation.py --runs linear_m1 dgf_m1 dgf_m2 --runs-dir outputs/dgf \
        --bench outputs/dgf/bench_mt-bench.json outputs/dgf/bench_gsm8k.json --out results/dgf_ablation_smollm2

Reads <runs-dir>/<run>/final/manifest.json (parameters, held-out accuracy) and every bench JSON
(method specs `dgf:<runs-dir>/<run>/final,g=<g>`); writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from draftsmith.eval.bench import parse_method


def collect(runs: list[str], runs_dir: Path, bench_files: list[Path]) -> dict:
    out = {"runs": {}, "bench": {}}
    for run in runs:
        manifest = json.loads((runs_dir / run / "final" / "manifest.json").read_text())
        after = manifest["eval"]["after"]
        out["runs"][run] = {
            "fusion": manifest["drafter"]["fusion"], "num_blocks": manifest["drafter"]["num_blocks"],
            "parameters": manifest["drafter"]["parameters"], "steps": manifest["training"]["steps"],
            "loss": manifest["training"]["loss"], "data": manifest["training"]["data"],
            "heldout_top1_by_step": [after[f"eval/step{j}_top1"] for j in range(8) if f"eval/step{j}_top1" in after],
        }
    for file in bench_files:
        doc = json.loads(file.read_text())
        suite = doc["config"]["suite"]
        entry = {"machine": doc["machine"], "config": doc["config"], "methods": {}}
        for spec, summary in doc["summary"].items():
            kind, options = parse_method(spec)
            if kind == "dgf":
                run = Path(options["path"]).parent.name
                entry["methods"][f"{run}@g={options.get('g', '16')}"] = {"run": run, "g": int(options.get("g", 16)),
                                                                           **summary}
            else:
                entry["methods"][spec] = summary
        out["bench"][suite] = entry
    return out


def markdown(data: dict) -> str:
    suites = list(data["bench"])
    lines = ["| method | trainable params | held-out top-1 (step 0 / 1 / 2) | "
             + " | ".join(f"{s} speedup (g=16) | {s} tau (g=16)" for s in suites) + " |",
             "|---|---|---|" + "---|---|" * len(suites)]
    for run, info in data["runs"].items():
        name = f"{'EAGLE linear' if info['fusion'] == 'linear' else 'DGF'} M={info['num_blocks']}"
        if info["loss"].get("unroll_steps", 1) > 1:
            name += f" + unroll {info['loss']['unroll_steps']}"
        cells = [name, f"{info['parameters'] / 1e6:.2f}M", " / ".join(f"{a:.3f}" for a in info["heldout_top1_by_step"][:3])]
        for suite in suites:
            m = data["bench"][suite]["methods"].get(f"{run}@g=16")
            cells += [f"{m['speedup']:.2f}x", f"{m['tau']:.2f}"] if m else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for suite in suites:
        bench = data["bench"][suite]
        plain = bench["methods"].get("plain", {})
        lines += [f"**{suite}** (plain {plain.get('tokens_per_s', 0):.2f} tok/s; load average at start "
                  f"{', '.join(f'{x:.1f}' for x in bench['machine'].get('load_average_at_start', []))})", "",
                  "| drafter | g | tau | speedup (95% CI) | tok/s | draft s | verify s | per-depth acceptance a_1..a_7 | lossless |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for key, m in bench["methods"].items():
            if key == "plain":
                continue
            ci = m.get("speedup_ci95")
            ci_text = f" (±{ci:.2f})" if isinstance(ci, float) and ci == ci else ""
            depths = " ".join(f"{v:.2f}" for v in m["depth_acceptance"].values()) or "-"
            lines.append(f"| {m.get('run', key)} | {m.get('g', '-')} | {m['tau']:.2f} | {m['speedup']:.2f}x{ci_text} | "
                         f"{m['tokens_per_s']:.2f} | {m['draft_s']:.1f} | {m['verify_s']:.1f} | {depths} | "
                         f"{'yes' if not m['mismatches'] else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True)
    parser.add_argument("--runs-dir", default="outputs/dgf")
    parser.add_argument("--bench", nargs="+", required=True)
    parser.add_argument("--out", required=True, help="output path without extension")
    args = parser.parse_args(argv)
    data = collect(args.runs, Path(args.runs_dir), [Path(b) for b in args.bench])
    Path(args.out + ".json").write_text(json.dumps(data, indent=2))
    Path(args.out + ".md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
