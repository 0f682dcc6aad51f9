"""Prompts of the kinds a chat/math/code training mix under-represents: translation,
summarization, extraction and question answering over a given text.

The passages are the Python Language Reference's own topics as the standard library ships them
(`pydoc_data.topics`, PSF licence): human-written English prose that no training source of this toolkit reads
(`python-source` and `python-docstrings` read functions' code and docstrings, not these topics). Each kind gets
its own passages (sorted topic names dealt round-robin), so no passage is seen under two kinds.

    breadth                  all four kinds (category = the kind)
    breadth:translation      one kind: translation | summarization | extraction | qa
"""

from __future__ import annotations

from draftsmith.data.sources.conversation import Conversation
from draftsmith.errors import UserError

KINDS = ("translation", "summarization", "extraction", "qa")
MIN_CHARS, MAX_CHARS = 400, 1600  # passages a 2k-token context holds with room for the answer


def _instruction(kind: str, topic: str, passage: str) -> str:
    if kind == "translation":
        return f"Translate the following text into French.\n\n{passage}"
    if kind == "summarization":
        return f"Summarize the following text in three sentences.\n\n{passage}"
    if kind == "extraction":
        return ("List every Python keyword, built-in name and operator that the following text mentions, "
                f"one per line, without explanations.\n\n{passage}")
    return (f"Read the text and answer the question.\n\nText:\n{passage}\n\n"
            f"Question: according to the text, what does '{topic}' do, and what is one rule it follows?")


def _passages() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    out = []
    for topic in sorted(topics):
        text = topics[topic].strip()
        if MIN_CHARS <= len(text) <= MAX_CHARS:
            out.append((topic, text))
        elif len(text) > MAX_CHARS:  # the first paragraphs up to MAX_CHARS
            cut = text[:MAX_CHARS].rsplit("\n\n", 1)[0]
            if len(cut) >= MIN_CHARS:
                out.append((topic, cut))
    return out


def load_breadth(kind: str | None = None, limit: int | None = None) -> list[Conversation]:
    if kind is not None and kind not in KINDS:
        raise UserError(f"breadth:{kind}: not a kind; valid kinds: {', '.join(KINDS)}")
    passages = _passages()
    records = []
    for index, (topic, passage) in enumerate(passages):
        passage_kind = KINDS[index % len(KINDS)]
        if kind is not None and passage_kind != kind:
            continue
        records.append(Conversation(id=f"breadth-{passage_kind}-{topic}", source="breadth", category=passage_kind,
                                    messages=[{"role": "user", "content": _instruction(passage_kind, topic, passage)}],
                                    meta={"topic": topic}))
    if not records:
        raise UserError("breadth: the standard library's pydoc_data.topics gave no passage of "
                        f"{MIN_CHARS}-{MAX_CHARS} characters")
    return records[:limit] if limit is not None else records
