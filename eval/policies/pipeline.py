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
(the policy's summary) say how often the pre-drafted tree was used.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from draftsmith.errors import UserError
from draftsmith.eval.decode.decoder import DecodeConfig, DecodeResult, Generation, Method, Round
from draftsmith.eval.decode.drafters.base import Drafter
from draftsmith.eval.decode.tree import DraftTree
from draftsmith.models.target import TargetModel, check_same_tokenizer


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


class PipelineDecoder:
    """The decoder loop (eval.decode.decoder.Generation) with the next tree pre-drafted during verification."""

    def __init__(self, target: TargetModel, drafter: Drafter, config: DecodeConfig, policy: "PipelinePolicy"):
        self.target, self.drafter, self.config, self.policy = target, drafter, config, policy
        if drafter.tokenizer is not None:
            check_same_tokenizer(target.tokenizer, drafter.tokenizer, what=f"{drafter.name} drafter")

    def _predraft(self, root: int, context: torch.Tensor, sampling, generator) -> DraftTree:
        with torch.inference_mode():
            return self.drafter.propose(root, context, sampling, generator)

    def _submit(self, gen: Generation, tree: DraftTree, generator) -> tuple[list[int], Future | None]:
        """Start drafting the tree after the tree's most likely path (assumed accepted)."""
        assumed = first_child_nodes(tree.parents)
        if not assumed:
            return assumed, None
        tokens = tree.tokens[assumed].to(gen.context.device)
        future = self.policy.executor.submit(self._predraft, int(tokens[-1]), torch.cat([gen.context, tokens]),
                                             gen.sampling, generator)
        return assumed, future

    def _collect(self, round: Round, assumed: list[int], future: Future | None) -> DraftTree | None:
        """The pre-drafted subtree under the target's next token when the assumption held, else None."""
        if future is None:
            return None
        speculative = future.result()
        if round.accepted != assumed:
            return None
        children = [i for i, p in enumerate(speculative.parents.tolist())
                    if p == -1 and int(speculative.tokens[i]) == round.next_token]
        if not children:
            return None
        self.policy.hits += 1
        return reroot(speculative, children[0])

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor) -> DecodeResult:
        gen = Generation(self.target, self.config, input_ids, prompt_cache=self.policy.kept_prompt(self.config))
        draft_generator = (torch.Generator(device=self.target.device).manual_seed(self.config.seed + 1)
                           if gen.sampling else None)
        with gen.drafting():
            if not self.config.prefix_cache:
                self.drafter.forget()
            self.drafter.begin(gen.prompt)
            self.drafter.observe(gen.prompt, {})
        ready: DraftTree | None = None  # a pre-drafted tree for the current root
        while not gen.done:
            with gen.drafting():
                tree = ready if ready is not None else self.drafter.propose(gen.root, gen.context, gen.sampling,
                                                                           draft_generator)
                gen.check_budget(tree, self.drafter.name)
                assumed, future = self._submit(gen, tree, draft_generator)
            round = gen.verify(tree)
            with gen.drafting():  # waiting for the background draft
                ready = self._collect(round, assumed, future)
            self.policy.rounds += 1
            with gen.drafting():
                self.drafter.observe(round.committed, {})
            gen.advance(round)
        return gen.result()


class PipelinePolicy(Method):
    """A decoding method wrapping one drafter; one background thread for the pre-drafts."""

    def __init__(self, drafter: Drafter, name: str = "pipeline"):
        if drafter.hidden_layers:
            raise UserError(f"pipeline: {drafter.name} reads the target's hidden states, which the pre-draft "
                            "cannot have yet; use a drafter without them (lm-chain, lm-tree, ngram, minions)")
        self.drafter, self.name = drafter, name
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="predraft")
        self.hits = 0
        self.rounds = 0

    def make_decoder(self, target: TargetModel, config: DecodeConfig) -> PipelineDecoder:
        return PipelineDecoder(target, self.drafter, config, self)

    def summary(self) -> dict:
        return {"predraft_hits": self.hits, "rounds": self.rounds,
                "hit_rate": self.hits / self.rounds if self.rounds else None}
