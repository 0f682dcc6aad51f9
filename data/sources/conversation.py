"""The one record type every source yields (`Conversation`), the JSON readers every loader shares, and
the files this toolkit writes: saved conversations and regenerated-data directories."""

from __future__ import annotations

import logging

import gzip
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Iterator, Mapping

from draftsmith.data.shards import IncompleteDataError, incomplete_message, read_job_index

log = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant")

# ShareGPT dumps use many spellings for the speaker.
SHAREGPT_ROLE_MAP = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
}


# ---------------------------------------------------------------------------
# Record type
# ---------------------------------------------------------------------------


@dataclass
class Conversation:
    """One normalised conversation.

    messages:  [{"role": "system"|"user"|"assistant", "content": str}, ...]
    reference: ground truth for checkers (GSM8K final answer, HumanEval solution, MT-Bench ref)
    category:  benchmark category (MT-Bench "writing", "math", ...)
    followups: user turns asked after the model answers the last message (MT-Bench turn 2)
    meta:      source-specific extras (HumanEval "test"/"entry_point", ...), JSON-serialisable
    """

    id: str
    source: str
    messages: list[dict]
    reference: str | None = None
    category: str | None = None
    followups: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for i, m in enumerate(self.messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(
                    f"conversation {self.id!r}: message {i} must be {{'role': one of {ROLES}, 'content': str}}, got {m!r}"
                )

    @property
    def has_response(self) -> bool:
        """True when at least one assistant message is present (usable for SFT / mask tests)."""
        return any(m["role"] == "assistant" for m in self.messages)

    def prompt_messages(self) -> list[dict]:
        """Messages up to and including the last user message (trailing assistant turns dropped).

        This is what a target model is asked to answer when it regenerates the data.
        """
        last_user = max((i for i, m in enumerate(self.messages) if m["role"] == "user"), default=-1)
        if last_user < 0:
            raise ValueError(f"conversation {self.id!r} has no user message")
        return [dict(m) for m in self.messages[: last_user + 1]]

    def next_turn(self, assistant_reply: str) -> "Conversation":
        """Append the model's reply and the next follow-up user turn (MT-Bench turn 2).

        Returns a new Conversation whose last message is the follow-up question.
        """
        if not self.followups:
            raise ValueError(f"conversation {self.id!r} has no follow-up turn left")
        if self.messages[-1]["role"] != "user":
            raise ValueError(f"conversation {self.id!r} must end with a user message to take a reply")
        messages = [dict(m) for m in self.messages] + [
            {"role": "assistant", "content": assistant_reply},
            {"role": "user", "content": self.followups[0]},
        ]
        return Conversation(
            id=self.id,
            source=self.source,
            messages=messages,
            reference=self.reference,
            category=self.category,
            followups=list(self.followups[1:]),
            meta=dict(self.meta),
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Conversation":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown Conversation field(s): {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


@dataclass
class LoadReport:
    """What a tolerant loader kept and skipped (and why)."""

    kept: int = 0
    skipped: Counter = field(default_factory=Counter)  # reason -> count
    truncated: bool = False  # the file ended inside a record (ShareGPT dump)

    @property
    def n_skipped(self) -> int:
        return sum(self.skipped.values())

    def __str__(self) -> str:
        reasons = ", ".join(f"{k}={v}" for k, v in sorted(self.skipped.items())) or "none"
        return f"kept {self.kept}, skipped {self.n_skipped} ({reasons}){', file truncated' if self.truncated else ''}"


# ---------------------------------------------------------------------------
# Small file helpers
# ---------------------------------------------------------------------------


def package_folder(import_name: str, missing: str) -> Path:
    """The folder of an installed package, located without importing it; FileNotFoundError(`missing`) if absent."""
    spec = find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(missing)
    return Path(list(spec.submodule_search_locations)[0])


def require_file(path: str | Path, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{what}: file not found: {str(path)!r} (resolved to {p.resolve()})")
    return p


def read_text_file(path: Path) -> str:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            return f.read()
    return path.read_text(encoding="utf-8", errors="replace")


_SKIP_SEP = re.compile(r"[\s,]*")


def iter_json_records(path: str | Path, report: LoadReport | None = None) -> Iterator[Any]:
    """Yield the top-level records of a JSON array, JSONL, or concatenated-JSON file.

    Records are decoded one at a time with ``json.JSONDecoder.raw_decode``, so a file
    that was cut off mid-record (the bundled ShareGPT dump) yields every complete
    record and sets ``report.truncated``. In JSONL files a malformed line is skipped
    (counted as ``bad_json``) and decoding resumes at the next line.
    """
    text = read_text_file(Path(path))
    dec = json.JSONDecoder()
    i = _SKIP_SEP.match(text, 0).end()
    in_array = i < len(text) and text[i] == "["
    if in_array:
        i += 1
    n = len(text)
    while True:
        i = _SKIP_SEP.match(text, i).end()
        if i >= n:
            if in_array and report is not None:
                report.truncated = True  # no closing bracket
            return
        if in_array and text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            nl = text.find("\n", i)
            if in_array or nl < 0:
                # Inside an array we cannot resynchronise: treat the rest as truncated.
                if report is not None:
                    report.truncated = True
                log.warning("%s: stopped at char %d of %d (%s)", path, i, n, e.msg)
                return
            if report is not None:
                report.skipped["bad_json"] += 1
            i = nl + 1
            continue
        yield obj


def finish_load(convs: list[Conversation], report: LoadReport, what: str) -> list[Conversation]:
    report.kept = len(convs)
    if report.n_skipped or report.truncated:
        log.warning("%s: %s", what, report)
    return convs


def save_conversations(path: str | Path, convs: list[Conversation]) -> Path:
    """Write records as JSONL (one ``Conversation.to_dict()`` per line)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w", encoding="utf-8") as f:
        for c in convs:
            f.write(json.dumps(c.to_dict(), ensure_ascii=False) + "\n")
    return p


def load_conversations(path: str | Path, limit: int | None = None) -> list[Conversation]:
    """Read records written by ``save_conversations`` (strict: a bad record raises), or a
    regenerated-data directory written by ``data.regenerate``."""
    if Path(path).expanduser().is_dir():
        return load_regenerated(path, limit=limit)
    p = require_file(path, "conversations")
    convs = []
    for item in iter_json_records(p):
        if limit is not None and len(convs) >= limit:
            break
        convs.append(Conversation.from_dict(item))
    return convs


REGEN_FORMAT = "draftsmith.regenerated/1"




def load_regenerated(path: str | Path, limit: int | None = None, require_complete: bool = False) -> list[Conversation]:
    """The conversations of a regeneration directory, in source order (across ranks).

    Reads the shards listed in the rank ledgers (temp files and unrecorded shards are ignored).
    ``require_complete`` raises when some rank has not finished; otherwise a partial run
    yields what is complete (with a warning).
    """
    d, index = read_job_index(path, REGEN_FORMAT, "regenerated data")
    msg = incomplete_message(d, index, "regeneration")
    if msg is not None:
        if require_complete:
            raise IncompleteDataError(msg + "; rerun the regeneration command to finish it")
        log.warning("%s; loading the complete shards", msg)
    convs: list[Conversation] = []
    for entry in index["shards"]:
        opener = gzip.open if entry["file"].endswith(".gz") else open
        with opener(d / entry["file"], "rt", encoding="utf-8") as f:
            convs += [Conversation.from_dict(json.loads(line)) for line in f if line.strip()]
    convs.sort(key=lambda c: c.meta["regenerated"]["item"])
    return convs[:limit] if limit is not None else convs
