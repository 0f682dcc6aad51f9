"""In-process A/B of prompt lookup's search in the goal cells' best method (lookup, else the DFlash tree:
ab_arguments.BEST): its n-gram index kept from round to round (`index`: eval.decode.drafters.ngram.NgramIndex, a few
tokens a round in lists, the tree built from lists) against the search anew each round that it replaced (`search`:
tensor windows of the whole context, nonzero, the tree's depths a tensor op a node; kept below as it was).
SmolLM2-135M-Instruct float32 on the compiled engine, MT-Bench first turns, 128 new tokens; per prompt both arms in
alternating order. Reports each arm's tokens/s (plain beside them) and lookup's own time a round (its propose, timed
in the loop). Same tokens in both arms (checked).
    scripts/jobs/quiet.sh python scripts/jobs/lookup_index_ab.py [float32] [prompts] [output.json]
"""
import sys
import time

import torch
from ab_arguments import alternating_rates, float32_arguments, float32_targets, method_drafter, write_result

from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.ngram import NgramDrafter
from draftsmith.eval.decode.tree import DraftTree, trie
from draftsmith.eval.prompts import load_prompts

ARMS = ("search", "index")
SECONDS = {arm: 0.0 for arm in ARMS}
CALLS = dict.fromkeys(ARMS, 0)
ARM = {"now": ARMS[0]}


def search_continuations(self: NgramDrafter, context: torch.Tensor) -> list[list[int]]:
    """The search anew, as it was: every window of the context compared in tensors."""
    found: list[list[int]] = []
    length = context.numel()
    for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
        windows = context[: length - 1].unfold(0, n, 1)
        starts = torch.nonzero((windows == context[-n:]).all(-1)).flatten().tolist()
        for start in reversed(starts):
            follow = context[start + n: start + n + self.budget].tolist()
            if follow and follow not in found:
                found.append(follow)
                if len(found) == self.num_branches:
                    return found
    return found


def search_propose(self: NgramDrafter, root, context, sampling, generator) -> DraftTree:
    """The propose it was: the search anew, the tree's depths filled a node at a time in a tensor."""
    tokens, parents = trie(search_continuations(self, context))
    tokens, parents = tokens[: self.budget], parents[: self.budget]
    if not tokens:
        return DraftTree.empty(context.device)
    parents_tensor = torch.tensor(parents, device=context.device)
    depths = torch.zeros_like(parents_tensor)
    for i, parent in enumerate(parents):
        depths[i] = 1 if parent < 0 else depths[parent] + 1
    return DraftTree(tokens=torch.tensor(tokens, device=context.device), parents=parents_tensor, depths=depths)


def timed_propose(lookup: NgramDrafter):
    index_propose = lookup.propose

    def propose(*args):
        start = time.perf_counter()
        try:
            return search_propose(lookup, *args) if ARM["now"] == "search" else index_propose(*args)
        finally:
            SECONDS[ARM["now"]] += time.perf_counter() - start
            CALLS[ARM["now"]] += 1
    return propose


@torch.inference_mode()
def main(argv: list[str]) -> None:
    count, output = float32_arguments(argv, "lookup_index_ab.py",
                                      "the goal cells run a float32 target: run with float32")
    base, target = float32_targets()
    config = DecodeConfig(max_new_tokens=128)
    best = method_drafter(base)
    lookup = best.drafters[0]
    lookup.propose = timed_propose(lookup)
    decoders = {"plain": SpeculativeDecoder(target, None, config), "best": SpeculativeDecoder(target, best, config)}
    prompts = [p["input_ids"] for p in load_prompts("mt-bench", count, 0, base.tokenizer)]
    rate = alternating_rates(prompts, ARMS, lambda arm: ARM.update(now=arm), decoders)
    per_call = {arm: 1e6 * SECONDS[arm] / max(CALLS[arm], 1) for arm in ARMS}
    print(f"float32, {count} MT-Bench first turns, tokens/s (same tokens in both arms):")
    for arm in ARMS:
        print(f"  {arm}: plain {rate[arm, 'plain']:.2f}, best {rate[arm, 'best']:.2f} "
              f"({rate[arm, 'best'] / rate[arm, 'plain']:.3f}x); lookup's propose {per_call[arm]:.0f} us a call "
              f"({CALLS[arm]} calls)")
    write_result(output, count, rate, lookup_propose_us=per_call, lookup_calls=CALLS)


if __name__ == "__main__":
    main(sys.argv[1:])
