"""Training records: pre-tokenised sequences with a loss mask, a held-out split and a resumable batch order.

A record is {"input_ids": [...], "loss_mask": [...]} (1 = a trained token). `load_records(spec)`
turns a spec into records:

    records:/path.jsonl    pre-tokenised records (no tokenizer needed)
    records:/path.npz      the same, packed (`write_packed_records`: token ids and masks concatenated,
                           compressed; ~30x smaller than JSONL, what a long job commits or carries)
    synthetic:<n>[:<t>]    n sequences sampled from the target itself at temperature t (tiny smoke runs)
    <data.sources spec>    conversations rendered with the target's chat template, assistant-only mask
    a + b + ...            a mixture: the records of each spec, concatenated in order

The batch order is addressed by `samples_seen` alone (`batch_indices`), so a resumed run draws
exactly the batches an uninterrupted run would have drawn.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch

from draftsmith.config import option, parse_script
from draftsmith.data.chat import render_and_mask
from draftsmith.data.sources import CHECKERS, load_source, refuse_test_suite
from draftsmith.errors import UserError, exit_with
from draftsmith.fileio import refuse_overwrite
from draftsmith.models.target import load_tokenizer

log = logging.getLogger(__name__)

RECORDS_PREFIX = "records:"
SYNTHETIC_PREFIX = "synthetic:"


PACKED_FORMAT = "draftsmith.records/1"


def write_packed_records(path: str | Path, records: Sequence[dict]) -> Path:
    """Records as one compressed .npz: every record's ids end to end (uint16 where the vocabulary fits,
    else int32), the loss masks as bits, and each record's length. `read_records` reads it back exactly."""
    lengths = np.array([len(r["input_ids"]) for r in records], dtype=np.int64)
    ids = np.fromiter((t for r in records for t in r["input_ids"]), dtype=np.int64, count=int(lengths.sum()))
    mask = np.fromiter((m for r in records for m in r["loss_mask"]), dtype=np.uint8, count=int(lengths.sum()))
    dtype = np.uint16 if ids.size == 0 or (ids.min() >= 0 and ids.max() < 2**16) else np.int32
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez_compressed(tmp, format=np.array(PACKED_FORMAT), input_ids=ids.astype(dtype), lengths=lengths,
                        loss_mask=np.packbits(mask))
    tmp.replace(path)
    return path


def _read_packed_records(path: Path) -> list[dict]:
    try:
        with np.load(path) as packed:
            if str(packed["format"]) != PACKED_FORMAT:
                raise UserError(f"{path}: not a {PACKED_FORMAT} file (format {packed['format']})")
            lengths, ids = packed["lengths"], packed["input_ids"].astype(np.int64)
            mask = np.unpackbits(packed["loss_mask"], count=ids.size)
    except (OSError, ValueError, KeyError) as err:
        raise UserError(f"{path}: not a packed records file ({err})") from None
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [{"input_ids": ids[a:b].tolist(), "loss_mask": mask[a:b].tolist()} for a, b in zip(bounds[:-1], bounds[1:])]


def read_records(path: str | Path) -> list[dict]:
    """JSONL of {"input_ids": [...], "loss_mask": [...]} (loss_mask optional: all ones), or a packed .npz."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"records file not found: {path}")
    if path.suffix == ".npz":
        return _read_packed_records(path)
    records = []
    with path.open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{line_no}: not valid JSON ({err})") from err
            ids = row.get("input_ids")
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise UserError(f"{path}:{line_no}: 'input_ids' must be a list of ints")
            mask = row.get("loss_mask", [1] * len(ids))
            if len(mask) != len(ids):
                raise UserError(f"{path}:{line_no}: 'loss_mask' has {len(mask)} entries, 'input_ids' {len(ids)}")
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
                 model=None, seed: int = 0, filter_wrong: bool = False, stats: dict | None = None) -> list[dict]:
    """Training records from a spec.

    `records:/path.jsonl`  pre-tokenised records (no tokenizer needed)
    `synthetic:<n>[:<t>]`  n sequences of `max_length` tokens sampled from `model` at temperature t
                           (default 1; tiny smoke runs)
    anything else          `data.sources.load_source(spec)` conversations rendered with the target's
                           chat template and assistant-only loss mask (`data.chat.render_and_mask`)
    `a + b + ...`          a mixture: the records of each spec, concatenated in order (`limit`
                           applies to each part; the recipes shuffle)
    Records without any trainable token are dropped; with `filter_wrong`, conversations that a
    checker of data.sources.CHECKERS marks wrong (GSM8K: final number != reference) are dropped too.
    `stats` (a dict) receives the counts: kept, wrong_answer, and `mix`: per spec of a mixture, its records and
    loss-bearing tokens (after max_length), the data mix a run reports.
    """
    stats = {} if stats is None else stats
    if " + " in spec:
        parts = [part.strip() for part in spec.split(" + ")]
        return [record for part in parts
                for record in load_records(part, tokenizer, max_length, limit, model, seed, filter_wrong, stats)]
    if spec.startswith(RECORDS_PREFIX):
        records = read_records(spec[len(RECORDS_PREFIX):])
        if limit is not None:
            records = records[:limit]
        if max_length is not None:
            records = [{k: v[:max_length] for k, v in r.items()} for r in records]
    elif spec.startswith(SYNTHETIC_PREFIX):
        if model is None or max_length is None:
            raise UserError(f"{spec!r} needs the target model and data.max_length")
        count, _, temperature = spec[len(SYNTHETIC_PREFIX):].partition(":")
        try:
            count, temperature = int(count), float(temperature or 1.0)
        except ValueError:
            raise UserError(f"bad synthetic source {spec!r}: expected synthetic:<count>[:<temperature>]") from None
        records = synthetic_records(model, count if limit is None else min(count, limit), max_length, seed=seed,
                                    temperature=temperature)
    else:
        if tokenizer is None:
            raise UserError(f"source {spec!r} needs the target's tokenizer")
        refuse_test_suite(spec)
        records = []
        for conv in load_source(spec, limit=limit):
            if not conv.has_response:
                continue
            check = CHECKERS.get(conv.source) if filter_wrong else None
            if check is not None and check(conv) is False:
                stats["wrong_answer"] = stats.get("wrong_answer", 0) + 1
                continue
            records.append(render_and_mask(tokenizer, conv.messages, max_length=max_length))
    kept = [r for r in records if sum(r["loss_mask"]) > 0]
    if len(kept) < len(records):
        log.info("dropped %d records without trainable tokens", len(records) - len(kept))
    if not kept:
        raise UserError(f"data source {spec!r} gave no record with trainable tokens"
                        + (f" (after filtering: {stats})" if stats else ""))
    stats["kept"] = stats.get("kept", 0) + len(kept)
    stats.setdefault("mix", {})[spec] = {"records": len(kept),
                                         "loss_tokens": int(sum(sum(r["loss_mask"]) for r in kept))}
    return kept


def spec_needs_model(spec: str) -> bool:
    """True when a records spec samples from the target itself (`synthetic:` in any part of a mixture)."""
    return any(part.strip().startswith(SYNTHETIC_PREFIX) for part in spec.split(" + "))


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
        raise UserError(f"held-out split of {n_held} leaves no training records (of {len(records)})")
    held = [records[i] for i in order[:n_held]]
    train = [records[i] for i in order[n_held:]]
    return train, held


def epoch_order(num_records: int, seed: int, epoch: int, lengths: Sequence[int] | None = None,
                window: int = 0) -> list[int]:
    """The shuffled record order of one epoch (a pure function of seed and epoch). With `lengths` and a
    `window` > 1, each run of `window` consecutive records is sorted longest first: batches cut from it hold
    records of similar length (less padding), and the data seen after N records is still a uniform draw."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(num_records, generator=generator).tolist()
    if lengths is None or window <= 1:
        return order
    return [index for start in range(0, num_records, window)
            for index in sorted(order[start:start + window], key=lambda i: -lengths[i])]


def batch_indices(num_records: int, samples_seen: int, count: int, seed: int, lengths: Sequence[int] | None = None,
                  window: int = 0) -> list[int]:
    """The next `count` record indices after `samples_seen` draws, crossing epochs as needed (`lengths`,
    `window`: epoch_order's grouping by length).

    The whole data position is `samples_seen`: resuming from it replays the same stream.
    """
    out: list[int] = []
    cache: dict[int, list[int]] = {}
    for pos in range(samples_seen, samples_seen + count):
        epoch, offset = divmod(pos, num_records)
        if epoch not in cache:
            cache[epoch] = epoch_order(num_records, seed, epoch, lengths, window)
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


@dataclass
class PackCommand:
    command: Literal["pack"] = option(help="pack: load SPEC and write its records packed (the first bare word)")
    spec: str = option(help="the data source spec, as a recipe's data.source (the second bare word)")
    out: str = option(help="the .npz file written (the third bare word)")
    target: str = option(help="the target whose tokenizer and chat template render SPEC")
    max_length: Optional[int] = option(None, "tokens per record (longer ones are cut)", ge=2)
    overwrite: bool = option(False, "replace OUT if it exists")


def main(argv: list[str] | None = None) -> int:
    """`python -m draftsmith.data.records pack SPEC OUT.npz target=NAME [max_length=N] [overwrite=true]`: the records
    a recipe would load from SPEC, packed (a job's data, committed or carried to another machine)."""
    args = parse_script("python -m draftsmith.data.records", main.__doc__, PackCommand,
                        sys.argv[1:] if argv is None else argv, positional=("command", "spec", "out"))
    refuse_overwrite(args.out, args.overwrite, instead="choose another OUT")  # before minutes of loading
    tokenizer = load_tokenizer(args.target)
    stats: dict = {}
    records = load_records(args.spec, tokenizer=tokenizer, max_length=args.max_length, stats=stats)
    write_packed_records(args.out, records)
    print(json.dumps({"records": len(records), "mix": stats.get("mix"), "out": args.out}))
    return 0


if __name__ == "__main__":
    exit_with(main)
