"""Loss curves and held-out metrics of one training run, as results.

    python scripts/training_report.py outputs/dgf_smollm2_final --out results/dgf_smollm2_final/training

Reads the run's metrics.jsonl (the same scalars the run logged to W&B) and writes
``<out>.png`` (training loss and per-step top-1; held-out top-1 and tau through the bundled decoder),
``<out>.md`` (one row per evaluation, the wall-clock time of training) and ``<out>.json`` (every logged
row, so the curves can be redrawn), and copies the run's offline W&B run directories (one per process
start: a resumed run logs to the same run id) to ``<out>_wandb/`` (``wandb sync <out>_wandb/offline-run-*``
uploads them); an existing report is replaced only with ``--overwrite``.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from draftsmith.config import option, parse_script
from draftsmith.errors import UserError, exit_with
from draftsmith.fileio import refuse_overwrite

# Held-out columns of every recipe (feature drafter / Medusa: token loss and top-1 per step; distilled student: its
# divergence, cross-entropy and greedy agreement); a table shows those its run logged.
EVAL_COLUMNS = (("eval/step0_token_loss", "loss@1"), ("eval/step0_top1", "top1@1"), ("eval/step1_top1", "top1@2"),
                ("eval/step2_top1", "top1@3"), ("eval/fkl", "fkl"), ("eval/rkl", "rkl"), ("eval/jsd", "jsd"),
                ("eval/tvd", "tvd"), ("eval/ce", "ce"), ("eval/agreement", "agreement"), ("eval/tau", "tau"),
                ("eval/tau_accept_depth1", "accept@1"), ("eval/tau_accept_depth2", "accept@2"),
                ("eval/tau_accept_depth3", "accept@3"), ("eval/tau_accept_depth4", "accept@4"))


def last_per_step(rows: list[dict]) -> list[dict]:
    """One row per step, the last logged (a resumed run logs again the steps after its checkpoint), in step order."""
    return sorted({row["step"]: row for row in rows}.values(), key=lambda row: row["step"])


def read_metrics(run: Path) -> tuple[list[dict], list[dict]]:
    """(training rows, evaluation rows) of ``run``/metrics.jsonl, in step order."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run}: no metrics.jsonl (is it a training run's output_dir?)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = last_per_step([r for r in rows if "train/loss" in r])
    evals = last_per_step([r for r in rows if any(k.startswith("eval/") for k in r)])
    if not train:
        raise UserError(f"{path}: no training rows yet")
    return train, evals


def plot(train: list[dict], evals: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, top1_ax, tau_ax) = plt.subplots(1, 3, figsize=(15, 4))
    loss_ax.plot([r["step"] for r in train], [r["train/loss"] for r in train], label="training loss (logged steps)")
    loss_ax.set_xlabel("optimizer step"), loss_ax.set_title("training loss"), loss_ax.legend()
    for depth in range(3):
        key = f"train/step{depth}_top1"
        if any(key in r for r in train):
            top1_ax.plot([r["step"] for r in train if key in r], [r[key] for r in train if key in r],
                         alpha=0.5, label=f"train top-1, step {depth + 1}")
        key = f"eval/step{depth}_top1"
        if any(key in r for r in evals):
            top1_ax.plot([r["step"] for r in evals if key in r], [r[key] for r in evals if key in r], "o-",
                         label=f"held-out top-1, step {depth + 1}")
    agreement = [r for r in evals if "eval/agreement" in r]  # a distilled student's top-1 against the target
    if agreement:
        top1_ax.plot([r["step"] for r in agreement], [r["eval/agreement"] for r in agreement], "o-",
                     label="held-out greedy agreement with the target")
    top1_ax.set_xlabel("optimizer step"), top1_ax.set_title("top-1 accuracy"), top1_ax.legend(fontsize=7)
    tau_rows = [r for r in evals if "eval/tau" in r]
    tau_ax.plot([r["step"] for r in tau_rows], [r["eval/tau"] for r in tau_rows], "o-")
    tau_ax.set_xlabel("optimizer step"), tau_ax.set_title("held-out tau (bundled decoder, greedy)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def markdown(train: list[dict], evals: list[dict], title: str) -> str:
    elapsed = max((r.get("train/elapsed_s") or 0.0) for r in train)
    last = train[-1]
    columns = [(key, name) for key, name in EVAL_COLUMNS if any(key in row for row in evals)]
    seen = {0: 0} | {r["step"]: r["train/loss_tokens_seen"] for r in train if "train/loss_tokens_seen" in r}
    seen_column = ["loss tokens seen"] if len(seen) > 1 else []
    lines = [f"# Training: {title}", "",
             f"{last['step']} optimizer steps, {last.get('train/samples_seen', '?')} sequences, "
             f"{elapsed / 3600:.2f} h of training (wall clock, the run's own `train/elapsed_s`); "
             f"final training loss {last['train/loss']:.3f}.", "",
             "| step | " + " | ".join(seen_column + [name for _, name in columns]) + " |",
             "|---" * (len(columns) + len(seen_column) + 1) + "|"]
    for row in evals:
        cells = [f"{seen[row['step']]:,}" if row["step"] in seen else "-"] if seen_column else []
        cells += [f"{row[key]:.3f}" if isinstance(row.get(key), float) else str(row.get(key, "-"))
                  for key, _ in columns]
        lines.append(f"| {row['step']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def copy_wandb_runs(run: Path, dest: Path) -> list[str]:
    """Copy ``run``/wandb/offline-run-* to ``dest`` (replacing it); the names copied ([] when none)."""
    sources = sorted(p for p in (run / "wandb").glob("offline-run-*") if p.is_dir() and not p.is_symlink())
    if dest.exists():
        shutil.rmtree(dest)
    for source in sources:
        shutil.copytree(source, dest / source.name, symlinks=True)
    return [source.name for source in sources]


@dataclass
class TrainingReportConfig:
    run: str = option(help="the training run's output_dir (holds metrics.jsonl); also the first bare word")
    out: str = option(help="path stem of the .png/.md/.json written")
    overwrite: bool = option(False, "replace an existing report")


def main(argv: list[str] | None = None) -> int:
    args = parse_script("scripts/training_report.py", __doc__.split("\n\n")[0], TrainingReportConfig,
                        sys.argv[1:] if argv is None else argv, positional=("run",))
    run, out = Path(args.run), Path(args.out)
    wandb_dest = out.with_name(out.name + "_wandb")
    for path in [out.with_suffix(suffix) for suffix in (".png", ".md", ".json")] + [wandb_dest]:
        refuse_overwrite(path, args.overwrite, "choose another --out")
    train, evals = read_metrics(run)
    out.parent.mkdir(parents=True, exist_ok=True)
    title = run.name
    plot(train, evals, out.with_suffix(".png"), title)
    out.with_suffix(".md").write_text(markdown(train, evals, title))
    out.with_suffix(".json").write_text(json.dumps({"train": train, "eval": evals}, indent=1))
    wandb_runs = copy_wandb_runs(run, wandb_dest)
    print(f"wrote {out}.png/.md/.json ({len(train)} training rows, {len(evals)} evaluations)"
          + (f" and {len(wandb_runs)} offline W&B run(s) to {wandb_dest}" if wandb_runs else ""))
    return 0


if __name__ == "__main__":
    exit_with(main)
