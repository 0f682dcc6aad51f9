"""Where a verify of w tokens goes through the compiled SmolLM2 target (256 cached tokens, 2 threads): a causal
forward, the same with a top-2 tree's mask and positions, + three layers' hidden states (the bundled drafter's
features), + the KV commit of an accepted path; variants interleaved per round, medians of 35 after 5 warm-up
rounds, each over the causal one-token forward (results/engine_kernels_zen4/README.md, the fifth run).
    scripts/jobs/quiet.sh python scripts/jobs/verify_tree_probe.py
"""
import statistics
import time

import torch

from draftsmith.eval.decode.tree import tree_attention_mask, tree_position_ids
from draftsmith.eval.latency import mt_bench_context
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.target import TargetModel

WIDTHS = (1, 4, 7, 9)
VARIANTS = ("causal", "tree", "tree+hidden", "tree+hidden+commit")
FEATURE_LAYERS = (2, 15, 27)  # models/bundled/smollm2-135m-instruct-eagle3/config.json: feature_layers
ROUNDS, WARMUP = 40, 5


def top2_tree(nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(parents, depths) of `nodes` tree nodes, each parent with two children, breadth first (-1: the root)."""
    parents = torch.tensor([-1, -1] + [(i - 2) // 2 for i in range(2, nodes)])[:nodes]
    depths = torch.zeros(nodes, dtype=torch.long)
    for i in range(nodes):
        depths[i] = 0 if parents[i] < 0 else depths[parents[i]] + 1
    return parents, depths


def seconds(target, cache, past: int, width: int, variant: str, generator: torch.Generator) -> float:
    """One verify-shaped forward of `width` random tokens after `past` cached ones (the cache restored)."""
    ids = torch.randint(0, 49152, (1, width), generator=generator)
    start = time.perf_counter()
    if variant == "causal":
        target.forward(ids, cache)
    else:
        parents, depths = top2_tree(width - 1)
        layers = FEATURE_LAYERS if "hidden" in variant else ()
        target.forward(ids, cache, tree_position_ids(depths, past), tree_attention_mask(parents, past),
                       hidden_layers=layers)
        if variant.endswith("commit"):  # the root and the path to node 2
            target.commit(cache, torch.cat([torch.arange(past), past + torch.tensor([0, 1, 3])]))
    elapsed = time.perf_counter() - start
    target.truncate(cache, past)
    return elapsed


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(2)
    base = TargetModel.from_pretrained("smollm2-135m-instruct")
    target = base.with_backend(Backend.COMPILED, CompileSettings())
    cache = target.new_cache(600)
    target.forward(mt_bench_context(base.tokenizer, 256), cache)
    past, generator = target.cache_length(cache), torch.Generator().manual_seed(0)
    cases = [(w, v) for w in WIDTHS for v in VARIANTS if w > 1 or v == "causal"]
    times = {case: [] for case in cases}
    for round_index in range(ROUNDS):
        for width, variant in cases:
            elapsed = seconds(target, cache, past, width, variant, generator)
            if round_index >= WARMUP:
                times[(width, variant)].append(elapsed)
    one = statistics.median(times[(1, "causal")])
    for (width, variant), values in times.items():
        median = statistics.median(values)
        print(f"w={width} {variant:20s} {1000 * median:6.2f} ms  {median / one:5.2f}x")


if __name__ == "__main__":
    main()
