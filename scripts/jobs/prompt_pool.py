"""The prompt pool a regeneration job answers where the data packages are not installed (the lent GPU): the first
user turn (with any system message before it) of every conversation of SOURCES, minus any prompt that equals a
test suite's (data.sources.TEST_SUITE_SPECS: MT-Bench, HumanEval, GSM8K test, breadth; whitespace- and
case-normalised), shuffled with a fixed seed so that any prefix of the pool is a mix of the sources; written as
`conversations:` JSONL, gzipped.

    python scripts/jobs/prompt_pool.py OUT.jsonl.gz ["sources=sharegpt + gsm8k:train + ..."] [seed=0]
"""

import gzip
import json
import random
from collections import Counter
from dataclasses import dataclass

from draftsmith.config import check_config, option, parse_script
from draftsmith.data.regenerate import context_chunks
from draftsmith.data.sources import TEST_SUITE_SPECS, Conversation, load_source

SOURCES = "sharegpt + gsm8k:train + python-docstrings + leetcode"


@dataclass
class PoolConfig:
    output: str = option(help="the gzipped conversations: JSONL to write (also the first bare word)")
    sources: str = option(SOURCES, "the sources whose first prompts make the pool, joined by ' + '")
    seed: int = option(0, "the shuffle's seed")

    def __post_init__(self) -> None:
        check_config(self)


def normalised(text: str) -> str:
    return " ".join(text.lower().split())


def first_prompt(conv: Conversation) -> Conversation | None:
    """The context of the first reply `data.regenerate` would generate (its `context_chunks`), as a conversation;
    None when there is none."""
    try:
        chunks = context_chunks(conv)
    except ValueError:  # no user message before the first reply
        return None
    if not chunks:
        return None
    return Conversation(id=conv.id, source=conv.source, messages=chunks[0], reference=conv.reference)


def test_prompts() -> set[str]:
    texts = set()
    for suite in TEST_SUITE_SPECS:
        for conv in load_source(suite):
            texts.update(normalised(m["content"]) for m in conv.messages if m["role"] == "user")
            texts.update(normalised(followup) for followup in conv.followups)  # MT-Bench's second turns
    return texts


def main(argv: list[str]) -> int:
    args = parse_script("scripts/jobs/prompt_pool.py", __doc__.split("\n\n")[0], PoolConfig, argv,
                        positional=("output",))
    banned = test_prompts()
    pool, counts, dropped = [], Counter(), Counter()
    for spec in (part.strip() for part in args.sources.split(" + ")):
        for conv in load_source(spec):
            cut = first_prompt(conv)
            if cut is None or any(normalised(m["content"]) in banned for m in cut.messages if m["role"] == "user"):
                dropped[spec] += 1
                continue
            pool.append(cut)
            counts[spec] += 1
    random.Random(args.seed).shuffle(pool)
    with gzip.open(args.output, "wt", encoding="utf-8") as f:
        for conv in pool:
            f.write(json.dumps(conv.to_dict(), ensure_ascii=False) + "\n")
    print(f"{len(pool)} prompts -> {args.output}: kept {dict(counts)}, dropped {dict(dropped)}")
    return 0


if __name__ == "__main__":
    from draftsmith.errors import exit_with

    exit_with(main)
