"""The run's guards, each small: how the run was launched (for the summary and resume lines), the metrics file,
the summary print, the non-finite stop, the output directory's lock and the stop request on SIGINT / SIGTERM."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from draftsmith.errors import UserError
from draftsmith.fileio import atomic_write
from draftsmith.train.checkpoints import latest_verified_checkpoint

LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"
RUN_FOLDERS = ("checkpoints", "final", "snapshots", "wandb", "resume")  # a run's own folders in its directory


def launch_command(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """How this process was started, as a user retypes it: `accelerate launch ... train/x.py args` when
    accelerate's launcher started it (it sets ACCELERATE_MIXED_PRECISION in every process it starts),
    else `python train/x.py args`."""
    if not argv or not argv[0].endswith(".py"):
        return shlex.join(argv)
    if "ACCELERATE_MIXED_PRECISION" in environ:
        launcher = ["accelerate", "launch", "--num_processes", environ.get("WORLD_SIZE", "1"),
                    "--mixed_precision", environ["ACCELERATE_MIXED_PRECISION"]]
        return shlex.join([*launcher, *argv])
    return shlex.join(["python", *argv])


def without_resume_flags(argv: Sequence[str]) -> list[str]:
    """argv less --resume, --resume-from DIR and --overwrite: the command a resume hint appends --resume to."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume-from":
            skip = True
        elif arg not in ("--resume", "--overwrite") and not arg.startswith("--resume-from="):
            out.append(arg)
    return out


class NonFiniteLossError(UserError, FloatingPointError):
    """A loss (or gradient norm) became NaN/inf; the message names the step."""


def check_finite(value: Any, step: int, what: str = "loss", checkpoints_dir: str | Path | None = None) -> None:
    """Stop the run when `value` (float or tensor) is NaN or inf, naming the step and the last good
    checkpoint. Call it on a value that is identical on every process, so every rank stops together."""
    tensor = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    if bool(torch.isfinite(tensor).all()):
        return
    kind = "NaN" if bool(torch.isnan(tensor).any()) else "inf"
    last = latest_verified_checkpoint(checkpoints_dir) if checkpoints_dir is not None else None
    keep = (f"; the last good checkpoint is {last} (resume with --resume after fixing the cause, e.g. a lower "
            f"learning rate)") if last is not None else "; no checkpoint was written before it"
    raise NonFiniteLossError(f"{what} is {kind} at step {step}: stopping the run{keep}")


def print_summary(summary: Mapping) -> None:
    """The final JSON summary as one line in one write (ranks share the stdout pipe)."""
    sys.stdout.write(json.dumps(dict(summary), default=str) + "\n")
    sys.stdout.flush()


class MetricsFile:
    """Append-only JSONL of logged metrics (main process only), read back by tests and reports."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled

    def write(self, record: Mapping) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(dict(record)) + "\n")

    def drop_after(self, step: int) -> None:
        """Forget rows logged after `step` (a resumed run redoes those steps and logs them again)."""
        if not (self.enabled and self.path.is_file()):
            return
        kept = [row for row in self.read(self.path) if int(row.get("step", 0)) <= step]
        atomic_write(self.path, lambda tmp: tmp.write_text("".join(json.dumps(row) + "\n" for row in kept)))

    @staticmethod
    def read(path: str | Path) -> list[dict]:
        path = Path(path)
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class DirectoryLock:
    """An exclusive flock on `<dir>/.lock` for the lifetime of a run; the file names the holder."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK_FILE
        self.handle = None

    def acquire(self) -> None:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise UserError(f"{self.path.parent} is in use by another run ({holder}); wait for it to finish or "
                            "choose another output_dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                     f"{shlex.join(sys.argv)}\n")
        handle.flush()
        self.handle = handle

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()
            self.handle = None


class StopRequest:
    """SIGINT / SIGTERM set a flag; the loop saves and stops at the next step boundary."""

    def __init__(self):
        self.signal: int | None = None
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.signal is not None:  # a second signal: stop at once
            raise KeyboardInterrupt
        self.signal = signum

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


class RunDirectoryError(UserError, RuntimeError):
    """The output directory belongs to another run, or holds files this run would replace."""


class Interrupted(UserError):
    """The run stopped on SIGINT / SIGTERM after saving a checkpoint; the message says how to resume."""
