"""DFlash block drafter in the decoder: one drafter forward per round proposes a chain of up to block - 1 tokens.

State per request: each draft layer's keys and values of the committed positions, computed from the target
features `observe` hands over (the target's hidden states at the drafter's layers), held by the drafter's engine
(models.dflash.EagerDFlashEngine, or on the compiled backend models.compiled_dflash.CompiledDFlashEngine).
`propose(root, context)` runs the block [root, mask, ..., mask] at the positions after the committed ones; the
block attends to the whole context and to itself, and block position k proposes the token k steps after the root.
Greedy: the argmax at each position (a chain; `stop_below` cuts it where the product of the drafter's probabilities
so far falls below the threshold). Sampling: block position k's token is drawn from its own distribution q_k, which
does not depend on the tokens drawn before it, so q_k is exactly the distribution the verifier needs for that node.
With `topk` > 1 the round is a tree instead: at every block position the top-k candidates (sampling: k draws
without replacement) as children of the previous position's first candidate, budget x topk nodes (static_tree_tokens, as
Medusa's heads: a position's distribution does not depend on the parent). `keep_above` (greedy) verifies only the
nodes whose path probability under the drafter is above it, as the other drafters' dynamic size, and `round_costs`
(greedy) the count of the best nodes with the most expected tokens per measured round cost (base.costs_cut).
`nodes` (greedy) makes the tree every path of top-k candidates instead (each block position's k under each of the
previous position's k), cut to its `nodes` best by path probability, the product of the positions' probabilities
along it (EAGLE-2's re-ranking): a round whose first position is doubtful goes on under its second candidate too.
With a `prior` (greedy; eval/decode/drafters/prior.py) each node's children are instead its block position's top
candidates re-ranked given the node's own token and its parent's, the trained n-gram prior's and the request's
context's counts: the later positions read the token drafted before them after all. The chain follows the best
child; the spine tree takes topk children of the chain's nodes; with `nodes` the tree grows level by level,
keeping the `nodes` most probable paths.
The decoder verifies every proposal, so the output is the target's whatever the drafter says.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import torch

from draftsmith.eval.decode.drafters.base import (Drafter, InputError, Sampling, TreeCut, check_open_unit, check_sizes,
                                                 confident_subtree, static_tree_tokens)
from draftsmith.eval.decode.drafters.prior import CANDIDATES, CandidatePrior, refuse_sampled_prior, reranked
from draftsmith.eval.decode.tree import DraftTree, tree_from_paths

from draftsmith.models.artifacts import load_dflash
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import (WeightPrecision, frozen_linear, gather_weights, invariant_model, top_log_probs,
                                      invariant_rows)
from draftsmith.models.compiled_dflash import CompiledDFlashEngine
from draftsmith.models.dflash import DFlashModel, EagerDFlashEngine
from draftsmith.models.vocab import DraftVocab


class DFlashDrafter(Drafter):
    def __init__(self, model: DFlashModel, budget: int | None = None, name: str = "dflash",
                 stop_below: float | None = None, vocab: DraftVocab | None = None,
                 precision: WeightPrecision | None = None, topk: int = 1, keep_above: float | None = None,
                 compiled: CompileSettings | None = None, nodes: int | None = None,
                 prior: CandidatePrior | None = None, round_costs: Sequence[float] | None = None):
        most = model.config.block_size - 1
        budget = most if budget is None else budget
        check_sizes(name, budget=budget, topk=topk, nodes=nodes)
        if nodes is not None and topk == 1:
            raise InputError(f"{name}: nodes={nodes} cuts a tree of top-k candidates; give topk > 1 with it")
        check_open_unit(name, "stop_below", stop_below)
        self.cut = TreeCut.checked(name, keep_above, round_costs)  # dynamic size (greedy)
        if budget > most:
            raise InputError(f"{name}: budget={budget} is more than the block of {model.config.block_size} can "
                             f"propose ({most} tokens after the root)")
        model._need_target()
        self.model = model.eval()
        self.budget, self.name, self.stop_below, self.topk, self.nodes = budget, name, stop_below, topk, nodes
        self.prior = prior
        paths = spine_paths(budget, topk) if nodes is None else product_paths(budget, topk)
        self.parents, self.depths, self.ranks = tree_from_paths(paths)
        # the greedy tree's nodes as lists (its few nodes chosen without an op a node)
        self.parent_list, self.depth_list, self.rank_list = (self.parents.tolist(), self.depths.tolist(),
                                                             self.ranks.tolist())
        self.nodes_to_depth = [sum(depth <= most for depth in self.depth_list) for most in range(budget + 1)]
        self.hidden_layers = model.config.hidden_layers
        # an optional draft vocabulary: the drafter's argmax over that slice of the LM head only (cheaper)
        self.vocab = vocab
        head = model.lm_head.weight if vocab is None else model.lm_head.weight[vocab.draft_to_target.to(
            model.fc.weight.device)]
        head = head.to(model.fc.weight.dtype)  # the target's rows, in the drafter's arithmetic
        # precision given: the compiled engine's batch-invariant kernels (the stock mm is slow for a block's few rows)
        if precision is None:
            runs, head = model, frozen_linear(head.detach())
        else:
            runs = invariant_model(model, precision, gather=False).use_kernel_attention()
            head = invariant_rows(head.detach(), precision)
            gather_weights(runs, head)  # the block's layers, then its head: the order a round streams
        # compiled given: the round's two forwards as compiled graphs over a static cache (models.compiled_dflash)
        self.engine = (EagerDFlashEngine(runs, head, budget + 1) if compiled is None
                       else CompiledDFlashEngine(runs, head, budget + 1, compiled))

    @property
    def length(self) -> int:
        """Context positions the drafter has keys and values of."""
        return self.engine.length

    def begin(self, prompt_ids):
        self.engine.begin()
        if self.prior is not None:
            self.prior.begin()

    @torch.inference_mode()
    def observe(self, tokens, hidden):
        device = self.model.fc.weight.device
        features = torch.cat([hidden[layer].to(device) for layer in self.hidden_layers], -1)[None]  # (1, m, kH)
        self.engine.append(features)

    @torch.inference_mode()
    def block_logits(self, root: int) -> torch.Tensor:
        """The logits of block positions 1..budget (budget, V or draft V)."""
        device = self.model.fc.weight.device
        ids = torch.full((1, self.budget + 1), self.model.config.mask_token_id, device=device)
        ids[0, 0] = root
        return self.engine.logits(ids)[0].float()

    def propose(self, root: int, context: torch.Tensor, sampling: Sampling | None, generator) -> DraftTree:
        if self.length != context.numel() - 1:
            raise RuntimeError(f"DFlashDrafter has features for {self.length} positions but the context holds "
                               f"{context.numel() - 1} committed tokens (observe() must see every committed token)")
        self.cut.refuse_sampling(self.name, sampling)
        if sampling is not None and self.nodes is not None:
            raise InputError(f"{self.name}: nodes={self.nodes} cuts a greedy tree by the drafter's probabilities; a "
                            "sampled tree keeps every drawn node: drop nodes or decode greedily")
        refuse_sampled_prior(self.name, self.prior, sampling, "drop the prior")
        logits = self.block_logits(root)
        if self.prior is not None:
            return self._prior_tree(logits, context)
        if self.topk > 1:
            return self._tree(logits, context.device, sampling, generator)
        if sampling is None:
            probs = torch.softmax(logits, -1)
            best, tokens = probs.max(-1)
            keep = self._kept(best)
            chain = DraftTree.chain(self._to_target(tokens[:keep]).to(context.device))
            return confident_subtree(chain, best[:keep], self.cut)
        probs = sampling.probs(logits)
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
        rows = self._full_rows(probs)
        return DraftTree.chain(self._to_target(tokens).to(context.device), rows.to(context.device))

    def _tree(self, logits: torch.Tensor, device, sampling: Sampling | None, generator) -> DraftTree:
        """The round as a tree of topk candidates per block position (greedy: cut at stop_below's depth)."""
        if sampling is None:
            return self._greedy_tree(torch.softmax(logits, -1), device)
        probs = sampling.probs(logits)
        tokens, rows = static_tree_tokens(lambda d: probs[d - 1], self.depths, self.ranks, sampling, generator)
        return DraftTree(self._to_target(tokens).to(device), self.parents.to(device), self.depths.to(device),
                         self._full_rows(rows).to(device))

    def _greedy_tree(self, probs: torch.Tensor, device) -> DraftTree:
        """Greedy: node (depth d, ranks along its path) is block position d's candidate of its last rank, from one
        top-k over the block; its path probability is the product of its path's candidates' probabilities (the
        spine tree: the top-1 probabilities before it times its own). Cut at stop_below's depth, to the `nodes` most
        probable and by the cut. The block's few nodes are chosen in Python lists: three tensors, no op a node."""
        values, indices = probs.topk(self.topk, -1)  # (budget, topk), ranks in order (draw_children's greedy pick)
        kept = self._kept(values[:, 0])  # nodes are ordered by depth: the tree cut at that depth
        count = self.nodes_to_depth[kept]
        tokens = self._to_target(indices).tolist()
        if not self.cut.cuts and self.nodes is None:
            keep = range(count)
        else:
            logs = values.double().clamp_min(1e-300).log().tolist()
            scores = []  # each node's path log-probability: its parent's (listed before it) plus its own
            for depth, rank, parent in zip(self.depth_list[:count], self.rank_list, self.parent_list):
                scores.append((scores[parent] if parent >= 0 else 0.0) + logs[depth - 1][rank])
            keep = self.cut.nodes(scores, self.parent_list[:count], count if self.nodes is None else self.nodes,
                                  torch.float64)
        where = {node: index for index, node in enumerate(keep)}
        return DraftTree.from_lists([tokens[self.depth_list[node] - 1][self.rank_list[node]] for node in keep],
                                    [where.get(self.parent_list[node], -1) for node in keep],
                                    [self.depth_list[node] for node in keep], device=device)

    def _prior_tree(self, logits: torch.Tensor, context: torch.Tensor) -> DraftTree:
        """Greedy with the prior: grown level by level from each block position's top candidates, re-ranked under
        each node given its token and its parent's (the module docstring), in Python lists: a round's few nodes."""
        # log q of each position's candidates, and their share of q: the re-ranked probabilities keep it, so
        # keep_above reads as without a prior
        values, indices, shares = top_log_probs(logits, min(CANDIDATES, logits.shape[-1]))
        values, candidates, shares = values.double().tolist(), self._to_target(indices).tolist(), shares.tolist()
        self.prior.extend(context)
        history = self.prior.tokens[-2:]
        frontier = [(-1, history[0], history[-1], 0.0)]  # (node, its parent's token, its own, path log-probability)
        tokens, parents, depths, scores = [], [], [], []
        floor = -math.inf if self.stop_below is None else math.log(self.stop_below)
        for depth in range(1, self.budget + 1):
            children = []
            row, tokens_here = values[depth - 1], candidates[depth - 1]
            for index, (node, before, last, base) in enumerate(frontier):
                gains = self.prior.scores(depth, before, last, tokens_here)
                children += [(base + logp, index, token) for logp, token in reranked(row, tokens_here, gains,
                                                                                      shares[depth - 1], self.topk)]
            if self.nodes is not None:  # the `nodes` best paths never need a node outside its level's best
                children = sorted(children, key=lambda child: -child[0])[:self.nodes]
            grown = []
            for score, index, token in children:
                grown.append((len(tokens), frontier[index][2], token, score))
                tokens.append(token)
                parents.append(frontier[index][0])
                depths.append(depth)
                scores.append(score)
            frontier = grown if self.nodes is not None else grown[:1]  # the chain and the spine: the best child
            if frontier[0][3] < floor:
                break
        keep = self.cut.nodes(scores, parents, len(tokens) if self.nodes is None else self.nodes, torch.float64)
        where = {node: index for index, node in enumerate(keep)}
        return DraftTree.from_lists([tokens[node] for node in keep], [where.get(parents[node], -1) for node in keep],
                                    [depths[node] for node in keep], device=context.device)

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


def spine_paths(budget: int, topk: int) -> list[list[int]]:
    """The default tree: ranks 0..topk-1 at each block position under the previous position's rank 0."""
    return [[0] * (depth - 1) + [rank] for depth in range(1, budget + 1) for rank in range(topk)]


def product_paths(budget: int, topk: int) -> list[list[int]]:
    """Every path of ranks 0..topk-1 down to depth `budget` (topk + topk**2 + ... nodes)."""
    paths, level = [], [[]]
    for _ in range(budget):
        level = [path + [rank] for path in level for rank in range(topk)]
        paths.extend(level)
    return paths


def load_dflash_drafter(path: str | Path, target, budget: int | None = None, name: str = "dflash",
                        stop_below: float | None = None, vocab: DraftVocab | None = None,
                        backend: Backend = Backend.EAGER, settings: CompileSettings | None = None,
                        topk: int = 1, dtype: torch.dtype | None = None,
                        keep_above: float | None = None, nodes: int | None = None,
                        prior: CandidatePrior | None = None,
                        round_costs: Sequence[float] | None = None) -> DFlashDrafter:
    """A train/dflash.py final/ (or snapshot) directory as the decoder's drafter for `target` (a TargetModel), in
    `dtype` (default: the target's); on the compiled backend its context and block run as compiled graphs
    (models.compiled_dflash), their Linears and head on the batch-invariant kernels when `settings` use them."""
    model, _ = load_dflash(path, target, dtype=dtype or target.dtype)
    settings = settings or CompileSettings()
    fast = settings.runs_invariant_kernels(backend)
    return DFlashDrafter(model, budget=budget, name=name, stop_below=stop_below, vocab=vocab,
                         precision=settings.weights if fast else None, topk=topk, keep_above=keep_above, nodes=nodes,
                         compiled=settings if backend is Backend.COMPILED else None, prior=prior,
                         round_costs=round_costs)
