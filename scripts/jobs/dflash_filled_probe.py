"""Does the block drafter read a token placed where its mask was? An offline probe, no training.

The DFlash block [root, mask, ..., mask] proposes every position from masks: position k never sees the token at
k - 1. A second forward over [root, t1, mask, ...] (t1 the first position's token) would give positions 2.. that
token to read, if the drafter, trained on masks only, reads a token there as it reads the root. On the held-out
answers of the drafter's training run (the same seeded split; every answer position an anchor) this probe runs each
block with its first `fill` positions holding the record's true tokens (0: the drafter's own block) and reports each
later position's top-1 agreement with the target's greedy token given the true prefix: an upper bound of what a
second forward over the first forward's tokens could gain.

    python scripts/jobs/dflash_filled_probe.py drafters/dflash_smollm2_human_then_regen/loss_tokens_1750000 \\
        outputs/medusa_regen/regen_records.npz results/drafter_families_epyc_avx2/dflash_filled/probe.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from draftsmith.data.records import collate, load_records, split_heldout
from draftsmith.models.artifacts import load_dflash
from draftsmith.models.dflash import anchored_block_mask
from draftsmith.models.target import TargetModel
from draftsmith.train.dflash import anchor_positions, block_targets

FILLS = (0, 1, 2, 3)


def filled_hidden(drafter, features, ids, valid, anchors, fill: int) -> torch.Tensor:
    """The drafter's training forward (models.dflash.DFlashModel.forward) with block positions 1..fill holding the
    record's tokens at anchor + 1..fill instead of the mask -> (A, block, H)."""
    b, t = ids.shape
    a, block = anchors.shape[1], drafter.config.block_size
    positions = torch.arange(t).expand(b, t)
    context = drafter.context_kv(features, positions)
    block_positions = anchors[..., None] + torch.arange(block)
    block_ids = torch.full_like(block_positions, drafter.config.mask_token_id)
    block_ids[..., :fill + 1] = ids.gather(1, block_positions[..., :fill + 1].clamp(max=t - 1).flatten(1)).view(
        b, a, fill + 1)
    anchor_valid = torch.ones_like(anchors, dtype=torch.bool)
    mask = anchored_block_mask(anchors, anchor_valid, valid, block)
    hidden = drafter.block_hidden(block_ids.flatten(1), block_positions.flatten(1), context, mask)
    return hidden.view(a, block, -1)


def main(drafter_dir: str, records_path: str, out_path: str) -> int:
    torch.set_grad_enabled(False)
    target = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=torch.float32, device="cpu")
    model = target.model.eval()
    drafter, _ = load_dflash(drafter_dir, target)
    records = load_records(f"records:{records_path}", tokenizer=target.tokenizer, max_length=1024, model=model)
    _, held = split_heldout(records, 0.01, 0, 32)
    steps = drafter.config.block_size - 1
    agree = {fill: [0] * steps for fill in FILLS}
    counted = [0] * steps
    for number, record in enumerate(held):
        batch = collate([record])
        ids, loss = batch["input_ids"], batch["loss_mask"]
        out = model(input_ids=ids, attention_mask=batch["attention_mask"], output_hidden_states=True, use_cache=False)
        features = torch.cat([out.hidden_states[i] for i in drafter.config.hidden_layers], -1).float()
        anchors = anchor_positions(loss).nonzero()[:, 1][None]
        ahead, labelled = block_targets(loss, anchors, torch.ones_like(anchors, dtype=torch.bool),
                                        drafter.config.block_size)
        greedy = out.logits[0].argmax(-1)[ahead[0] - 1]  # (A, steps): the target's token given the true prefix
        labelled = labelled[0]
        for step in range(steps):
            counted[step] += int(labelled[:, step].sum())
        for fill in FILLS:
            hidden = filled_hidden(drafter, features, ids, batch["attention_mask"].bool(), anchors, fill)[:, 1:]
            drafted = torch.cat([drafter.lm_head(chunk).argmax(-1) for chunk in hidden.split(64)])
            hits = (drafted == greedy) & labelled
            for step in range(fill, steps):
                agree[fill][step] += int(hits[:, step].sum())
        print(f"record {number + 1}/{len(held)}", file=sys.stderr, flush=True)
    rows = [{"filled_positions": fill,
             "agreement_at_position": [None if step < fill else round(agree[fill][step] / counted[step], 4)
                                       for step in range(steps)]} for fill in FILLS]
    result = {"drafter": drafter_dir, "held_out_records": len(held), "labelled_per_position": counted, "rows": rows}
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(result, indent=1) + "\n")
    print("| block positions holding the true tokens | top-1 agreement at position 1 .. 7 |")
    print("|---|---|")
    for row in rows:
        print(f"| 1..{row['filled_positions']} | " + " / ".join("-" if x is None else f"{x:.3f}"
                                                                for x in row["agreement_at_position"]) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
