"""A token n-gram prior counted over training answers: which token follows the two before it.

    python -m draftsmith.data.ngram_prior target=smollm2-135m-instruct \\
        sources="records:outputs/medusa_regen/regen_records.npz" \\
        output=drafters/dflash_smollm2_human_then_regen/ngram_prior

A block drafter (DFlash) proposes every position of its block from one forward: a later position reads a mask
where the token drafted before it will be, so its distribution is a marginal over what may come first. The decoder
re-ranks its top candidates by this prior given the tokens drafted before them (eval/decode/drafters/dflash.py,
`prior`). Tokens are counted where the records' loss mask is on (the answers); the records the drafter's training
run held out (the same seeded split, data.records.split_heldout) are left out, so its held-out figures stay
unseen. Trigrams seen once are dropped (their share goes to the bigram back-off): they change the probe's
acceptance by less than 0.001 and hold half the table.

P(c | a, b) = l3 * n(a, b, c) / n(a, b) + (1 - l3) * P(c | b), P(c | b) = l2 * n(b, c) / n(b) + (1 - l2) * P(c),
P(c) add-one, each l = n / (n + 50) of its history's count. Writes `ngram_prior.safetensors` and
`ngram_prior.json` (what was counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from draftsmith.config import check_config, command_parser, config_to_dict, option, parse_command
from draftsmith.data.records import load_records, split_heldout
from draftsmith.errors import UserError, exit_with
from draftsmith.fileio import atomic_write, atomic_write_json, refuse_overwrite
from draftsmith.models.bundled import DEFAULT_TARGET
from draftsmith.models.target import load_model_config, load_tokenizer

PRIOR_FILE = "ngram_prior.safetensors"
REPORT_FILE = "ngram_prior.json"
FORMAT = "draftsmith.ngram_prior/1"
SMOOTHING = 50.0  # a history seen n times weighs n / (n + SMOOTHING) against its back-off


@dataclass
class NgramPriorConfig:
    target: str = option(DEFAULT_TARGET, "the target whose tokens are counted (its tokenizer is used)")
    sources: list[str] = option(factory=list, help="source specs counted (the drafter's training records)")
    max_length: int = option(1024, "tokens per record (as the drafter's training run)", ge=2)
    heldout_fraction: float = option(0.01, "the training run's held-out share, left out here", ge=0, lt=1)
    max_heldout: int | None = option(32, "the training run's held-out cap", ge=1)
    seed: int = option(0, "the training run's split seed")
    min_trigram: int = option(2, "trigrams seen fewer times are dropped", ge=1)
    output: str = option("outputs/ngram_prior", "directory for ngram_prior.safetensors + ngram_prior.json")

    def __post_init__(self):
        check_config(self)
        if not self.sources:
            raise UserError("sources: give at least one source spec, e.g. sources=records:<packed records .npz>")


@dataclass
class NgramPrior:
    vocab_size: int
    unigram: np.ndarray  # (V,) answer-token counts
    first: np.ndarray  # (V,) how often each token is followed by an answer token
    bigram_keys: np.ndarray  # sorted a * V + b
    bigram_counts: np.ndarray
    history_counts: np.ndarray  # per bigram key: how often (a, b) is followed by an answer token
    trigram_keys: np.ndarray  # sorted (a * V + b) * V + c
    trigram_counts: np.ndarray

    def __post_init__(self):
        # the few lookups a drafted node makes go faster through dicts than through array searches
        self._unigram = self.unigram.tolist()
        self._first = self.first.tolist()
        self._total = float(self.unigram.sum(dtype=np.float64)) + self.vocab_size
        self._pairs = dict(zip(self.bigram_keys.tolist(), self.bigram_counts.tolist()))
        self._histories = dict(zip(self.bigram_keys.tolist(), self.history_counts.tolist()))
        self._triples = dict(zip(self.trigram_keys.tolist(), self.trigram_counts.tolist()))

    def log_prob(self, before: int, last: int, candidates: list[int]) -> list[float]:
        """log P(c | before, last) for each candidate token c."""
        vocab, pairs, triples = self.vocab_size, self._pairs, self._triples
        n_last = self._first[last]
        weight_last = n_last / (n_last + SMOOTHING)
        history = before * vocab + last
        n_history = self._histories.get(history, 0)
        weight_history = n_history / (n_history + SMOOTHING)
        out = []
        for token in candidates:
            p = (self._unigram[token] + 1.0) / self._total
            if n_last:
                p = weight_last * pairs.get(last * vocab + token, 0) / n_last + (1.0 - weight_last) * p
            if n_history:
                p = weight_history * triples.get(history * vocab + token, 0) / n_history + (1.0 - weight_history) * p
            out.append(math.log(p))
        return out

    def save(self, directory: str | Path) -> Path:
        arrays = {name: getattr(self, name) for name in ARRAYS}
        path = Path(directory) / PRIOR_FILE
        atomic_write(path, lambda tmp: save_file(arrays, str(tmp), metadata={"format": FORMAT,
                                                                           "vocab_size": str(self.vocab_size)}))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "NgramPrior":
        path = Path(directory) / PRIOR_FILE
        if not path.is_file():
            raise UserError(f"no n-gram prior at {path}: build one with python -m draftsmith.data.ngram_prior")
        arrays = load_file(str(path))
        vocab = int(arrays["unigram"].shape[0])
        return cls(vocab_size=vocab, **{name: arrays[name] for name in ARRAYS})


ARRAYS = ("unigram", "first", "bigram_keys", "bigram_counts", "history_counts", "trigram_keys", "trigram_counts")


def count_ngrams(records: list[dict], vocab_size: int, min_trigram: int) -> NgramPrior:
    """The prior's tables over the answer tokens (loss mask on) of tokenised records."""
    unigram, firsts, pairs, triples = [], [], [], []
    for record in records:
        ids = np.asarray(record["input_ids"], dtype=np.int64)
        answer = np.asarray(record["loss_mask"], dtype=bool)
        unigram.append(ids[answer])
        follows = answer[1:]  # position i + 1 is an answer token
        firsts.append(ids[:-1][follows])
        pairs.append((ids[:-1] * vocab_size + ids[1:])[follows])
        if ids.size > 2:
            history = ids[:-2] * vocab_size + ids[1:-1]
            triples.append((history * vocab_size + ids[2:])[answer[2:]])
    pair_keys, pair_counts = np.unique(np.concatenate(pairs), return_counts=True)
    triple_keys, triple_counts = np.unique(np.concatenate(triples), return_counts=True)
    history_counts = np.zeros(pair_keys.size, dtype=np.int64)
    np.add.at(history_counts, np.searchsorted(pair_keys, triple_keys // vocab_size), triple_counts)
    keep = triple_counts >= min_trigram
    return NgramPrior(vocab_size=vocab_size,
                      unigram=np.bincount(np.concatenate(unigram), minlength=vocab_size).astype(np.int32),
                      first=np.bincount(np.concatenate(firsts), minlength=vocab_size).astype(np.int32),
                      bigram_keys=pair_keys, bigram_counts=pair_counts.astype(np.int32),
                      history_counts=history_counts.astype(np.int32), trigram_keys=triple_keys[keep],
                      trigram_counts=triple_counts[keep].astype(np.int32))


def build_ngram_prior(config: NgramPriorConfig, say=print) -> tuple[NgramPrior, dict]:
    tokenizer = load_tokenizer(config.target)
    vocab_size = load_model_config(config.target).vocab_size
    records = []
    for spec in config.sources:
        records += load_records(spec, tokenizer=tokenizer, max_length=config.max_length)
    train, held = split_heldout(records, config.heldout_fraction, config.seed, config.max_heldout)
    prior = count_ngrams(train, vocab_size, config.min_trigram)
    report = {"format": FORMAT, "config": config_to_dict(config), "records": len(train), "held_out": len(held),
              "answer_tokens": int(prior.unigram.sum()), "bigrams": int(prior.bigram_keys.size),
              "trigrams_kept": int(prior.trigram_keys.size)}
    say(f"[ngram_prior] {len(train)} records ({len(held)} held out): {report['answer_tokens']} answer tokens, "
        f"{report['bigrams']} bigrams, {report['trigrams_kept']} trigrams seen >= {config.min_trigram} times")
    return prior, report


def main(argv: list[str]) -> dict:
    parser = command_parser("python -m draftsmith.data.ngram_prior", __doc__.split("\n\n")[0], NgramPriorConfig)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing prior")
    config, flags = parse_command(parser, NgramPriorConfig, argv)
    out = Path(config.output)
    refuse_overwrite(out / PRIOR_FILE, flags.overwrite, "set output=<another dir>")
    prior, report = build_ngram_prior(config)
    out.mkdir(parents=True, exist_ok=True)
    prior.save(out)
    atomic_write_json(out / REPORT_FILE, report)
    print(f"wrote {out / PRIOR_FILE} and {out / REPORT_FILE}")
    return report


if __name__ == "__main__":
    exit_with(main)
