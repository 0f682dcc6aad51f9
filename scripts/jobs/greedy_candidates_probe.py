"""How many of SmolLM2-135M-Instruct's 49,152 logits the greedy head recomputes a row with each approximation
(models.kernels.GreedyHead): the int8 rows times float32 inputs (c = 1/2), times inputs rounded to bf16 (the AMX
pairs: c = 1/2 + 130/512) and times the inputs' two int8 halves (the AMX quads: 1/2 of sum|x| plus 64 K s_x), each
a_j and bound_j in float64 as the kernels bound them (the float32 sums' small terms left out), over the final hidden
states of the first MT-Bench prompts (250 positions): mean and most candidates a row. Prints one line.
    python scripts/jobs/greedy_candidates_probe.py
"""
import torch

from draftsmith.eval.prompts import load_prompts
from draftsmith.models.kernels import quantize_int8
from draftsmith.models.target import TargetModel

POSITIONS, SPAN = 250, 127 * 128


def candidates(approximate: torch.Tensor, bound: torch.Tensor) -> tuple[float, int]:
    """(mean, most) columns a row whose upper bound reaches the row's largest lower bound."""
    lowest = (approximate - bound).max(-1, keepdim=True).values
    count = ((approximate + bound) >= lowest).sum(-1)
    return count.double().mean().item(), int(count.max())


@torch.inference_mode()
def main() -> None:
    base = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=torch.float32)
    quantized, scale = quantize_int8(base.model.get_output_embeddings().weight)
    q, s = quantized.double(), scale.double()
    states = [base.model(prompt["input_ids"], output_hidden_states=True).hidden_states[-1][0]
              for prompt in load_prompts("mt-bench", 5, 0, base.tokenizer)]
    x = torch.cat(states)[:POSITIONS].double()
    l1, k = x.abs().sum(-1, keepdim=True), x.shape[1]
    step = x.abs().amax(-1, keepdim=True) / SPAN
    copies = {"int8": ((x @ q.T) * s, s * 0.5 * l1),
              "int8 pairs": ((x.float().bfloat16().double() @ q.T) * s, s * (0.5 + 130 / 512) * l1),
              "int8 quads": ((torch.round(x / step) @ q.T) * s * step, s * (0.5 * l1 + 64 * k * step))}
    counts = {name: candidates(*pair) for name, pair in copies.items()}
    print(f"{x.shape[0]} positions, candidates a row (mean, most): "
          + ", ".join(f"{name} {mean:.1f} / {most}" for name, (mean, most) in counts.items()))


if __name__ == "__main__":
    main()
