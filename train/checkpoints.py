"""Checkpoints: nested training state written without pickle, atomically, the newest N kept.

A checkpoint `step_<N>/` holds `tensors.safetensors` (every tensor of the state) and `state.json` (the
rest of the nested dicts/lists/tuples, with references to the tensors). It is written into a temporary
sibling directory that is renamed into place, so a `step_<N>` directory exists only when complete.
Loading names the missing or corrupt file; `load_latest_checkpoint` falls back past a corrupt newest one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftsmith.errors import UserError
from draftsmith.fileio import digest_mismatch, file_digest, process_alive

log = logging.getLogger(__name__)

CHECKPOINT_TENSORS = "tensors.safetensors"
CHECKPOINT_STATE = "state.json"
CHECKPOINT_FORMAT = "draftsmith.checkpoint/1"
STEP_PREFIX = "step_"


class CheckpointError(UserError):
    """A checkpoint is missing a file or a file is corrupt; the message names the file."""


def pack_state(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """Replace tensors by references (storing them in `tensors`); keep tuples and non-str keys."""
    if isinstance(obj, torch.Tensor):
        name = prefix or "tensor"
        while name in tensors:  # keys containing dots could collide with nested paths
            name += "_"
        tensors[name] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": name}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [pack_state(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [pack_state(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj) and not any(k.startswith("__") for k in obj):
            return {k: pack_state(v, tensors, f"{prefix}.{k}" if prefix else k) for k, v in obj.items()}
        return {"__items__": [[k, pack_state(v, tensors, f"{prefix}.{k}")] for k, v in obj.items()]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a value of type {type(obj).__name__} at {prefix or '<root>'}")


def unpack_state(obj: Any, tensors: Mapping[str, torch.Tensor], source: str = "") -> Any:
    if isinstance(obj, list):
        return [unpack_state(v, tensors, source) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            name = obj["__tensor__"]
            if name not in tensors:
                raise CheckpointError(f"{source}: {CHECKPOINT_TENSORS} lacks tensor {name!r} named in {CHECKPOINT_STATE}")
            return tensors[name]
        if "__ndarray__" in obj:
            return np.asarray(obj["__ndarray__"], dtype=obj["dtype"])
        if "__tuple__" in obj:
            return tuple(unpack_state(v, tensors, source) for v in obj["__tuple__"])
        if "__items__" in obj:
            return {(tuple(k) if isinstance(k, list) else k): unpack_state(v, tensors, source)
                    for k, v in obj["__items__"]}
        return {k: unpack_state(v, tensors, source) for k, v in obj.items()}
    return obj


def checkpoint_step(path: Path) -> int | None:
    name = path.name
    if not name.startswith(STEP_PREFIX) or not name[len(STEP_PREFIX):].isdigit():
        return None
    return int(name[len(STEP_PREFIX):])


def list_checkpoints(checkpoints_dir: str | Path) -> list[Path]:
    """Complete `step_<N>` directories, oldest first."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    steps = [(checkpoint_step(p), p) for p in root.iterdir() if p.is_dir()]
    return [p for step, p in sorted((s, p) for s, p in steps if s is not None)]


def latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    found = list_checkpoints(checkpoints_dir)
    return found[-1] if found else None


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(checkpoints_dir: str | Path, step: int, state: Mapping, keep_last: int | None = None) -> Path:
    """Write `state` (nested dicts/lists/tuples of tensors and plain values) as `step_<step>/`.

    Files go to a temporary sibling directory first, which is renamed into place, so an
    interrupted write never leaves a `step_<N>` directory behind. Afterwards only the
    `keep_last` newest checkpoints are kept (None or 0 keeps all).
    """
    root = Path(checkpoints_dir)
    root.mkdir(parents=True, exist_ok=True)
    recover_checkpoints(root)  # leftovers of a killed earlier save
    final = root / f"{STEP_PREFIX}{step}"
    tmp = root / f".tmp_{STEP_PREFIX}{step}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    skeleton = pack_state(dict(state), tensors)
    save_file(tensors, str(tmp / CHECKPOINT_TENSORS), metadata={"format": CHECKPOINT_FORMAT})
    digest = file_digest(tmp / CHECKPOINT_TENSORS)  # verified before the checkpoint is trusted again
    (tmp / CHECKPOINT_STATE).write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": step,
                                                    "tensors_digest": digest, "state": skeleton}))
    for name in (CHECKPOINT_TENSORS, CHECKPOINT_STATE):
        _fsync_file(tmp / name)
    if final.exists():  # re-saving a step (e.g. after a resume): swap the old one out
        old = root / f".old_{STEP_PREFIX}{step}_{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    if keep_last:
        for stale in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def verify_checkpoint(path: str | Path) -> str | None:
    """None when the checkpoint's files are complete and its tensors match their recorded sha256, else
    what is wrong (cheap next to loading: one read of the tensors file)."""
    path = Path(path)
    try:
        doc = json.loads((path / CHECKPOINT_STATE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        return f"{path / CHECKPOINT_STATE} is missing or corrupt ({err})"
    return digest_mismatch(path / CHECKPOINT_TENSORS, doc.get("tensors_digest") or {}) if isinstance(doc, dict) \
        else f"{path / CHECKPOINT_STATE} is corrupt"


def latest_verified_checkpoint(checkpoints_dir: str | Path | None) -> Path | None:
    """The newest checkpoint that verifies (what a NaN stop calls the last good checkpoint)."""
    if checkpoints_dir is None:
        return None
    for path in reversed(list_checkpoints(checkpoints_dir)):
        if verify_checkpoint(path) is None:
            return path
    return None


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint directory written by `save_checkpoint` into its nested state."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    for name in (CHECKPOINT_STATE, CHECKPOINT_TENSORS):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    try:
        doc = json.loads((path / CHECKPOINT_STATE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: {CHECKPOINT_STATE} is corrupt ({err})") from err
    if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT or "state" not in doc:
        raise CheckpointError(f"checkpoint {path}: {CHECKPOINT_STATE} is not a {CHECKPOINT_FORMAT} state file")
    problem = digest_mismatch(path / CHECKPOINT_TENSORS, doc.get("tensors_digest") or {})
    if problem is not None:
        raise CheckpointError(f"checkpoint {path}: {CHECKPOINT_TENSORS} is corrupt or truncated ({problem})")
    try:
        tensors = load_file(str(path / CHECKPOINT_TENSORS))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {path}: {CHECKPOINT_TENSORS} is corrupt or truncated ({err})") from err
    return unpack_state(doc["state"], tensors, source=f"checkpoint {path}")


CORRUPT_SUFFIX = ".corrupt"


def recover_checkpoints(checkpoints_dir: str | Path) -> None:
    """Tidy what a killed `save_checkpoint` left behind (call from the process that saves).

    `.tmp_step_<N>_<pid>` of a dead process: an unfinished write, removed. `.old_step_<N>_<pid>`
    without `step_<N>`: the process died between swapping a re-saved step out and in; the old
    (complete) copy is put back.
    """
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return
    for entry in root.iterdir():
        for kind in (".tmp_", ".old_"):
            if not entry.name.startswith(kind + STEP_PREFIX):
                continue
            name, _, pid = entry.name[len(kind):].rpartition("_")
            if not pid.isdigit() or int(pid) == os.getpid() or process_alive(int(pid)):
                continue
            final = root / name
            if kind == ".old_" and not final.exists() and checkpoint_step(final) is not None:
                os.replace(entry, final)
                log.warning("restored %s from an interrupted re-save", final)
            else:
                shutil.rmtree(entry, ignore_errors=True)


def load_latest_checkpoint(checkpoints_dir: str | Path, quarantine: bool = True) -> tuple[Path, dict] | None:
    """(path, state) of the newest checkpoint that loads, or None when there is none.

    A newest checkpoint that is corrupt or truncated does not stop a resume: a warning naming the
    file is printed (stderr and the log) and the previous one is used; with `quarantine` (the main
    process only, under multi-process launches) the bad directory is renamed to
    `step_<N>.corrupt` so it is kept for inspection but never listed or pruned as a checkpoint.
    Raises `CheckpointError` naming every file when checkpoints exist but none loads.
    """
    if quarantine:
        recover_checkpoints(checkpoints_dir)
    found = list_checkpoints(checkpoints_dir)
    problems = []
    for path in reversed(found):
        try:
            return path, load_checkpoint(path)
        except (CheckpointError, FileNotFoundError) as err:
            problems.append(str(err))
            message = f"warning: {err}; falling back to the previous checkpoint"
            print(message, file=sys.stderr, flush=True)
            log.warning(message)
            if quarantine and path.exists():
                bad = path.with_name(path.name + CORRUPT_SUFFIX)
                shutil.rmtree(bad, ignore_errors=True)
                os.replace(path, bad)
    if problems:
        raise CheckpointError(f"no usable checkpoint in {checkpoints_dir}: " + "; ".join(problems))
    return None


LEAN_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def write_lean_checkpoint(checkpoint: str | Path, resume_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Copy a checkpoint without its optimizer state into `resume_dir/step_<N>/` (the one newest kept): what a
    long run commits so that another machine can resume it (`--resume-from resume_dir/step_<N>`; AdamW's moments
    restart). The trainable weights, step, data position, schedule and RNG go along; the moments (2x the weights)
    do not. `dtype` bfloat16 stores the weights rounded to bf16 (half the bytes: a resume point that fits a
    transfer; the resumed run trains on in its own dtype from the rounded values)."""
    state = load_checkpoint(checkpoint)
    state.pop("optimizer", None)
    state["trainable"] = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor
                          for name, tensor in state["trainable"].items()}
    return save_checkpoint(resume_dir, int(state["step"]), state, keep_last=1)


LEAN_USAGE = "usage: python -m draftsmith.train.checkpoints lean <checkpoint dir> <resume dir> [float32 | bfloat16]"


def main(argv: list[str]) -> int:
    """`python -m draftsmith.train.checkpoints lean <run>/checkpoints/step_<N> <resume dir> [dtype]`."""
    if len(argv) not in (3, 4) or argv[0] != "lean":
        raise UserError(LEAN_USAGE)
    if len(argv) == 4 and argv[3] not in LEAN_DTYPES:
        raise UserError(f"lean: unknown dtype {argv[3]!r} (float32 or bfloat16)")
    print(write_lean_checkpoint(argv[1], argv[2], LEAN_DTYPES[argv[3] if len(argv) == 4 else "float32"]))
    return 0


if __name__ == "__main__":
    from draftsmith.errors import exit_with

    exit_with(main)
