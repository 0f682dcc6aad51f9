"""Speculative generation pipeline: the drafter keeps drafting while the target verifies.

Spec: LLMCad section 3.4 ("continuing generating tokens through the memory-resident LLM during
the verification process ... sometimes the verification detects no error so the speculatively
generated tokens could be used afterwards") and Minions section 3.4 (decoupled SSM drafting and
LLM verification). Batch size 1, one background thread:

  round r:  tree T_r is ready. Its most likely path P (first child at every level; drafters list
            children best first) is taken as the assumed outcome. A background thread asks the
            drafter for a tree T' continuing context + P, rooted at P's last token, while the
            main thread runs the target's verification forward over T_r.
  then:     if verification accepted exactly P (all of it, nothing else) and the target's next
            token b is one of T'`s depth-1 tokens, the subtree of T' under b (re-rooted at b) is
            the next round's tree and no drafting is needed; otherwise T' is discarded and the
            drafter proposes from the true context as usual.

The drafter is never used by two threads at once (the main thread waits for the background
draft before `observe` and the next `propose`), so any drafter that does not need the target's
hidden states works (LMDrafter chain/tree, n-gram, Minions; per-round feedback of Minions /
LLMCad then sees rounds in pipeline order, which only affects their adaptation). Lossless: the
tree verified each round is a proposal drawn from the true context either way; when sampling,
the drafter draws from its own generator (seed + 1) so its draws stay independent of the
verification's random numbers.

Whether it helps depends on spare compute: on a GPU the draft can overlap the target's kernels;
on a 2-core CPU both forwards compete for the same cores and the GIL. `stats.draft_s` counts
main-thread drafting plus the time spent waiting for the background draft; `hits` / `rounds`
on the decoder say how often the pre-drafted tree was used.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from draftsmith.eval.decoder import DecodeConfig, DecodeResult, DecodeStats, SpeculativeDecoder
from draftsmith.eval.drafters.base import Drafter
from draftsmith.eval.tree import DraftTree
from draftsmith.models.target import TargetModel


def first_child_nodes(parents: torch.Tensor) -> list[int]:
    """Node ids along the first child at each level, from depth 1 down."""
    parent_list = parents.tolist()
    path, node = [], -1
    while True:
        child = next((i for i, p in enumerate(parent_list) if p == node), None)
        if child is None:
            return path
        path.append(child)
        node = child


def reroot(tree: DraftTree, node: int) -> DraftTree:
    """The subtree strictly below `node`, with `node` as the new root (its children at depth 1)."""
    parents = tree.parents.tolist()
    inside = [False] * tree.size
    for i in range(node + 1, tree.size):
        inside[i] = parents[i] == node or (parents[i] > node and inside[parents[i]])
    keep = [i for i in range(tree.size) if inside[i]]
    if not keep:
        return DraftTree.empty(tree.tokens.device)
    remap = {old: new for new, old in enumerate(keep)}
    new_parents = [-1 if parents[i] == node else remap[parents[i]] for i in keep]
    index = torch.tensor(keep, dtype=torch.long, device=tree.tokens.device)
    probs = None if tree.draft_probs is None else tree.draft_probs[index]
    return DraftTree(tokens=tree.tokens[index], parents=torch.tensor(new_parents, device=tree.tokens.device),
                     depths=tree.depths[index] - int(tree.depths[node]), draft_probs=probs)


class PipelineDecoder(SpeculativeDecoder):
    """SpeculativeDecoder whose drafter pre-drafts the next tree during verification."""

    def __init__(self, target: TargetModel, drafter: Drafter, config: DecodeConfig, executor: ThreadPoolExecutor):
        if drafter is None or drafter.hidden_layers:
            raise ValueError("the pipeline needs a drafter that does not read the target's hidden states")
        super().__init__(target, drafter, config)
        self.executor = executor
        self.hits = 0
        self.rounds = 0

    def _predraft(self, root: int, context: torch.Tensor, sampling, generator) -> DraftTree:
        with torch.inference_mode():
            return self.drafter.propose(root, context, sampling, generator)

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor) -> DecodeResult:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError("PipelineDecoder.generate takes input_ids of shape (1, T)")
        config, target, drafter = self.config, self.target, self.drafter
        sampling = config.sampling
        device = target.device
        generator = torch.Generator(device=device).manual_seed(config.seed) if sampling else None
        draft_generator = torch.Generator(device=device).manual_seed(config.seed + 1) if sampling else None
        eos = target.eos_token_ids if config.stop_on_eos else set()
        stats = DecodeStats()
        start = time.perf_counter()

        prompt = input_ids.to(device)
        cache = target.new_cache()
        out = target.forward(prompt, cache)
        root = self._pick(out.logits[0, -1], generator)
        drafter.begin(prompt[0])
        drafter.observe(prompt[0], {})
        generated = [root]
        context = torch.cat([prompt[0], torch.tensor([root], device=device)])
        stats.prefill_s = time.perf_counter() - start
        ready: DraftTree | None = None  # a pre-drafted tree for the current root

        while len(generated) < config.max_new_tokens and root not in eos:
            tick = time.perf_counter()
            tree = ready if ready is not None else drafter.propose(root, context, sampling, draft_generator)
            if tree.size > config.max_tree_tokens:
                raise ValueError(f"{drafter.name} proposed {tree.size} tree tokens; the budget is "
                                 f"max_tree_tokens={config.max_tree_tokens}")
            assumed = first_child_nodes(tree.parents)
            future = None
            if assumed:
                assumed_tokens = tree.tokens[assumed].to(device)
                future = self.executor.submit(self._predraft, int(assumed_tokens[-1]),
                                              torch.cat([context, assumed_tokens]), sampling, draft_generator)
            tock = time.perf_counter()
            accepted, next_token, _ = self._verify(tree, root, cache, (), generator)
            verified = time.perf_counter()
            stats.verify_s += verified - tock
            ready = None
            if future is not None:
                speculative = future.result()
                if accepted == assumed:
                    children = [i for i, p in enumerate(speculative.parents.tolist())
                                if p == -1 and int(speculative.tokens[i]) == next_token]
                    if children:
                        ready = reroot(speculative, children[0])
                        self.hits += 1
            self.rounds += 1
            stats.draft_s += (tock - tick) + (time.perf_counter() - verified)

            new_tokens = tree.tokens[accepted].tolist() + [next_token]
            drafter.observe(torch.tensor([root] + new_tokens[:-1], device=device), {})
            self._record(stats, tree, len(accepted))
            for token in new_tokens:
                if len(generated) >= config.max_new_tokens:
                    break
                generated.append(token)
                if token in eos:
                    break
            root = generated[-1]
            context = torch.cat([context, torch.tensor(new_tokens, device=device)])
        stats.total_s = time.perf_counter() - start
        stats.new_tokens = len(generated)
        return DecodeResult(tokens=generated, stats=stats)


class PipelinePolicy:
    """A decoding policy (see eval.bench) wrapping one drafter; one background thread."""

    def __init__(self, drafter: Drafter, name: str = "pipeline"):
        self.drafter = drafter
        self.name = name
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predraft")
        self.hits = 0
        self.rounds = 0

    def make_decoder(self, target: TargetModel, decode_config: DecodeConfig) -> PipelineDecoder:
        policy = self

        class _Counting(PipelineDecoder):  # report hit counts back to the policy
            def generate(self, input_ids):
                result = super().generate(input_ids)
                policy.hits += self.hits
                policy.rounds += self.rounds
                return result

        return _Counting(target, self.drafter, decode_config, self.executor)


def build_from_spec(options: dict, target, draft, name: str):
    """Bench method `pipeline:<base method>[,<its options>]`, e.g. `pipeline:lm-chain,k=4`,
    `pipeline:lm-tree,depth=4,topk=3,budget=16,student=every3`, `pipeline:ngram,k=5`: every
    option after the base kind is the base method's own (eval.bench method syntax)."""
    from draftsmith.eval.bench import build_drafter

    base = options.pop("path", None) or options.pop("base", None)
    if not base:
        raise ValueError("pipeline needs a base method: pipeline:lm-chain,k=4")
    rest = ",".join(f"{k}={v}" for k, v in options.items())
    options.clear()
    drafter = build_drafter(f"{base}:{rest}" if rest else base, target, draft)
    if drafter is None or hasattr(drafter, "make_decoder"):
        raise ValueError(f"pipeline base {base!r} must be a drafter (not a policy or the plain loop)")
    return PipelinePolicy(drafter, name=name)
