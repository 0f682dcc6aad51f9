"""Nothing lost, in every recipe: one run per output directory (a lock naming the holder),
no final/ or metrics replaced without --overwrite (also after checkpoints/ was removed), SIGTERM and
SIGINT save at the next step boundary and say how to resume, the progress bar (and --no-progress)."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys

import pytest

from draftsmith.train import dgf, distill, medusa
from draftsmith.train.run_guards import DirectoryLock
from launch_utils import REPO

RECIPES = {"medusa": medusa.cli, "dgf": dgf.cli, "distill": distill.cli}


def config(name: str) -> str:
    return str(REPO / "train" / "configs" / f"{name}_tiny.yaml")


def digest(directory) -> str:
    """Every file of a run directory but its lock, which each run that takes the lock (a refused one too) rewrites
    with its pid and the time to the second: a refusal that crossed a second changed the digest (a flake)."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != ".lock")
    return hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in files)).hexdigest()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One finished tiny run per recipe."""
    runs = {}
    for name, cli in RECIPES.items():
        out = tmp_path_factory.mktemp(name) / "run"
        assert cli(["--config", config(name), f"output_dir={out}", "--no-progress"]) == 0
        runs[name] = out
    return runs


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_finished_run_is_never_replaced_without_overwrite(name, finished, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(finished[name], out)
    before = digest(out)
    assert RECIPES[name](["--config", config(name), f"output_dir={out}", "--no-progress"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    shutil.rmtree(out / "checkpoints")  # the case that used to replace final/ silently
    before = digest(out)
    assert RECIPES[name](["--config", config(name), f"output_dir={out}", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "final" in err
    assert digest(out) == before


@pytest.mark.parametrize("flags", [[], ["--overwrite"], ["--resume"]], ids=["fresh", "overwrite", "resume"])
def test_a_folder_of_other_runs_is_refused_whatever_the_flags(flags, finished, tmp_path, capsys):
    shutil.copytree(finished["medusa"], tmp_path / "runs" / "earlier")
    before = digest(tmp_path / "runs")
    assert medusa.cli(["--config", config("medusa"), f"output_dir={tmp_path / 'runs'}", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "other runs' outputs (earlier)" in err, err
    assert digest(tmp_path / "runs") == before and sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["earlier"]


@pytest.mark.parametrize("name", list(RECIPES))
def test_a_second_run_on_a_directory_in_use_is_refused(name, tmp_path, capsys):
    out = tmp_path / "run"
    lock = DirectoryLock(out)
    lock.acquire()
    try:
        assert RECIPES[name](["--config", config(name), f"output_dir={out}", "--no-progress"]) == 2
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert "in use by another run" in err and f"pid {os.getpid()}" in err
    assert not (out / "final").exists() and not (out / "metrics.jsonl").exists()


# Steps enough that the run is still training when the signal comes (a tiny step takes ~30 ms on the AVX2 EPYC, so
# 200 last ~6 s; the signal is sent within 0.1 s of the first logged step), few enough that the resumed run's rest is
# short (with 400 the two cases took 46-78 s each in the parallel suite).
SIGNALLED_STEPS = 200


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_at_the_step_boundary_and_says_how_to_resume(stop, tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "draftsmith.train.medusa", "--config", config("medusa"), f"output_dir={out}",
               f"train.max_steps={SIGNALLED_STEPS}", "train.checkpoint_every=1000", "--no-progress"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"

    def stepped() -> bool:  # a training step logged (the first eval's line comes before the loop and its handler)
        return metrics.exists() and "train/loss" in metrics.read_text()

    for _ in range(3000):  # up to 300 s: a loaded machine starts slowly, and a signal before the loop is an interrupt
        if stepped() or process.poll() is not None:
            break
        __import__("time").sleep(0.1)
    assert stepped(), "the run logged no step in 300 s"
    process.send_signal(stop)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 2, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "--resume" in last, err
    assert any((out / "checkpoints").iterdir()) and not (out / "final").exists()
    resumed = subprocess.run(command[:-1] + ["--resume", "--no-progress"], cwd=REPO,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert (out / "final").is_dir()


def test_progress_bar_and_no_progress(tmp_path, capfd):
    assert medusa.cli(["--config", config("medusa"), f"output_dir={tmp_path / 'a'}"]) == 0
    shown = capfd.readouterr().err
    assert "8/8" in shown and "step/s" in shown and "loss" in shown  # step/total, rate, current loss
    assert medusa.cli(["--config", config("medusa"), f"output_dir={tmp_path / 'b'}", "--no-progress"]) == 0
    hidden = capfd.readouterr().err
    assert "step/s" not in hidden and "8/8" not in hidden


def test_the_resume_hint_names_resume_once():
    """A run started with --resume-from DIR (or --resume, --overwrite) is told to go on with one --resume."""
    from draftsmith.train.run_guards import without_resume_flags

    argv = ["train/dflash.py", "--config", "x.yaml", "--resume-from", "drafters/run/resume/step_9", "a=1",
            "--resume", "--overwrite", "--resume-from=elsewhere", "--no-progress"]
    assert without_resume_flags(argv) == ["train/dflash.py", "--config", "x.yaml", "a=1", "--no-progress"]
