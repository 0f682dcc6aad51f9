"""Does re-ranking the DFlash block's candidates given the token before them lift its acceptance? An offline probe.

The block drafter proposes every position of a block from one forward: position j reads a mask where the token
drafted at j - 1 will be, so its distribution is a marginal over what came before it. On the held-out answers of
the drafter's training run (the same seeded split; every answer position an anchor), this probe grows the chain the
decoder grows with a prior (eval/decode/drafters/prior.py: the training answers' n-gram prior from block position
2 on, the record's own tokens before the block) at several weights, beside the drafter's own top-1 chain, and
reports the mean accepted prefix per block (of 7) and the share of blocks accepted to each depth. The target's
greedy token given the true prefix is the one to match (the records are its own answers).

    python scripts/jobs/dflash_prior_probe.py drafters/dflash_smollm2_human_then_regen/loss_tokens_1750000 \\
        drafters/dflash_smollm2_human_then_regen/ngram_prior outputs/medusa_regen/regen_records.npz \\
        results/drafter_families_epyc_avx2/dflash_prior/probe.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from draftsmith.data.ngram_prior import NgramPrior
from draftsmith.data.records import collate, load_records, split_heldout
from draftsmith.eval.decode.drafters.prior import CANDIDATES, CandidatePrior, reranked
from draftsmith.models.artifacts import load_dflash
from draftsmith.models.target import TargetModel
from draftsmith.train.dflash import anchor_positions, block_targets

SETTINGS = [(0.0, 0.0), (0.2, 0.0), (0.0, 0.3), (0.0, 0.6), (0.0, 1.0), (0.2, 0.3), (0.2, 0.6), (0.2, 1.0), (0.2, 1.5),
            (0.3, 1.0)]  # (prior weight, context weight)


def blocks_of(drafter, target, batch: dict):
    """-> per anchor of one record: the drafter's top candidates' logits and tokens (A, block - 1, K), the
    target's greedy tokens (A, block - 1), which are labelled (A, block - 1), and the anchors (A,)."""
    ids, mask, loss = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
    out = target(input_ids=ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
    features = torch.cat([out.hidden_states[i] for i in drafter.config.hidden_layers], -1).float()
    anchors = anchor_positions(loss).nonzero()[:, 1][None]
    valid = torch.ones_like(anchors, dtype=torch.bool)
    hidden = drafter(features, ids, mask.bool(), anchors, valid)[0, :, 1:]
    parts = [drafter.lm_head(chunk).float().topk(CANDIDATES, -1) for chunk in hidden.split(64)]
    values, candidates = torch.cat([p.values for p in parts]), torch.cat([p.indices for p in parts])
    ahead, labelled = block_targets(loss, anchors, valid, drafter.config.block_size)
    greedy = out.logits[0].argmax(-1)[ahead[0] - 1]
    keep = labelled[0][:, 0]
    return values[keep], candidates[keep], greedy[keep], labelled[0][keep], anchors[0][keep]


def chain(prior: CandidatePrior, values: list, candidates: list, before: int, last: int) -> list[int]:
    """The decoder's chain under the prior (DFlashDrafter._prior_tree with topk 1, no cut)."""
    out = []
    for depth in range(1, len(values) + 1):
        gains = prior.scores(depth, before, last, candidates[depth - 1])
        token = reranked(values[depth - 1], candidates[depth - 1], gains, 0.0, 1)[0][1]
        out.append(token)
        before, last = last, token
    return out


def main(drafter_dir: str, prior_dir: str, records_path: str, out_path: str) -> int:
    torch.set_grad_enabled(False)
    target = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=torch.float32, device="cpu")
    model = target.model.eval()
    drafter, _ = load_dflash(drafter_dir, target)
    ngrams = NgramPrior.load(prior_dir)
    records = load_records(f"records:{records_path}", tokenizer=target.tokenizer, max_length=1024, model=model)
    _, held = split_heldout(records, 0.01, 0, 32)
    depth_sums = {setting: [0] * (drafter.config.block_size - 1) for setting in SETTINGS}
    blocks = 0
    for number, record in enumerate(held):
        values, candidates, greedy, labelled, anchors = blocks_of(drafter, model, collate([record]))
        values, candidates = values.double().tolist(), candidates.tolist()
        greedy, labelled, ids = greedy.tolist(), labelled.tolist(), record["input_ids"]
        blocks += len(values)
        for setting in SETTINGS:
            prior = CandidatePrior(ngrams, *setting)
            for block, anchor in enumerate(anchors.tolist()):
                prior.extend(ids[:anchor + 1])
                drafted = chain(prior, values[block], candidates[block], ids[max(anchor - 1, 0)], ids[anchor])
                for depth, token in enumerate(drafted):
                    if not labelled[block][depth] or token != greedy[block][depth]:
                        break
                    depth_sums[setting][depth] += 1
        print(f"record {number + 1}/{len(held)}: {blocks} blocks", file=sys.stderr, flush=True)
    rows = [{"prior_weight": w, "context_weight": c, "accepted_per_block": round(sum(s) / blocks, 4),
             "accepted_to_depth": [round(x / blocks, 4) for x in s]} for (w, c), s in depth_sums.items()]
    result = {"drafter": drafter_dir, "prior": prior_dir, "held_out_records": len(held), "blocks": blocks,
              "candidates": CANDIDATES, "rows": rows}
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(result, indent=1) + "\n")
    print("| prior weight | context weight | accepted per block | accepted to depth 1 / 2 / 3 / 4 |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['prior_weight']} | {row['context_weight']} | {row['accepted_per_block']:.3f} | "
              + " / ".join(f"{x:.3f}" for x in row["accepted_to_depth"][:4]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
