"""Helpers shared by every training recipe (each recipe stays a self-contained file).

- Config: YAML -> nested typed dataclasses; unknown keys and wrong types are rejected with the key
  path in the message (`train.max_stepz`); `key.path=value` command-line overrides.
- Targets: `load_target(spec)` for a zoo name / local dir / hub id, or `tiny:<family>` for a tiny
  random Llama/Qwen2 built in-process with a fixed seed (tests and smoke runs; no files, no network).
- Data: pre-tokenised records ({"input_ids", "loss_mask"}) from a source spec, a deterministic
  held-out split, and a deterministic batch order addressed by `samples_seen` alone, so a resumed
  run draws exactly the batches an uninterrupted run would have drawn.
- Checkpoints: nested state (tensors anywhere inside dicts/lists/tuples) written without pickle as
  `tensors.safetensors` + `state.json` into a temporary directory that is renamed into place
  (a `step_<N>` directory exists only when complete); the last N are kept. Loading names the
  missing or corrupt file.
- RNG: torch (CPU and CUDA), Python and NumPy generator states as plain data.
- Tracking: W&B through accelerate's trackers, in offline mode when there is no network.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import random
import shutil
import socket
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import torch
import yaml

log = logging.getLogger(__name__)

T = TypeVar("T")

# ---------------------------------------------------------------------------------------------
# Config: YAML -> typed dataclasses
# ---------------------------------------------------------------------------------------------


class ConfigError(ValueError):
    """A config value or key is invalid; the message names the key path."""


def _join(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check (and lightly convert) `value` against the annotation `tp`."""
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return config_from_dict(tp, value, path)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{path}: must not be null (expected {_type_name(tp)})")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {_type_name(tp)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{path}: {value!r} is not one of {list(args)}")
        return value
    if value is None:
        raise ConfigError(f"{path}: must not be null (expected {_type_name(tp)})")
    if origin in (list, Sequence) or tp is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        item = args[0] if args else Any
        return [_coerce(v, item, _join(path, i)) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], _join(path, i)) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}")
        return tuple(_coerce(v, a, _join(path, i)) for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        vt = args[1] if args else Any
        return {str(k): _coerce(v, vt, _join(path, str(k))) for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported annotation {_type_name(tp)}")


def config_from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build the dataclass `cls` from a (nested) mapping; unknown keys are errors naming the key."""
    where = path or "the top level"
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of keys to values, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {_join(path, close[0])!r}?)" if close else ""
            raise ConfigError(f"unknown config key {_join(path, str(key))!r}{hint}; valid keys at {where}: "
                              f"{sorted(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], _join(path, name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"missing required config key {_join(path, name)!r}")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{where}: {err}") from err


def config_to_dict(cfg: Any) -> dict:
    """Plain nested dict (lists for tuples) of a config dataclass, safe for YAML/JSON."""
    return json.loads(json.dumps(dataclasses.asdict(cfg)))


def parse_override(text: str) -> tuple[list[str], Any]:
    """`train.max_steps=10` -> (["train", "max_steps"], 10); values are parsed as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not of the form key.path=value")
    return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Set `key.path=value` overrides in a raw config mapping (validated when the config is built)."""
    for text in overrides:
        keys, value = parse_override(text)
        node = raw
        for i, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {'.'.join(keys[:i + 1])!r} is not a section")
            node = child
        node[keys[-1]] = value
    return raw


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Read a YAML file (optional), apply overrides, and build the typed config `cls`."""
    raw: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the top level must be a mapping, got {type(raw).__name__}")
    return config_from_dict(cls, apply_overrides(raw, overrides))


def save_config(cfg: Any, path: str | Path, header: str | None = None) -> None:
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
    Path(path).write_text((f"# {header}\n" if header else "") + text)


# ---------------------------------------------------------------------------------------------
# Targets: real checkpoints or tiny in-process models
# ---------------------------------------------------------------------------------------------

TINY_PREFIX = "tiny:"


class TinyTokenizer:
    """Stand-in tokenizer for tiny random targets: token i is the string `<i>`."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.pad_token_id = None

    def get_vocab(self) -> dict[str, int]:
        return {f"<{i}>": i for i in range(self.vocab_size)}

    def __len__(self) -> int:
        return self.vocab_size


def build_tiny_causal_lm(family: str = "llama", seed: int = 0, vocab_size: int = 96, hidden_size: int = 48,
                         num_layers: int = 2, dtype: torch.dtype = torch.float32):
    """A tiny random Llama / Qwen2 causal LM (fixed seed, sdpa attention, untied LM head)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    families = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if family not in families:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {sorted(families)}")
    config_cls, model_cls = families[family]
    config = config_cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=1024, initializer_range=0.2, eos_token_id=None,
                        bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.to(dtype).eval()


def load_target(spec: str, dtype: str | torch.dtype = "float32", device: str | torch.device | None = None,
                attn_implementation: str = "sdpa"):
    """A `TargetModel` from a zoo name / local dir / hub id, or `tiny:<family>` (seed 0)."""
    from draftsmith.models.target import TargetModel, resolve_device, resolve_dtype

    if spec.startswith(TINY_PREFIX):
        model = build_tiny_causal_lm(spec[len(TINY_PREFIX):], seed=0, dtype=resolve_dtype(dtype))
        tokenizer = TinyTokenizer(model.config.vocab_size)
        return TargetModel(model.to(resolve_device(device)), tokenizer, name=spec)
    return TargetModel.from_pretrained(spec, dtype=dtype, device=device, attn_implementation=attn_implementation)


# ---------------------------------------------------------------------------------------------
# Data: pre-tokenised records, held-out split, resumable batch order
# ---------------------------------------------------------------------------------------------

RECORDS_PREFIX = "records:"
SYNTHETIC_PREFIX = "synthetic:"


def read_records(path: str | Path) -> list[dict]:
    """JSONL of {"input_ids": [...], "loss_mask": [...]} (loss_mask optional: all ones)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"records file not found: {path}")
    records = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({err})") from err
            ids = row.get("input_ids")
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError(f"{path}:{line_no}: 'input_ids' must be a list of ints")
            mask = row.get("loss_mask", [1] * len(ids))
            if len(mask) != len(ids):
                raise ValueError(f"{path}:{line_no}: 'loss_mask' has {len(mask)} entries, 'input_ids' {len(ids)}")
            records.append({"input_ids": ids, "loss_mask": [int(m) for m in mask]})
    return records


def write_records(path: str | Path, records: Sequence[dict]) -> None:
    with Path(path).open("w") as f:
        for rec in records:
            f.write(json.dumps({"input_ids": list(rec["input_ids"]), "loss_mask": list(rec["loss_mask"])}) + "\n")


@torch.no_grad()
def synthetic_records(model, count: int, length: int, seed: int = 0, prompt_length: int = 4,
                      temperature: float = 1.0) -> list[dict]:
    """`count` sequences sampled from `model` itself after a random prompt (loss on the samples).

    Self-distilled data for smoke runs on tiny targets: heads can learn what the target predicts.
    """
    generator = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab, (count, prompt_length), generator=generator)
    for _ in range(length - prompt_length):
        logits = model(input_ids=ids.to(device)).logits[:, -1].float().cpu()  # (count, V)
        probs = torch.softmax(logits / temperature, dim=-1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    mask = [0] * prompt_length + [1] * (length - prompt_length)
    return [{"input_ids": row, "loss_mask": list(mask)} for row in ids.tolist()]


def load_records(spec: str, tokenizer=None, max_length: int | None = None, limit: int | None = None,
                 model=None, seed: int = 0) -> list[dict]:
    """Training records from a spec.

    `records:/path.jsonl`  pre-tokenised records (no tokenizer needed)
    `synthetic:<n>[:<t>]`  n sequences of `max_length` tokens sampled from `model` at temperature t
                           (default 1; tiny smoke runs)
    anything else          `data.sources.load_source(spec)` conversations rendered with the target's
                           chat template and assistant-only loss mask (`data.chat.render_and_mask`)
    `a + b + ...`          a mixture: the records of each spec, concatenated in order (`limit`
                           applies to each part; the recipes shuffle)
    Records without any trainable token are dropped.
    """
    if " + " in spec:
        parts = [part.strip() for part in spec.split(" + ")]
        return [record for part in parts
                for record in load_records(part, tokenizer, max_length, limit, model, seed)]
    if spec.startswith(RECORDS_PREFIX):
        records = read_records(spec[len(RECORDS_PREFIX):])
        if limit is not None:
            records = records[:limit]
        if max_length is not None:
            records = [{k: v[:max_length] for k, v in r.items()} for r in records]
    elif spec.startswith(SYNTHETIC_PREFIX):
        if model is None or max_length is None:
            raise ValueError(f"{spec!r} needs the target model and data.max_length")
        count, _, temperature = spec[len(SYNTHETIC_PREFIX):].partition(":")
        try:
            count, temperature = int(count), float(temperature or 1.0)
        except ValueError:
            raise ValueError(f"bad synthetic source {spec!r}: expected synthetic:<count>[:<temperature>]") from None
        records = synthetic_records(model, count if limit is None else min(count, limit), max_length, seed=seed,
                                    temperature=temperature)
    else:
        from draftsmith.data.chat import render_and_mask
        from draftsmith.data.sources import load_source

        if tokenizer is None:
            raise ValueError(f"source {spec!r} needs the target's tokenizer")
        records = []
        for conv in load_source(spec, limit=limit):
            if not conv.has_response:
                continue
            records.append(render_and_mask(tokenizer, conv.messages, max_length=max_length))
    kept = [r for r in records if sum(r["loss_mask"]) > 0]
    if len(kept) < len(records):
        log.info("dropped %d records without trainable tokens", len(records) - len(kept))
    if not kept:
        raise ValueError(f"data source {spec!r} gave no record with trainable tokens")
    return kept


def split_heldout(records: Sequence[dict], fraction: float, seed: int,
                  max_heldout: int | None = None) -> tuple[list[dict], list[dict]]:
    """Deterministic (train, held-out) split: a seeded permutation, the first part held out."""
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
    n_held = int(round(fraction * len(records))) if fraction > 0 else 0
    if fraction > 0:
        n_held = max(1, n_held)
    if max_heldout is not None:
        n_held = min(n_held, max_heldout)
    if n_held >= len(records):
        raise ValueError(f"held-out split of {n_held} leaves no training records (of {len(records)})")
    held = [records[i] for i in order[:n_held]]
    train = [records[i] for i in order[n_held:]]
    return train, held


def epoch_order(num_records: int, seed: int, epoch: int) -> list[int]:
    """The shuffled record order of one epoch (a pure function of seed and epoch)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_records, generator=generator).tolist()


def batch_indices(num_records: int, samples_seen: int, count: int, seed: int) -> list[int]:
    """The next `count` record indices after `samples_seen` draws, crossing epochs as needed.

    The whole data position is `samples_seen`: resuming from it replays the same stream.
    """
    out: list[int] = []
    cache: dict[int, list[int]] = {}
    for pos in range(samples_seen, samples_seen + count):
        epoch, offset = divmod(pos, num_records)
        if epoch not in cache:
            cache[epoch] = epoch_order(num_records, seed, epoch)
        out.append(cache[epoch][offset])
    return out


def collate(records: Sequence[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-pad to the longest record: input_ids, attention_mask, loss_mask (B, T)."""
    length = max(len(r["input_ids"]) for r in records)
    ids = torch.full((len(records), length), pad_id, dtype=torch.long)
    attention = torch.zeros((len(records), length), dtype=torch.long)
    loss_mask = torch.zeros((len(records), length), dtype=torch.long)
    for i, r in enumerate(records):
        n = len(r["input_ids"])
        ids[i, :n] = torch.tensor(r["input_ids"], dtype=torch.long)
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(r["loss_mask"], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


# ---------------------------------------------------------------------------------------------
# RNG state as plain data
# ---------------------------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Generator states of torch (CPU, CUDA), Python and NumPy; tensors + JSON-able values."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"kind": np_state[0], "keys": np_state[1].tolist(), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping) -> None:
    torch.set_rng_state(state["torch"].cpu().to(torch.uint8))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], np.asarray(npy["keys"], dtype=np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu().to(torch.uint8) for s in state["cuda"]])


# ---------------------------------------------------------------------------------------------
# Checkpoints: safetensors + JSON, atomic, keep last N
# ---------------------------------------------------------------------------------------------

CHECKPOINT_TENSORS = "tensors.safetensors"
CHECKPOINT_STATE = "state.json"
CHECKPOINT_FORMAT = "draftsmith.checkpoint/1"
STEP_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint is missing a file or a file is corrupt; the message names the file."""


def pack_state(obj: Any, tensors: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """Replace tensors by references (storing them in `tensors`); keep tuples and non-str keys."""
    if isinstance(obj, torch.Tensor):
        name = prefix or "tensor"
        while name in tensors:  # keys containing dots could collide with nested paths
            name += "_"
        tensors[name] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": name}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": obj.tolist(), "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [pack_state(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [pack_state(v, tensors, f"{prefix}.{i}") for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        if all(isinstance(k, str) for k in obj) and not any(k.startswith("__") for k in obj):
            return {k: pack_state(v, tensors, f"{prefix}.{k}" if prefix else k) for k, v in obj.items()}
        return {"__items__": [[k, pack_state(v, tensors, f"{prefix}.{k}")] for k, v in obj.items()]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint a value of type {type(obj).__name__} at {prefix or '<root>'}")


def unpack_state(obj: Any, tensors: Mapping[str, torch.Tensor], source: str = "") -> Any:
    if isinstance(obj, list):
        return [unpack_state(v, tensors, source) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            name = obj["__tensor__"]
            if name not in tensors:
                raise CheckpointError(f"{source}: {CHECKPOINT_TENSORS} lacks tensor {name!r} named in {CHECKPOINT_STATE}")
            return tensors[name]
        if "__ndarray__" in obj:
            return np.asarray(obj["__ndarray__"], dtype=obj["dtype"])
        if "__tuple__" in obj:
            return tuple(unpack_state(v, tensors, source) for v in obj["__tuple__"])
        if "__items__" in obj:
            return {(tuple(k) if isinstance(k, list) else k): unpack_state(v, tensors, source)
                    for k, v in obj["__items__"]}
        return {k: unpack_state(v, tensors, source) for k, v in obj.items()}
    return obj


def checkpoint_step(path: Path) -> int | None:
    name = path.name
    if not name.startswith(STEP_PREFIX) or not name[len(STEP_PREFIX):].isdigit():
        return None
    return int(name[len(STEP_PREFIX):])


def list_checkpoints(checkpoints_dir: str | Path) -> list[Path]:
    """Complete `step_<N>` directories, oldest first."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    steps = [(checkpoint_step(p), p) for p in root.iterdir() if p.is_dir()]
    return [p for step, p in sorted((s, p) for s, p in steps if s is not None)]


def latest_checkpoint(checkpoints_dir: str | Path) -> Path | None:
    found = list_checkpoints(checkpoints_dir)
    return found[-1] if found else None


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def save_checkpoint(checkpoints_dir: str | Path, step: int, state: Mapping, keep_last: int | None = None) -> Path:
    """Write `state` (nested dicts/lists/tuples of tensors and plain values) as `step_<step>/`.

    Files go to a temporary sibling directory first, which is renamed into place, so an
    interrupted write never leaves a `step_<N>` directory behind. Afterwards only the
    `keep_last` newest checkpoints are kept (None or 0 keeps all).
    """
    from safetensors.torch import save_file

    root = Path(checkpoints_dir)
    root.mkdir(parents=True, exist_ok=True)
    recover_checkpoints(root)  # leftovers of a killed earlier save
    final = root / f"{STEP_PREFIX}{step}"
    tmp = root / f".tmp_{STEP_PREFIX}{step}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    tensors: dict[str, torch.Tensor] = {}
    skeleton = pack_state(dict(state), tensors)
    save_file(tensors, str(tmp / CHECKPOINT_TENSORS), metadata={"format": CHECKPOINT_FORMAT})
    (tmp / CHECKPOINT_STATE).write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": step, "state": skeleton}))
    for name in (CHECKPOINT_TENSORS, CHECKPOINT_STATE):
        _fsync_file(tmp / name)
    if final.exists():  # re-saving a step (e.g. after a resume): swap the old one out
        old = root / f".old_{STEP_PREFIX}{step}_{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    if keep_last:
        for stale in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path) -> dict:
    """Read a checkpoint directory written by `save_checkpoint` into its nested state."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    for name in (CHECKPOINT_STATE, CHECKPOINT_TENSORS):
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    try:
        doc = json.loads((path / CHECKPOINT_STATE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"checkpoint {path}: {CHECKPOINT_STATE} is corrupt ({err})") from err
    if not isinstance(doc, dict) or doc.get("format") != CHECKPOINT_FORMAT or "state" not in doc:
        raise CheckpointError(f"checkpoint {path}: {CHECKPOINT_STATE} is not a {CHECKPOINT_FORMAT} state file")
    try:
        tensors = load_file(str(path / CHECKPOINT_TENSORS))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"checkpoint {path}: {CHECKPOINT_TENSORS} is corrupt or truncated ({err})") from err
    return unpack_state(doc["state"], tensors, source=f"checkpoint {path}")


CORRUPT_SUFFIX = ".corrupt"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def recover_checkpoints(checkpoints_dir: str | Path) -> None:
    """Tidy what a killed `save_checkpoint` left behind (call from the process that saves).

    `.tmp_step_<N>_<pid>` of a dead process: an unfinished write, removed. `.old_step_<N>_<pid>`
    without `step_<N>`: the process died between swapping a re-saved step out and in; the old
    (complete) copy is put back.
    """
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return
    for entry in root.iterdir():
        for kind in (".tmp_", ".old_"):
            if not entry.name.startswith(kind + STEP_PREFIX):
                continue
            name, _, pid = entry.name[len(kind):].rpartition("_")
            if not pid.isdigit() or int(pid) == os.getpid() or _pid_alive(int(pid)):
                continue
            final = root / name
            if kind == ".old_" and not final.exists() and checkpoint_step(final) is not None:
                os.replace(entry, final)
                log.warning("restored %s from an interrupted re-save", final)
            else:
                shutil.rmtree(entry, ignore_errors=True)


def load_latest_checkpoint(checkpoints_dir: str | Path, quarantine: bool = True) -> tuple[Path, dict] | None:
    """(path, state) of the newest checkpoint that loads, or None when there is none.

    A newest checkpoint that is corrupt or truncated does not stop a resume: a warning naming the
    file is printed (stderr and the log) and the previous one is used; with `quarantine` (the main
    process only, under multi-process launches) the bad directory is renamed to
    `step_<N>.corrupt` so it is kept for inspection but never listed or pruned as a checkpoint.
    Raises `CheckpointError` naming every file when checkpoints exist but none loads.
    """
    import sys

    if quarantine:
        recover_checkpoints(checkpoints_dir)
    found = list_checkpoints(checkpoints_dir)
    problems = []
    for path in reversed(found):
        try:
            return path, load_checkpoint(path)
        except (CheckpointError, FileNotFoundError) as err:
            problems.append(str(err))
            message = f"warning: {err}; falling back to the previous checkpoint"
            print(message, file=sys.stderr, flush=True)
            log.warning(message)
            if quarantine and path.exists():
                bad = path.with_name(path.name + CORRUPT_SUFFIX)
                shutil.rmtree(bad, ignore_errors=True)
                os.replace(path, bad)
    if problems:
        raise CheckpointError(f"no usable checkpoint in {checkpoints_dir}: " + "; ".join(problems))
    return None


# ---------------------------------------------------------------------------------------------
# Faults: non-finite losses, multi-process helpers
# ---------------------------------------------------------------------------------------------


class NonFiniteLossError(FloatingPointError):
    """A loss (or gradient norm) became NaN/inf; the message names the step."""


def check_finite(value: Any, step: int, what: str = "loss", checkpoints_dir: str | Path | None = None) -> None:
    """Stop the run when `value` (float or tensor) is NaN or inf, naming the step.

    Call it before saving anything for `step`, on a value that is identical on every process
    (e.g. the loss after `accelerator.reduce`), so every rank stops together and the last good
    checkpoint stays the newest one; `checkpoints_dir` lets the message name that checkpoint.
    """
    tensor = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
    if bool(torch.isfinite(tensor).all()):
        return
    kind = "NaN" if bool(torch.isnan(tensor).any()) else "inf"
    last = latest_checkpoint(checkpoints_dir) if checkpoints_dir is not None else None
    keep = (f"; the last good checkpoint is {last} (resume with --resume after fixing the cause, e.g. a lower "
            f"learning rate)") if last is not None else "; no checkpoint was written before it"
    raise NonFiniteLossError(f"{what} is {kind} at step {step}: stopping the run{keep}")


def gather_trainable_state(accelerator, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU copies of `module`'s trainable parameters, by name.

    Call on EVERY process: under FSDP / DeepSpeed ZeRO-3 `accelerator.get_state_dict` gathers the
    shards collectively (and returns them on the main process); under DDP it is a local copy.
    Frozen parameters (the target) are left out, so drafter checkpoints stay small.
    """
    unwrapped = accelerator.unwrap_model(module)
    trainable = {name for name, p in unwrapped.named_parameters() if p.requires_grad}
    state = accelerator.get_state_dict(module, unwrap=True) or {}
    return {name: t.detach().cpu().contiguous() for name, t in state.items() if name in trainable}


def even_shard(items: Sequence[T], rank: int, world: int) -> list[tuple[T, bool]]:
    """This rank's items (`i % world == rank`) as (item, real) pairs, padded with (items[0], False)
    so that every rank gets the same count.

    Evaluation loops need it: a DDP forward broadcasts buffers and an FSDP / ZeRO-3 forward gathers
    parameters, both collectives, so a rank that runs one batch more than another hangs the run.
    Run the forward for every pair and drop the results of the padding ones (`real` False).
    """
    mine = [(item, True) for item in items[rank::world]]
    longest = -(-len(items) // world) if items else 0
    return mine + [(items[0], False) for _ in range(longest - len(mine))]


def local_rank_zero() -> bool:
    """True in the process that should write shared files, before an Accelerator exists
    (`RANK` from torchrun / `accelerate launch`; 0 when not launched)."""
    return int(os.environ.get("RANK", "0") or 0) == 0


# ---------------------------------------------------------------------------------------------
# Tracking
# ---------------------------------------------------------------------------------------------


def network_available(host: str = "api.wandb.ai", port: int = 443, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def prepare_wandb_env(output_dir: str | Path) -> str:
    """Pick W&B offline mode when there is no network (an explicit WANDB_MODE wins)."""
    os.environ.setdefault("WANDB_SILENT", "true")
    if "WANDB_MODE" not in os.environ and not network_available():
        os.environ["WANDB_MODE"] = "offline"
        log.info("no network: W&B runs in offline mode (sync later with `wandb sync`)")
    return os.environ.get("WANDB_MODE", "online")


def flatten_dict(d: Mapping, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten_dict(v, key))
        else:
            out[key] = v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
    return out


def print_summary(summary: Mapping) -> None:
    """Print a recipe's final JSON summary as one line in one write: under `accelerate launch` the ranks
    share the stdout pipe, and a print split into several writes can interleave with another rank's."""
    sys.stdout.write(json.dumps(dict(summary)) + "\n")
    sys.stdout.flush()


class MetricsFile:
    """Append-only JSONL of logged metrics (main process only), read back by tests and reports."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled

    def write(self, record: Mapping) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(dict(record)) + "\n")

    def drop_after(self, step: int) -> None:
        """Forget rows logged after `step` (a resumed run redoes those steps and logs them again)."""
        if not (self.enabled and self.path.is_file()):
            return
        kept = [row for row in self.read(self.path) if int(row.get("step", 0)) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(tmp, self.path)

    @staticmethod
    def read(path: str | Path) -> list[dict]:
        path = Path(path)
        if not path.is_file():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
