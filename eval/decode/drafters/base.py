"""The one interface every drafter implements, and the sampling settings it is told about."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from draftsmith.errors import UserError
from draftsmith.eval.decode.tree import DraftTree, ancestor_matrix, subtree, top_nodes
from draftsmith.eval.decode.verify import logits_to_probs
from draftsmith.models.target import check_same_tokenizer
from draftsmith.models.trees import CHAIN_BUDGET, TREE_BUDGET  # noqa: F401  (re-exported: drafters import them here)


@dataclass(frozen=True)
class Sampling:
    """Sampling settings shared by target and drafter (temperature > 0)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return logits_to_probs(logits, self.temperature, self.top_k, self.top_p)




class InputError(UserError):
    """A value the decode API cannot take (a ValueError: API callers catch it as such)."""


def check_sizes(what: str, **sizes: int | None) -> None:
    """Tree sizes a drafter is built with (budget, depth, topk, ...): whole numbers >= 1 (None: not given)."""
    for name, value in sizes.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise InputError(f"{what}: {name} must be a whole number >= 1, got {value!r}")


def check_open_unit(what: str, name: str, value: float | None) -> None:
    """A probability threshold a drafter is built with (stop_below): strictly between 0 and 1 (None: not given)."""
    if value is not None and not 0 < value < 1:
        raise InputError(f"{what}: {name}={value} must be between 0 and 1 (exclusive)")


def costs_cut(best_scores: Sequence[float], round_costs: Sequence[float]) -> int:
    """How many of a greedy tree's best nodes (`best_scores`: their path log-probabilities, best first) give the most
    expected tokens per cost: a round of n nodes commits 1 + the sum of their path probabilities on average (each
    node is accepted when its whole path is, the drafter's probability of that), and costs round_costs[n - 1] (the
    draft and the verify of n + 1 tokens, measured on the machine: a verify's cost grows in steps with its width).
    At least one node; none beyond the costs given."""
    best, best_rate, expected = 1, -math.inf, 1.0
    for count, (score, cost) in enumerate(zip(best_scores, round_costs), start=1):
        expected += math.exp(score)
        if expected / cost > best_rate:
            best, best_rate = count, expected / cost
    return best


def check_round_costs(name: str, round_costs: Sequence[float] | None) -> tuple[float, ...] | None:
    """round_costs a drafter is built with: positive numbers, one per node count from 1 (None: not given)."""
    if round_costs is None:
        return None
    costs = tuple(round_costs)
    if not costs or any(isinstance(c, bool) or not isinstance(c, (int, float)) or not c > 0 for c in costs):
        raise InputError(f"{name}: round_costs must be positive numbers (the cost of a round of 1, 2, ... draft "
                         f"nodes), got {round_costs!r:.80}")
    return tuple(float(c) for c in costs)


@dataclass(frozen=True)
class TreeCut:
    """How a greedy round cuts its tree below the drafter's budget (each None: not that cut). `keep_above`: only the
    nodes whose path probability under the drafter is above it (the most probable always kept); `round_costs`: then
    the count of best nodes that costs_cut picks (the measured cost of a round of 1, 2, ... nodes)."""

    keep_above: float | None = None
    round_costs: tuple[float, ...] | None = None

    @classmethod
    def checked(cls, name: str, keep_above: float | None = None,
                round_costs: Sequence[float] | None = None) -> TreeCut:
        """The cut a drafter named `name` is built with, each value checked (one line where it cannot be taken)."""
        check_open_unit(name, "keep_above", keep_above)
        return cls(keep_above, check_round_costs(name, round_costs))

    @property
    def cuts(self) -> bool:
        return self.keep_above is not None or self.round_costs is not None

    def refuse_sampling(self, name: str, sampling: Sampling | None) -> None:
        """Both cuts trim greedy trees only: speculative sampling needs every drawn node."""
        if sampling is None:
            return
        for option, value in (("keep_above", self.keep_above), ("round_costs", self.round_costs)):
            if value is not None:
                raise UserError(f"{name}: {option} trims a greedy tree; a sampled tree keeps every drawn node "
                                f"(speculative sampling needs them): drop {option} or decode greedily")

    def nodes(self, path_scores: list[float], parents: list[int], budget: int, dtype: torch.dtype) -> list[int]:
        """The nodes of a greedy tree cut to its `budget` best by path log-probability (EAGLE-2's re-ranking), then
        by this cut (the scores are values of `dtype`: keep_above is compared in it). A path's probability falls
        along it, so the kept nodes stay closed under ancestors: a confident round verifies its whole budget, a
        doubtful one its best guesses only."""
        if self.keep_above is not None:
            threshold = torch.tensor(math.log(self.keep_above), dtype=dtype).item()
            budget = min(budget, max(1, sum(score > threshold for score in path_scores)))
        if self.round_costs is not None:
            budget = min(budget, costs_cut(sorted(path_scores, reverse=True)[:budget], self.round_costs))
        return top_nodes(path_scores, parents, budget)


def keep_confident(tree: DraftTree, path_scores: torch.Tensor, cut: TreeCut, budget: int) -> DraftTree:
    """A greedy tree cut by `cut` below `budget` (`path_scores` (n,): each node's path log-probability)."""
    keep = cut.nodes(path_scores.tolist(), tree.parents.tolist(), budget, path_scores.dtype)
    return subtree(tree, torch.tensor(keep, dtype=torch.long, device=tree.tokens.device))


def confident_subtree(tree: DraftTree, node_probs: torch.Tensor, cut: TreeCut) -> DraftTree:
    """keep_confident for a static tree given the drafter's probability of each node's token (`node_probs`; a path's
    probability is their product along it). No cut: the tree as it is."""
    if not cut.cuts or tree.size == 0:
        return tree
    reach = ancestor_matrix(tree.parents)[1:, 1:].to(torch.float64)  # [a, b]: b is a or an ancestor of a
    scores = reach @ node_probs.to(reach.device, torch.float64).clamp_min(1e-300).log()
    return keep_confident(tree, scores, cut, tree.size)


def check_types(where: str, expected: list[tuple[str, object, type | tuple[type, ...], str]]) -> None:
    """Arguments of a public function are the toolkit's types: (name, value, allowed types, what to pass); a
    name or a dict in their place is one line, not an AttributeError from deep inside."""
    for name, value, kind, example in expected:
        if not isinstance(value, kind):
            raise InputError(f"{where}{name}: expected {example}, got {type(value).__name__} {value!r:.60}")


class Drafter:
    """Proposes a token tree after the root; learns what the target committed.

    `budget` is the most draft nodes a proposal holds (a chain's length, a tree's node count): one
    name on every drafter; policies (Minions' adaptive length, ARCA) change it between rounds.

    The decoder calls, per request:
      begin(prompt_ids)                      - reset per-request state
      observe(tokens, hidden)                - tokens now committed in the target's cache, with the
                                               target's hidden states at those positions for the
                                               layers in `hidden_layers` (dict layer -> (m, H))
      propose(root, context, sampling, gen)  - tree of continuations of `context` (all committed
                                               tokens followed by the root, which the target has
                                               not processed yet). `sampling` None = greedy: propose
                                               likely tokens; otherwise draw children from q
                                               without replacement and return the q rows.
    """

    name = "drafter"
    budget: int = TREE_BUDGET
    hidden_layers: tuple[int, ...] = ()
    tokenizer = None  # set by drafters that carry their own tokenizer (checked against the target's)

    def begin(self, prompt_ids: torch.Tensor) -> None:
        pass

    def forget(self) -> None:
        """Drop what the drafter keeps from earlier requests for the next one's prompt (a draft LM's KV cache: the
        decoders call it before `begin` where DecodeConfig.prefix_cache is off)."""

    def observe(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        pass

    def propose(self, root: int, context: torch.Tensor, sampling: Sampling | None,
                generator: torch.Generator | None) -> DraftTree:
        raise NotImplementedError

    def summary(self) -> dict | None:
        """Internal state worth reporting (adaptive weights, thresholds); None for stateless drafters."""
        return None


class CompositeDrafter(Drafter):
    """A drafter built from sub-drafters (Minions, union, cascade): it reads the target layers any of them
    reads, carries their common tokenizer, and passes begin / observe on to every one of them."""

    def __init__(self, drafters: list[Drafter], what: str):
        if not drafters:
            raise ValueError(f"{what} needs at least one drafter")
        self.drafters = drafters
        self.hidden_layers = tuple(sorted({layer for d in drafters for layer in d.hidden_layers}))
        tokenizers = [d.tokenizer for d in drafters if d.tokenizer is not None]
        for other in tokenizers[1:]:
            check_same_tokenizer(tokenizers[0], other, what=f"{what} sub-drafter")
        self.tokenizer = tokenizers[0] if tokenizers else None

    def begin(self, prompt_ids):
        for drafter in self.drafters:
            drafter.begin(prompt_ids)

    def forget(self) -> None:
        for drafter in self.drafters:
            drafter.forget()

    def observe(self, tokens, hidden):
        for drafter in self.drafters:
            drafter.observe(tokens, {layer: hidden[layer] for layer in drafter.hidden_layers})


class NoDrafter(Drafter):
    """Proposes nothing: the decoder then runs plain one-token-per-forward decoding."""

    name = "none"

    def propose(self, root, context, sampling, generator):
        return DraftTree.empty(context.device)


def draw_children(probs: torch.Tensor, count: int, sampling: Sampling | None,
                  generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pick `count` distinct children of one node from its draft distribution.

    probs (V,): the draft distribution (greedy: any monotone score is fine). Greedy: the top-count
    tokens, no q rows. Sampling: `count` draws without replacement (Gumbel-top-k = sequential
    draws), and q rows (count, V) where row i = probs with the earlier draws removed,
    renormalised: the distribution draw i actually came from.
    """
    count = min(count, int((probs > 0).sum()) if sampling is not None else probs.numel())
    if sampling is None:
        return torch.topk(probs, count).indices, None
    gumbel = -torch.log(-torch.log(torch.rand(probs.shape, generator=generator, device=probs.device)
                                   .clamp_(min=1e-20, max=1 - 1e-7)))
    tokens = torch.topk(torch.log(probs) + gumbel, count).indices
    rows = probs.expand(count, -1).clone()  # (count, V)
    for i in range(1, count):
        rows[i:, tokens[i - 1]] = 0.0
    rows = rows / rows.sum(-1, keepdim=True)
    return tokens, rows


def static_tree_tokens(probs_at_depth, depths: torch.Tensor, ranks: torch.Tensor, sampling: Sampling | None,
                       generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens (and, sampling, q rows) of a static tree whose node at depth d and rank r takes the r-th candidate drawn
    from `probs_at_depth(d)`: drafters whose distribution at a depth does not depend on the parent (Medusa heads, a
    DFlash block's positions). The candidates of a depth are drawn once; a node's children are a prefix of them, so
    each node's q rows are exact (draw_children)."""
    candidates = {}
    for depth in sorted(set(depths.tolist())):
        count = int(ranks[depths == depth].max()) + 1
        candidates[depth] = draw_children(probs_at_depth(depth), count, sampling, generator)
    tokens = torch.empty(depths.numel(), dtype=torch.long)
    rows = []
    for node, (depth, rank) in enumerate(zip(depths.tolist(), ranks.tolist())):
        chosen, q = candidates[depth]
        tokens[node] = chosen[rank]
        if q is not None:
            rows.append(q[rank])
    return tokens, (torch.stack(rows) if rows else None)
