"""The benchmark prompts every bench shares (the PyTorch bench, the llama.cpp and OpenVINO benches, the ARCA
profile): the suites, which conversations a run takes from each (a seeded sample of GSM8K test, else the first N
in category round-robin order), and each turn's prompt through the target's chat template."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from draftsmith.config import option
from draftsmith.data.chat import prompt_ids
from draftsmith.data.sources import load_source, source_help
from draftsmith.errors import UserError

SUITES = {"mt-bench": "mt-bench", "gsm8k": "gsm8k:test", "humaneval": "humaneval"}
SAMPLED_SUITES = ("gsm8k",)  # suites drawn as a seeded random sample (the others: first N, categories round-robin)


@dataclass
class PromptSettings:
    """The prompt options every bench shares (the PyTorch bench, the llama.cpp and OpenVINO benches), declared once:
    each bench's config extends this section."""

    suites: list[str] = option(factory=lambda: list(SUITES),
                               help="mt-bench | gsm8k | humaneval | a source spec: " + source_help())
    num_prompts: int = option(3, "prompts per suite", ge=1)
    turns: int = option(2, "turns per conversation (MT-Bench has 2)", ge=1)
    max_new_tokens: int = option(64, "new tokens per prompt turn", ge=1)
    seed: int = option(0, "GSM8K's sample seed (and the sampling seed at temperature > 0)")


def prompt_options(settings: PromptSettings) -> dict:
    """The prompt section of any bench's config, as keyword arguments of another's (the same prompts)."""
    return {field.name: getattr(settings, field.name) for field in fields(PromptSettings)}


def check_suites(suites: list[str]) -> None:
    if not suites or any(not suite.strip() for suite in suites):
        raise UserError(f"suites {suites!r}: give one suite or several, space-separated, e.g. suites=\"mt-bench gsm8k\"")
    if len(set(suites)) != len(suites):
        raise UserError(f"suites {suites!r} names a suite twice")


def select_conversations(suite: str, num_prompts: int, seed: int) -> list:
    """`num_prompts` records of one suite: a seeded random sample for GSM8K test, else the first N in
    category round-robin order (MT-Bench's first 10 records are all `writing`: 10 prompts cover its 8
    categories instead)."""
    conversations = load_source(SUITES.get(suite, suite))
    if not conversations:
        raise UserError(f"suite {suite!r} has no prompts")
    if suite in SAMPLED_SUITES:
        order = torch.randperm(len(conversations), generator=torch.Generator().manual_seed(seed)).tolist()
        conversations = [conversations[i] for i in order]
    return categories_round_robin(conversations)[:num_prompts]


def categories_round_robin(conversations: list) -> list:
    """The first record of each category (in order of first appearance), then the second of each, ...;
    records without categories keep their order."""
    by_category: dict = {}
    for conversation in conversations:
        by_category.setdefault(conversation.category, []).append(conversation)
    columns = list(by_category.values())
    return [column[rank] for rank in range(max(map(len, columns))) for column in columns if rank < len(column)]


def turn_messages(conversation, answers: list[str]) -> list[dict]:
    """Messages of turn len(answers) + 1: the first question, then for each earlier turn the given
    assistant answer and the next follow-up question (MT-Bench turn 2 = [q1, answer 1, q2])."""
    for answer in answers:
        conversation = conversation.next_turn(answer)
    return conversation.prompt_messages()


def turn_input_ids(tokenizer, conversation, answers: list[str]) -> torch.Tensor:
    """(1, T) prompt ids of a turn through the tokenizer's chat template (generation prompt added)."""
    return torch.tensor([prompt_ids(tokenizer, turn_messages(conversation, answers))])


def num_turns(conversation, max_turns: int) -> int:
    return 1 + min(len(conversation.followups), max(max_turns, 1) - 1)


def load_prompts(suite: str, num_prompts: int, seed: int, tokenizer) -> list[dict]:
    """First-turn prompts of a suite, tokenised with the target's chat template."""
    return [{"id": conv.id, "category": conv.category, "input_ids": turn_input_ids(tokenizer, conv, [])}
            for conv in select_conversations(suite, num_prompts, seed)]


def category_of(suite: str, conversation) -> str:
    """'mt-bench/writing' for MT-Bench (its own categories), else the suite name."""
    return f"{suite}/{conversation.category}" if conversation.category else suite
