"""Would a token-transition prior lift the DFlash block's later positions? An offline probe.

The block drafter proposes every position of a block from one forward: position j reads mask tokens where the
token drafted at j - 1 would be, so its distribution is a marginal over what came before it. This probe re-ranks
position j's top candidates by log q_j(c) + weight * log P(c | the token before it), with P counted from the
training answers (a bigram with a unigram back-off) or from the record's own context before the block, and
reports the mean accepted prefix per block and the acceptance at each depth on the held-out answers the training
run measures (every answer position an anchor), beside the drafter's own top-1.

    python scripts/jobs/dflash_prior_probe.py drafters/dflash_smollm2_human_then_regen/loss_tokens_1750000 \
        outputs/medusa_regen/regen_records.npz results/drafter_families_epyc_avx2/dflash_prior/probe.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from draftsmith.data.records import collate, load_records, split_heldout
from draftsmith.models.artifacts import load_dflash
from draftsmith.models.target import TargetModel
from draftsmith.train.dflash import anchor_positions, block_targets

WEIGHTS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
CANDIDATES = 10


def bigram_table(records: list[dict], vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted pair keys prev * vocab + next, their counts, each previous token's count) over answer tokens."""
    keys, firsts = [], []
    for record in records:
        ids = torch.tensor(record["input_ids"], dtype=torch.long)
        answer = torch.tensor(record["loss_mask"], dtype=torch.bool)[1:]
        keys.append((ids[:-1] * vocab + ids[1:])[answer])
        firsts.append(ids[:-1][answer])
    pairs, counts = torch.unique(torch.cat(keys), return_counts=True)
    return pairs, counts, torch.bincount(torch.cat(firsts), minlength=vocab)


def bigram_logp(table, vocab: int, prev: torch.Tensor, cand: torch.Tensor, unigram: torch.Tensor) -> torch.Tensor:
    """log P(cand | prev) with interpolated add-one unigram back-off (prev (N,), cand (N, K))."""
    pairs, counts, totals = table
    key = prev[:, None] * vocab + cand
    index = torch.searchsorted(pairs, key).clamp(max=len(pairs) - 1)
    found = torch.where(pairs[index] == key, counts[index], torch.zeros_like(key)).double()
    total = totals[prev].double()[:, None]
    lam = total / (total + 50.0)
    return torch.log(lam * found / total.clamp(min=1) + (1 - lam) * unigram[cand] + 1e-12)


def blocks_of(drafter, target, batch: dict, block: int):
    """-> the drafter's top candidates' log-probabilities and tokens (A, block - 1, K), the target's greedy tokens
    (A, block - 1) and which positions are labelled (A, block - 1), for every anchor of one record."""
    ids, mask, loss = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    out = target(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    features = torch.cat([out.hidden_states[i] for i in drafter.config.hidden_layers], -1).float()
    anchors = anchor_positions(loss).nonzero()[:, 1][None]
    valid = torch.ones_like(anchors, dtype=torch.bool)
    hidden = drafter(features, ids, mask.bool(), anchors, valid)[0, :, 1:]
    parts = [torch.log_softmax(drafter.lm_head(chunk).float(), -1).topk(CANDIDATES, -1) for chunk in hidden.split(64)]
    logq, cand = torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])
    ahead, labelled = block_targets(loss, anchors, valid, block)
    greedy = out.logits[0].argmax(-1)[ahead[0] - 1]
    keep = labelled[0][:, 0]
    context = [ids[0, :a + 1] for a in anchors[0][keep].tolist()]
    return logq[keep], cand[keep], greedy[keep], labelled[0][keep], context


def accepted(chosen: torch.Tensor, greedy: torch.Tensor, labelled: torch.Tensor) -> torch.Tensor:
    agree = (chosen == greedy) & labelled
    return (agree | ~labelled).long().cumprod(-1) * labelled.long()


def main(drafter_dir: str, records_path: str, out_path: str) -> int:
    torch.set_grad_enabled(False)
    target = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=torch.float32, device="cpu")
    model = target.model.eval()
    drafter, _ = load_dflash(drafter_dir, target)
    records = load_records(f"records:{records_path}", tokenizer=target.tokenizer, max_length=1024, model=model)
    train, held = split_heldout(records, 0.01, 0, 32)
    vocab = model.config.vocab_size
    table = bigram_table(train, vocab)
    unigram = (table[2].double() + 1) / (table[2].sum() + vocab)
    block = drafter.config.block_size
    sums = {w: torch.zeros(block - 1, dtype=torch.float64) for w in WEIGHTS}
    blocks = 0
    for number, record in enumerate(held):
        logq, cand, greedy, labelled = blocks_of(drafter, model, collate([record]), block)
        blocks += int(labelled[:, 0].sum())
        for weight in WEIGHTS:
            chosen = cand[..., 0].clone()
            for j in range(1, block - 1):  # position j reads the greedy token before it (equal where accepted)
                prior = bigram_logp(table, vocab, greedy[:, j - 1], cand[:, j], unigram)
                pick = (logq[:, j].double() + weight * prior).argmax(-1)
                chosen[:, j] = cand[:, j].gather(1, pick[:, None])[:, 0]
            sums[weight] += accepted(chosen, greedy, labelled).sum(0).double()
        print(f"record {number + 1}/{len(held)}: {blocks} blocks", file=sys.stderr, flush=True)
    rows = {str(w): {"accepted_per_block": float(sums[w].sum() / blocks),
                     "accepted_at_depth": [round(float(x / blocks), 4) for x in sums[w]]} for w in WEIGHTS}
    result = {"drafter": drafter_dir, "blocks": blocks, "candidates": CANDIDATES, "prior": "bigram of the training "
              "answers, interpolated with the unigram (count / (count + 50))", "weights": rows}
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(result, indent=1) + "\n")
    for w in WEIGHTS:
        print(f"weight {w:4}: accepted per block {rows[str(w)]['accepted_per_block']:.3f}  "
              f"depth {rows[str(w)]['accepted_at_depth'][:4]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
