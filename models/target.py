"""The target model: a stock Hugging Face causal LM driven with 4D tree masks over a DynamicCache.

No modeling code is copied. Tree verification is one ordinary forward call of the stock model with
  - `attention_mask`: an additive float mask (B, 1, n, past + n), 0 where a query may attend and
    the dtype's minimum elsewhere (transformers passes a 4D mask through unchanged, and additive
    float masks work for both the eager and the sdpa attention implementations);
  - `position_ids`: past + depth of each tree node, so siblings share a position;
  - `past_key_values`: a `DynamicCache` holding the committed prefix.
After verification only the accepted path is kept: `commit_kv` gathers those cache slots along the
sequence axis (or crops, when the kept slots are a contiguous prefix).

Hidden-state indices follow transformers' `output_hidden_states` tuple: 0 is the embedding output,
`num_hidden_layers` the final (normed) state that feeds the LM head; negative indices count from the
end (-1 = final, -2 = output of the second-to-top decoder layer).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from draftsmith.errors import UserError
from draftsmith.models.tiny import TinyTokenizer, build_tiny_causal_lm, parse_tiny_spec
from draftsmith.models.zoo import resolve_model_path

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name to a torch dtype (resolved once, at the entry point)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'auto' picks cuda when present, else cpu; None means cpu (the default everywhere)."""
    if device is None:
        return torch.device("cpu")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise UserError(f"unknown device {device!r}: use cpu, cuda, cuda:<index> or auto") from err


def vocab_fingerprint(tokenizer) -> str:
    """sha256 of the token -> id map; equal fingerprints mean interchangeable token ids."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def check_same_tokenizer(target_tokenizer, draft_tokenizer, what: str = "drafter") -> None:
    """Refuse a drafter whose tokens mean something else than the target's."""
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    only_target = len(target_vocab.keys() - draft_vocab.keys())
    only_draft = len(draft_vocab.keys() - target_vocab.keys())
    moved = sum(1 for tok, idx in target_vocab.items() if tok in draft_vocab and draft_vocab[tok] != idx)
    raise ValueError(
        f"the {what}'s tokenizer differs from the target's: vocab sizes {len(draft_vocab)} vs "
        f"{len(target_vocab)}, {only_target} tokens only in the target, {only_draft} only in the "
        f"{what}, {moved} shared tokens with different ids. Speculative decoding needs identical "
        f"token ids; use a {what} trained with the target's tokenizer.")


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool (…, q, k) 'may attend' -> additive float mask: 0 allowed, dtype-min forbidden."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Shrink the cache to its first `length` slots (a negative crop argument removes slots in
    both transformers 4.x and 5.x; positive arguments changed meaning between them)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def commit_kv(cache: DynamicCache, keep: torch.Tensor) -> None:
    """Keep only the cache slots `keep` (1D, increasing) along the sequence axis, in place.

    After a tree forward the cache holds past + tree slots; `keep` = the prefix plus the accepted
    path. Contiguous prefixes are cropped (no copy); anything else is gathered.
    """
    kept = keep.numel()
    contiguous = kept == 0 or (int(keep[-1]) == kept - 1)  # increasing, so 0..kept-1 exactly
    if contiguous:
        crop_cache(cache, kept)
        return
    for layer in cache.layers:
        if not hasattr(layer, "keys") or type(layer).__name__ != "DynamicLayer":
            raise NotImplementedError(f"commit_kv supports full-attention DynamicLayer caches, got {type(layer).__name__}")
        index = keep.to(layer.keys.device)
        layer.keys = layer.keys.index_select(-2, index)  # (B, kv_heads, kept, head_dim)
        layer.values = layer.values.index_select(-2, index)


def load_tokenizer(name_or_path: str):
    """The tokenizer of a zoo name / dir / hub id, or the TinyTokenizer of a `tiny:` model."""
    tiny = parse_tiny_spec(name_or_path)
    if tiny is not None:
        return TinyTokenizer(build_tiny_causal_lm(tiny.family, seed=tiny.seed).config.vocab_size)
    return AutoTokenizer.from_pretrained(resolve_model_path(name_or_path))


def load_model_config(name_or_path: str):
    """The HF config of a zoo name / dir / hub id (or of a `tiny:` model) without loading weights."""
    tiny = parse_tiny_spec(name_or_path)
    if tiny is not None:
        return build_tiny_causal_lm(tiny.family, seed=tiny.seed).config
    return AutoConfig.from_pretrained(resolve_model_path(name_or_path))


@dataclass
class TargetOutput:
    logits: torch.Tensor  # (B, n, V) float32
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer index -> (B, n, H)


class TargetModel:
    """A stock HF causal LM plus its tokenizer, with tree-masked forwards over a DynamicCache."""

    def __init__(self, model: PreTrainedModel, tokenizer, name: str = ""):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "")
        self.config = model.config

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str | torch.dtype = "float32",
                        device: str | torch.device | None = None, gguf_file: str | None = None,
                        attn_implementation: str = "sdpa") -> "TargetModel":
        """Load by zoo name, local dir or hub id (and optionally a GGUF file inside that dir), or build a
        tiny random model for `tiny:<family>[:<seed>]` (models.tiny)."""
        tiny = parse_tiny_spec(name_or_path)
        if tiny is not None:
            model = build_tiny_causal_lm(tiny.family, seed=tiny.seed, dtype=resolve_dtype(dtype))
            return cls(model.to(resolve_device(device)), TinyTokenizer(model.config.vocab_size), name=name_or_path)
        path = resolve_model_path(name_or_path)
        extra = {"gguf_file": gguf_file} if gguf_file else {}
        tokenizer = AutoTokenizer.from_pretrained(path, **extra)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=resolve_dtype(dtype), attn_implementation=attn_implementation, **extra)
        return cls(model.to(resolve_device(device)), tokenizer, name=name_or_path)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def eos_token_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        return set(ids)

    def new_cache(self, max_length: int | None = None) -> DynamicCache:
        """An empty KV cache (a growing DynamicCache; `max_length` is what static backends preallocate)."""
        return DynamicCache(config=self.config)

    def cache_length(self, cache: DynamicCache) -> int:
        """Committed slots in the cache."""
        return cache.get_seq_length()

    def commit(self, cache: DynamicCache, keep: torch.Tensor) -> None:
        """Keep only the cache slots `keep` (1D, increasing): the prefix plus the accepted path."""
        commit_kv(cache, keep)

    def truncate(self, cache: DynamicCache, length: int) -> None:
        """Drop every slot from `length` on."""
        crop_cache(cache, length)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: DynamicCache | None = None,
                position_ids: torch.Tensor | None = None, allowed: torch.Tensor | None = None,
                hidden_layers: tuple[int, ...] = ()) -> TargetOutput:
        """One forward over `input_ids` (B, n) appended to `cache`.

        `allowed` (B or 1, 1, n, past + n) bool: which cache/new slots each new token may attend
        to; None means plain causal attention. Returns float32 logits and the requested hidden
        states. The cache grows by n slots (use `commit_kv` to keep only some of them).
        """
        mask = None if allowed is None else additive_mask(allowed, self.dtype)
        out = self.model(input_ids=input_ids, past_key_values=cache, position_ids=position_ids,
                         attention_mask=mask, use_cache=cache is not None,
                         output_hidden_states=bool(hidden_layers))
        hidden = {layer: out.hidden_states[layer] for layer in hidden_layers}
        return TargetOutput(logits=out.logits.float(), hidden=hidden)
