"""Files written so that nothing is ever half-written, and checked before they are trusted.

- `atomic_write(path, write)`: `write(tmp)`, fsync, rename: readers see the old file or the new one.
- `file_digest(path)`: (size, sha256) recorded when a file is written (checkpoints, shards) and
  compared before the file is trusted again (`verify_digest`).
- `dir_lock(directory)`: an exclusive flock on `<dir>/.lock` (short critical sections, e.g. index merges).
- `refuse_overwrite(path, overwrite)`: a user's earlier output is replaced only with --overwrite.
- `refuse_folder_of_runs(directory, what)`: a run's output goes to a folder of its own, not among other runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from draftsmith.errors import UserError


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` then fsync + rename to ``path``: readers see the old file or the whole new one.

    The temp name is unique per process, so concurrent writers never share a half-written file.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # some writers (safetensors) create files 0600
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def atomic_write_json(path: str | Path, obj: Any) -> Path:
    text = json.dumps(obj, indent=2, ensure_ascii=False) + "\n"
    return atomic_write(path, lambda p: p.write_text(text, encoding="utf-8"))


@contextlib.contextmanager
def dir_lock(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``<dir>/.lock`` (serialises index merges across ranks)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: merges may race, each one is still atomic
        yield
        return
    with open(directory / ".lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)




def file_digest(path: str | Path, chunk_bytes: int = 1 << 20) -> dict:
    """{"size": bytes, "sha256": hex digest} of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            digest.update(block)
            size += len(block)
    return {"size": size, "sha256": digest.hexdigest()}


def digest_mismatch(path: str | Path, expected: dict) -> str | None:
    """None when `path` has the recorded size and sha256, else what differs (a missing file included)."""
    path = Path(path)
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if "size" in expected and size != expected["size"]:
        return f"{path} has {size} bytes, {expected['size']} were written"
    if "sha256" in expected and file_digest(path)["sha256"] != expected["sha256"]:
        return f"{path} does not match the sha256 recorded when it was written"
    return None


def refuse_overwrite(path: str | Path, overwrite: bool, instead: str = "set output=<another path>") -> None:
    """One line naming `path` when it exists and --overwrite was not given (`instead`: the other way out)."""
    if Path(path).exists() and not overwrite:
        raise UserError(f"{path} exists: pass --overwrite to replace it, or {instead}")


# a folder holding one of these is a training run, a drafter, a benchmark's results or a dataset's shards
RUN_MARKERS = ("metrics.jsonl", "train_config.yaml", "manifest.json", "bench.json", "progress.jsonl", "index.json")


def other_runs_in(directory: Path, own_folders: tuple[str, ...] = (), most: int = 3) -> list[str]:
    """The first `most` folders directly in `directory` (`own_folders` aside: the run's own) that hold another run,
    a drafter, a benchmark's results or a dataset."""
    if not directory.is_dir():
        return []
    found = sorted(entry.name for entry in directory.iterdir() if entry.is_dir() and entry.name not in own_folders
                   and any((entry / marker).exists() for marker in RUN_MARKERS))
    return found[:most]


def refuse_folder_of_runs(directory: str | Path, what: str, own_folders: tuple[str, ...] = ()) -> None:
    """One line when `directory` holds other runs (`drafters/`, `results/`): writing there would mix this run's
    files among theirs, so no flag allows it."""
    directory = Path(directory)
    others = other_runs_in(directory, own_folders)
    if others:
        raise UserError(f"{directory} holds other runs' outputs ({', '.join(others)}): give the {what} a folder of "
                        f"its own, e.g. output_dir={directory / 'my_run'}")


def process_alive(pid: int) -> bool:
    """Whether a process with this id exists (the owner of a folder or file named after its pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def environment_variable(name: str, value: str) -> Iterator[None]:
    """`name` set to `value` for the block (read by native code, e.g. torch's), restored afterwards."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
