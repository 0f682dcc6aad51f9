"""Minions: several small drafters, a weighted-majority token tree, adaptive speculation length.

Spec: Minions (`../shared/papers/004_cc3881eab17c5404.txt`), section 3.2 (majority-voted
speculator) and 3.3 (adaptive speculation length selector). The pipeline of section 3.4 is
`eval/policies/pipeline.py` (it wraps any drafter, this one included).

Per round (batch size 1 here; the paper's "batch of outputs" is one round):
  1. every sub-drafter (any `Drafter`: LM chains over small models, layer-subset students,
     n-gram lookup) proposes a continuation of length s (its first-child path when it returns a
     tree);
  2. the proposals are merged into a trie; node weight w_u = sum of the weights w_i of the
     drafters whose sequence passes through u (section 3.2, "Tree-based Weighted Majority
     Decision");
  3. the majority-approved output is found by descending from the root to the heaviest child,
     v_{i+1} = argmax_{u in c(v_i)} w_u, until a leaf; the drafters whose sequence ends at that
     leaf are the round's `voted` drafters;
  4. `verify=path` (the paper: no extra verification cost) sends only that path to the target;
     `verify=tree` sends the whole merged trie (children ordered by weight), a variant;
  5. after verification each drafter's acceptance rate = matched prefix of its proposal against
     the committed tokens (accepted + the target's bonus token) / its proposal length. Equation 1:
     ACR_i = mean acceptance rate of the outputs credited to drafter i (`feedback=voted`: only the
     rounds where i was voted, as in the paper; `feedback=all` (default): every round, since the
     committed tokens tell us every drafter's hindsight accuracy, the classic weighted-majority
     update). Every `update_interval` rounds, ACR_i > reward_threshold multiplies w_i by
     reward_factor, ACR_i < punish_threshold multiplies it by punish_factor (the paper gives no
     values; ours are defaults below);
  6. adaptive speculation length (section 3.3, equation 4: s* = argmin_s t_LLM(s) / vl(s)): an
     online monitor records y = t_verify / vl per round (t_verify = wall time between the end of
     `propose` and the next `observe`, i.e. the target forward + verification + KV commit;
     vl = tokens the round produced, accepted + bonus, so that N / vl is the number of rounds as
     in equations 2-3). Once `decision_threshold` records exist since the last change of s, a
     least-squares line y ~ a + b * s is fitted over the recent window (which spans the previous
     and the current s); b > 0 means longer speculation costs more per token -> s -= s_punish,
     b < 0 -> s += s_reward. (The paper fits over time, the transition s1 -> s2; regressing on s
     is the same test for batch size 1 and keeps its sign right after a decrease.) The first
     decision, with a single s in the window, explores upward. `cost=round` uses
     (t_draft + t_verify) / vl instead, for a sequential (non-pipelined) loop where drafting time
     is not hidden.

Weights and s persist across requests (the paper adapts them online over the serving run).
Losslessness: sub-drafters are always asked for their greedy proposals, so every node is a
deterministic function of the history; the tree carries no q rows (point masses) and
`verify_sampling` stays exact at temperature > 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from draftsmith.config import ConfigError, TextEnum, check_config, option
from draftsmith.eval.decode.drafters.base import CHAIN_BUDGET, CompositeDrafter, Drafter, Sampling
from draftsmith.eval.decode.tree import DraftTree


class VoteCost(TextEnum):
    VERIFY = "verify"  # t_verify / vl (the paper, pipelined)
    ROUND = "round"  # (t_draft + t_verify) / vl


class Feedback(TextEnum):
    ALL = "all"  # every drafter credited each round
    VOTED = "voted"  # only the drafters that voted for the verified path


class VoteVerify(TextEnum):
    PATH = "path"  # the majority path (the paper)
    TREE = "tree"  # the merged tree


@dataclass
class MinionsConfig:
    budget: int = option(CHAIN_BUDGET, "speculation length s at the start (the paper's baseline uses 4)", ge=1)
    min_budget: int = option(1, "smallest s the selector may pick", ge=1)
    max_budget: int = option(12, "largest s the selector may pick (the paper sweeps 2..12)", ge=1)
    adaptive: bool = option(True, "adapt s online (section 3.3)")
    decision_threshold: int = option(8, "records since the last change of s before deciding again", ge=1)
    window: int = option(24, "records used by the linear fit (spans the previous and the current s)", ge=2)
    s_reward: int = option(1, "s += s_reward when longer speculation is cheaper per token", ge=0)
    s_punish: int = option(1, "s -= s_punish when it is dearer", ge=0)
    cost: VoteCost = option(VoteCost.VERIFY, "verify: t_verify / vl (the paper, pipelined); "
                                             "round: (t_draft + t_verify) / vl")
    reward_threshold: float = option(0.6, "ACR above it multiplies a drafter's weight by reward_factor", ge=0, le=1)
    punish_threshold: float = option(0.3, "ACR below it multiplies a drafter's weight by punish_factor", ge=0, le=1)
    reward_factor: float = option(1.25, "weight reward", gt=0)
    punish_factor: float = option(0.8, "weight punishment", gt=0)
    min_weight: float = option(1e-3, "weights are clamped to [min_weight, max_weight]", gt=0)
    max_weight: float = option(1e3, "weights are clamped to [min_weight, max_weight]", gt=0)
    update_interval: int = option(1, "rounds between weight updates (the paper: one verified batch)", ge=1)
    feedback: Feedback = option(Feedback.ALL, "credit every drafter each round, or only the voted ones")
    verify: VoteVerify = option(VoteVerify.PATH, "verify the majority path (the paper) or the merged tree")

    def __post_init__(self):
        check_config(self)
        if not self.min_budget <= self.budget <= self.max_budget:
            raise ConfigError("minions: need min_budget <= budget <= max_budget")


# ---------------------------------------------------------------------------------------------
# Pure functions: merge, vote, acceptance, weight update, length selection
# ---------------------------------------------------------------------------------------------

@dataclass
class MergedTree:
    tokens: list[int]  # per node, topological order (by depth, then weight, then first seen)
    parents: list[int]  # -1 = root
    weights: list[float]  # w_u = sum of the weights of the drafters passing through u
    members: list[list[int]]  # drafter indices whose proposal passes through u
    ends: list[int]  # per drafter: its last node (-1 for an empty proposal)


def merge_proposals(paths: list[list[int]], weights: list[float]) -> MergedTree:
    """Trie of the drafters' sequences with Minions node weights (section 3.2)."""
    if len(paths) != len(weights):
        raise ValueError("one weight per proposal")
    key_to_node: dict[tuple[int, int], int] = {}  # (parent, token) -> provisional node id
    tokens, parents, node_weights, members, depth = [], [], [], [], []
    ends = []
    for index, (path, weight) in enumerate(zip(paths, weights)):
        parent = -1
        for token in path:
            key = (parent, int(token))
            if key not in key_to_node:
                key_to_node[key] = len(tokens)
                tokens.append(int(token))
                parents.append(parent)
                node_weights.append(0.0)
                members.append([])
                depth.append(1 if parent < 0 else depth[parent] + 1)
            node = key_to_node[key]
            node_weights[node] += weight
            members[node].append(index)
            parent = node
        ends.append(parent)
    order = sorted(range(len(tokens)), key=lambda n: (depth[n], -node_weights[n], n))
    new_id = {old: new for new, old in enumerate(order)}
    return MergedTree(tokens=[tokens[o] for o in order],
                      parents=[new_id[parents[o]] if parents[o] >= 0 else -1 for o in order],
                      weights=[node_weights[o] for o in order], members=[members[o] for o in order],
                      ends=[new_id[e] if e >= 0 else -1 for e in ends])


def majority_path(merged: MergedTree) -> list[int]:
    """v_{i+1} = argmax_{u in c(v_i)} w_u from the root to a leaf (ties: the earlier node)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(merged.parents):
        children.setdefault(parent, []).append(node)
    path, node = [], -1
    while children.get(node):
        node = max(children[node], key=lambda c: (merged.weights[c], -c))
        path.append(node)
    return path


def voted_drafters(merged: MergedTree, path: list[int]) -> list[int]:
    """The drafters whose sequence is the majority-approved output (ends at its leaf)."""
    if not path:
        return []
    return [i for i, end in enumerate(merged.ends) if end == path[-1]]


def acceptance_rate(proposal: list[int], committed: list[int]) -> float:
    """Correctly verified length / speculation length (matched prefix of committed tokens)."""
    if not proposal:
        return 0.0
    matched = 0
    for draft_token, true_token in zip(proposal, committed):
        if draft_token != true_token:
            break
        matched += 1
    return matched / len(proposal)


def update_weights(weights: list[float], rates: list[list[float]], config: MinionsConfig) -> list[float]:
    """Reward/punish thresholds on ACR_i (equation 1 = the mean of drafter i's recorded rates)."""
    new = []
    for weight, history in zip(weights, rates):
        if history:
            acr = sum(history) / len(history)  # equation 1
            if acr > config.reward_threshold:
                weight *= config.reward_factor
            elif acr < config.punish_threshold:
                weight *= config.punish_factor
        new.append(min(max(weight, config.min_weight), config.max_weight))
    return new


def fit_slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys on xs; None when xs has a single value."""
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    if var == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var


class LengthSelector:
    """Adaptive speculation length selector (Minions section 3.3, equation 4)."""

    def __init__(self, config: MinionsConfig):
        self.config = config
        self.length = config.budget
        self.records: list[tuple[int, float]] = []  # (s, y = cost / vl), most recent last
        self.since_change = 0
        self.decisions: list[tuple[int, float | None, int]] = []  # (old s, slope, new s)

    def record(self, cost_s: float, verified_length: int) -> int:
        """Add one round's measurement; return the (possibly updated) speculation length."""
        config = self.config
        self.records.append((self.length, cost_s / max(verified_length, 1)))
        self.records = self.records[-config.window:]
        self.since_change += 1
        if not config.adaptive or self.since_change < config.decision_threshold:
            return self.length
        xs = [float(s) for s, _ in self.records]
        ys = [y for _, y in self.records]
        slope = fit_slope(xs, ys)
        old = self.length
        if slope is None or slope < 0:  # no comparison yet, or longer is cheaper per token: grow
            new = old + config.s_reward
        elif slope > 0:
            new = old - config.s_punish
        else:
            new = old
        self.length = min(max(new, config.min_budget), config.max_budget)
        self.decisions.append((old, slope, self.length))
        self.since_change = 0
        return self.length


def first_child_path(tree: DraftTree) -> list[int]:
    """Tokens along the first child at each level (drafters list children best first)."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    path, node = [], -1
    while True:
        child = next((i for i, p in enumerate(parents) if p == node), None)
        if child is None:
            return path
        path.append(tokens[child])
        node = child


# ---------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------

class MinionsDrafter(CompositeDrafter):
    """Weighted-majority merge of several drafters' proposals (see the module docstring)."""

    def __init__(self, drafters: list[Drafter], config: MinionsConfig | None = None,
                 weights: list[float] | None = None, name: str = "minions"):
        super().__init__(drafters, what="Minions")
        self.config = config or MinionsConfig()
        self.name = name
        self.weights = list(weights) if weights is not None else [1.0] * len(drafters)
        if len(self.weights) != len(drafters):
            raise ValueError("one initial weight per drafter")
        self.selector = LengthSelector(self.config)
        self.rates: list[list[float]] = [[] for _ in drafters]
        self.rounds = 0
        self.voted_counts = [0] * len(drafters)
        self._pending = None  # last round: proposals, voted, accepted tokens, timings

    @property
    def speculation_length(self) -> int:
        """s, the current speculation length (what the sub-drafters are asked for)."""
        return self.selector.length

    def begin(self, prompt_ids):
        super().begin(prompt_ids)
        self._pending = None

    def observe(self, tokens, hidden):
        super().observe(tokens, hidden)
        if self._pending is not None and self._pending.get("verify_end") is None:
            self._pending["verify_end"] = time.perf_counter()
            self._pending["accepted"] = tokens[1:].tolist()  # the root comes first

    def _feedback(self, bonus: int) -> None:
        """Score the previous round now that its bonus token (this round's root) is known."""
        pending, config = self._pending, self.config
        committed = pending["accepted"] + [bonus]
        credited = range(len(self.drafters)) if config.feedback is Feedback.ALL else pending["voted"]
        for i in credited:
            if pending["proposals"][i]:
                self.rates[i].append(acceptance_rate(pending["proposals"][i], committed))
        self.rounds += 1
        if self.rounds % config.update_interval == 0:
            self.weights = update_weights(self.weights, self.rates, config)
            self.rates = [[] for _ in self.drafters]
        verify_s = pending["verify_end"] - pending["propose_end"]
        cost = verify_s if config.cost is VoteCost.VERIFY else verify_s + pending["draft_s"]
        self.selector.record(cost, len(committed))

    @torch.inference_mode()
    def propose(self, root: int, context: torch.Tensor, sampling: Sampling | None, generator) -> DraftTree:
        start = time.perf_counter()
        if self._pending is not None and self._pending.get("verify_end") is not None:
            self._feedback(root)
        length = self.selector.length
        proposals = []
        for drafter in self.drafters:
            drafter.budget = length
            tree = drafter.propose(root, context, None, None)  # greedy proposals: deterministic nodes
            proposals.append(first_child_path(tree)[:length])
        merged = merge_proposals(proposals, self.weights)
        path = majority_path(merged)
        voted = voted_drafters(merged, path)
        for i in voted:
            self.voted_counts[i] += 1
        device = context.device
        if self.config.verify is VoteVerify.PATH or not merged.tokens:
            tree = DraftTree.chain(torch.tensor([merged.tokens[n] for n in path], dtype=torch.long, device=device))
        else:
            tree = DraftTree.from_parents(torch.tensor(merged.tokens, device=device),
                                          torch.tensor(merged.parents, device=device))
        end = time.perf_counter()
        self._pending = {"proposals": proposals, "voted": voted, "propose_end": end, "draft_s": end - start,
                         "verify_end": None}
        return tree

    def summary(self) -> dict:
        return {"weights": dict(zip([d.name for d in self.drafters], self.weights)),
                "voted": dict(zip([d.name for d in self.drafters], self.voted_counts)),
                "speculation_length": self.selector.length, "decisions": self.selector.decisions[-10:]}
