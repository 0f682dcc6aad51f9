"""Does a forward's order cost its linear layers time? A SmolLM2-135M-Instruct-shaped step (random weights, fp32, the
batch-invariant kernels as the engine runs them: q/k/v and gate/up joined) at 1-8 rows, in one process, three arms
interleaved: its decoder's linear layers back to back (eval.kernel_ab's step without the LM head), its attention
calls back to back (a chain of w rows over 256 cached keys in each layer's cache of 1,024 slots), and both in a
forward's order (each layer's q/k/v, its attention, o, gate/up, down). The excess of the third over the first two
is what the interleaving costs. Medians of ROUNDS.
    scripts/jobs/quiet.sh python scripts/jobs/interleave_probe.py [output.json]   (a markdown table beside it; an
    existing output is refused)
"""
import statistics
import sys
import time

import torch
import transformers
from ab_arguments import probe_output

from draftsmith.eval.documents import cpu_model, write_document
from draftsmith.eval.kernel_ab import StepPrecision, step_linears
from draftsmith.eval.roofline import head_dim
from draftsmith.models.kernels import kernel_isa, load_kernels
from draftsmith.models.registry import resolve_model_path

WIDTHS, ROUNDS, WARMUP, CONTEXT, CAPACITY = (1, 2, 3, 4, 8), 12, 2, 256, 1024
ARMS = ("linears", "attention", "interleaved")


def step_arms() -> dict:
    """Each arm as a function of the width."""
    directory = str(resolve_model_path("smollm2-135m-instruct"))
    linears = step_linears(directory, StepPrecision.FLOAT32)[:-1]  # the decoder's, in order (the head apart)
    config = transformers.AutoConfig.from_pretrained(directory)
    layers, dim = config.num_hidden_layers, head_dim(config)
    generator = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, 1, config.num_key_value_heads, CAPACITY, dim, generator=generator) for _ in range(layers)]
    queries = {w: torch.randn(1, config.num_attention_heads, w, dim, generator=generator) for w in WIDTHS}
    visible = {w: torch.arange(CAPACITY) < CONTEXT + torch.arange(1, w + 1)[:, None] for w in WIDTHS}
    masks = {w: torch.where(visible[w], 0.0, torch.finfo(torch.float32).min)[None, None] for w in WIDTHS}
    inputs = {w: {k: torch.randn(w, k) for k in {m.in_features for m in linears}} for w in WIDTHS}

    def attend(w: int, layer: int) -> None:
        keys, values = caches[layer]
        torch.ops.draftsmith.attention(queries[w], keys, values, masks[w], dim ** -0.5)

    def forward_order(w: int) -> None:
        for layer in range(layers):
            qkv, out, gate_up, down = linears[4 * layer: 4 * layer + 4]
            qkv(inputs[w][qkv.in_features])
            attend(w, layer)
            for linear in (out, gate_up, down):
                linear(inputs[w][linear.in_features])

    return {"linears": lambda w: [linear(inputs[w][linear.in_features]) for linear in linears],
            "attention": lambda w: [attend(w, layer) for layer in range(layers)],
            "interleaved": forward_order}


@torch.inference_mode()
def main() -> None:
    output = probe_output(sys.argv)
    load_kernels()
    torch.set_num_threads(2)
    arms = step_arms()
    runs = {(arm, w): [] for arm in ARMS for w in WIDTHS}
    for round_ in range(WARMUP + ROUNDS):
        for w in WIDTHS:
            for arm in ARMS:
                start = time.perf_counter()
                arms[arm](w)
                if round_ >= WARMUP:
                    runs[arm, w].append(1000 * (time.perf_counter() - start))
    ms = {w: {arm: statistics.median(runs[arm, w]) for arm in ARMS} for w in WIDTHS}
    lines = [f"{cpu_model()} (kernels {kernel_isa()}, 2 threads), a SmolLM2-shaped step, medians of {ROUNDS}, ms "
             f"(T(w)/T(1))", "", "| w | linears | attention | interleaved | excess |", "|---|---|---|---|---|"]
    for w, row in ms.items():
        excess = row["interleaved"] - row["linears"] - row["attention"]
        lines.append(f"| {w} | " + " | ".join(f"{row[arm]:.2f} ({row[arm] / ms[1][arm]:.2f})" for arm in ARMS)
                     + f" | {excess:+.2f} |")
    write_document(output, {"cpu": cpu_model(), "kernel_isa": str(kernel_isa()), "rounds": ROUNDS, "ms": ms},
                   "\n".join(lines))


if __name__ == "__main__":
    main()
