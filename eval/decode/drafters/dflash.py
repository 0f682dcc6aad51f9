"""DFlash block drafter in the decoder: one drafter forward per round proposes a chain of up to block - 1 tokens.

State per request: each draft layer's keys and values of the committed positions, computed from the target
features `observe` hands over (the target's hidden states at the drafter's layers). `propose(root, context)` runs
the block [root, mask, ..., mask] at the positions after the committed ones; the block attends to the whole
context and to itself, and block position k proposes the token k steps after the root. Greedy: the argmax at
each position (a chain; `stop_below` cuts it where the product of the drafter's probabilities so far falls below
the threshold). Sampling: block position k's token is drawn from its own distribution q_k, which does not depend
on the tokens drawn before it, so q_k is exactly the distribution the verifier needs for that node. With `topk`
> 1 the round is a tree instead: at every block position the top-k candidates (sampling: k draws without
replacement) as children of the previous position's first candidate, budget x topk nodes (static_tree_tokens, as
Medusa's heads: a position's distribution does not depend on the parent). `keep_above` (greedy) verifies only the
nodes whose path probability under the drafter is above it, as the other drafters' dynamic size.
The decoder verifies every proposal, so the output is the target's whatever the drafter says.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.eval.decode.drafters.base import (Drafter, InputError, Sampling, check_open_unit, check_sizes,
                                                 confident_subtree, refuse_sampled_trim, static_tree_tokens)
from draftsmith.eval.decode.tree import DraftTree, tree_from_paths

from draftsmith.models.artifacts import load_dflash
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import (WeightPrecision, frozen_linear, gather_weights, invariant_model,
                                      invariant_rows)
from draftsmith.models.dflash import ContextBuffers, DFlashModel
from draftsmith.models.vocab import DraftVocab


class DFlashDrafter(Drafter):
    def __init__(self, model: DFlashModel, budget: int | None = None, name: str = "dflash",
                 stop_below: float | None = None, vocab: DraftVocab | None = None,
                 precision: WeightPrecision | None = None, topk: int = 1, keep_above: float | None = None):
        most = model.config.block_size - 1
        budget = most if budget is None else budget
        check_sizes(name, budget=budget, topk=topk)
        check_open_unit(name, "stop_below", stop_below)
        check_open_unit(name, "keep_above", keep_above)
        self.keep_above = keep_above  # dynamic size (greedy): only nodes whose path's probability is above it
        if budget > most:
            raise InputError(f"{name}: budget={budget} is more than the block of {model.config.block_size} can "
                             f"propose ({most} tokens after the root)")
        model._need_target()
        self.model = model.eval()
        self.budget, self.name, self.stop_below, self.topk = budget, name, stop_below, topk
        # the tree (topk > 1): ranks 0..topk-1 at each position under the previous position's rank 0, by depth
        paths = [[0] * (depth - 1) + [rank] for depth in range(1, budget + 1) for rank in range(topk)]
        self.parents, self.depths, self.ranks = tree_from_paths(paths)
        self.hidden_layers = model.config.hidden_layers
        # an optional draft vocabulary: the drafter's argmax over that slice of the LM head only (cheaper)
        self.vocab = vocab
        head = model.lm_head.weight if vocab is None else model.lm_head.weight[vocab.draft_to_target.to(
            model.fc.weight.device)]
        head = head.to(model.fc.weight.dtype)  # the target's rows, in the drafter's arithmetic
        # precision given: the compiled engine's batch-invariant kernels (the stock mm is slow for a block's few rows)
        if precision is None:
            self.runs, self.head = model, frozen_linear(head.detach())
        else:
            self.runs = invariant_model(model, precision, gather=False)
            self.head = invariant_rows(head.detach(), precision)
            gather_weights(self.runs, self.head)  # the block's layers, then its head: the order a round streams
        self.context = ContextBuffers()

    @property
    def length(self) -> int:
        """Context positions the drafter has keys and values of."""
        return self.context.length

    def begin(self, prompt_ids):
        self.context = ContextBuffers()

    @torch.inference_mode()
    def observe(self, tokens, hidden):
        device = self.model.fc.weight.device
        features = torch.cat([hidden[layer].to(device) for layer in self.hidden_layers], -1)[None]  # (1, m, kH)
        positions = torch.arange(self.length, self.length + features.shape[1], device=device)[None]
        self.context.append(self.runs.context_kv(features, positions), room=self.budget + 1)

    @torch.inference_mode()
    def block_logits(self, root: int) -> torch.Tensor:
        """The logits of block positions 1..budget (budget, V or draft V)."""
        device = self.model.fc.weight.device
        ids = torch.full((1, self.budget + 1), self.model.config.mask_token_id, device=device)
        ids[0, 0] = root
        positions = torch.arange(self.length, self.length + self.budget + 1, device=device)[None]
        hidden = self.runs.block_hidden(ids, positions, self.context.layers, None, self.length)[0, 1:]
        return self.head(hidden).float()

    def propose(self, root: int, context: torch.Tensor, sampling: Sampling | None, generator) -> DraftTree:
        if self.length != context.numel() - 1:
            raise RuntimeError(f"DFlashDrafter has features for {self.length} positions but the context holds "
                               f"{context.numel() - 1} committed tokens (observe() must see every committed token)")
        refuse_sampled_trim(self.name, self.keep_above, sampling)
        logits = self.block_logits(root)
        if self.topk > 1:
            return self._tree(logits, context.device, sampling, generator)
        if sampling is None:
            probs = torch.softmax(logits, -1)
            best, tokens = probs.max(-1)
            keep = self._kept(best)
            chain = DraftTree.chain(self._to_target(tokens[:keep]).to(context.device))
            return confident_subtree(chain, best[:keep], self.keep_above)
        probs = sampling.probs(logits)
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
        rows = self._full_rows(probs)
        return DraftTree.chain(self._to_target(tokens).to(context.device), rows.to(context.device))

    def _tree(self, logits: torch.Tensor, device, sampling: Sampling | None, generator) -> DraftTree:
        """The round as a tree of topk candidates per block position (greedy: cut at stop_below's depth)."""
        probs = torch.softmax(logits, -1) if sampling is None else sampling.probs(logits)
        depth = self._kept(probs.max(-1).values) if sampling is None else self.budget
        nodes = depth * self.topk  # nodes are ordered by depth: the first `nodes` are the tree cut at `depth`
        tokens, rows = static_tree_tokens(lambda d: probs[d - 1], self.depths[:nodes], self.ranks[:nodes], sampling,
                                          generator)
        rows = None if rows is None else self._full_rows(rows).to(device)
        tree = DraftTree(self._to_target(tokens).to(device), self.parents[:nodes].to(device),
                         self.depths[:nodes].to(device), rows)
        return confident_subtree(tree, probs[self.depths[:nodes] - 1, tokens], self.keep_above)

    def _kept(self, best: torch.Tensor) -> int:
        """How many of the chain's tokens to propose (all, or until the path's probability falls below
        stop_below; at least one)."""
        if self.stop_below is None:
            return best.numel()
        below = (best.cumprod(0) < self.stop_below).nonzero()
        return max(1, int(below[0])) if below.numel() else best.numel()

    def _to_target(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens if self.vocab is None else self.vocab.to_target(tokens)

    def _full_rows(self, probs: torch.Tensor) -> torch.Tensor:
        """Draft distributions over the target's vocabulary (a draft vocabulary's rows scattered)."""
        return probs if self.vocab is None else self.vocab.scatter(probs)


def load_dflash_drafter(path: str | Path, target, budget: int | None = None, name: str = "dflash",
                        stop_below: float | None = None, vocab: DraftVocab | None = None,
                        backend: Backend = Backend.EAGER, settings: CompileSettings | None = None,
                        topk: int = 1, dtype: torch.dtype | None = None,
                        keep_above: float | None = None) -> DFlashDrafter:
    """A train/dflash.py final/ (or snapshot) directory as the decoder's drafter for `target` (a TargetModel), in
    `dtype` (default: the target's); on the compiled backend with the batch-invariant kernels (`settings`), its
    Linears and head run on those kernels."""
    model, _ = load_dflash(path, target, dtype=dtype or target.dtype)
    settings = settings or CompileSettings()
    fast = settings.runs_invariant_kernels(backend)
    return DFlashDrafter(model, budget=budget, name=name, stop_below=stop_below, vocab=vocab,
                         precision=settings.weights if fast else None, topk=topk, keep_above=keep_above)
