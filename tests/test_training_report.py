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
