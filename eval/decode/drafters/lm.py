"""Small-LM drafter: any HF causal LM with the target's tokenizer, as a chain or a token tree.

The drafter keeps its own KV cache over the committed tokens, through the same engine interface as the
target (`models.target.TargetModel`: eager, or compiled when a compiled TargetModel is given). `propose` first feeds the
committed tokens it has not seen (reusing the longest common prefix with what it cached last
time), then drafts:
  chain: `budget` tokens, one forward each (greedy argmax, or one draw from q when sampling). With
         `stop_below`, the chain stops early once the drafter's own probability of the whole chain so far
         (the product of q(token) over its tokens) falls below it: another forward would buy a token the
         target is unlikely to reach (a dynamic draft length, like HF's assistant_confidence_threshold).
         The decision depends only on the drafter's own proposals, so verification stays exact;
  parallel: PARD (arXiv 2504.18583): `budget` tokens from ONE forward. The uncached committed tokens are fed
         followed by `budget - 1` copies of the model's mask token (`config.pard_token`, as PARD's released
         models set it); the last committed token's logits give the first draft token and mask i's logits the
         (i+1)-th. A model trained for it (train/distill.py `parallel:`) predicts well; any other model stays
         lossless (the target verifies) and simply proposes worse. The mask slots are dropped from the cache.
  tree:  EAGLE-2 style dynamic tree: every expanded node gets `topk` children (greedy: top-k;
         sampling: k draws without replacement); the `beam` best nodes of each new level by
         cumulative log-probability are expanded next, for `depth` levels. Greedy then keeps
         the best `budget` nodes overall (re-ranking). Sampling keeps every drawn node, since
         dropping drawn siblings by their value would bias verification.

With a draft vocabulary (`vocab`, models.vocab.DraftVocab) the small model's LM head scores only the
subset (a frozen slice of its own head, made at load time: `models.vocab.with_sliced_head`); drafted
ids are mapped back to target ids and the q rows scattered onto the full vocabulary, so verification
is unchanged.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from draftsmith.config import TextEnum, enum_member
from draftsmith.eval.decode.drafters.base import (CHAIN_BUDGET, Drafter, InputError, Sampling, check_open_unit,
                                                  check_sizes, draw_children)
from draftsmith.eval.decode.tree import DraftTree, ancestor_matrix, select_top_nodes, subtree
from draftsmith.models.target import TargetModel
from draftsmith.models.trees import LM_TREE
from draftsmith.models.vocab import DraftVocab, with_sliced_head


class LMDraftMode(TextEnum):
    CHAIN = "chain"  # one token a step
    TREE = "tree"  # EAGLE-2-style growth, a forward a level
    PARALLEL = "parallel"  # PARD: a block of mask tokens in one forward


class LMDrafter(Drafter):
    def __init__(self, model: PreTrainedModel | TargetModel, tokenizer=None,
                 mode: LMDraftMode | str = LMDraftMode.CHAIN,
                 budget: int = CHAIN_BUDGET, depth: int = LM_TREE.depth, topk: int = LM_TREE.topk,
                 beam: int | None = None,
                 name: str | None = None, vocab: DraftVocab | None = None, stop_below: float | None = None):
        mode = enum_member(LMDraftMode, mode, "LMDrafter mode")
        check_sizes(name or f"lm-{mode}", budget=budget, depth=depth, topk=topk, beam=beam)
        check_open_unit(name or f"lm-{mode}", "stop_below", stop_below)
        if stop_below is not None and mode is not LMDraftMode.CHAIN:
            raise InputError(f"{name or f'lm-{mode}'}: stop_below is read by mode 'chain' only, not '{mode}'")
        self.stop_below = stop_below
        self.lm = model if isinstance(model, TargetModel) else None  # a given engine (e.g. compiled) is kept
        self.model = (model.model if self.lm is not None else model).eval()
        self.vocab = vocab
        if vocab is not None and self.model.get_output_embeddings().out_features != vocab.size:
            if self.lm is not None:
                raise ValueError("slice the LM head before building the drafter's engine "
                                 "(models.vocab.with_sliced_head), or pass the model itself")
            self.model = with_sliced_head(self.model, vocab)
        self.tokenizer = tokenizer if tokenizer is not None or self.lm is None else self.lm.tokenizer
        self.mode, self.budget = mode, budget
        self.depth, self.topk, self.beam = depth, topk, beam or topk
        self.name = name or f"lm-{mode}"
        self.mask_token = parallel_mask_token(self.model, self.name) if mode is LMDraftMode.PARALLEL else None
        self.cache = None
        self.cached: list[int] = []  # tokens whose KV sits in self.cache, in order

    @property
    def device(self) -> torch.device:
        return self.model.device

    def begin(self, prompt_ids):
        """A new request: the cache of the last one stays (`_sync` keeps what the new context shares with it, as
        the target's PromptCache does) unless `forget` dropped it."""
        if self.lm is None or self.lm.model is not self.model:  # the eager engine of (a moved copy of) the model
            self.lm, self.cache = TargetModel(self.model, self.tokenizer), None
        if self.cache is None:
            self.cache, self.cached = self.lm.new_cache(), []

    def forget(self) -> None:
        self.cache, self.cached = None, []

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                 allowed: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """Append input_ids (1, n) to the cache; float32 logits (n, V), or (1, V) of the last token with
        `last_only`."""
        return self.lm.forward(input_ids, self.cache, position_ids, allowed, last_only=last_only).logits[0]

    def _sync(self, context: list[int]) -> torch.Tensor:
        """Make the cache hold exactly `context`; return the logits after its last token (V,). Only that token meets
        the LM head (a prompt's other rows would cost the head's multiply-adds for nothing)."""
        common = self._common_prefix(context)
        self.lm.truncate(self.cache, common)
        logits = self._forward(torch.tensor([context[common:]], device=self.device), last_only=True)
        self.cached = list(context)
        return logits[-1]

    @torch.inference_mode()
    def propose(self, root: int, context: torch.Tensor, sampling: Sampling | None, generator) -> DraftTree:
        context_list = context.tolist()
        if self.mode is LMDraftMode.PARALLEL:
            return self._parallel(context_list, sampling, generator)
        logits = self._sync(context_list)
        if self.mode is LMDraftMode.CHAIN:
            return self._chain(logits, sampling, generator)
        tree = self._tree(logits, len(context_list), sampling, generator)
        self.lm.truncate(self.cache, len(context_list))  # drop the tree slots; keep the committed context
        return tree

    def _draw(self, probs: torch.Tensor, count: int, sampling, generator) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor | None]:
        """(draft-space ids, target ids, q rows over the target vocabulary or None) of `count` children."""
        children, q = draw_children(probs, count, sampling, generator)
        if self.vocab is None:
            return children, children, q
        return children, self.vocab.to_target(children), None if q is None else self.vocab.scatter(q)

    def _chain(self, logits, sampling, generator) -> DraftTree:
        tokens, rows, chain_probability = [], [], 1.0
        for step in range(self.budget):
            probs = torch.softmax(logits, -1) if sampling is None else sampling.probs(logits)
            drafted, token, q = self._draw(probs, 1, sampling, generator)
            tokens.append(int(token[0]))
            if q is not None:
                rows.append(q[0])
            if self.stop_below is not None:
                chain_probability *= float(probs[drafted[0]])
                if chain_probability < self.stop_below:
                    break
            if step + 1 < self.budget:
                logits = self._forward(token.view(1, 1))[-1]
                self.cached.append(tokens[-1])
        probs = torch.stack(rows) if rows else None
        return DraftTree.chain(torch.tensor(tokens, device=self.device), probs)

    def _parallel(self, context: list[int], sampling, generator) -> DraftTree:
        """One forward over the uncached context and budget - 1 mask tokens; a chain from its last budget rows."""
        common = self._common_prefix(context)
        self.lm.truncate(self.cache, common)
        fed = context[common:] + [self.mask_token] * (self.budget - 1)
        logits = self._forward(torch.tensor([fed], device=self.device))[-self.budget:]
        self.lm.truncate(self.cache, len(context))  # keep the committed context, drop the mask slots
        self.cached = list(context)
        probs = torch.softmax(logits, -1) if sampling is None else sampling.probs(logits)
        tokens, rows = [], []
        for row in probs:  # each position's proposal is drawn from its own q row
            _, token, q = self._draw(row, 1, sampling, generator)
            tokens.append(int(token[0]))
            if q is not None:
                rows.append(q[0])
        return DraftTree.chain(torch.tensor(tokens, device=self.device), torch.stack(rows) if rows else None)

    def _common_prefix(self, context: list[int]) -> int:
        """How many leading context tokens the cache holds (at least the root is re-fed for its logits)."""
        common, limit = 0, min(len(self.cached), len(context) - 1)
        while common < limit and self.cached[common] == context[common]:
            common += 1
        return common

    def _tree(self, root_logits, context_len, sampling, generator) -> DraftTree:
        tokens, parents, scores, rows = [], [], [], []  # per node; scores = cumulative log-prob
        fed: list[int] = []  # node ids whose KV follows the context in the cache, in order
        expand = [(-1, root_logits)]  # (node id, its next-token logits)
        for level in range(self.depth):
            new_nodes = []
            for parent, logits in expand:
                probs = torch.softmax(logits, -1) if sampling is None else sampling.probs(logits)
                children, targets, q = self._draw(probs, self.topk, sampling, generator)
                base = 0.0 if parent < 0 else scores[parent]
                for i, (child, token) in enumerate(zip(children.tolist(), targets.tolist())):
                    new_nodes.append(len(tokens))
                    tokens.append(token)
                    parents.append(parent)
                    scores.append(base + float(torch.log(probs[child].clamp(min=1e-30))))
                    if q is not None:
                        rows.append(q[i])
            if level + 1 == self.depth:
                break
            # Expand the `beam` best nodes of this level: one drafter forward over them.
            best = sorted(new_nodes, key=lambda n: -scores[n])[: self.beam]
            parents_t = torch.tensor(parents, dtype=torch.long)
            reach = ancestor_matrix(parents_t)[1:, 1:]  # (n, n) node-level ancestor-or-self
            tree_cols = torch.tensor(fed + best, dtype=torch.long)
            allowed = torch.ones(len(best), context_len + len(tree_cols), dtype=torch.bool)
            allowed[:, context_len:] = reach[torch.tensor(best)][:, tree_cols]
            depth_of = [self._depth(parents, n) for n in best]
            positions = torch.tensor([[context_len - 1 + d for d in depth_of]])
            level_logits = self._forward(torch.tensor([[tokens[n] for n in best]], device=self.device),
                                         positions.to(self.device), allowed[None, None].to(self.device))
            fed.extend(best)
            expand = list(zip(best, level_logits))
        tree = DraftTree.from_parents(torch.tensor(tokens), torch.tensor(parents),
                                      torch.stack(rows) if rows else None)
        if sampling is None:
            tree = subtree(tree, select_top_nodes(torch.tensor(scores), tree.parents, self.budget))
        return DraftTree(tree.tokens.to(self.device), tree.parents.to(self.device), tree.depths.to(self.device),
                         tree.draft_probs)

    @staticmethod
    def _depth(parents: list[int], node: int) -> int:
        depth = 0
        while node >= 0:
            depth, node = depth + 1, parents[node]
        return depth


def parallel_mask_token(model: PreTrainedModel, name: str) -> int:
    """The mask token a parallel (PARD) draft model was trained with: `config.pard_token`, inside its vocabulary."""
    token = getattr(model.config, "pard_token", None)
    size = model.get_input_embeddings().weight.shape[0]
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < size:
        raise InputError(f"{name}: the draft model has no parallel-drafting mask token (config.pard_token = "
                         f"{token!r}; train one with train/distill.py parallel.copies > 1, or use lm-chain)")
    return token
