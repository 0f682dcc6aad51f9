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
The ledger, the index and shard integrity (size + sha256 per shard) are `data.shards`.

CLI::

    python -m draftsmith.data.regenerate target=smollm2-135m-instruct source=gsm8k:train limit=64 \\
        output_dir=runs/regen/gsm8k-smollm2 [temperature=0.7 top_p=0.95] [filter_wrong=true]

Reading the result back: ``load_regenerated(dir)`` (or, once ``data.sources`` accepts a directory,
the source spec ``conversations:<dir>``).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from tqdm.auto import tqdm

from draftsmith.config import TextEnum, check_config, option
from draftsmith.data.chat import end_of_turn_candidates, prompt_ids, render_text
from draftsmith.data.shards import (ShardLedger, chunk, fingerprint, parse_job_command, rank_items,
                                    resolve_rank_device, resolve_rank_world)
from draftsmith.data.sources import (CHECKERS, REGEN_FORMAT, Conversation, load_source, refuse_test_suite,
                                     source_help)
from draftsmith.errors import UserError, exit_with
from draftsmith.fileio import atomic_write
from draftsmith.models.engines.llamacpp import CONVERTER_TYPES, LlamaServer, ServerSettings, cached_gguf
from draftsmith.models.target import TargetModel, load_model_config, resolve_dtype
from draftsmith.models.registry import resolve_model_path

log = logging.getLogger(__name__)



# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


class RegenerationEngine(TextEnum):
    """Who generates the target's answers."""

    PYTORCH = "pytorch"  # HF generate, left-padded batches
    LLAMACPP = "llamacpp"  # the built llama.cpp's server on loopback


@dataclass
class RegenerateConfig:
    """What `regenerate` does; every default is declared here once."""

    target: str = option(help="the model that answers: registry name, model directory, hub id or tiny:<family>")
    source: str | None = option(help="the conversations, a source spec: " + source_help())
    output_dir: str = option(help="run directory (shards + ledgers + index.json)")
    max_new_tokens: int = option(512, "new tokens per assistant turn", ge=1)
    temperature: float = option(0.0, "0 = greedy; > 0 samples at this temperature", ge=0)
    top_p: float = option(1.0, "nucleus sampling mass (ignored when greedy)", gt=0, le=1)
    top_k: int = option(0, "top-k sampling (0: off; ignored when greedy)", ge=0)
    engine: RegenerationEngine = option(
        RegenerationEngine.PYTORCH,
        "who generates: pytorch (HF generate, left-padded batches) or llamacpp (the built llama.cpp's server on "
        "loopback, `batch_size` parallel slots, the target converted once to GGUF in `dtype`; build it with "
        "`python -m draftsmith.models.engines.llamacpp build`)")
    batch_size: int = option(8, "conversations generated together (pytorch: left-padded; llamacpp: server slots)",
                             ge=1)
    shard_size: int = option(256, "conversations per shard (the unit of resuming)", ge=1)
    limit: int | None = option(None, "keep the first N records of the source (before sharding across ranks)", ge=1)
    skip: int = option(0, "drop the source's first N records before `limit` (continue past an earlier run's "
                          "limit in another output_dir)", ge=0)
    seed: int = option(0, "sampling seed; every shard reseeds with (seed, rank, shard index)")
    dtype: str = option("float32", "the target's compute dtype (llamacpp: its GGUF type, also q8_0)")
    device: str | None = option(None, "null = cpu, auto = cuda when present")
    rank: int | None = option(None, "null: RANK from the environment, else 0", ge=0)
    world_size: int | None = option(None, "null: WORLD_SIZE from the environment, else 1", ge=1)
    filter_wrong: bool = option(False, "drop replies a checker marks wrong (GSM8K); else keep them marked")
    max_prompt_tokens: int | None = option(None, "a turn with a longer prompt ends the replay there (null: the "
                                                 "context length minus max_new_tokens; engine=llamacpp: 1024, "
                                                 "the size of its slots)", ge=1)
    max_turns: int | None = option(None, "regenerate at most this many assistant replies per conversation", ge=1)
    max_shards: int | None = option(None, "stop after this many shards in this call (the rerun continues)", ge=1)
    threads: int | None = option(None, "torch CPU threads (null: torch's default)", ge=1)
    compress: bool = option(False, "gzip each shard (shard_*.jsonl.gz): the compact form a job commits to git")
    progress: bool = option(True, "progress bar on stderr")

    def __post_init__(self) -> None:
        check_config(self)
        if self.source is not None:
            refuse_test_suite(self.source)
        if self.engine is RegenerationEngine.LLAMACPP:
            if self.dtype not in CONVERTER_TYPES:
                raise UserError(f"dtype={self.dtype}: engine=llamacpp converts the target to one of "
                                f"{', '.join(CONVERTER_TYPES)}")
            if self.device not in (None, "cpu"):
                raise UserError(f"device={self.device}: engine=llamacpp runs on the CPU here; unset device")
            if self.rank not in (None, 0) or self.world_size not in (None, 1):
                raise UserError("engine=llamacpp runs one server for the whole job; unset rank and world_size")
        elif self.dtype == "q8_0":
            raise UserError("dtype=q8_0 is a GGUF type: set engine=llamacpp, or a torch dtype (float32, bfloat16)")



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
    server: LlamaServer | None = None  # engine=llamacpp: replies come from this server, not from `model`


def make_backend(model: Any, tokenizer: Any) -> GenerationBackend:
    stops = stop_token_ids(tokenizer, model)
    if not stops:
        raise UserError("the target has no EOS / end-of-turn token to stop a reply at: set its "
                        "generation_config.eos_token_id or its tokenizer's eos_token")
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
    if backend.server is not None:
        return server_replies(backend, prompts, cfg)
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


def server_replies(backend: GenerationBackend, prompts: list[list[int]],
                   cfg: RegenerateConfig) -> list[tuple[str, bool]]:
    """The replies of llama-server's parallel slots: every prompt in flight at once, `batch_size` decoding."""
    def one(ids: list[int]) -> tuple[str, bool]:
        reply = backend.server.complete(ids, cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed,
                                        top_p=cfg.top_p, top_k=cfg.top_k)
        tokens = [t for t in reply.get("tokens", []) if t not in backend.stop_ids]
        return backend.tokenizer.decode(tokens, skip_special_tokens=True).strip(), reply.get("stop_type") == "eos"

    with ThreadPoolExecutor(max_workers=cfg.batch_size) as pool:
        return list(pool.map(one, prompts))


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
        order = sorted(prompts, key=lambda i: len(prompts[i]))  # batches of similar length: little padding
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


LLAMACPP_DEFAULT_MAX_PROMPT = 1024  # every server slot holds this many prompt tokens plus max_new_tokens


def _default_max_prompt(model: Any, max_new_tokens: int,
                        engine: RegenerationEngine = RegenerationEngine.PYTORCH) -> int | None:
    if engine is RegenerationEngine.LLAMACPP:
        return LLAMACPP_DEFAULT_MAX_PROMPT
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


def regen_plan(cfg: RegenerateConfig, convs: Sequence[Conversation], given: bool) -> dict:
    """What the run does (recorded in every rank's ledger; a rerun with another plan is refused)."""
    plan = {"format": REGEN_FORMAT, "model": cfg.target, "source": cfg.source if not given else "<records>",
            "n_items": len(convs), "items_sha256": fingerprint([c.to_dict() for c in convs]),
            "shard_size": cfg.shard_size, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
            "top_p": cfg.top_p, "top_k": cfg.top_k, "seed": cfg.seed, "dtype": cfg.dtype,
            "filter_wrong": cfg.filter_wrong, "max_prompt_tokens": cfg.max_prompt_tokens}
    if cfg.max_turns is not None:  # absent from plans that replay every turn (as before the option)
        plan["max_turns"] = cfg.max_turns
    if cfg.skip:  # absent from plans that start at the source's first record (as before the option)
        plan["skip"] = cfg.skip
    if cfg.engine is not RegenerationEngine.PYTORCH:  # absent from plans generated with HF generate (as before)
        plan["engine"] = cfg.engine
    return plan


def mark_conversation(cfg: RegenerateConfig, conv: Conversation, item: int, original: Conversation, info: dict,
                      checkers: Mapping) -> bool:
    """Record where a regenerated conversation came from; False when a checker drops it (filter_wrong)."""
    mark = {"model": cfg.target, "item": item, "original_id": original.id, "turns": info["turns"],
            "truncated": info["truncated"], "temperature": cfg.temperature, "top_p": cfg.top_p, "seed": cfg.seed,
            "engine": cfg.engine, "dtype": cfg.dtype}
    if info["context_cut"]:
        mark["context_cut"] = True
    check = checkers.get(conv.source)
    verdict = check(conv) if check is not None else None
    if verdict is not None:
        mark["correct"] = bool(verdict)
        if not verdict and cfg.filter_wrong:
            return False
    conv.meta["regenerated"] = mark
    return True


def regenerate_shard(cfg: RegenerateConfig, backend: GenerationBackend, convs: Sequence[Conversation],
                     items: Sequence[int], max_prompt: int | None, checkers: Mapping, bar) -> tuple[list[str], Counter]:
    """The JSONL lines of one shard and what was dropped (reason -> count)."""
    lines: list[str] = []
    dropped: Counter = Counter()
    step = len(items) if backend.server is not None else cfg.batch_size  # the server's slots take a queue
    for start in range(0, len(items), step):
        batch_items = items[start: start + step]
        for item, (conv, info) in zip(batch_items, replay_batch(backend, [convs[i] for i in batch_items], cfg,
                                                                max_prompt)):
            bar.update(1)
            if conv is None:
                dropped[info["reason"]] += 1
            elif mark_conversation(cfg, conv, item, convs[item], info, checkers):
                lines.append(json.dumps(conv.to_dict(), ensure_ascii=False) + "\n")
            else:
                dropped["wrong_answer"] += 1
    return lines, dropped


def write_lines(path: Path, lines: list[str], compress: bool) -> None:
    data = "".join(lines).encode("utf-8")
    path.write_bytes(gzip.compress(data, compresslevel=9, mtime=0) if compress else data)


def regenerate(
    cfg: RegenerateConfig,
    target: Any = None,
    records: Sequence[Conversation] | None = None,
    checkers: Mapping[str, Callable[[Conversation], bool | None]] | None = None,
) -> RegenerateResult:
    """Regenerate the assistant turns of ``cfg.source`` (or ``records``) with ``cfg.target``.

    ``target``: an already loaded ``models.target.TargetModel`` (or anything with ``.model`` and
    ``.tokenizer``); None loads ``cfg.target`` with ``cfg.dtype`` / ``cfg.device``. ``checkers``
    maps ``Conversation.source`` to a checker (default ``CHECKERS``: GSM8K final answers).
    Resumable: complete shards of this rank are skipped (see the module docstring).
    """
    rank, world = resolve_rank_world(cfg.rank, cfg.world_size)
    end = None if cfg.limit is None else cfg.skip + cfg.limit
    convs = list(records)[:end] if records is not None else load_source(cfg.source, limit=end)
    convs = convs[cfg.skip:]
    out = Path(cfg.output_dir)
    if target is None:
        load_model_config(cfg.target)  # a bad model name fails before anything is written
    ledger = ShardLedger(out, rank, world, regen_plan(cfg, convs, records is not None))
    ledger.start()
    mine = rank_items(len(convs), rank, world)
    shards = chunk(mine, cfg.shard_size)
    todo = [k for k in range(len(shards)) if not ledger.is_complete(k)]
    result = RegenerateResult(out, rank, world, 0, len(shards) - len(todo), 0)
    if not todo:
        log.info("regenerate rank %d: all %d shard(s) complete in %s", rank, len(shards), out)
        ledger.finish()
        return result
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if target is None:
        llamacpp = cfg.engine is RegenerationEngine.LLAMACPP
        dtype = "float32" if llamacpp else cfg.dtype  # llamacpp: only the tokenizer is used
        target = TargetModel.from_pretrained(cfg.target, dtype=resolve_dtype(dtype),
                                             device=resolve_rank_device(cfg.device))
    backend = make_backend(target.model, target.tokenizer)
    max_prompt = cfg.max_prompt_tokens if cfg.max_prompt_tokens is not None else _default_max_prompt(
        target.model, cfg.max_new_tokens, cfg.engine)
    done_items = sum(len(shards[k]) for k in range(len(shards)) if k not in todo)
    with contextlib.ExitStack() as stack, tqdm(total=len(mine), initial=done_items, unit="conv",
                                               desc=f"regenerate rank {rank}/{world}", disable=not cfg.progress,
                                               file=sys.stderr) as bar:
        if cfg.engine is RegenerationEngine.LLAMACPP:
            backend.server = stack.enter_context(start_server(cfg, max_prompt))
        for k in todo:
            if cfg.max_shards is not None and result.shards_written >= cfg.max_shards:
                result.stopped_early = True
                return result
            t0 = time.perf_counter()
            torch.manual_seed(cfg.seed * 1_000_003 + rank * 100_003 + k)  # a redone shard is the same shard
            lines, dropped = regenerate_shard(cfg, backend, convs, shards[k], max_prompt,
                                              CHECKERS if checkers is None else checkers, bar)
            name = _shard_name(rank, k, "jsonl.gz" if cfg.compress else "jsonl")
            atomic_write(out / name, lambda p: write_lines(p, lines, cfg.compress))
            ledger.commit({"file": name, "index": k, "n_items": len(shards[k]), "n_written": len(lines),
                           "first_item": shards[k][0], "dropped": dict(dropped),
                           "seconds": round(time.perf_counter() - t0, 3)})
            result.shards_written += 1
            result.items_written += len(lines)
            result.dropped.update(dropped)
    ledger.finish()
    return result


def start_server(cfg: RegenerateConfig, max_prompt: int) -> LlamaServer:
    """llama-server over the target's GGUF (converted once into the cache), `batch_size` slots."""
    model_dir = Path(resolve_model_path(cfg.target))
    gguf = cached_gguf(model_dir, model_dir.name, cfg.dtype)
    context = max_prompt + cfg.max_new_tokens + 8
    settings = ServerSettings(model=gguf, slots=cfg.batch_size, context_per_slot=context, threads=cfg.threads or 2)
    return LlamaServer(settings, log_path=Path(cfg.output_dir) / "llama-server.log")


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    cfg = parse_job_command("python -m draftsmith.data.regenerate",
                            "Regenerate assistant turns with the target model (resumable, sharded).", RegenerateConfig,
                            argv)
    res = regenerate(cfg)
    print(f"rank {res.rank}/{res.world_size}: wrote {res.shards_written} shard(s) ({res.items_written} conversations), "
          f"skipped {res.shards_skipped} complete shard(s), dropped {dict(res.dropped)}"
          f"{' (stopped at max_shards)' if res.stopped_early else ''} -> {res.output_dir}")
    return 0


if __name__ == "__main__":
    exit_with(main)
