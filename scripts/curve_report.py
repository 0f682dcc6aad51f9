"""The acceptance-vs-data curve: one table and one plot (log-scale x) from the committed curve points.

    python scripts/curve_report.py drafters/curve_smollm2_human --bench results/data_curve_smollm2/bench.json \\
        --out results/data_curve_smollm2/curve

Each point is a `loss_tokens_<N>/` snapshot of one training run (`train.snapshots_at_loss_tokens`): its
held-out top-1 per unrolled step and tau through the bundled decoder on held-out prompts (`snapshot.json`).
With `--bench`, a bench run that measured the points as methods (`dgf:<point>`; the goal bench's prompts)
adds their depth-1 acceptance, tau and speedup per suite. Writes `<out>.md`, `<out>.json` and `<out>.png`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from draftsmith.config import option, parse_script
from draftsmith.errors import UserError, exit_with
from draftsmith.fileio import refuse_overwrite

HELD_OUT = (("eval/step0_top1", "held-out top-1@1"), ("eval/step1_top1", "top-1@2"), ("eval/step2_top1", "top-1@3"),
            ("eval/tau", "held-out tau"))


def read_points(folder: Path) -> list[dict]:
    """Every snapshot below `folder`, by loss tokens seen."""
    points = []
    for info in sorted(folder.glob("loss_tokens_*/snapshot.json")):
        snapshot = json.loads(info.read_text())
        points.append({"path": str(info.parent), **snapshot})
    if not points:
        raise UserError(f"{folder}: no loss_tokens_<N>/snapshot.json (a curve run writes them as it reaches each N)")
    return sorted(points, key=lambda p: p["loss_tokens_seen"])


def bench_rows(bench: Path, points: list[dict]) -> dict[str, dict]:
    """point path -> {suite: (depth-1 acceptance, tau, headline speedup)} from a bench that ran `dgf:<path>` (the
    first method of each point: the curve's tree)."""
    summary = json.loads(bench.read_text())["summary"]
    out = {}
    for point in points:
        at_point = re.compile(re.escape(point["path"]) + r"(,|$)")  # loss_tokens_1000000 is a prefix of ..._10000000
        entry = next((e for label, e in summary.items() if label.startswith("dgf:") and at_point.search(label)), None)
        if entry is not None:
            out[point["path"]] = {suite: (sub["depth_acceptance"].get("1"), sub["tau"], sub.get("headline_speedup"))
                                  for suite, sub in entry["by_suite"].items()}
    return out


def table(points: list[dict], measured: dict[str, dict]) -> str:
    suites = sorted({suite for rows in measured.values() for suite in rows})
    head = ["loss tokens", "step"] + [name for _, name in HELD_OUT] + [
        f"{suite} {what}" for suite in suites for what in ("accept@1", "tau", "speedup")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for point in points:
        held = point.get("held_out") or {}
        cells = [f"{point['loss_tokens_seen']:,}", str(point["step"])]
        cells += [f"{held[key]:.3f}" if isinstance(held.get(key), (int, float)) else "-" for key, _ in HELD_OUT]
        for suite in suites:
            accept, tau, speedup = measured.get(point["path"], {}).get(suite, (None, None, None))
            cells += [f"{v:.2f}" if v is not None else "-" for v in (accept, tau, speedup)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(points: list[dict], measured: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [p["loss_tokens_seen"] for p in points]
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    for key, name in HELD_OUT[:1] + HELD_OUT[2:3]:
        axes.plot(x, [(p.get("held_out") or {}).get(key) for p in points], marker="o", label=name)
    for suite in sorted({s for rows in measured.values() for s in rows}):
        axes.plot(x, [measured.get(p["path"], {}).get(suite, (None,))[0] for p in points], marker="s",
                  linestyle="--", label=f"{suite} accept@1 (bench)")
    axes.set_xscale("log")
    axes.set_xlabel("loss-bearing answer tokens trained on (log scale)")
    axes.set_ylabel("accuracy / acceptance")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


@dataclass
class CurveReportConfig:
    points: str = option(help="a folder of loss_tokens_<N>/ snapshots (also the first bare word)")
    out: str = option(help="output path without suffix (.md, .json, .png are written)")
    bench: str | None = option(None, "bench.json of a run that measured the points as dgf:<point> methods")
    overwrite: bool = option(False, "replace an existing report")


def main(argv: list[str]) -> int:
    args = parse_script("scripts/curve_report.py", __doc__.split("\n\n")[0], CurveReportConfig, argv,
                        positional=("points",))
    out = Path(args.out)
    refuse_overwrite(out.with_suffix(".md"), args.overwrite)
    points = read_points(Path(args.points))
    measured = bench_rows(Path(args.bench), points) if args.bench else {}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(table(points, measured) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"points": points, "bench": measured}, indent=2) + "\n")
    plot(points, measured, out.with_suffix(".png"))
    print(f"wrote {out}.md, {out}.json, {out}.png")
    return 0


if __name__ == "__main__":
    exit_with(main)
