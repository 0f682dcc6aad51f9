"""A benchmark's results written conversation by conversation, so an interrupted run loses nothing and
a re-run with the same config continues where it stopped.

`output_dir/progress.jsonl`: a header line (format, config digest, the config) then one line per
finished conversation: its key (`suite/id`), its per-prompt rows and, per method, its timed runs
(DecodeStats as dicts) and lossless mismatches. Lines are appended and fsynced as each conversation
ends. On a re-run: a torn last line (the process died mid-write) is dropped and that conversation runs
again; a config that differs (methods, prompts, tokens, backend, ...; not output_dir or plots) is
refused in one line, since timings of two different runs must not be mixed into one table; so is a re-run on
another CPU model (the header names the machine that started it): the two machine kinds time differently.
Restored conversations keep their original timings: a resumed result says so (`resumed_conversations`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from draftsmith.errors import UserError
from draftsmith.eval.decode.decoder import DecodeStats
from draftsmith.eval.documents import cpu_isa, cpu_model

PROGRESS_FILE = "progress.jsonl"
PROGRESS_FORMAT = "draftsmith.bench-progress/1"
NOT_PART_OF_THE_RUN = ("output_dir", "plots", "wandb", "wandb_project")


def config_digest(config: dict) -> str:
    relevant = {key: value for key, value in config.items() if key not in NOT_PART_OF_THE_RUN}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True, default=str).encode()).hexdigest()[:16]


def read_lines(file: Path) -> list[dict]:
    """The file's JSON lines; a torn last line is dropped (and cut from the file)."""
    lines = file.read_text().splitlines()
    records = []
    for index, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if index != len(lines) - 1:
                raise UserError(f"{file} line {index + 1} is corrupt: remove the file (or pass --overwrite) to "
                                "run the benchmark from the start") from None
            file.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


@dataclass
class Progress:
    """Finished conversations of this config in output_dir (none without an output_dir)."""

    file: Path | None
    done: dict[str, dict] = field(default_factory=dict)
    restored: int = 0

    @classmethod
    def open(cls, output_dir: str | None, config: dict, overwrite: bool) -> "Progress":
        if not output_dir:
            return cls(None)
        file = Path(output_dir) / PROGRESS_FILE
        digest = config_digest(config)
        lines = [] if overwrite or not file.exists() else read_lines(file)
        if len(lines) <= 1:  # new, --overwrite, or a header alone (a run refused at its input): nothing to keep
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(json.dumps({"format": PROGRESS_FORMAT, "config_digest": digest, "machine": cpu_model(),
                                        "isa": cpu_isa(), "config": config}) + "\n")
            return cls(file)
        header, *records = lines
        if header.get("format") != PROGRESS_FORMAT or header.get("config_digest") != digest:
            raise UserError(f"{file} holds the progress of a benchmark with another config (digest "
                            f"{header.get('config_digest')}, this one {digest}): rerun with that config to continue "
                            "it, choose another output_dir, or pass --overwrite to start over")
        this_machine = f"{cpu_model()} ({cpu_isa()})"  # one model name covers CPUs of more than one ISA (AMD EPYC)
        started_on = f"{header.get('machine', cpu_model())} ({header.get('isa', cpu_isa())})"  # older files: no isa
        if started_on != this_machine:
            raise UserError(f"{file} was started on another CPU ({started_on}; this one is {this_machine}): timings of "
                            "two machines must not be mixed in one table; continue it on that machine kind, choose "
                            "another output_dir, or pass --overwrite to start over")
        return cls(file, {record["key"]: record for record in records})

    def snapshot(self, state) -> dict:
        return {"rows": len(state.rows), "runs": {spec: (len(record["runs"]), len(record["mismatches"]))
                                                  for spec, record in state.runs.items()}}

    def restore(self, key: str, state) -> bool:
        """Put a finished conversation's results into `state`; False when it has not run yet."""
        record = self.done.get(key)
        if record is None:
            return False
        state.rows.extend(record["rows"])
        specs = {str(spec): spec for spec in state.runs}  # the line holds each spec's canonical text
        for label, runs in record["runs"].items():
            state.runs[specs[label]]["runs"].extend(
                {**run, "stats": DecodeStats.from_dict(run["stats"]) if run["stats"] else None} for run in runs)
            state.runs[specs[label]]["mismatches"].extend(record["mismatches"][label])
        self.restored += 1
        return True

    def append(self, key: str, state, before: dict) -> None:
        """Write the conversation that ran since `before` (a snapshot) as one fsynced line."""
        if self.file is None:
            return
        done = before["runs"]
        runs = {str(spec): [{**run, "stats": run["stats"].to_dict() if run["stats"] else None}
                            for run in record["runs"][done[spec][0]:]] for spec, record in state.runs.items()}
        mismatches = {str(spec): record["mismatches"][done[spec][1]:] for spec, record in state.runs.items()}
        line = json.dumps({"key": key, "rows": state.rows[before["rows"]:], "runs": runs, "mismatches": mismatches},
                          default=str)
        with open(self.file, "a") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())
