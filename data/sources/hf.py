"""Any Hugging Face `datasets` dataset as conversations (column mapping, automatic where unambiguous)."""

from __future__ import annotations

import logging

from pathlib import Path
from typing import Any, Mapping

from draftsmith.data.sources.dumps import alpaca_prompt, sharegpt_item_to_messages
from draftsmith.data.sources.conversation import Conversation, LoadReport, finish_load
from draftsmith.errors import UserError

log = logging.getLogger(__name__)

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
    return finish_load(convs, report, src)
