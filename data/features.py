"""Offline feature cache: run the target once over tokenised data, store what a recipe needs.

Recipes that train on target features (Medusa heads on the final hidden state, EAGLE-style
drafters on a few layers, KD on top-k logits) should not pay a target forward per epoch.
``build_feature_cache(cfg)`` renders and masks every conversation (``data.chat.render_and_mask``),
runs the target once per sequence (or per right-padded batch) and stores, per sequence:

    input_ids (int32), loss_mask (uint8), the chosen hidden layers (bf16),
    optionally the top-k logits (bf16 values + int32 indices) and the logsumexp of the full
    logits (fp32; ``topk_values - logsumexp`` are exact log-probabilities of those tokens).

Hidden-layer indices follow transformers' ``output_hidden_states``: 0 = embeddings, -1 = the
final normed state that feeds the LM head, -2 = the output of the second-to-top decoder layer.

On disk (one directory per cache)::

    shard_<rank>_<index>.safetensors   flat concatenation over the shard's sequences:
        input_ids (N,) int32 | loss_mask (N,) uint8 | offsets (n+1,) int64 | items (n,) int64
        hidden.<layer> (N, H) bf16, one per cached layer (absolute index 0..L)
        [topk_values (N, k) bf16 | topk_indices (N, k) int32 | logsumexp (N,) float32]
        sequence i is rows offsets[i]:offsets[i+1]; metadata "ids" = JSON list of record ids
    progress_rank<r>.json / index.json  ledgers and the merged index (``data.regenerate.ShardLedger``):
        model, vocab_fingerprint, vocab_size, hidden_size, num_layers, hidden_layers (as asked),
        hidden_layers_abs, topk_logits, dtype, bytes_per_token, shards [{file, n_sequences,
        n_tokens, n_loss_tokens, bytes}], complete

Sharding and resuming work like regeneration: rank r of W takes items ``i % W == r``, packs them
into shards of about ``shard_tokens`` tokens (deterministic: a rerun plans the same shards),
writes each to a temp name, renames it and records it; a rerun skips recorded shards. Before the
first write the bytes per token and the total estimate are printed, and the run refuses to start
when the free disk space is below the estimate.

``FeatureDataset`` streams the cache shard by shard (``safetensors.safe_open``, reading only the
rows it yields), optionally shuffled with a seed, split across DataLoader workers and ranks.
``load_index(dir, target)`` checks that a cache belongs to a target before training on it.

CLI::

    python -m draftsmith.data.features --model smollm2-135m-instruct --source gsm8k:train --limit 64 \\
        --layers -1 --topk 0 --output-dir runs/features/gsm8k-smollm2
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch.utils.data import IterableDataset, get_worker_info

from draftsmith.config import config_from_dict
from draftsmith.data.chat import render_and_mask
from draftsmith.data.regenerate import job_parser
from draftsmith.data.shards import (PlanMismatch, ShardLedger, fingerprint, merged_index, rank_items,
                                    resolve_rank_device, resolve_rank_world)
from draftsmith.data.sources import Conversation, load_source
from draftsmith.fileio import atomic_write
from draftsmith.models.target import TargetModel, resolve_dtype, vocab_fingerprint

log = logging.getLogger(__name__)

FEATURES_FORMAT = "draftsmith.features/1"
__all__ = ["FeatureCacheConfig", "build_feature_cache", "FeatureDataset", "load_index", "FeatureCacheMismatch",
           "InsufficientDiskSpace", "bytes_per_token", "PlanMismatch"]


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


@dataclass
class FeatureCacheConfig:
    """What ``build_feature_cache`` stores; every default is declared here once.

    model:          zoo name, local dir or hub id (recorded as the cache's model id)
    source:         source spec for ``data.sources.load_source`` (or None with ``records=``)
    output_dir:     cache directory
    hidden_layers:  output_hidden_states indices to store (-1 = final normed state)
    topk_logits:    store the top-k logits per token (0 = none)
    max_length:     sequences are cut at this many tokens (right)
    shard_tokens:   tokens per shard (a shard closes once it holds at least this many)
    storage_dtype:  dtype of stored hidden states / logit values ("bfloat16")
    dtype, device:  target compute dtype / device
    batch_size:     sequences per forward (right-padded; 1 = no padding)
    limit:          keep the first N records of the source (before sharding across ranks)
    rank, world_size: None = from RANK / WORLD_SIZE, else 0 / 1
    skip_no_loss:   drop sequences without a single trained token (nothing to learn from)
    disk_margin:    refuse to start unless free space >= estimate * (1 + disk_margin)
    max_shards:     stop after writing this many shards in this call (rerun continues)
    num_threads:    torch CPU threads (None = torch's default)
    progress:       tqdm progress bar on stderr
    """

    model: str
    source: str | dict | None
    output_dir: str
    hidden_layers: tuple[int, ...] = (-1,)
    topk_logits: int = 0
    max_length: int = 2048
    shard_tokens: int = 262_144
    storage_dtype: str = "bfloat16"
    dtype: str = "float32"
    device: str | None = None
    batch_size: int = 1
    limit: int | None = None
    rank: int | None = None
    world_size: int | None = None
    skip_no_loss: bool = True
    disk_margin: float = 0.05
    max_shards: int | None = None
    num_threads: int | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        self.hidden_layers = tuple(int(x) for x in self.hidden_layers)
        if not self.hidden_layers:
            raise ValueError("FeatureCacheConfig.hidden_layers must name at least one layer")
        if len(set(self.hidden_layers)) != len(self.hidden_layers):
            raise ValueError(f"FeatureCacheConfig.hidden_layers has duplicates: {self.hidden_layers}")
        for name in ("max_length", "shard_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"FeatureCacheConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.topk_logits < 0:
            raise ValueError(f"FeatureCacheConfig.topk_logits must be >= 0, got {self.topk_logits}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FeatureCacheConfig":
        return config_from_dict(cls, d)


class InsufficientDiskSpace(OSError):
    """Free disk space is below the feature cache's size estimate."""


class FeatureCacheMismatch(ValueError):
    """A feature cache was built for another target (vocab / hidden size / layers / top-k)."""


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def absolute_layers(layers: Sequence[int], num_layers: int) -> list[int]:
    """output_hidden_states indices -> 0..num_layers (the tuple has num_layers + 1 entries)."""
    out = []
    for layer in layers:
        a = layer if layer >= 0 else num_layers + 1 + layer
        if not 0 <= a <= num_layers:
            raise ValueError(f"hidden layer {layer} out of range for a model with {num_layers} layers "
                             f"(valid: {-(num_layers + 1)}..{num_layers})")
        out.append(a)
    return out


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_token(n_layers: int, hidden_size: int, topk: int, storage_dtype: torch.dtype = torch.bfloat16) -> int:
    """Stored bytes per token: hidden states + top-k (values, int32 indices, fp32 logsumexp) +
    input id (int32) + loss mask (uint8)."""
    s = _itemsize(storage_dtype)
    return n_layers * hidden_size * s + (topk * (s + 4) + 4 if topk else 0) + 4 + 1


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


def _existing_parent(path: Path) -> Path:
    p = path.resolve()
    while not p.exists():
        p = p.parent
    return p


def _model_config(target: Any) -> Any:
    return getattr(target, "config", None) or target.model.config


def _tokenise(records: Sequence[Any], items: Sequence[int], tokenizer: Any, max_length: int,
              skip_no_loss: bool) -> tuple[list[dict], dict[str, int]]:
    """[{item, id, input_ids, loss_mask}] for the given item indices, plus skip counts."""
    seqs, skipped = [], {}
    for i in items:
        rec = records[i]
        if isinstance(rec, Conversation):
            rid = rec.id
            if skip_no_loss and not rec.has_response:
                skipped["no_assistant_turn"] = skipped.get("no_assistant_turn", 0) + 1
                continue
            tok = render_and_mask(tokenizer, rec.messages, max_length=max_length)
        elif isinstance(rec, Mapping) and "input_ids" in rec:
            rid = str(rec.get("id", i))
            ids = list(rec["input_ids"])
            tok = {"input_ids": ids[:max_length], "loss_mask": list(rec.get("loss_mask", [1] * len(ids)))[:max_length]}
        else:
            raise TypeError(f"record {i}: expected a Conversation or a dict with input_ids, got {type(rec).__name__}")
        if not tok["input_ids"] or (skip_no_loss and not any(tok["loss_mask"])):
            skipped["no_loss_tokens"] = skipped.get("no_loss_tokens", 0) + 1
            continue
        seqs.append({"item": i, "id": rid, **tok})
    return seqs, skipped


def _pack(seqs: list[dict], shard_tokens: int) -> list[list[dict]]:
    shards, cur, n = [], [], 0
    for s in seqs:
        cur.append(s)
        n += len(s["input_ids"])
        if n >= shard_tokens:
            shards.append(cur)
            cur, n = [], 0
    if cur:
        shards.append(cur)
    return shards


def _accepts(model: Any, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


@torch.inference_mode()
def forward_features(model: Any, batch: list[list[int]], layers_abs: Sequence[int], topk: int,
                     pad_id: int = 0) -> list[dict[str, torch.Tensor]]:
    """One target forward over right-padded ``batch``; per sequence (T = its length):
    ``hidden`` (K, T, H) in the model dtype, and with topk: ``topk_values`` (T, k) float32,
    ``topk_indices`` (T, k), ``logsumexp`` (T,) float32."""
    device = model.device
    lens = [len(s) for s in batch]
    width = max(lens)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for b, s in enumerate(batch):
        ids[b, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[b, : len(s)] = 1
    kwargs: dict[str, Any] = {"output_hidden_states": True, "use_cache": False}
    if _accepts(model, "logits_to_keep"):
        kwargs["logits_to_keep"] = 0 if topk else 1  # skip the LM head when no logits are stored
    out = model(input_ids=ids.to(device), attention_mask=mask.to(device) if min(lens) < width else None, **kwargs)
    hs = out.hidden_states  # L+1 x (B, T, H)
    results = []
    for b, n in enumerate(lens):
        r = {"hidden": torch.stack([hs[a][b, :n] for a in layers_abs])}  # (K, T, H)
        if topk:
            logits = out.logits[b, :n].float()  # (T, V)
            r["logsumexp"] = torch.logsumexp(logits, dim=-1)
            r["topk_values"], r["topk_indices"] = logits.topk(topk, dim=-1)
        results.append(r)
    return results


# ---------------------------------------------------------------------------
# Building the cache
# ---------------------------------------------------------------------------


@dataclass
class FeatureCacheResult:
    output_dir: Path
    rank: int
    world_size: int
    shards_written: int
    shards_skipped: int
    tokens_written: int
    bytes_per_token: int
    estimate_bytes: int  # what this call was about to write (this rank)
    skipped: dict[str, int] = field(default_factory=dict)
    stopped_early: bool = False


def build_feature_cache(cfg: FeatureCacheConfig, target: Any = None,
                        records: Sequence[Conversation | Mapping[str, Any]] | None = None) -> FeatureCacheResult:
    """Run the target once over the data and write (or complete) the feature cache of this rank.

    ``target``: a loaded ``TargetModel`` (or anything with ``.model`` and ``.tokenizer``); None
    loads ``cfg.model``. ``records``: Conversations or pre-tokenised ``{"input_ids",
    "loss_mask"[, "id"]}`` dicts instead of ``cfg.source``.
    Raises ``InsufficientDiskSpace`` before writing anything when the estimate does not fit.
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    rank, world = resolve_rank_world(cfg.rank, cfg.world_size)
    recs = list(records) if records is not None else load_source(cfg.source, limit=cfg.limit)
    if records is not None and cfg.limit is not None:
        recs = recs[: cfg.limit]
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    if target is None:
        target = TargetModel.from_pretrained(cfg.model, dtype=resolve_dtype(cfg.dtype), device=resolve_rank_device(cfg.device))
    model, tokenizer = target.model, target.tokenizer
    mcfg = _model_config(target)
    num_layers, hidden_size = int(mcfg.num_hidden_layers), int(mcfg.hidden_size)
    layers_abs = absolute_layers(cfg.hidden_layers, num_layers)
    storage = resolve_dtype(cfg.storage_dtype)
    bpt = bytes_per_token(len(layers_abs), hidden_size, cfg.topk_logits, storage)

    plan = {
        "format": FEATURES_FORMAT,
        "model": cfg.model,
        "vocab_fingerprint": vocab_fingerprint(tokenizer),
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "hidden_layers": list(cfg.hidden_layers),
        "hidden_layers_abs": layers_abs,
        "topk_logits": cfg.topk_logits,
        "dtype": str(storage).removeprefix("torch."),
        "compute_dtype": cfg.dtype,
        "bytes_per_token": bpt,
        "max_length": cfg.max_length,
        "shard_tokens": cfg.shard_tokens,
        "skip_no_loss": cfg.skip_no_loss,
        "source": cfg.source if records is None else "<records>",
        "n_items": len(recs),
        "items_sha256": fingerprint([r.to_dict() if isinstance(r, Conversation) else dict(r) for r in recs]),
    }
    out = Path(cfg.output_dir)
    ledger = ShardLedger(out, rank, world, plan)  # refuses a differently planned directory

    seqs, skipped = _tokenise(recs, rank_items(len(recs), rank, world), tokenizer, cfg.max_length, cfg.skip_no_loss)
    shards = _pack(seqs, cfg.shard_tokens)
    todo = [k for k in range(len(shards)) if not ledger.is_complete(k)]
    todo_tokens = sum(len(s["input_ids"]) for k in todo for s in shards[k])
    all_tokens = sum(len(s["input_ids"]) for s in seqs)
    n_seq_meta = sum(8 * (len(sh) * 2 + 1) for sh in shards)  # offsets + items
    estimate = todo_tokens * bpt + (n_seq_meta if todo else 0)
    # Every rank writes into the same directory: ranks that have not finished need about as much.
    others_busy = 0
    for r in range(world):
        if r != rank:
            p = out / f"progress_rank{r}.json"
            others_busy += not (p.exists() and json.loads(p.read_text(encoding="utf-8")).get("done"))
    required = int(estimate * (1 + others_busy) * (1 + cfg.disk_margin)) if todo else 0
    free = shutil.disk_usage(_existing_parent(out)).free
    layer_txt = f"{len(layers_abs)} layer(s) {list(cfg.hidden_layers)} x {hidden_size} x {_itemsize(storage)} B"
    topk_txt = f" + top-{cfg.topk_logits} logits ({_itemsize(storage)} B values + 4 B ids) + 4 B logsumexp" if cfg.topk_logits else ""
    print(f"[features] {bpt} bytes/token = {layer_txt}{topk_txt} + 5 B ids/mask", flush=True)
    print(f"[features] rank {rank}/{world}: {len(seqs)} sequences, {all_tokens} tokens in {len(shards)} shard(s); "
          f"{len(todo)} shard(s) / {todo_tokens} tokens to write -> estimate {human_bytes(estimate)}"
          f"{f' (x{1 + others_busy} ranks still writing)' if others_busy and todo else ''}; "
          f"free {human_bytes(free)} at {_existing_parent(out)}", flush=True)
    if skipped:
        print(f"[features] rank {rank}: skipped {skipped}", flush=True)
    if required > free:
        raise InsufficientDiskSpace(
            f"feature cache needs about {human_bytes(required)} (estimate {human_bytes(estimate)} for rank {rank}"
            f"{f' x {1 + others_busy} ranks' if others_busy else ''} + {cfg.disk_margin:.0%} margin) but only "
            f"{human_bytes(free)} is free at {_existing_parent(out)}. Free space, pick another --output-dir, "
            "store fewer layers or fewer top-k logits, or lower --limit / --max-length.")

    ledger.start()
    result = FeatureCacheResult(out, rank, world, 0, len(shards) - len(todo), 0, bpt, estimate, skipped)
    if not todo:
        ledger.finish()
        return result
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    done_tokens = all_tokens - todo_tokens
    bar = tqdm(total=all_tokens, initial=done_tokens, desc=f"features rank {rank}/{world}", unit="tok",
               unit_scale=True, disable=not cfg.progress, file=sys.stderr)
    try:
        for k in todo:
            if cfg.max_shards is not None and result.shards_written >= cfg.max_shards:
                result.stopped_early = True
                break
            t0 = time.perf_counter()
            shard = shards[k]
            parts: dict[str, list[torch.Tensor]] = {}
            for start in range(0, len(shard), cfg.batch_size):
                group = shard[start : start + cfg.batch_size]
                feats = forward_features(model, [s["input_ids"] for s in group], layers_abs, cfg.topk_logits, pad_id)
                for s, f in zip(group, feats):
                    for j, a in enumerate(layers_abs):
                        parts.setdefault(f"hidden.{a}", []).append(f["hidden"][j].to("cpu", storage))
                    if cfg.topk_logits:
                        parts.setdefault("topk_values", []).append(f["topk_values"].to("cpu", storage))
                        parts.setdefault("topk_indices", []).append(f["topk_indices"].to("cpu", torch.int32))
                        parts.setdefault("logsumexp", []).append(f["logsumexp"].to("cpu", torch.float32))
                    bar.update(len(s["input_ids"]))
            lens = [len(s["input_ids"]) for s in shard]
            tensors = {name: torch.cat(ts).contiguous() for name, ts in parts.items()}
            tensors["input_ids"] = torch.tensor([t for s in shard for t in s["input_ids"]], dtype=torch.int32)
            tensors["loss_mask"] = torch.tensor([t for s in shard for t in s["loss_mask"]], dtype=torch.uint8)
            tensors["offsets"] = torch.tensor([0] + lens, dtype=torch.int64).cumsum(0)
            tensors["items"] = torch.tensor([s["item"] for s in shard], dtype=torch.int64)
            meta = {"format": FEATURES_FORMAT, "ids": json.dumps([s["id"] for s in shard], ensure_ascii=False)}
            name = f"shard_{rank}_{k:05d}.safetensors"
            atomic_write(out / name, lambda p: save_file(tensors, str(p), metadata=meta))
            ledger.commit({"file": name, "index": k, "n_sequences": len(shard), "n_tokens": sum(lens),
                           "n_loss_tokens": int(tensors["loss_mask"].sum()), "bytes": (out / name).stat().st_size,
                           "seconds": round(time.perf_counter() - t0, 3)})
            result.shards_written += 1
            result.tokens_written += sum(lens)
        else:
            ledger.finish()
    finally:
        bar.close()
    return result


# ---------------------------------------------------------------------------
# Reading the cache
# ---------------------------------------------------------------------------


def load_index(path: str | Path, target: Any = None, *, hidden_layers: Sequence[int] | None = None,
               topk_logits: int | None = None, require_complete: bool = True) -> dict:
    """The merged index of a feature cache, validated.

    ``target`` (a ``TargetModel`` or anything with ``.tokenizer`` and ``.config``/``.model.config``):
    the cache must have the same vocab fingerprint, hidden size and layer count.
    ``hidden_layers``: layers a recipe needs (any indexing; compared as absolute indices).
    ``topk_logits``: the recipe needs at least this many stored logits.
    Raises ``FeatureCacheMismatch`` naming every difference; ``RuntimeError`` for an unfinished
    cache when ``require_complete``.
    """
    d = Path(path).expanduser()
    if not d.is_dir():
        raise FileNotFoundError(f"feature cache: {d} is not a directory")
    index = merged_index(d)
    if index.get("format") != FEATURES_FORMAT:
        raise ValueError(f"{d}: format {index.get('format')!r} is not a feature cache ({FEATURES_FORMAT!r})")
    if require_complete and not index["complete"]:
        raise RuntimeError(f"{d}: feature cache incomplete (ranks done {index['ranks_done']} of world size "
                           f"{index['world_size']}); rerun the build command to finish it")
    problems = []
    if target is not None:
        mcfg = _model_config(target)
        if index["vocab_fingerprint"] != vocab_fingerprint(target.tokenizer):
            problems.append(f"vocab fingerprint differs (cache built with {index['model']!r}, vocab size "
                            f"{index['vocab_size']}; target vocab size {len(target.tokenizer)}): token ids mean "
                            "different things")
        if index["hidden_size"] != int(mcfg.hidden_size):
            problems.append(f"hidden size: cache {index['hidden_size']} != target {mcfg.hidden_size}")
        if index["num_layers"] != int(mcfg.num_hidden_layers):
            problems.append(f"number of layers: cache {index['num_layers']} != target {mcfg.num_hidden_layers}")
    if hidden_layers is not None:
        want = absolute_layers(hidden_layers, index["num_layers"])
        missing = [lay for lay, a in zip(hidden_layers, want) if a not in index["hidden_layers_abs"]]
        if missing:
            problems.append(f"hidden layers {missing} not cached (cache has {index['hidden_layers']} = absolute "
                            f"{index['hidden_layers_abs']} of {index['num_layers']} layers)")
    if topk_logits is not None and topk_logits > index["topk_logits"]:
        problems.append(f"top-k logits: need {topk_logits}, cache has {index['topk_logits']}")
    if problems:
        raise FeatureCacheMismatch(f"feature cache {d} does not match: " + "; ".join(problems))
    return index


class FeatureDataset(IterableDataset):
    """Stream a feature cache sequence by sequence, shard by shard.

    Yields dicts: ``input_ids`` (T,) int64, ``loss_mask`` (T,) int64, ``hidden_states`` (K, T, H)
    in storage dtype (K = ``hidden_layers`` in the order asked, default all cached layers),
    ``item`` () int64 (index in the source), and when cached ``topk_values`` (T, k),
    ``topk_indices`` (T, k) int64, ``logsumexp`` (T,) float32.

    Splitting: consumer c = rank * num_workers + worker_id of C = world_size * num_workers takes
    every C-th sequence of one global order, so ranks and workers see disjoint sets that together
    cover the cache exactly once (balanced to one sequence). Shuffling (``shuffle=True``) permutes
    the shard order and the order inside each shard with ``seed`` + ``set_epoch(e)``; all
    consumers compute the same permutation. Only the rows of yielded sequences are read.
    """

    def __init__(self, path: str | Path, *, target: Any = None, hidden_layers: Sequence[int] | None = None,
                 with_logits: bool = True, shuffle: bool = False, seed: int = 0, rank: int | None = None,
                 world_size: int | None = None, require_complete: bool = True):
        super().__init__()
        self.dir = Path(path).expanduser()
        self.index = load_index(self.dir, target, hidden_layers=hidden_layers, require_complete=require_complete)
        cached = self.index["hidden_layers_abs"]
        self.layers_abs = cached if hidden_layers is None else absolute_layers(hidden_layers, self.index["num_layers"])
        self.with_logits = with_logits and self.index["topk_logits"] > 0
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        self.shards = list(self.index["shards"])

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def num_sequences(self) -> int:
        return sum(int(s["n_sequences"]) for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(int(s["n_tokens"]) for s in self.shards)

    def _order(self) -> Iterator[tuple[dict, list[int]]]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        shard_order = torch.randperm(len(self.shards), generator=g).tolist() if self.shuffle else range(len(self.shards))
        for s in shard_order:
            n = int(self.shards[s]["n_sequences"])
            yield self.shards[s], torch.randperm(n, generator=g).tolist() if self.shuffle else list(range(n))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        from safetensors import safe_open

        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        consumers, me = self.world_size * workers, self.rank * workers + worker
        counter = 0
        for shard, order in self._order():
            mine = [j for pos, j in enumerate(order) if (counter + pos) % consumers == me]
            counter += len(order)
            if not mine:
                continue
            with safe_open(str(self.dir / shard["file"]), framework="pt") as f:
                offsets = f.get_tensor("offsets").tolist()
                items = f.get_tensor("items")
                names = set(f.keys())
                slices = {k: f.get_slice(k) for k in names if k not in ("offsets", "items")}
                for j in mine:
                    a, b = offsets[j], offsets[j + 1]
                    rec = {
                        "input_ids": slices["input_ids"][a:b].long(),
                        "loss_mask": slices["loss_mask"][a:b].long(),
                        "hidden_states": torch.stack([slices[f"hidden.{lay}"][a:b] for lay in self.layers_abs]),
                        "item": items[j].clone(),
                    }
                    if self.with_logits:
                        rec["topk_values"] = slices["topk_values"][a:b]
                        rec["topk_indices"] = slices["topk_indices"][a:b].long()
                        rec["logsumexp"] = slices["logsumexp"][a:b]
                    yield rec


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = job_parser("python -m draftsmith.data.features",
                    "Cache target hidden states / top-k logits to bf16 safetensors shards.",
                    FeatureCacheConfig, "source spec, e.g. gsm8k:train or conversations:<regenerated dir>",
                    (("max_length", int), ("shard_tokens", int), ("storage_dtype", str), ("dtype", str),
                     ("device", str), ("batch_size", int), ("limit", int), ("rank", int), ("world_size", int),
                     ("disk_margin", float), ("max_shards", int), ("num_threads", int)))
    defaults = {f.name: f.default for f in dataclasses.fields(FeatureCacheConfig)}
    ap.add_argument("--layers", dest="hidden_layers", type=int, nargs="+", default=list(defaults["hidden_layers"]),
                    help="output_hidden_states indices (-1 = final normed state)")
    ap.add_argument("--topk", dest="topk_logits", type=int, default=defaults["topk_logits"])
    ap.add_argument("--keep-no-loss", action="store_true", help="keep sequences without trained tokens")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    args["progress"] = not args.pop("no_progress")
    args["skip_no_loss"] = not args.pop("keep_no_loss")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    res = build_feature_cache(FeatureCacheConfig.from_dict(args))
    print(f"[features] rank {res.rank}/{res.world_size}: wrote {res.shards_written} shard(s) ({res.tokens_written} "
          f"tokens), skipped {res.shards_skipped} complete shard(s)"
          f"{' (stopped at --max-shards)' if res.stopped_early else ''} -> {res.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
