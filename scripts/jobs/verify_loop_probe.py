"""A chain's verify as the decode loop runs it (`Generation.verify`: the forward with three layers' hidden states,
greedy verification, the KV commit) against the bare compiled forward, over 256 cached tokens of the SmolLM2 target
in float32 or bfloat16 (2 threads); widths and kinds interleaved per round, medians of 25 after 5 warm-up rounds,
each over the bare one-token forward (results/engine_kernels_zen4/README.md, the sixth run).
    scripts/jobs/quiet.sh python scripts/jobs/verify_loop_probe.py [float32 | bfloat16]
"""
import statistics
import sys
import time

import torch

from draftsmith.eval.decode.decoder import DecodeConfig, Generation
from draftsmith.eval.decode.tree import DraftTree
from draftsmith.eval.latency import mt_bench_context
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.target import TargetModel

WIDTHS = (1, 4, 7, 9)
KINDS = ("forward", "forward+hidden", "verify")
FEATURE_LAYERS = (2, 15, 27)  # models/bundled/smollm2-135m-instruct-eagle3/config.json: feature_layers
ROUNDS, WARMUP = 30, 5
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def chain(tokens: torch.Tensor) -> DraftTree:
    return DraftTree.from_parents(tokens, torch.arange(tokens.numel()) - 1)


def seconds(target, gen: Generation, width: int, kind: str, generator: torch.Generator) -> float:
    """One verify-shaped step of `width` tokens (the root and a chain of random drafts); the cache restored."""
    past = target.cache_length(gen.cache)
    drafts = torch.randint(0, 49152, (width - 1,), generator=generator)
    start = time.perf_counter()
    if kind == "verify":
        gen.verify(chain(drafts), FEATURE_LAYERS)
    else:
        ids = torch.tensor([[gen.root] + drafts.tolist()])
        out = target.forward(ids, gen.cache, hidden_layers=FEATURE_LAYERS if kind.endswith("hidden") else ())
        out.logits[0].argmax(-1)
    elapsed = time.perf_counter() - start
    target.truncate(gen.cache, past)
    return elapsed


@torch.inference_mode()
def main(argv: list[str]) -> None:
    if len(argv) > 1 or (argv and argv[0] not in DTYPES):
        sys.exit(f"usage: python scripts/jobs/verify_loop_probe.py [{' | '.join(DTYPES)}]")
    dtype = DTYPES[argv[0] if argv else "float32"]
    torch.set_num_threads(2)
    base = TargetModel.from_pretrained("smollm2-135m-instruct", dtype=dtype)
    target = base.with_backend(Backend.COMPILED, CompileSettings())
    gen = Generation(target, DecodeConfig(max_new_tokens=400), mt_bench_context(base.tokenizer, 256), FEATURE_LAYERS)
    generator = torch.Generator().manual_seed(0)
    times = {(w, k): [] for w in WIDTHS for k in KINDS}
    for round_index in range(ROUNDS):
        for case in times:
            elapsed = seconds(target, gen, *case, generator)
            if round_index >= WARMUP:
                times[case].append(elapsed)
    one = statistics.median(times[(1, "forward")])
    for (width, kind), values in times.items():
        median = statistics.median(values)
        print(f"{dtype} w={width} {kind:15s} {1000 * median:6.2f} ms  {median / one:5.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
