"""Sharded, resumable output of the data jobs (regeneration, feature caching), across ranks.

Rank r of world size W takes items `i % W == r` and splits them into shards of `shard_size` items;
shard k of rank r is always the same items. A shard is written whole (`draftsmith.fileio.atomic_write`)
and then recorded, with its size and sha256, in the rank's ledger `progress_rank<r>.json`; the ledgers
are merged into `index.json`. A rerun of the same command skips recorded shards whose file still has
the recorded digest, so a kill -9 loses at most the shard in progress and a damaged shard is redone.
The ledger stores the plan (model, data fingerprint, world size, shard size, settings); a rerun with
a different plan in the same directory is refused, naming the field.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from draftsmith.config import command_parser, parse_command
from draftsmith.errors import UserError
from draftsmith.fileio import atomic_write_json, digest_mismatch, dir_lock, file_digest, refuse_folder_of_runs
from draftsmith.models.target import resolve_device

log = logging.getLogger(__name__)

INDEX_NAME = "index.json"


class IncompleteDataError(UserError, RuntimeError):
    """A data job's output is used before the job has finished."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def resolve_rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): explicit values win, else ``RANK``/``WORLD_SIZE`` (torchrun and
    ``accelerate launch`` set both), else (0, 1)."""
    world = world_size if world_size is not None else _env_int("WORLD_SIZE", 1)
    r = rank if rank is not None else _env_int("RANK", 0)
    if world < 1 or not 0 <= r < world:
        raise UserError(f"need 0 <= rank < world_size, got rank={r}, world_size={world}")
    return r, world


def resolve_rank_device(device: str | None):
    """``models.target.resolve_device``, pinned to ``cuda:$LOCAL_RANK`` for multi-process runs."""
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is None and "LOCAL_RANK" in os.environ:
        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return dev


def rank_items(n_items: int, rank: int, world_size: int) -> list[int]:
    """Item indices of one rank: ``i % world_size == rank``."""
    return list(range(rank, n_items, world_size))


def chunk(seq: Sequence, size: int) -> list[Sequence]:
    return [seq[i : i + size] for i in range(0, len(seq), size)]


def fingerprint(obj: Any) -> str:
    """sha256 of a JSON-serialisable object (the data a run was planned on)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


class PlanMismatch(UserError):
    """An output directory holds a run planned differently from the one being started."""


def _plan_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    keys = sorted(set(old) | set(new))
    return [f"{k}: {old.get(k)!r} (on disk) != {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]


class ShardLedger:
    """The record of one rank's complete shards, plus the merged ``index.json`` of all ranks.

    ``progress_rank<r>.json`` = {"plan", "rank", "world_size", "done", "shards": [entry, ...]};
    an entry is a dict with at least "file" and "index". The ledger, not the presence of a shard
    file, says a shard is complete (a file renamed just before a crash is redone).
    """

    def __init__(self, out_dir: str | Path, rank: int, world_size: int, plan: Mapping[str, Any]):
        self.dir = Path(out_dir)
        refuse_folder_of_runs(self.dir, "dataset")
        self.rank, self.world_size = rank, world_size
        self.plan = {**plan, "world_size": world_size}
        self.path = self.dir / f"progress_rank{rank}.json"
        self.shards: dict[int, dict] = {}
        self.done = False
        if self.path.exists():
            state = json.loads(self.path.read_text(encoding="utf-8"))
            diff = _plan_diff(state["plan"], self.plan)
            if diff:
                raise PlanMismatch(
                    f"{self.dir} holds a run planned differently ({'; '.join(diff)}). Rerun with the "
                    "same settings to resume, or use a new output directory."
                )
            self.shards = {int(e["index"]): e for e in state["shards"]}
            self.done = bool(state.get("done"))

    def is_complete(self, index: int) -> bool:
        """The shard is recorded and its file still has the recorded size and sha256 (shards recorded
        without a digest, by older versions, only need to exist). A damaged shard is reported and redone."""
        entry = self.shards.get(index)
        if entry is None:
            return False
        problem = digest_mismatch(self.dir / entry["file"], entry.get("digest", {}))
        if problem is not None:
            log.warning("shard %d of rank %d is not trusted (%s): it will be redone", index, self.rank, problem)
            print(f"warning: {problem}; redoing that shard", file=sys.stderr, flush=True)
            return False
        return True

    def _save(self) -> None:
        atomic_write_json(self.path, {"plan": self.plan, "rank": self.rank, "world_size": self.world_size,
                                      "done": self.done,
                                      "shards": [self.shards[k] for k in sorted(self.shards)]})
        write_merged_index(self.dir)

    def start(self) -> None:
        """Write the ledger (so the plan is fixed on disk), drop this rank's temp files left by a
        killed run, and refresh the index."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for stale in self.dir.glob(f"shard_{self.rank}_*.tmp"):
            stale.unlink(missing_ok=True)
        self._save()

    def commit(self, entry: dict) -> None:
        """Record a shard whose file is already in place, with its size and sha256."""
        entry = {**entry, "digest": file_digest(self.dir / entry["file"])}
        self.shards[int(entry["index"])] = entry
        self._save()

    def finish(self) -> None:
        self.done = True
        self._save()


def merged_index(out_dir: str | Path) -> dict:
    """All ranks' ledgers merged: the common plan, every complete shard (sorted by rank, index),
    and ``complete`` = every rank of the plan's world size has finished."""
    d = Path(out_dir)
    ledgers = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(d.glob("progress_rank*.json"))]
    if not ledgers:
        if (d / INDEX_NAME).is_file():  # a copy without the ledgers: the index is all there is
            return json.loads((d / INDEX_NAME).read_text(encoding="utf-8"))
        raise FileNotFoundError(f"{d}: neither progress_rank*.json ledgers nor {INDEX_NAME} (not a shard directory?)")
    plan = ledgers[0]["plan"]
    for led in ledgers[1:]:
        diff = _plan_diff(plan, led["plan"])
        if diff:
            raise PlanMismatch(f"{d}: ranks 0 and {led['rank']} planned differently: {'; '.join(diff)}")
    world = int(plan["world_size"])
    done = sorted(int(led["rank"]) for led in ledgers if led.get("done"))
    shards = [dict(e, rank=int(led["rank"])) for led in ledgers for e in led["shards"]]
    shards.sort(key=lambda e: (e["rank"], int(e["index"])))
    return {**plan, "ranks_done": done, "complete": done == list(range(world)), "shards": shards}


def write_merged_index(out_dir: str | Path) -> dict:
    """Merge the ledgers into ``index.json`` (under a directory lock, atomically)."""
    d = Path(out_dir)
    with dir_lock(d):
        index = merged_index(d)
        atomic_write_json(d / INDEX_NAME, index)
    return index


def read_job_index(path: str | Path, expected_format: str, what: str) -> tuple[Path, dict]:
    """(directory, merged index) of a data job's output, refusing a directory of another format."""
    d = Path(path).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"{what}: {d} is not a directory")
    index = merged_index(d)
    if index.get("format") != expected_format:
        raise UserError(f"{d}: format {index.get('format')!r} is not {what} ({expected_format!r})")
    return d, index


def incomplete_message(d: Path, index: dict, what: str) -> str | None:
    """None when every rank of the job has finished, else a message saying what is done."""
    if index["complete"]:
        return None
    return (f"{d}: {what} incomplete (ranks done {index['ranks_done']} of world size {index['world_size']}, "
            f"{len(index['shards'])} shard(s) complete)")


def parse_job_command(prog: str, description: str, config_cls: type, argv: list[str]):
    """The data jobs' command line: the config system plus --no-progress; logging at INFO."""
    parser = command_parser(prog, description, config_cls)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    cfg, flags = parse_command(parser, config_cls, argv)
    cfg.progress = cfg.progress and not flags.no_progress
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return cfg
