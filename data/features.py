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

    python -m draftsmith.data.features target=smollm2-135m-instruct source=gsm8k:train limit=64 \\
        hidden_layers=[-1] topk_logits=0 output_dir=runs/features/gsm8k-smollm2
"""

from __future__ import annotations

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
from safetensors.torch import save_file
from tqdm.auto import tqdm
from torch.utils.data import IterableDataset, get_worker_info

from draftsmith.config import check_config, option
from draftsmith.data.chat import render_and_mask
from draftsmith.data.shards import (IncompleteDataError, PlanMismatch, ShardLedger, fingerprint, incomplete_message,
                                    parse_job_command, rank_items, read_job_index,
                                    resolve_rank_device, resolve_rank_world)
from draftsmith.data.sources import Conversation, load_source, refuse_test_suite, source_help
from draftsmith.errors import UserError, exit_with
from draftsmith.fileio import atomic_write
from draftsmith.models.target import TargetModel, dtype_name, resolve_dtype, vocab_fingerprint

log = logging.getLogger(__name__)

FEATURES_FORMAT = "draftsmith.features/1"
__all__ = ["FeatureCacheConfig", "build_feature_cache", "FeatureDataset", "load_index", "FeatureCacheMismatch",
           "InsufficientDiskSpace", "bytes_per_token", "PlanMismatch"]


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


@dataclass
class FeatureCacheConfig:
    """What `build_feature_cache` stores; every default is declared here once."""

    target: str = option(help="the model whose features are cached: registry name, model directory, hub id, tiny:<family>")
    source: str | None = option(help="a source spec: " + source_help())
    output_dir: str = option(help="cache directory")
    hidden_layers: tuple[int, ...] = option((-1,), "output_hidden_states indices to store (-1: final normed state)")
    topk_logits: int = option(0, "store the top-k logits per token (0: none)", ge=0)
    max_length: int = option(2048, "sequences are cut at this many tokens", ge=1)
    shard_tokens: int = option(262_144, "tokens per shard (a shard closes once it holds at least this many)", ge=1)
    storage_dtype: str = option("bfloat16", "dtype of the stored hidden states and logit values")
    dtype: str = option("float32", "the target's compute dtype")
    device: str | None = option(None, "null = cpu, auto = cuda when present")
    batch_size: int = option(1, "sequences per forward (right-padded; 1 = no padding)", ge=1)
    limit: int | None = option(None, "keep the first N records of the source (before sharding across ranks)", ge=1)
    rank: int | None = option(None, "null: RANK from the environment, else 0", ge=0)
    world_size: int | None = option(None, "null: WORLD_SIZE from the environment, else 1", ge=1)
    skip_no_loss: bool = option(True, "drop sequences without a single trained token")
    disk_margin: float = option(0.05, "refuse to start unless free space >= estimate * (1 + disk_margin)", ge=0)
    max_shards: int | None = option(None, "stop after this many shards in this call (the rerun continues)", ge=1)
    threads: int | None = option(None, "torch CPU threads (null: torch's default)", ge=1)
    progress: bool = option(True, "progress bar on stderr")

    def __post_init__(self) -> None:
        check_config(self)
        if self.source is not None:
            refuse_test_suite(self.source)
        self.hidden_layers = tuple(int(x) for x in self.hidden_layers)
        if not self.hidden_layers:
            raise UserError("hidden_layers must name at least one layer")
        if len(set(self.hidden_layers)) != len(self.hidden_layers):
            raise UserError(f"hidden_layers has duplicates: {self.hidden_layers}")


class InsufficientDiskSpace(UserError, OSError):
    """Free disk space is below the feature cache's size estimate."""


class FeatureCacheMismatch(UserError):
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
            raise UserError(f"hidden layer {layer} out of range for a model with {num_layers} layers "
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


def _feature_plan(cfg: FeatureCacheConfig, tokenizer, mcfg, recs: Sequence, given: bool) -> dict:
    """What the cache holds (recorded in every rank's ledger; a rerun with another plan is refused)."""
    num_layers, hidden_size = int(mcfg.num_hidden_layers), int(mcfg.hidden_size)
    storage = resolve_dtype(cfg.storage_dtype)
    layers_abs = absolute_layers(cfg.hidden_layers, num_layers)
    return {
        "format": FEATURES_FORMAT, "model": cfg.target, "vocab_fingerprint": vocab_fingerprint(tokenizer),
        "vocab_size": len(tokenizer), "hidden_size": hidden_size, "num_layers": num_layers,
        "hidden_layers": list(cfg.hidden_layers), "hidden_layers_abs": layers_abs, "topk_logits": cfg.topk_logits,
        "dtype": dtype_name(storage), "compute_dtype": cfg.dtype,
        "bytes_per_token": bytes_per_token(len(layers_abs), hidden_size, cfg.topk_logits, storage),
        "max_length": cfg.max_length, "shard_tokens": cfg.shard_tokens, "skip_no_loss": cfg.skip_no_loss,
        "source": cfg.source if not given else "<records>", "n_items": len(recs),
        "items_sha256": fingerprint([r.to_dict() if isinstance(r, Conversation) else dict(r) for r in recs]),
    }


def _check_disk(cfg: FeatureCacheConfig, plan: dict, out: Path, rank: int, world: int, shards: list,
                todo: list[int]) -> int:
    """Print the size estimate of what this rank still writes and refuse to start when it does not fit."""
    bpt, storage = plan["bytes_per_token"], resolve_dtype(cfg.storage_dtype)
    todo_tokens = sum(len(s["input_ids"]) for k in todo for s in shards[k])
    all_tokens = sum(len(s["input_ids"]) for shard in shards for s in shard)
    estimate = todo_tokens * bpt + (sum(8 * (len(sh) * 2 + 1) for sh in shards) if todo else 0)
    # Every rank writes into the same directory: ranks that have not finished need about as much.
    others_busy = sum(not ((p := out / f"progress_rank{r}.json").exists()
                           and json.loads(p.read_text(encoding="utf-8")).get("done"))
                      for r in range(world) if r != rank)
    required = int(estimate * (1 + others_busy) * (1 + cfg.disk_margin)) if todo else 0
    where = _existing_parent(out)
    free = shutil.disk_usage(where).free
    layer_txt = f"{len(plan['hidden_layers_abs'])} layer(s) {list(cfg.hidden_layers)} x {plan['hidden_size']} x " \
                f"{_itemsize(storage)} B"
    topk_txt = (f" + top-{cfg.topk_logits} logits ({_itemsize(storage)} B values + 4 B ids) + 4 B logsumexp"
                if cfg.topk_logits else "")
    print(f"[features] {bpt} bytes/token = {layer_txt}{topk_txt} + 5 B ids/mask", flush=True)
    print(f"[features] rank {rank}/{world}: {sum(len(sh) for sh in shards)} sequences, {all_tokens} tokens in "
          f"{len(shards)} shard(s); {len(todo)} shard(s) / {todo_tokens} tokens to write -> estimate "
          f"{human_bytes(estimate)}{f' (x{1 + others_busy} ranks still writing)' if others_busy and todo else ''}; "
          f"free {human_bytes(free)} at {where}", flush=True)
    if required > free:
        raise InsufficientDiskSpace(
            f"feature cache needs about {human_bytes(required)} (estimate {human_bytes(estimate)} for rank {rank}"
            f"{f' x {1 + others_busy} ranks' if others_busy else ''} + {cfg.disk_margin:.0%} margin) but only "
            f"{human_bytes(free)} is free at {where}. Free space, pick another output_dir, store fewer layers or "
            "fewer top-k logits, or lower limit / max_length.")
    return estimate


def _shard_tensors(model, shard: list[dict], plan: dict, cfg: FeatureCacheConfig, pad_id: int, bar) -> dict:
    """One shard's tensors: every layer's hidden states (+ top-k logits), ids, masks, offsets, items."""
    storage, layers_abs = resolve_dtype(cfg.storage_dtype), plan["hidden_layers_abs"]
    parts: dict[str, list[torch.Tensor]] = {}
    for start in range(0, len(shard), cfg.batch_size):
        group = shard[start: start + cfg.batch_size]
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
    return tensors


def build_feature_cache(cfg: FeatureCacheConfig, target: Any = None,
                        records: Sequence[Conversation | Mapping[str, Any]] | None = None) -> FeatureCacheResult:
    """Run the target once over the data and write (or complete) the feature cache of this rank.

    ``target``: a loaded ``TargetModel`` (or anything with ``.model`` and ``.tokenizer``); None
    loads ``cfg.target``. ``records``: Conversations or pre-tokenised ``{"input_ids",
    "loss_mask"[, "id"]}`` dicts instead of ``cfg.source``.
    Raises ``InsufficientDiskSpace`` before writing anything when the estimate does not fit.
    """
    rank, world = resolve_rank_world(cfg.rank, cfg.world_size)
    recs = list(records) if records is not None else load_source(cfg.source, limit=cfg.limit)
    recs = recs[: cfg.limit] if records is not None and cfg.limit is not None else recs
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if target is None:
        target = TargetModel.from_pretrained(cfg.target, dtype=resolve_dtype(cfg.dtype),
                                             device=resolve_rank_device(cfg.device))
    plan = _feature_plan(cfg, target.tokenizer, _model_config(target), recs, records is not None)
    out = Path(cfg.output_dir)
    ledger = ShardLedger(out, rank, world, plan)  # refuses a differently planned directory
    seqs, skipped = _tokenise(recs, rank_items(len(recs), rank, world), target.tokenizer, cfg.max_length,
                              cfg.skip_no_loss)
    shards = _pack(seqs, cfg.shard_tokens)
    todo = [k for k in range(len(shards)) if not ledger.is_complete(k)]
    estimate = _check_disk(cfg, plan, out, rank, world, shards, todo)
    if skipped:
        print(f"[features] rank {rank}: skipped {skipped}", flush=True)
    ledger.start()
    result = FeatureCacheResult(out, rank, world, 0, len(shards) - len(todo), 0, plan["bytes_per_token"], estimate,
                                skipped)
    if todo:
        _write_shards(cfg, target, plan, ledger, shards, todo, result)
    if not result.stopped_early:
        ledger.finish()
    return result


def _write_shards(cfg: FeatureCacheConfig, target, plan: dict, ledger: ShardLedger, shards: list, todo: list[int],
                  result: FeatureCacheResult) -> None:
    tokenizer, out, rank = target.tokenizer, ledger.dir, ledger.rank
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    all_tokens = sum(len(s["input_ids"]) for shard in shards for s in shard)
    done_tokens = all_tokens - sum(len(s["input_ids"]) for k in todo for s in shards[k])
    with tqdm(total=all_tokens, initial=done_tokens, desc=f"features rank {rank}/{ledger.world_size}", unit="tok",
              unit_scale=True, disable=not cfg.progress, file=sys.stderr) as bar:
        for k in todo:
            if cfg.max_shards is not None and result.shards_written >= cfg.max_shards:
                result.stopped_early = True
                return
            t0 = time.perf_counter()
            shard = shards[k]
            tensors = _shard_tensors(target.model, shard, plan, cfg, pad_id, bar)
            meta = {"format": FEATURES_FORMAT, "ids": json.dumps([s["id"] for s in shard], ensure_ascii=False)}
            name = f"shard_{rank}_{k:05d}.safetensors"
            atomic_write(out / name, lambda p: save_file(tensors, str(p), metadata=meta))
            tokens = int(tensors["input_ids"].numel())
            ledger.commit({"file": name, "index": k, "n_sequences": len(shard), "n_tokens": tokens,
                           "n_loss_tokens": int(tensors["loss_mask"].sum()), "bytes": (out / name).stat().st_size,
                           "seconds": round(time.perf_counter() - t0, 3)})
            result.shards_written += 1
            result.tokens_written += tokens


def cache_parts(spec: str) -> list[str]:
    """The cache directories of a `data.feature_cache` value: one directory, or several joined by ` + `."""
    return [part.strip() for part in spec.split(" + ") if part.strip()]


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
    d, index = read_job_index(path, FEATURES_FORMAT, "a feature cache")
    msg = incomplete_message(d, index, "feature cache")
    if require_complete and msg is not None:
        raise IncompleteDataError(msg + "; rerun the build command to finish it")
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


def main(argv: list[str]) -> int:
    cfg = parse_job_command("python -m draftsmith.data.features",
                            "Cache target hidden states / top-k logits to bf16 safetensors shards.", FeatureCacheConfig,
                            argv)
    res = build_feature_cache(cfg)
    print(f"[features] rank {res.rank}/{res.world_size}: wrote {res.shards_written} shard(s) ({res.tokens_written} "
          f"tokens), skipped {res.shards_skipped} complete shard(s)"
          f"{' (stopped at max_shards)' if res.stopped_early else ''} -> {res.output_dir}")
    return 0


if __name__ == "__main__":
    exit_with(main)
