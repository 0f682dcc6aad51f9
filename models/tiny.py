"""Tiny random causal LMs built in-process (tests, smoke runs, CI): `tiny:<family>[:<seed>]` targets.

No files and no network: a Llama or Qwen2 model with a few layers, a fixed seed, sdpa attention and
an untied LM head, plus a stand-in tokenizer whose token i is the string `<i>`. Every command that
takes a model name takes `tiny:llama` / `tiny:qwen2,seed=1` too (`models.target.TargetModel.from_pretrained`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from draftsmith.errors import UserError
from draftsmith.specs import SpecError, parse_spec

TINY_PREFIX = "tiny:"
FAMILIES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}


class TinyTokenizer:
    """Stand-in tokenizer for tiny random targets: text is encoded byte by byte (byte value modulo the
    vocabulary), token i decodes to the string `<i>`; the chat template is `role: content` lines."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.pad_token_id = None

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(self.vocab_size)}

    def __len__(self) -> int:
        return self.vocab_size

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False, add_generation_prompt: bool = False,
                            **unused) -> str:
        text = "".join(f"{message['role']}: {message['content']}\n" for message in messages)
        return text + ("assistant: " if add_generation_prompt else "")

    def __call__(self, text: str, add_special_tokens: bool = False, **unused) -> dict:
        return {"input_ids": [byte % self.vocab_size for byte in text.encode()]}

    def decode(self, ids, skip_special_tokens: bool = False, **unused) -> str:
        return "".join(f"<{int(i)}>" for i in ids)


def build_tiny_causal_lm(family: str = "llama", seed: int = 0, vocab_size: int = 96, hidden_size: int = 48,
                         num_layers: int = 2, dtype: torch.dtype = torch.float32):
    """A tiny random Llama / Qwen2 causal LM (fixed seed, sdpa attention, untied LM head)."""
    if family not in FAMILIES:
        raise UserError(f"unknown tiny model family {family!r}; choose one of {', '.join(sorted(FAMILIES))}")
    config_cls, model_cls = FAMILIES[family]
    config = config_cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=1024, initializer_range=0.2, eos_token_id=None,
                        bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.to(dtype).eval()


@dataclass(frozen=True)
class TinySpec:
    family: str
    seed: int = 0


def parse_tiny_spec(spec: str) -> TinySpec | None:
    """`tiny:llama` -> TinySpec("llama", 0), `tiny:qwen2,seed=3` -> seed 3 (the toolkit's one spec grammar,
    draftsmith/specs.py); None for any other model name."""
    if not spec.startswith(TINY_PREFIX):
        return None
    usage = "expected tiny:<family>[,seed=<integer>]"
    try:
        parsed = parse_spec(spec)
    except SpecError as err:
        raise UserError(f"bad tiny model {spec!r}: {err}; {usage}") from None
    seed = parsed.options.pop("seed", "0")
    if parsed.first is None or parsed.options or not seed.isdigit():
        raise UserError(f"bad tiny model {spec!r}: {usage}")
    return TinySpec(parsed.first, int(seed))
