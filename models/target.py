"""The target model: a stock Hugging Face causal LM and its tokenizer, driven through an engine.

No modeling code is copied. Tree verification is one ordinary forward call of the stock model with
  - `attention_mask`: an additive float mask (B, 1, n, past + n), 0 where a query may attend and
    the dtype's minimum elsewhere (transformers passes a 4D mask through unchanged, and additive
    float masks work for both the eager and the sdpa attention implementations);
  - `position_ids`: past + depth of each tree node, so siblings share a position;
  - the KV cache (`cache=`, `past_key_values=` before transformers 5.2x): the engine's KV cache holding the committed prefix.
After verification only the accepted path is kept (`commit`). Engines: `models.engine.EagerEngine`
(a growing DynamicCache, the default) and `models.compiled.CompiledEngine` (backend="compiled":
a preallocated cache, inputs padded to buckets, one AOT-compiled graph per bucket).

Hidden-state indices follow transformers' `output_hidden_states` tuple: 0 is the embedding output,
`num_hidden_layers` the final (normed) state that feeds the LM head; negative indices count from the
end (-1 = final, -2 = output of the second-to-top decoder layer).
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from draftsmith.errors import UserError
from draftsmith.models.compiled import CompiledDGFEngine, CompileSettings, CompiledEngine
from draftsmith.models.dgf import DGFModel, EagerDGFEngine
from draftsmith.models.engine import Backend, EagerEngine, TargetOutput
from draftsmith.models.student import lean_student_spec, rebuild_lean_student
from draftsmith.models.tiny import TinyTokenizer, build_tiny_causal_lm, parse_tiny_spec
from draftsmith.models.registry import REGISTRY, resolve_model_path

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a user-facing dtype name to a torch dtype (resolved once, at the entry point)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    """The user-facing name of a torch dtype (resolve_dtype's inverse): torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def resolve_device(device: str | torch.device | None) -> torch.device:
    """'auto' picks cuda when present, else cpu; None means cpu (the default everywhere)."""
    if device is None:
        return torch.device("cpu")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise UserError(f"unknown device {device!r}: use cpu, cuda, cuda:<index> or auto") from err
    check_device_present(resolved)
    return resolved


def check_device_present(device: torch.device) -> None:
    """One line when the machine or this torch build lacks the device asked for (not an assertion from torch)."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise UserError(f"device {str(device)!r}: this toolkit runs on cpu or cuda; use device=cpu or auto")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU-only build")
        raise UserError(f"device {str(device)!r}: no CUDA device here ({build}); use device=cpu, or auto to take "
                        "a GPU only when one is present")
    if device.index is not None and device.index >= count:
        raise UserError(f"device {str(device)!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}")


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


def from_hub_or_dir(loader, name_or_path: str, path: str, **kwargs):
    """`loader.from_pretrained(path)`; a hub id that cannot be fetched is one UserError naming it (the hub client's
    own retry warnings held back: the error says what failed)."""
    hub_logger = logging.getLogger("huggingface_hub")
    level = hub_logger.level
    hub_logger.setLevel(logging.ERROR)
    try:
        return loader.from_pretrained(path, **kwargs)
    except OSError as err:
        if Path(path).is_dir():
            raise
        first_sentence = " ".join(str(err).split()).split(". ")[0].rstrip(".")[:200]
        raise UserError(f"model {name_or_path!r}: not a registry name ({', '.join(REGISTRY)}) or an existing directory, "
                        f"and the hub id could not be loaded ({first_sentence})") from err
    finally:
        hub_logger.setLevel(level)


def load_tokenizer(name_or_path: str):
    """The tokenizer of a registry name / dir / hub id, or the TinyTokenizer of a `tiny:` model."""
    tiny = parse_tiny_spec(name_or_path)
    if tiny is not None:
        return TinyTokenizer(build_tiny_causal_lm(tiny.family, seed=tiny.seed).config.vocab_size)
    return from_hub_or_dir(AutoTokenizer, name_or_path, resolve_model_path(name_or_path))


def load_model_config(name_or_path: str):
    """The HF config of a registry name / dir / hub id (or of a `tiny:` model) without loading weights."""
    tiny = parse_tiny_spec(name_or_path)
    if tiny is not None:
        return build_tiny_causal_lm(tiny.family, seed=tiny.seed).config
    return from_hub_or_dir(AutoConfig, name_or_path, resolve_model_path(name_or_path))


# (backend, what runs) -> engine factory (model, compile settings): the one table of engines. A stock HF causal
# LM (target, draft LM) and a feature drafter (models.dgf) each have an eager and a compiled engine.
ENGINES = {(Backend.EAGER, PreTrainedModel): lambda model, settings: EagerEngine(model),
           (Backend.COMPILED, PreTrainedModel): lambda model, settings: CompiledEngine(model, settings),
           (Backend.EAGER, DGFModel): lambda model, settings: EagerDGFEngine(model),
           (Backend.COMPILED, DGFModel): lambda model, settings: CompiledDGFEngine(model, settings)}


def make_engine(model: nn.Module, backend: Backend, settings: CompileSettings | None = None):
    """The engine that runs `model` (an HF causal LM or a DGFModel) on `backend`, from ENGINES."""
    kind = DGFModel if isinstance(model, DGFModel) else PreTrainedModel
    return ENGINES[(Backend(backend), kind)](model, settings)


class TargetModel:
    """A stock HF causal LM plus its tokenizer, driven through an engine (eager: a growing DynamicCache;
    compiled: models.compiled, static shapes and AOT-compiled graphs). `model` stays the stock module
    (HF `generate` baselines use it as it is)."""

    def __init__(self, model: PreTrainedModel, tokenizer, name: str = "", engine=None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name or getattr(model.config, "_name_or_path", "")
        self.config = model.config
        self.engine = engine or EagerEngine(self.model)

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str | torch.dtype = "float32",
                        device: str | torch.device | None = None, gguf_file: str | None = None,
                        attn_implementation: str = "sdpa", backend: Backend = Backend.EAGER,
                        settings: CompileSettings | None = None) -> "TargetModel":
        """Load by registry name, local dir or hub id (and optionally a GGUF file inside that dir), or build a
        tiny random model for `tiny:<family>[,seed=N]` (models.tiny); `backend` picks the engine."""
        tiny = parse_tiny_spec(name_or_path)
        lean = lean_student_spec(name_or_path) if tiny is None else None
        if lean is not None:  # a lean student: the target's model with its trained layers
            base = cls.from_pretrained(lean["target"], dtype=dtype, device=device,
                                       attn_implementation=attn_implementation)
            loaded = cls(rebuild_lean_student(base.model, name_or_path), base.tokenizer, name=name_or_path)
        elif tiny is not None:
            model = build_tiny_causal_lm(tiny.family, seed=tiny.seed, dtype=resolve_dtype(dtype))
            loaded = cls(model.to(resolve_device(device)), TinyTokenizer(model.config.vocab_size), name=name_or_path)
        else:
            path = resolve_model_path(name_or_path)
            extra = {"gguf_file": gguf_file} if gguf_file else {}
            tokenizer = from_hub_or_dir(AutoTokenizer, name_or_path, path, **extra)
            model = from_hub_or_dir(AutoModelForCausalLM, name_or_path, path, dtype=resolve_dtype(dtype),
                                    attn_implementation=attn_implementation, **extra)
            loaded = cls(model.to(resolve_device(device)), tokenizer, name=name_or_path)
        return loaded.with_backend(backend, settings)

    def with_backend(self, backend: Backend, settings: CompileSettings | None = None) -> "TargetModel":
        """This model (same module, same weights) driven by another engine; `self` when it already is."""
        if not isinstance(backend, Backend):
            raise TypeError(f"backend must be a models.engine.Backend, got {backend!r}")
        if backend == self.engine.name:
            return self
        engine = make_engine(self.model, backend, settings)
        return TargetModel(self.model, self.tokenizer, name=self.name, engine=engine)

    @property
    def backend(self) -> Backend:
        return self.engine.name

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
    def max_positions(self) -> int | None:
        """Positions the target holds, prompt and new tokens together (None where its config does not say)."""
        return getattr(self.config, "max_position_embeddings", None)

    @property
    def eos_token_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        ids = [ids] if isinstance(ids, int) else list(ids or [])
        return set(ids)

    # -- the engine: caches and forwards -------------------------------------------------------

    def prepare(self, sizes: tuple[int, ...] | None = None) -> None:
        """Build or load whatever forwards of these input sizes need (compiled: their graphs), untimed."""
        self.engine.prepare(sizes)

    def release(self, sizes: tuple[int, ...] | None = None) -> None:
        """Free what `prepare` built for these sizes (compiled: a frozen weight copy per graph)."""
        self.engine.release(sizes)

    def graph_groups(self, sizes: tuple[int, ...]) -> list[tuple[int, ...]]:
        """Input sizes grouped by the graph `prepare` builds for them (eager: one group)."""
        return self.engine.graph_groups(sizes)

    def new_cache(self, max_length: int | None = None):
        """An empty KV cache for a request of up to `max_length` tokens."""
        return self.engine.new_cache(max_length)

    def cache_length(self, cache) -> int:
        """Committed slots in the cache."""
        return self.engine.cache_length(cache)

    def fits(self, max_length: int) -> bool:
        """Whether the caches `new_cache` gives take a request of up to `max_length` tokens."""
        return self.engine.fits(max_length)

    def commit(self, cache, keep: torch.Tensor) -> None:
        """Keep only the cache slots `keep` (1D, increasing): the prefix plus the accepted path."""
        self.engine.commit(cache, keep)

    def truncate(self, cache, length: int) -> None:
        """Drop every slot from `length` on."""
        self.engine.truncate(cache, length)

    def forward(self, input_ids: torch.Tensor, cache=None, position_ids: torch.Tensor | None = None,
                allowed: torch.Tensor | None = None, hidden_layers: tuple[int, ...] = (),
                last_only: bool = False, argmax_only: bool = False, greedy_rows: bool = False) -> TargetOutput:
        """One forward over `input_ids` (1, n) appended to `cache`.

        `allowed` (1, 1, n, past + n) bool: which cache/new slots each new token may attend to; None
        means plain causal attention. Returns float32 logits (of the last position only with `last_only`: a
        prompt's prefill needs no more, and the LM head is a fifth of a small model's work) and the requested
        hidden states. The cache grows by n slots (`commit` keeps only some of them). With `argmax_only` (greedy
        decoding) only each row's argmax need be exact: the compiled engine's greedy head computes the others from
        int8 or bf16 copies of its weights (models.kernels.GreedyHead). With `greedy_rows` (greedy decoding, a caller
        that reads each row's greedy token only) an engine whose greedy head costs less a row apart than rows
        together (GreedyHead.rows_apart) returns no logits but `greedy`: each row's token on demand.
        """
        return self.engine.forward(input_ids, cache, position_ids, allowed, hidden_layers, last_only, argmax_only,
                                   greedy_rows)
