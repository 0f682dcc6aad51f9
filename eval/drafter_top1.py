"""Teacher-forced top-1 of a feature drafter on a bench's own greedy outputs, per suite, beside the decoder's
depth-1 acceptance on the same run: when acceptance is below the training run's held-out top-1, this says
whether the drafter is weaker on these prompts (top-1 as low as the acceptance) or the decode path loses
something (top-1 well above it).

    python -m draftsmith.eval.drafter_top1 bench=results/dgf_smollm2_long/bench.json \\
        drafter=outputs/dgf_smollm2_long/final output=results/dgf_smollm2_long/top1.json

The bench's first-turn prompts are selected again from its config (suites, prompt count, seed). Each prompt
plus plain's greedy tokens goes through the target once; the drafter reads the target's features f_t with
the next token x_{t+1}, as in training, and its argmax is compared with the target's greedy token after
x_{t+1}, over the generated positions (the first draft of a round onward).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.config import check_config, config_to_dict, option
from draftsmith.errors import UserError, exit_with
from draftsmith.eval.prompts import load_prompts
from draftsmith.eval.documents import parse_document_command, write_document
from draftsmith.models.artifacts import DGF_FORMAT, load_dgf, read_json, read_manifest
from draftsmith.models.dgf import DGFModel
from draftsmith.models.target import TargetModel


@dataclass
class DrafterTop1Config:
    bench: str = option("results/dgf_smollm2_long/bench.json", "a bench.json whose plain outputs are read")
    drafter: str = option("outputs/dgf_smollm2_long/final", "a train/dgf.py final/ or dgf export directory")
    threads: int = option(0, "torch CPU threads (0: torch's default)", ge=0)
    output: str | None = option(None, "JSON path (a markdown table is written beside it); null: print only")

    def __post_init__(self):
        check_config(self)


def pair_hits(guess: torch.Tensor, greedy: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """guess (T-1,): the drafter's token for pair t = (f_t, x_{t+1}); greedy (T,): the target's argmax after
    each position. Pair t is right when guess[t] == greedy[t+1]; returned (bool) for t in [P-1, T-2): from the
    pair that drafts the first token after the prompt's own next token to the last one the sequence can check."""
    region = slice(prompt_length - 1, greedy.shape[0] - 2)
    return guess[region] == greedy[1:][region]


def sequence_hits(drafter: DGFModel, target: TargetModel, ids: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Which pairs of one sequence (1, T) = prompt + greedy continuation the drafter gets right (bool)."""
    with torch.inference_mode():
        out = target.model(ids.to(target.device), output_hidden_states=True)
        layers = torch.stack([out.hidden_states[i] for i in drafter.config.layers_read], dim=2)  # (1, T, k, H)
        pred = drafter(drafter.fuse_layers(layers[:, :-1].to(drafter.dtype)), ids[:, 1:].to(target.device))
        guess = drafter.logits(pred).argmax(-1)[0]  # (T-1,)
        if drafter.config.draft_vocab_size:
            guess = drafter.draft_to_target[guess]
    return pair_hits(guess.cpu(), out.logits.argmax(-1)[0].cpu(), prompt_length)


def share(flags: torch.Tensor) -> float:
    """The share of True in a bool tensor (NaN when empty)."""
    return float(flags.float().mean()) if flags.numel() else float("nan")


def hit_rates(hits: list[torch.Tensor]) -> dict:
    """Top-1 over all pairs, and over the pairs right after a miss / after a hit: a decoding round starts after
    a rejected draft (or a fully accepted chain), so the decoder samples positions after misses more often."""
    hits = hits or [torch.zeros(0, dtype=torch.bool)]
    after = [(h[1:], h[:-1]) for h in hits]
    after_miss = torch.cat([now[~before] for now, before in after])
    after_hit = torch.cat([now[before] for now, before in after])
    every = torch.cat(hits)
    return {"top1": share(every), "positions": every.numel(), "top1_after_miss": share(after_miss),
            "top1_after_hit": share(after_hit)}


def decoder_acceptance(results: dict, drafter_dir: str) -> dict[str, dict[str, float]]:
    """Depth-1 acceptance per suite of every bench method that decoded with `drafter_dir`."""
    return {label: {suite: entry["depth_acceptance"].get("1") for suite, entry in summary["by_suite"].items()}
            for label, summary in results["summary"].items() if f"path={drafter_dir}" in label}


def first_turn_sequences(results: dict, tokenizer) -> dict[str, list[tuple[torch.Tensor, int]]]:
    """Per suite of a bench: (prompt + plain's greedy tokens (1, T), prompt length) of each first turn, the prompts
    selected again from the bench's config."""
    config = results["config"]
    plain = {(entry["suite"], entry["id"]): entry["plain"]["tokens"] for entry in results["per_prompt"]
             if entry["turn"] == 1}
    sequences = {}
    for suite in config["suites"]:
        sequences[suite] = []
        for prompt in load_prompts(suite, config["num_prompts"], config["seed"], tokenizer):
            prompt_ids = torch.as_tensor(prompt["input_ids"]).reshape(-1).tolist()
            sequences[suite].append((torch.tensor([prompt_ids + plain[(suite, prompt["id"])]]), len(prompt_ids)))
    return sequences


def measure_top1(results: dict, drafter: DGFModel, target: TargetModel) -> dict[str, dict]:
    """Per suite: teacher-forced top-1 of `drafter` over the bench's first-turn plain outputs."""
    return {suite: hit_rates([sequence_hits(drafter, target, ids, length) for ids, length in sequences])
            for suite, sequences in first_turn_sequences(results, target.tokenizer).items()}


def format_top1(document: dict) -> str:
    accept = document["decoder_depth1_acceptance"]
    lines = [f"Teacher-forced top-1 of {document['drafter']} on the first-turn plain outputs of {document['bench']} "
             "(target features from one forward), beside the decoder's depth-1 acceptance (both turns).", "",
             "| suite | positions | teacher-forced top-1 | after a miss | after a hit | "
             + " | ".join(f"acceptance@1 {m}" for m in accept) + " |",
             "|---|---|---|---|---|" + "---|" * len(accept)]
    for suite, entry in document["suites"].items():
        cells = " | ".join(f"{accept[m].get(suite, float('nan')):.3f}" for m in accept)
        lines.append(f"| {suite} | {entry['positions']} | {entry['top1']:.3f} | {entry['top1_after_miss']:.3f} | "
                     f"{entry['top1_after_hit']:.3f} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str]) -> dict:
    config, out = parse_document_command("draftsmith.eval.drafter_top1", __doc__, DrafterTop1Config, argv)
    if config.threads:
        torch.set_num_threads(config.threads)
    if not Path(config.bench).is_file():
        raise UserError(f"bench={config.bench}: no such file (a bench.json written by draftsmith.eval.bench)")
    results = read_json(Path(config.bench), "bench results")
    read_manifest(config.drafter, DGF_FORMAT)  # refused before the target loads
    target = TargetModel.from_pretrained(results["config"]["target"], dtype=results["config"]["dtype"])
    drafter, _ = load_dgf(config.drafter, target=target)
    document = {"format": "draftsmith.drafter_top1/1", "config": config_to_dict(config), "bench": config.bench,
                "drafter": config.drafter, "suites": measure_top1(results, drafter, target),
                "decoder_depth1_acceptance": decoder_acceptance(results, config.drafter)}
    write_document(out, document, format_top1(document))
    return document


if __name__ == "__main__":
    exit_with(main)
