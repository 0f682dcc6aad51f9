"""Build a draft vocabulary: the target's `size` most frequent tokens in a corpus (FR-Spec, EAGLE-3).

    python -m draftsmith.data.draft_vocab target=smollm2-135m-instruct size=8192 \\
        sources="conversations:outputs/regen/smollm2/gsm8k conversations:outputs/regen/smollm2/sharegpt" \\
        output=outputs/vocab/smollm2_8k

Tokens are counted where the records' loss mask is on: for a regenerated source
(`conversations:<regeneration dir>`) that is exactly what the target generated; any source spec of
data.records works. The tokenizer's special tokens (EOS, the chat template's markers) are always in
the subset, so a drafter can propose the end of an answer. Writes `draft_vocab.safetensors`
(models.vocab.DraftVocab) and `vocab_report.json`: per source the tokens counted and the coverage
(share of its counted tokens inside the subset) at `size` and at each of `report_sizes`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.config import check_config, command_parser, config_to_dict, option, parse_command
from draftsmith.data.records import load_records
from draftsmith.errors import UserError, exit_with
from draftsmith.fileio import atomic_write_json, refuse_overwrite
from draftsmith.models.bundled import DEFAULT_TARGET
from draftsmith.models.target import load_model_config, load_tokenizer
from draftsmith.models.vocab import VOCAB_FILE, DraftVocab


@dataclass
class DraftVocabConfig:
    target: str = option(DEFAULT_TARGET, "the target whose tokens are ranked (its tokenizer is used)")
    sources: list[str] = option(factory=list, help="source specs counted (e.g. conversations:<regeneration dir>)")
    size: int = option(8192, "tokens in the draft vocabulary", ge=1)
    report_sizes: list[int] = option(factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768],
                                     help="sizes whose coverage is also reported", ge=1)
    limit: int | None = option(None, "records per source (null: all)", ge=1)
    max_length: int = option(4096, "tokens per record", ge=2)
    include_special: bool = option(True, "always keep the tokenizer's special tokens")
    output: str = option("outputs/vocab/draft_vocab", "directory for draft_vocab.safetensors + vocab_report.json")

    def __post_init__(self):
        check_config(self)
        if not self.sources:
            raise UserError("sources: give at least one source spec, e.g. sources=conversations:<regeneration dir>")


def count_tokens(records: list[dict]) -> Counter:
    """Token id -> count over the loss-masked positions of tokenised records."""
    counts: Counter = Counter()
    for record in records:
        ids = torch.as_tensor(record["input_ids"])
        mask = torch.as_tensor(record["loss_mask"]) > 0
        counts.update(ids[mask].tolist())
    return counts


def special_ids(tokenizer) -> list[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    return sorted(ids)


def top_tokens(counts: Counter, size: int, forced: list[int], target_size: int) -> DraftVocab:
    """The `size` most frequent ids (ties: lower id first), the forced ones included; padded with the
    lowest unused ids when the corpus has fewer distinct tokens."""
    chosen = list(dict.fromkeys(i for i in forced if i < target_size))[:size]
    taken = set(chosen)
    ranked = (token for token, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0])))
    for token in list(ranked) + list(range(target_size)):  # then the lowest unused ids, if the corpus runs out
        if len(chosen) >= min(size, target_size):
            break
        if token not in taken and token < target_size:
            chosen.append(token)
            taken.add(token)
    return DraftVocab.from_ids(chosen, target_size)


def coverage(counts: Counter, vocab: DraftVocab) -> float:
    total = sum(counts.values())
    inside = set(vocab.draft_to_target.tolist())
    return sum(c for token, c in counts.items() if token in inside) / total if total else float("nan")


def build_draft_vocab(config: DraftVocabConfig, say=print) -> tuple[DraftVocab, dict]:
    tokenizer = load_tokenizer(config.target)
    target_size = load_model_config(config.target).vocab_size
    per_source = {}
    for spec in config.sources:
        records = load_records(spec, tokenizer=tokenizer, max_length=config.max_length, limit=config.limit)
        per_source[spec] = count_tokens(records)
        say(f"[draft_vocab] {spec}: {len(records)} records, {sum(per_source[spec].values())} tokens counted, "
            f"{len(per_source[spec])} distinct")
    total = sum(per_source.values(), Counter())
    forced = special_ids(tokenizer) if config.include_special else []
    vocab = top_tokens(total, config.size, forced, target_size)
    sizes = sorted(set(config.report_sizes + [config.size]))
    ladders = {size: top_tokens(total, size, forced, target_size) for size in sizes if size <= target_size}
    report = {"format": "draftsmith.draft_vocab/1", "config": config_to_dict(config), "target_vocab_size": target_size,
              "size": vocab.size, "sha256": vocab.digest(), "forced_special_ids": forced,
              "tokens_counted": sum(total.values()), "distinct_tokens": len(total),
              "coverage": {spec: {str(size): coverage(counts, ladder) for size, ladder in ladders.items()}
                           for spec, counts in {**per_source, "all": total}.items()}}
    return vocab, report


def format_report(report: dict) -> str:
    sizes = list(next(iter(report["coverage"].values())))
    lines = [f"Draft vocabulary: {report['size']} of {report['target_vocab_size']} tokens; coverage of the counted "
             f"tokens ({report['tokens_counted']}):", "", "| source | " + " | ".join(sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for spec, row in report["coverage"].items():
        lines.append(f"| {spec} | " + " | ".join(f"{100 * row[s]:.1f}%" for s in sizes) + " |")
    return "\n".join(lines)


def main(argv: list[str]) -> dict:
    parser = command_parser("python -m draftsmith.data.draft_vocab", __doc__.split("\n\n")[0], DraftVocabConfig)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing draft vocabulary")
    config, flags = parse_command(parser, DraftVocabConfig, argv)
    out = Path(config.output)
    refuse_overwrite(out / VOCAB_FILE, flags.overwrite, "set output=<another dir>")
    vocab, report = build_draft_vocab(config)
    out.mkdir(parents=True, exist_ok=True)
    vocab.save(out)
    atomic_write_json(out / "vocab_report.json", report)
    print(format_report(report))
    print(f"wrote {out / VOCAB_FILE} and {out / 'vocab_report.json'}")
    return report


if __name__ == "__main__":
    exit_with(main)
