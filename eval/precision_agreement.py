"""How far the target in another precision strays from its float32 self: per suite, the teacher-forced top-1
agreement of its next token with float32's and the mean KL divergence of float32's next-token distribution from its
own, over a bench's first-turn plain outputs.

    python -m draftsmith.eval.precision_agreement bench=<a float32 bench.json> output=<dir>/precision_agreement.json

Every precision is the stock model on the batch-invariant kernels (models/kernels.py), one forward per sequence:
float32 (the reference), bfloat16, weight-only int8 (float32 activations, and under bfloat16 ones), w8a8 (int8
weights, each input row quantized to int8), and on AMX CPUs float32 as split bf16 pairs. Speculative decoding is
lossless against the target in whichever precision it runs; this says how far that target is from the float32 model,
a different question.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.config import check_config, config_to_dict, option
from draftsmith.errors import UserError, exit_with
from draftsmith.eval.documents import parse_document_command, write_document
from draftsmith.eval.drafter_top1 import first_turn_sequences
from draftsmith.models.artifacts import read_json
from draftsmith.models.kernels import WeightPrecision, invariant_model, precision_runs_here
from draftsmith.models.target import TargetModel

# (label, dtype, stored weights) of each precision compared with the float32 reference
PRECISIONS = (("bfloat16", torch.bfloat16, WeightPrecision.MODEL),
              ("int8 weights", torch.float32, WeightPrecision.INT8),
              ("int8 weights, bfloat16 activations", torch.bfloat16, WeightPrecision.INT8),
              ("w8a8", torch.float32, WeightPrecision.W8A8))
SPLIT_BF16 = ("split bf16 (AMX)", torch.float32, WeightPrecision.SPLIT_BF16)  # where the kernels have AMX tiles


def precisions_here() -> tuple:
    """PRECISIONS, and float32 as split bf16 pairs where the kernels run on AMX tiles."""
    return PRECISIONS + ((SPLIT_BF16,) if precision_runs_here(WeightPrecision.SPLIT_BF16) else ())


@dataclass
class PrecisionAgreementConfig:
    bench: str = option("results/engine_kernels_zen4/goal_bench_int8_drafter/bench.json",
                        "a float32 bench.json whose first-turn plain outputs are scored")
    threads: int = option(0, "torch CPU threads (0: torch's default)", ge=0)
    output: str | None = option(None, "JSON path (a markdown table is written beside it); null: print only")

    def __post_init__(self):
        check_config(self)


def next_token_log_probs(model, ids: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """log-softmax (float32) of the model's next-token logits at the generated positions of one sequence."""
    with torch.inference_mode():
        logits = model(ids).logits[0, prompt_length - 1:-1]
    return logits.float().log_softmax(-1)


def agreement(reference: list[torch.Tensor], other: list[torch.Tensor]) -> dict:
    """Top-1 agreement and mean KL(reference || other) over every position of the sequences."""
    ref, oth = torch.cat(reference), torch.cat(other)
    same = (ref.argmax(-1) == oth.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - oth)).sum(-1).mean().item()
    return {"positions": ref.shape[0], "top1_agreement": same, "kl": kl}


def measure(results: dict, base: TargetModel) -> dict[str, dict[str, dict]]:
    """Per precision, per suite: agreement with the float32 model on the kernels."""
    sequences = first_turn_sequences(results, base.tokenizer)

    def log_probs(model) -> dict[str, list[torch.Tensor]]:
        return {suite: [next_token_log_probs(model, ids, length) for ids, length in items]
                for suite, items in sequences.items()}

    reference = log_probs(invariant_model(base.model))
    document = {}
    for label, dtype, weights in precisions_here():
        converted = base.model if dtype == base.dtype else copy.deepcopy(base.model).to(dtype)  # (base unchanged)
        model = invariant_model(converted, weights)
        document[label] = {suite: agreement(reference[suite], other)
                           for suite, other in log_probs(model).items()}
    return document


def format_agreement(document: dict) -> str:
    suites = list(next(iter(document["precisions"].values())))
    lines = [f"Each precision against the float32 model on the batch-invariant kernels, teacher-forced over the "
             f"first-turn plain outputs of {document['bench']}: top-1 agreement (KL(float32 || it), nats).", "",
             "| precision | " + " | ".join(suites) + " |", "|---|" + "---|" * len(suites)]
    for label, per_suite in document["precisions"].items():
        # (a KL at float32's noise can read a hair below zero: shown as 0)
        cells = " | ".join(f"{e['top1_agreement']:.3f} ({max(e['kl'], 0.0):.4f})" for e in per_suite.values())
        lines.append(f"| {label} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str]) -> dict:
    config, out = parse_document_command("draftsmith.eval.precision_agreement", __doc__, PrecisionAgreementConfig,
                                         argv)
    if config.threads:
        torch.set_num_threads(config.threads)
    if not Path(config.bench).is_file():
        raise UserError(f"bench={config.bench}: no such file (a bench.json written by draftsmith.eval.bench)")
    results = read_json(Path(config.bench), "bench results")
    if results["config"]["dtype"] != "float32":
        raise UserError(f"bench={config.bench}: its plain outputs are {results['config']['dtype']}'s; give a "
                        "float32 bench")
    base = TargetModel.from_pretrained(results["config"]["target"], dtype="float32")
    document = {"format": "draftsmith.precision_agreement/1", "config": config_to_dict(config),
                "bench": config.bench, "precisions": measure(results, base)}
    write_document(out, document, format_agreement(document))
    return document


if __name__ == "__main__":
    exit_with(main)
