"""Regeneration: the target model rewrites the assistant turns (self-distillation data).

A drafter learns the *target's* distribution best from text the target itself wrote (Medusa-2,
SpecForge, EAGLE "regenerated ShareGPT"). ``regenerate(cfg)`` replays every conversation turn by
turn: the target answers the first user turn (after any system message), its reply replaces the
original assistant message, the next original user turn follows, and so on; single-turn prompt
datasets get one reply, MT-Bench-style ``followups`` are asked after the last turn. Generation is
batched (left padding, one ``model.generate`` call per batch and turn), greedy
(``temperature=0``) or sampled, and stops at the template's end-of-turn token or EOS.

Output directory (one per run; shared by all ranks)::

    shard_<rank>_<index>.jsonl   Conversation.to_dict() records, one per line, with
                                 meta["regenerated"] = {"model", "item", "original_id", "turns",
                                 "truncated", ["correct"], ...}
    progress_rank<rank>.json     per-rank ledger: the run's plan + complete shards (the authority)
    index.json                   all ranks' ledgers merged (rewritten after every shard)

Sharding and resuming (shared with ``data/features.py``, see ``ShardLedger``):
  - rank r of world size W takes items ``i % W == r`` of the (limited) source and splits them
    into shards of ``shard_size`` items; shard k of rank r is always the same items.
  - a shard is written to ``<name>.tmp``, fsynced, renamed, then recorded in the rank's ledger.
    A rerun of the same command skips recorded shards, so a kill -9 loses at most the shard in
    progress; a shard that was renamed but not recorded is simply redone (same content: each
    shard reseeds the RNG).
  - the ledger stores the plan (model, data fingerprint, world size, shard size, generation
    settings); a rerun with a different plan in the same directory is refused, naming the field.

``RANK``/``WORLD_SIZE`` come from the environment (``torchrun``, ``accelerate launch``) unless set
in the config, so ``accelerate launch -m draftsmith.data.regenerate ...`` runs one rank per process.

CLI::

    python -m draftsmith.data.regenerate --model smollm2-135m-instruct --source gsm8k:train --limit 64 \\
        --output-dir runs/regen/gsm8k-smollm2 [--temperature 0.7 --top-p 0.95] [--filter-wrong]

Reading the result back: ``load_regenerated(dir)`` (or, once ``data.sources`` accepts a directory,
the source spec ``conversations:<dir>``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

from draftsmith.config import config_from_dict
from draftsmith.data.chat import end_of_turn_candidates, prompt_ids, render_text
from draftsmith.data.shards import (PlanMismatch, ShardLedger, chunk, fingerprint, merged_index, rank_items,
                                    resolve_rank_device, resolve_rank_world)
from draftsmith.data.sources import CHECKERS, REGEN_FORMAT, Conversation, check_gsm8k, load_regenerated, load_source
from draftsmith.fileio import atomic_write
from draftsmith.models.target import TargetModel, resolve_dtype

log = logging.getLogger(__name__)



# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


@dataclass
class RegenerateConfig:
    """What ``regenerate`` does; every default is declared here once.

    model:            zoo name, local dir or hub id (used as the model id in the output)
    source:           source spec for ``data.sources.load_source`` ("gsm8k:train", a dict, ...)
    output_dir:       run directory (shards + ledgers + index.json)
    max_new_tokens:   per assistant turn
    temperature:      0 = greedy; > 0 samples at this temperature
    top_p, top_k:     nucleus / top-k sampling (top_k=0: off); ignored when greedy
    batch_size:       conversations generated together (left-padded)
    shard_size:       conversations per shard (the unit of resuming)
    limit:            keep the first N records of the source (before sharding across ranks)
    seed:             sampling seed; every shard reseeds with (seed, rank, shard index)
    dtype, device:    target compute dtype / device (None = cpu, "auto" = cuda when present)
    rank, world_size: None = from RANK / WORLD_SIZE in the environment, else 0 / 1
    filter_wrong:     drop replies that a checker (by ``Conversation.source``) marks wrong;
                      without it they are kept and marked meta["regenerated"]["correct"]=False
    max_prompt_tokens: a turn whose prompt is longer ends the replay there (a first turn that is
                      too long drops the conversation); None = the model's context length minus
                      max_new_tokens
    max_turns:        regenerate at most this many assistant replies per conversation (the replay
                      ends there); None = every turn
    max_shards:       stop after writing this many shards in this call (time-boxed jobs; the
                      rerun continues); None = all
    num_threads:      torch CPU threads (None = torch's default; 1 is fastest on a busy shared CPU)
    progress:         tqdm progress bar on stderr
    """

    model: str
    source: str | dict | None
    output_dir: str
    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    batch_size: int = 8
    shard_size: int = 256
    limit: int | None = None
    seed: int = 0
    dtype: str = "float32"
    device: str | None = None
    rank: int | None = None
    world_size: int | None = None
    filter_wrong: bool = False
    max_prompt_tokens: int | None = None
    max_turns: int | None = None
    max_shards: int | None = None
    num_threads: int | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"RegenerateConfig.max_turns must be >= 1 (or None for every turn), got {self.max_turns}")
        for name in ("max_new_tokens", "batch_size", "shard_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"RegenerateConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"RegenerateConfig.temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"RegenerateConfig.top_p must be in (0, 1], got {self.top_p}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RegenerateConfig":
        return config_from_dict(cls, d)


# ---------------------------------------------------------------------------
# Checkers (by Conversation.source)
# ---------------------------------------------------------------------------




# ---------------------------------------------------------------------------
# Turn-by-turn replay
# ---------------------------------------------------------------------------


def context_chunks(conv: Conversation) -> list[list[dict]]:
    """The non-assistant messages that precede each reply to generate.

    [sys, u1, a1, u2, a2] -> [[sys, u1], [u2]]; [u1] -> [[u1]]; followups add one [user] chunk
    each. Original assistant messages are dropped (they are what gets regenerated).
    """
    chunks: list[list[dict]] = []
    cur: list[dict] = []
    for m in conv.messages:
        if m["role"] == "assistant":
            if cur:
                chunks.append(cur)
                cur = []
            continue  # an assistant turn with no new context (e.g. leading) is dropped
        cur.append(dict(m))
    if cur:
        chunks.append(cur)
    chunks += [[{"role": "user", "content": f}] for f in conv.followups]
    if chunks and not any(m["role"] == "user" for m in chunks[0]):
        raise ValueError(f"conversation {conv.id!r}: no user message before the first reply")
    return chunks


def stop_token_ids(tokenizer: Any, model: Any) -> list[int]:
    """EOS ids of the model's generation config and tokenizer, plus the special token that the
    chat template puts after an assistant reply (its end-of-turn token)."""
    ids: list[int] = []
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids += [gen_eos] if isinstance(gen_eos, int) else list(gen_eos or [])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    marker = "draftsmith-probe-reply"
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
    text = render_text(tokenizer, probe)
    after = text[text.rfind(marker) + len(marker) :].lstrip()
    for tok in end_of_turn_candidates(tokenizer):
        if after.startswith(tok):
            ids.append(tokenizer.convert_tokens_to_ids(tok))
            break
    return sorted({int(i) for i in ids if i is not None and i >= 0})


@dataclass
class GenerationBackend:
    """The pieces ``generate_replies`` needs (a TargetModel or a bare model + tokenizer)."""

    model: Any
    tokenizer: Any
    stop_ids: list[int]
    pad_id: int


def make_backend(model: Any, tokenizer: Any) -> GenerationBackend:
    stops = stop_token_ids(tokenizer, model)
    if not stops:
        raise ValueError("no EOS / end-of-turn token: set generation_config.eos_token_id or the tokenizer's eos_token")
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = stops[0]  # pad token missing: pad with EOS (masked out anyway)
    return GenerationBackend(model=model, tokenizer=tokenizer, stop_ids=stops, pad_id=int(pad))


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, T_max), padded on the left."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        if s:
            ids[b, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[b, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


def generate_replies(backend: GenerationBackend, prompts: list[list[int]], cfg: RegenerateConfig) -> list[tuple[str, bool]]:
    """One batched ``generate`` call: (reply text, finished) per prompt; finished = a stop token
    was produced within ``max_new_tokens``."""
    from transformers import GenerationConfig

    model = backend.model
    ids, mask = left_pad(prompts, backend.pad_id, model.device)
    sample = cfg.temperature > 0
    gen = GenerationConfig(
        max_new_tokens=cfg.max_new_tokens,
        do_sample=sample,
        temperature=cfg.temperature if sample else None,
        top_p=cfg.top_p if sample else None,
        top_k=cfg.top_k if sample else None,
        eos_token_id=backend.stop_ids,
        pad_token_id=backend.pad_id,
    )
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen)
    new = out[:, ids.shape[1] :].tolist()
    stops = set(backend.stop_ids)
    replies = []
    for row in new:
        cut = next((t for t, tok in enumerate(row) if tok in stops), None)
        body = row if cut is None else row[:cut]
        replies.append((backend.tokenizer.decode(body, skip_special_tokens=True).strip(), cut is not None))
    return replies


def replay_batch(
    backend: GenerationBackend, convs: list[Conversation], cfg: RegenerateConfig, max_prompt_tokens: int | None
) -> list[tuple[Conversation | None, dict]]:
    """Regenerate the assistant turns of ``convs`` (one batch), turn by turn.

    Returns (conversation or None when dropped, info) per input; info holds "turns",
    "truncated" (a reply hit max_new_tokens) and "reason" when dropped.
    """
    plans: list[list[list[dict]]] = []
    info: list[dict] = [{"turns": 0, "truncated": False, "context_cut": False} for _ in convs]
    for i, conv in enumerate(convs):
        try:
            plans.append(context_chunks(conv)[: cfg.max_turns])
        except ValueError:
            plans.append([])
            info[i]["reason"] = "no_user_turn"
    history: list[list[dict]] = [[] for _ in convs]
    active = [i for i in range(len(convs)) if plans[i]]
    turn = 0
    while active:
        prompts: dict[int, list[int]] = {}
        for i in active:
            msgs = history[i] + plans[i][turn]
            ids = prompt_ids(backend.tokenizer, msgs)
            if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
                info[i]["context_cut"] = True  # the replay ends here; earlier turns are kept
                continue
            prompts[i] = ids
        order = list(prompts)
        for start in range(0, len(order), cfg.batch_size):
            part = order[start : start + cfg.batch_size]
            for i, (reply, finished) in zip(part, generate_replies(backend, [prompts[i] for i in part], cfg)):
                history[i] = history[i] + plans[i][turn] + [{"role": "assistant", "content": reply}]
                info[i]["turns"] += 1
                info[i]["truncated"] |= not finished
        turn += 1
        active = [i for i in order if turn < len(plans[i])]
    results = []
    for conv, msgs, inf in zip(convs, history, info):
        if inf["turns"] == 0:
            results.append((None, {"reason": "prompt_too_long", **inf}))
            continue
        results.append((Conversation(id=conv.id, source=conv.source, messages=msgs, reference=conv.reference,
                                     category=conv.category, followups=[], meta=dict(conv.meta)), inf))
    return results


# ---------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------


def _shard_name(rank: int, index: int, suffix: str) -> str:
    return f"shard_{rank}_{index:05d}.{suffix}"


def _default_max_prompt(model: Any, max_new_tokens: int) -> int | None:
    ctx = getattr(model.config, "max_position_embeddings", None)
    return None if ctx is None else max(1, int(ctx) - max_new_tokens)


@dataclass
class RegenerateResult:
    output_dir: Path
    rank: int
    world_size: int
    shards_written: int
    shards_skipped: int
    items_written: int
    dropped: Counter = field(default_factory=Counter)
    stopped_early: bool = False  # max_shards reached before the rank's last shard


def regenerate(
    cfg: RegenerateConfig,
    target: Any = None,
    records: Sequence[Conversation] | None = None,
    checkers: Mapping[str, Callable[[Conversation], bool | None]] | None = None,
) -> RegenerateResult:
    """Regenerate the assistant turns of ``cfg.source`` (or ``records``) with ``cfg.model``.

    ``target``: an already loaded ``models.target.TargetModel`` (or anything with ``.model`` and
    ``.tokenizer``); None loads ``cfg.model`` with ``cfg.dtype`` / ``cfg.device``. ``checkers``
    maps ``Conversation.source`` to a checker (default ``CHECKERS``: GSM8K final answers).
    Resumable: complete shards of this rank are skipped (see the module docstring).
    """
    from tqdm.auto import tqdm

    rank, world = resolve_rank_world(cfg.rank, cfg.world_size)
    convs = list(records) if records is not None else load_source(cfg.source, limit=cfg.limit)
    if records is not None and cfg.limit is not None:
        convs = convs[: cfg.limit]
    plan = {
        "format": REGEN_FORMAT,
        "model": cfg.model,
        "source": cfg.source if records is None else "<records>",
        "n_items": len(convs),
        "items_sha256": fingerprint([c.to_dict() for c in convs]),
        "shard_size": cfg.shard_size,
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "seed": cfg.seed,
        "dtype": cfg.dtype,
        "filter_wrong": cfg.filter_wrong,
        "max_prompt_tokens": cfg.max_prompt_tokens,
    }
    if cfg.max_turns is not None:  # absent from plans that replay every turn (as before the option)
        plan["max_turns"] = cfg.max_turns
    out = Path(cfg.output_dir)
    ledger = ShardLedger(out, rank, world, plan)
    ledger.start()
    mine = rank_items(len(convs), rank, world)
    shards = chunk(mine, cfg.shard_size)
    todo = [k for k in range(len(shards)) if not ledger.is_complete(k)]
    result = RegenerateResult(out, rank, world, 0, len(shards) - len(todo), 0)
    if not todo:
        log.info("regenerate rank %d: all %d shard(s) complete in %s", rank, len(shards), out)
        ledger.finish()
        return result

    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    if target is None:
        target = TargetModel.from_pretrained(cfg.model, dtype=resolve_dtype(cfg.dtype), device=resolve_rank_device(cfg.device))
    backend = make_backend(target.model, target.tokenizer)
    max_prompt = cfg.max_prompt_tokens if cfg.max_prompt_tokens is not None else _default_max_prompt(
        target.model, cfg.max_new_tokens)
    checkers = CHECKERS if checkers is None else checkers
    done_items = sum(len(shards[k]) for k in range(len(shards)) if k not in todo)
    bar = tqdm(total=len(mine), initial=done_items, desc=f"regenerate rank {rank}/{world}", unit="conv",
               disable=not cfg.progress, file=sys.stderr)
    try:
        for k in todo:
            if cfg.max_shards is not None and result.shards_written >= cfg.max_shards:
                result.stopped_early = True
                break
            t0 = time.perf_counter()
            torch.manual_seed(cfg.seed * 1_000_003 + rank * 100_003 + k)  # a redone shard is the same shard
            lines: list[str] = []
            dropped: Counter = Counter()
            items = shards[k]
            for start in range(0, len(items), cfg.batch_size):
                batch_items = items[start : start + cfg.batch_size]
                for item, (conv, info) in zip(batch_items, replay_batch(backend, [convs[i] for i in batch_items],
                                                                         cfg, max_prompt)):
                    bar.update(1)
                    if conv is None:
                        dropped[info["reason"]] += 1
                        continue
                    mark = {"model": cfg.model, "item": item, "original_id": convs[item].id,
                            "turns": info["turns"], "truncated": info["truncated"],
                            "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed}
                    if info["context_cut"]:
                        mark["context_cut"] = True
                    check = checkers.get(conv.source)
                    verdict = check(conv) if check is not None else None
                    if verdict is not None:
                        mark["correct"] = bool(verdict)
                        if not verdict and cfg.filter_wrong:
                            dropped["wrong_answer"] += 1
                            continue
                    conv.meta["regenerated"] = mark
                    lines.append(json.dumps(conv.to_dict(), ensure_ascii=False) + "\n")
            name = _shard_name(rank, k, "jsonl")
            atomic_write(out / name, lambda p: p.write_text("".join(lines), encoding="utf-8"))
            ledger.commit({"file": name, "index": k, "n_items": len(items), "n_written": len(lines),
                           "first_item": items[0], "dropped": dict(dropped),
                           "seconds": round(time.perf_counter() - t0, 3)})
            result.shards_written += 1
            result.items_written += len(lines)
            result.dropped.update(dropped)
            if dropped:
                log.info("regenerate rank %d shard %d: dropped %s", rank, k, dict(dropped))
        else:
            ledger.finish()
    finally:
        bar.close()
    return result


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def job_parser(prog: str, description: str, config_cls: type, source_help: str,
               options: Sequence[tuple[str, type]]) -> argparse.ArgumentParser:
    """The CLI shared by the sharded data jobs (regenerate, features): --model/--source/--output-dir,
    one --flag per (config field, type) in `options` with the dataclass default, and --no-progress."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--model", required=True, help="zoo name, local dir or hub id")
    ap.add_argument("--source", required=True, help=source_help)
    ap.add_argument("--output-dir", required=True)
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    for name, typ in options:
        ap.add_argument("--" + name.replace("_", "-"), type=typ, default=defaults[name])
    ap.add_argument("--no-progress", action="store_true")
    return ap


def build_parser() -> argparse.ArgumentParser:
    ap = job_parser("python -m draftsmith.data.regenerate",
                    "Regenerate assistant turns with the target model (resumable, sharded).",
                    RegenerateConfig, "source spec, e.g. gsm8k:train, sharegpt, mt-bench",
                    (("max_new_tokens", int), ("temperature", float), ("top_p", float), ("top_k", int),
                     ("batch_size", int), ("shard_size", int), ("limit", int), ("seed", int), ("dtype", str),
                     ("device", str), ("rank", int), ("world_size", int), ("max_prompt_tokens", int),
                     ("max_turns", int), ("max_shards", int), ("num_threads", int)))
    ap.add_argument("--filter-wrong", action="store_true", help="drop replies a checker marks wrong (GSM8K)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    args["progress"] = not args.pop("no_progress")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    res = regenerate(RegenerateConfig.from_dict(args))
    print(f"rank {res.rank}/{res.world_size}: wrote {res.shards_written} shard(s) ({res.items_written} conversations), "
          f"skipped {res.shards_skipped} complete shard(s), dropped {dict(res.dropped)}"
          f"{' (stopped at --max-shards)' if res.stopped_early else ''} -> {res.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
