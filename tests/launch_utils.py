"""Subprocess helpers for the multi-process and kill -9 tests (real launches, 1 thread per process)."""

from __future__ import annotations

import json
import os
import signal
import socket
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
ACCELERATE_CONFIGS = REPO / "train" / "accelerate"
TINY_YAML = REPO / "train" / "configs" / "medusa_tiny.yaml"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(extra)
    return env


def accelerate_launch(num_processes: int = 2) -> list[str]:
    """`accelerate launch` with the shipped CPU DDP config (torchrun launcher, gloo) on a free port."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ACCELERATE_CONFIGS / "ddp_cpu.yaml"),
            "--num_processes", str(num_processes), "--main_process_port", str(free_port())]


def run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-5000:]}"
    return done


def kill_when(cmd: list[str], ready: Callable[[], bool], log_path: Path, timeout: float = 240) -> int:
    """Start `cmd`, poll `ready()` every few ms and SIGKILL the process as soon as it holds.

    Returns the exit status (-9 when it was killed). Fails when the command ends first.
    """
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if ready():
                    os.kill(proc.pid, signal.SIGKILL)
                    break
                time.sleep(0.005)
            code = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert code == -signal.SIGKILL, f"{' '.join(cmd)} was not killed (exit {code}):\n{log_path.read_text()[-3000:]}"
    return code


def ledger_shards(out_dir: Path, rank: int = 0) -> int:
    """Shards recorded as complete in a data job's per-rank ledger (0 while it is being written)."""
    path = out_dir / f"progress_rank{rank}.json"
    try:
        return len(json.loads(path.read_text()).get("shards", []))
    except (FileNotFoundError, json.JSONDecodeError):
        return 0


def save_tiny_model_dir(tokenizer, path: Path, seed: int = 0) -> Path:
    """A tiny random Llama with the given tokenizer's vocab, saved like a real model directory."""
    from conftest import tiny_model

    model = tiny_model("llama", seed=seed, vocab_size=len(tokenizer), hidden_size=32,
                       eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def summaries(stdout: str) -> list[dict]:
    """The recipes' final JSON summaries (`{"step": ...}`) in a launch's stdout. Ranks share the pipe, so
    two summaries can land on one line: decode each object from where it starts instead of per line."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(stdout, match.start())[0] for match in re.finditer(r'\{"step": ', stdout)]
