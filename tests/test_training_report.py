"""scripts/training_report.py: loss curves and held-out metrics of a run, as results."""

import json

import pytest

from draftsmith.errors import UserError


def write_run(run, steps=(10, 20)):
    rows = [{"step": 0, "eval/step0_top1": 0.0, "eval/tau": 1.0}]
    rows += [{"step": s, "train/loss": 5.0 - s / 10, "train/step0_top1": s / 100, "train/samples_seen": 8 * s,
              "train/elapsed_s": 3.0 * s} for s in steps]
    rows += [{"step": steps[-1], "eval/step0_top1": 0.4, "eval/tau": 1.8, "eval/tau_accept_depth1": 0.6}]
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")


def test_training_report_writes_curves_table_and_rows(tmp_path):
    from draftsmith.scripts import training_report

    write_run(tmp_path / "run")
    out = tmp_path / "results" / "training"
    assert training_report.main([str(tmp_path / "run"), "--out", str(out)]) == 0
    assert out.with_suffix(".png").stat().st_size > 1000
    table = out.with_suffix(".md").read_text()
    assert "20 optimizer steps, 160 sequences, 0.02 h" in table
    assert "| step | top1@1 | tau | accept@1 |" in table and "| 20 | 0.400 | 1.800 | 0.600 |" in table
    assert len(json.loads(out.with_suffix(".json").read_text())["train"]) == 2
    with pytest.raises(UserError, match="training.png exists: pass --overwrite"):
        training_report.main([str(tmp_path / "run"), "--out", str(out)])
    assert training_report.main([str(tmp_path / "run"), "--out", str(out), "--overwrite"]) == 0
    # the same command in key=value form (every command's form); a stray word is one line naming it
    assert training_report.main([f"run={tmp_path / 'run'}", f"out={out}", "overwrite=true"]) == 0
    with pytest.raises(UserError, match="'stray': not a key=value override"):
        training_report.main([str(tmp_path / "run"), "stray", f"out={out}"])


def test_a_resumed_run_s_repeated_steps_are_one_row_each():
    from draftsmith.scripts.training_report import last_per_step

    rows = [{"step": 20, "x": 1}, {"step": 10, "x": 2}, {"step": 20, "x": 3}]  # step 20 logged again after a resume
    assert last_per_step(rows) == [{"step": 10, "x": 2}, {"step": 20, "x": 3}]


def test_training_report_copies_the_offline_wandb_runs(tmp_path):
    from draftsmith.scripts import training_report

    write_run(tmp_path / "run")
    for name in ("offline-run-20261124_110000-abc", "offline-run-20261124_120000-abc"):  # a run and its resume
        (tmp_path / "run" / "wandb" / name / "files").mkdir(parents=True)
        (tmp_path / "run" / "wandb" / name / "run-abc.wandb").write_bytes(b"records")
    (tmp_path / "run" / "wandb" / "latest-run").symlink_to(tmp_path / "run" / "wandb" / name)
    out = tmp_path / "results" / "training"
    assert training_report.main([str(tmp_path / "run"), "--out", str(out)]) == 0
    copied = tmp_path / "results" / "training_wandb"
    assert sorted(p.name for p in copied.iterdir()) == ["offline-run-20261124_110000-abc",
                                                       "offline-run-20261124_120000-abc"]
    assert (copied / name / "run-abc.wandb").read_bytes() == b"records"
    for suffix in (".png", ".md", ".json"):
        out.with_suffix(suffix).unlink()
    with pytest.raises(UserError, match="training_wandb exists: pass --overwrite"):
        training_report.main([str(tmp_path / "run"), "--out", str(out)])


def test_training_report_names_a_directory_without_metrics(tmp_path):
    from draftsmith.scripts import training_report

    with pytest.raises(UserError, match="no metrics.jsonl"):
        training_report.main([str(tmp_path), "--out", str(tmp_path / "x")])


def test_curve_report_tables_and_plots_the_points(tmp_path):
    """scripts/curve_report.py: one row per committed curve point (by loss tokens), a log-x PNG, and the
    bench's per-suite acceptance when given."""
    import json

    from scripts.curve_report import main as curve_main

    points = tmp_path / "points"
    for tokens, step, top1 in [(250_000, 80, 0.41), (100_000, 33, 0.30)]:
        folder = points / f"loss_tokens_{tokens}"
        folder.mkdir(parents=True)
        (folder / "snapshot.json").write_text(json.dumps({"loss_tokens_seen": tokens + 17, "step": step,
                                                          "held_out": {"eval/step0_top1": top1, "eval/tau": 1.5}}))
    bench = tmp_path / "bench.json"
    label = f"dgf:{points / 'loss_tokens_250000'},budget=8"
    bench.write_text(json.dumps({"summary": {"plain": {"by_suite": {}}, label: {"by_suite": {
        "gsm8k": {"depth_acceptance": {"1": 0.5}, "tau": 2.0, "headline_speedup": 1.2}}}}}))
    assert curve_main([str(points), "--bench", str(bench), "--out", str(tmp_path / "curve")]) == 0
    rows = (tmp_path / "curve.md").read_text().splitlines()[2:]
    assert rows[0].startswith("| 100,017 | 33 | 0.300") and rows[1].startswith("| 250,017 | 80 | 0.410")
    assert rows[1].endswith("| 0.50 | 2.00 | 1.20 |") and rows[0].endswith("| - | - | - |")
    assert (tmp_path / "curve.png").stat().st_size > 1000


def test_training_report_says_the_loss_tokens_seen_at_each_evaluation(tmp_path):
    """A recipe that counts its loss-bearing tokens (dgf, distill) gets them beside each held-out row: the x of a
    data curve."""
    from draftsmith.scripts import training_report

    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": 0, "eval/agreement": 0.30},
            {"step": 25, "train/loss": 1.0, "train/loss_tokens_seen": 21000, "train/elapsed_s": 60.0},
            {"step": 25, "eval/agreement": 0.50}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "training"
    assert training_report.main([str(run), "--out", str(out)]) == 0
    table = out.with_suffix(".md").read_text()
    assert "| step | loss tokens seen | agreement |" in table
    assert "| 0 | 0 | 0.300 |" in table and "| 25 | 21,000 | 0.500 |" in table
