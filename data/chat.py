"""Chat templating with the target tokenizer's own template, and assistant-only loss masks.

    render_and_mask(tok, messages)  -> {"input_ids": [T], "loss_mask": [T]}
    prompt_ids(tok, messages)       -> [T]   (generation prompt appended)
    format_mask(tok, ids, mask)     -> str   (trained spans highlighted)

Mask rule: ``loss_mask[t] == 1`` exactly on the tokens of each assistant message's
content plus the end-of-turn token that closes it (``<|im_end|>`` for ChatML,
``<|eot_id|>`` for Llama 3, ...) so the drafter learns to stop; 0 on system / user
messages and on template tokens (role headers, the default system prompt a template
may inject, the newline after the end-of-turn token).

How the spans are found (strategy "prefix", the default, works for any template whose
rendering of a conversation prefix is a text prefix of the full rendering - ChatML,
Qwen2.5, SmolLM2, Llama 3, Gemma, Mistral):

1. Render the whole conversation once, as text, with the tokenizer's own template.
2. For assistant message i, render ``messages[:i]`` with ``add_generation_prompt=True``.
   That text must be a prefix of the full text; where it ends, assistant i begins.
3. Find the message content from there (exact, else whitespace-stripped for templates that
   ``trim``), never crossing an end-of-turn token.
4. Extend the span over the end-of-turn token right after the content: the first special
   token (after optional whitespace) that does not also appear in the generation prompt
   (so turn *openers* such as ``<|im_start|>`` are never taken for turn *closers*).
5. Tokenize the full text once (``add_special_tokens=False``, exactly what
   ``apply_chat_template(tokenize=True)`` does) and mark every token whose character
   offsets overlap a span. Slow tokenizers without offsets fall back to tokenizing text
   prefixes.

Working on text and character offsets (rather than comparing token-id prefixes) is
immune to BPE merges across the boundary between a prefix render and the rest.

Fallback (strategy "auto"): when step 2 or 3 fails - templates that rewrite earlier turns,
e.g. ones that drop reasoning from history - and the template has a
``{% generation %}`` block, HF's ``return_assistant_tokens_mask`` is used instead (its
span is whatever the template author put inside the block). Otherwise a
``ChatTemplateError`` explains what went wrong; nothing is guessed silently.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Literal

from draftsmith.config import command_parser, option, parse_command
from draftsmith.data.sources import load_source
from draftsmith.errors import UserError, exit_with
from draftsmith.models.target import load_tokenizer

log = logging.getLogger(__name__)

Strategy = Literal["auto", "prefix", "generation"]

# Plain-text markers and ANSI colours used by ``format_mask``.
OPEN, CLOSE = "[[", "]]"
ANSI_TRAINED = "\x1b[1;32m"  # bold green
ANSI_CONTEXT = "\x1b[2m"  # dim
ANSI_RESET = "\x1b[0m"

_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(ValueError):
    """The template does not allow locating assistant turns (see the module docstring)."""


# ---------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------


def render_text(
    tokenizer: Any,
    messages: list[dict],
    add_generation_prompt: bool = False,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> str:
    """The tokenizer's chat template applied to ``messages``, as text."""
    if not messages:
        raise ValueError("cannot render an empty conversation")
    return tokenizer.apply_chat_template(
        messages,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **template_kwargs,
    )


def _encode(tokenizer: Any, text: str, offsets: bool) -> tuple[list[int], list[tuple[int, int]] | None]:
    if offsets and getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]), None


def prompt_ids(
    tokenizer: Any, messages: list[dict], chat_template: str | None = None, **template_kwargs: Any
) -> list[int]:
    """Token ids of ``messages`` + the generation prompt, ready for ``generate``.

    ``messages`` must end with a user (or system) message; for a record with a reference
    answer use ``Conversation.prompt_messages()``.
    """
    if messages and messages[-1]["role"] == "assistant":
        raise ValueError("prompt_ids: last message is an assistant turn; pass conv.prompt_messages()")
    text = render_text(tokenizer, messages, add_generation_prompt=True, chat_template=chat_template, **template_kwargs)
    return _encode(tokenizer, text, offsets=False)[0]


# ---------------------------------------------------------------------------
# Assistant spans
# ---------------------------------------------------------------------------


def _special_strings(tokenizer: Any) -> list[str]:
    """All special-token strings (declared special tokens + added tokens flagged special), longest first."""
    out = set(getattr(tokenizer, "all_special_tokens", []) or [])
    for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(tok, "special", False):
            out.add(str(tok.content))
    return sorted((s for s in out if s), key=len, reverse=True)


def end_of_turn_candidates(tokenizer: Any, chat_template: str | None = None, **template_kwargs: Any) -> list[str]:
    """Special tokens that may close a turn: every special token except the ones that appear
    in the generation prompt (those open a turn, e.g. ``<|im_start|>``)."""
    probe = [{"role": "user", "content": "x"}]
    base = render_text(tokenizer, probe, False, chat_template, **template_kwargs)
    with_gp = render_text(tokenizer, probe, True, chat_template, **template_kwargs)
    gen_prompt = with_gp[len(base) :] if with_gp.startswith(base) else ""
    return [s for s in _special_strings(tokenizer) if s not in gen_prompt]


def assistant_char_spans(
    tokenizer: Any,
    messages: list[dict],
    full_text: str,
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` in ``full_text`` of each assistant content + its end-of-turn token.

    Strategy "prefix" (module docstring, steps 2-4). Raises ChatTemplateError when the
    template is not prefix-stable or a content cannot be located.
    """
    closers = end_of_turn_candidates(tokenizer, chat_template, **template_kwargs)
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise ChatTemplateError("conversation starts with an assistant message; nothing to condition on")
        pre = render_text(tokenizer, messages[:i], True, chat_template, **template_kwargs)
        if not full_text.startswith(pre):
            raise ChatTemplateError(
                f"template is not prefix-stable at message {i}: rendering messages[:{i}] with the generation "
                "prompt is not a prefix of the full rendering"
            )
        start = len(pre)
        content = m["content"]
        pos = full_text.find(content, start)
        if pos < 0 or not content:
            content = content.strip()
            pos = full_text.find(content, start)
        # The content must start before the next end-of-turn token after ``start`` (never
        # match a later turn); closers *inside* the content are the data's business.
        if pos < 0 or any(c in full_text[start:pos] for c in closers):
            raise ChatTemplateError(f"could not locate assistant message {i} in the rendered text")
        end = pos + len(content)
        j = end
        while j < len(full_text) and full_text[j].isspace():
            j += 1
        closer = next((c for c in closers if full_text.startswith(c, j)), None)
        if closer is not None:
            end = j + len(closer)
        else:
            log.debug("assistant message %d: no end-of-turn token after its content", i)
        spans.append((pos, end))
    return spans


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    mask = [0] * len(offsets)
    k = 0
    for t, (s, e) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= s:  # span k lies before this token
            k += 1
        if k == len(spans):
            break
        a, b = spans[k]
        if (s < b and e > a) or (s == e and a <= s < b):
            mask[t] = 1
    return mask


def _mask_from_prefixes(tokenizer: Any, text: str, ids: list[int], spans: list[tuple[int, int]]) -> list[int]:
    """For tokenizers without offsets: token boundaries from tokenizing text prefixes."""
    mask = [0] * len(ids)
    for a, b in spans:
        ta = len(_encode(tokenizer, text[:a], offsets=False)[0])
        tb = len(_encode(tokenizer, text[:b], offsets=False)[0])
        for t in range(ta, min(tb, len(ids))):
            mask[t] = 1
    return mask


def _generation_mask(
    tokenizer: Any, messages: list[dict], add_generation_prompt: bool, chat_template: str | None, **template_kwargs: Any
) -> tuple[list[int], list[int]]:
    out = tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        add_generation_prompt=add_generation_prompt,
        chat_template=chat_template,
        **template_kwargs,
    )
    return list(out["input_ids"]), [int(x) for x in out["assistant_masks"]]


def render_and_mask(
    tokenizer: Any,
    messages: list[dict],
    max_length: int | None = None,
    add_generation_prompt: bool = False,
    strategy: Strategy = "auto",
    chat_template: str | None = None,
    **template_kwargs: Any,
) -> dict[str, list[int]]:
    """Tokenize ``messages`` with the tokenizer's chat template and build the assistant-only loss mask.

    Returns ``{"input_ids": [T], "loss_mask": [T]}`` (plain lists, ``T <= max_length``; longer
    conversations are cut at the right). ``loss_mask`` is 1 on assistant contents and on the
    end-of-turn token closing each assistant turn. ``input_ids`` equal
    ``tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]``.

    strategy: "prefix" (incremental prefix rendering + char offsets), "generation" (the
    template's ``{% generation %}`` blocks), "auto" (prefix, then generation, else error).
    ``chat_template`` overrides the tokenizer's template; ``template_kwargs`` go to the
    template (e.g. ``enable_thinking=False``).
    """
    if strategy not in ("auto", "prefix", "generation"):
        raise UserError(f"unknown strategy {strategy!r}; valid: auto, prefix, generation")
    ids: list[int]
    mask: list[int]
    if strategy in ("auto", "prefix"):
        text = render_text(tokenizer, messages, add_generation_prompt, chat_template, **template_kwargs)
        try:
            spans = assistant_char_spans(tokenizer, messages, text, chat_template, **template_kwargs)
        except ChatTemplateError as err:
            template = chat_template or tokenizer.get_chat_template()
            if strategy == "prefix" or not _GENERATION_BLOCK.search(template or ""):
                raise ChatTemplateError(
                    f"{err}. The template has no {{% generation %}} block to fall back on; "
                    "pass chat_template=<a template with {% generation %}...{% endgeneration %} around "
                    "assistant content> or fix the template's prefix stability."
                ) from err
            log.info("render_and_mask: %s; using the template's {%% generation %%} blocks", err)
            ids, mask = _generation_mask(tokenizer, messages, add_generation_prompt, chat_template, **template_kwargs)
        else:
            ids, offsets = _encode(tokenizer, text, offsets=True)
            mask = _mask_from_offsets(offsets, spans) if offsets is not None else _mask_from_prefixes(tokenizer, text, ids, spans)
    else:
        ids, mask = _generation_mask(tokenizer, messages, add_generation_prompt, chat_template, **template_kwargs)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return {"input_ids": ids, "loss_mask": mask}


# ---------------------------------------------------------------------------
# Debug view
# ---------------------------------------------------------------------------


def _use_color(color: bool | None) -> bool:
    if color is not None:
        return color
    return sys.stdout.isatty() and "NO_COLOR" not in os.environ


def format_mask(tokenizer: Any, input_ids: list[int], loss_mask: list[int], color: bool | None = None) -> str:
    """The decoded text with trained spans (``loss_mask == 1``) highlighted.

    color=True: trained spans bold green, the rest dim (ANSI). color=False: trained spans
    wrapped in ``[[ ... ]]``. color=None: ANSI when stdout is a tty and NO_COLOR is unset.
    """
    if len(input_ids) != len(loss_mask):
        raise ValueError(f"input_ids ({len(input_ids)}) and loss_mask ({len(loss_mask)}) differ in length")
    ansi = _use_color(color)
    parts: list[str] = []
    t = 0
    while t < len(input_ids):
        u = t
        while u < len(input_ids) and bool(loss_mask[u]) == bool(loss_mask[t]):
            u += 1
        piece = tokenizer.decode(list(input_ids[t:u]), skip_special_tokens=False)
        if loss_mask[t]:
            parts.append(f"{ANSI_TRAINED}{piece}{ANSI_RESET}" if ansi else f"{OPEN}{piece}{CLOSE}")
        else:
            parts.append(f"{ANSI_CONTEXT}{piece}{ANSI_RESET}" if ansi else piece)
        t = u
    return "".join(parts)


# ---------------------------------------------------------------------------
# CLI: python -m draftsmith.data.chat target=<name_or_path> source=gsm8k:train n=2
# ---------------------------------------------------------------------------

@dataclass
class MaskViewConfig:
    target: str = option(help="whose chat template and tokenizer: registry name, model directory, hub id or tiny:<family>")
    source: str = option("gsm8k:train", "data.sources spec, e.g. gsm8k:train, sharegpt, mt-bench")
    n: int = option(2, "conversations shown", ge=1)
    max_length: int | None = option(None, "cut at this many tokens", ge=1)
    color: Literal["auto", "always", "never"] = option("auto", "highlight trained tokens in green")


def main(argv: list[str]) -> int:
    parser = command_parser("python -m draftsmith.data.chat", "Print samples with their loss masks highlighted.",
                            MaskViewConfig)
    cfg, _ = parse_command(parser, MaskViewConfig, argv)
    tok = load_tokenizer(cfg.target)
    color = {"auto": None, "always": True, "never": False}[cfg.color]
    legend = "trained tokens in green" if _use_color(color) else f"trained tokens inside {OPEN} {CLOSE}"
    print(f"# {cfg.source} with the chat template of {cfg.target}; {legend}")
    for conv in load_source(cfg.source, limit=cfg.n):
        out = render_and_mask(tok, conv.messages, max_length=cfg.max_length)
        n_on = sum(out["loss_mask"])
        print(f"\n=== {conv.id} ({conv.source}): {len(out['input_ids'])} tokens, {n_on} trained ===")
        print(format_mask(tok, out["input_ids"], out["loss_mask"], color=color))
    return 0


if __name__ == "__main__":
    exit_with(main)
