"""Minions: several small drafters, a weighted-majority token tree, adaptive speculation length.

Spec: Minions (`../shared/papers/004_cc3881eab17c5404.txt`), section 3.2 (majority-voted
speculator) and 3.3 (adaptive speculation length selector). The pipeline of section 3.4 is
`eval/pipeline.py` (it wraps any drafter, this one included).

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
from dataclasses import dataclass, fields

import torch

from draftsmith.eval.drafters.base import Drafter, Sampling
from draftsmith.eval.tree import DraftTree
from draftsmith.models.target import check_same_tokenizer


@dataclass
class MinionsConfig:
    speculation_length: int = 4  # s at the start (the paper's default baseline uses 4)
    min_length: int = 1
    max_length: int = 12  # the paper sweeps s in 2..12
    adaptive: bool = True
    decision_threshold: int = 8  # records since the last change of s before deciding again
    window: int = 24  # records used by the linear fit (spans the previous and the current s)
    s_reward: int = 1
    s_punish: int = 1
    cost: str = "verify"  # verify: t_verify / vl (the paper, pipelined); round: (t_draft + t_verify) / vl
    reward_threshold: float = 0.6
    punish_threshold: float = 0.3
    reward_factor: float = 1.25
    punish_factor: float = 0.8
    min_weight: float = 1e-3
    max_weight: float = 1e3
    update_interval: int = 1  # rounds between weight updates (the paper: one verified batch)
    feedback: str = "all"  # all | voted
    verify: str = "path"  # path (the paper) | tree

    def __post_init__(self):
        if self.feedback not in ("all", "voted"):
            raise ValueError(f"feedback must be 'all' or 'voted', got {self.feedback!r}")
        if self.verify not in ("path", "tree"):
            raise ValueError(f"verify must be 'path' or 'tree', got {self.verify!r}")
        if self.cost not in ("verify", "round"):
            raise ValueError(f"cost must be 'verify' or 'round', got {self.cost!r}")
        if not 1 <= self.min_length <= self.speculation_length <= self.max_length:
            raise ValueError("need 1 <= min_length <= speculation_length <= max_length")


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
        self.length = config.speculation_length
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
        self.length = min(max(new, config.min_length), config.max_length)
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

class MinionsDrafter(Drafter):
    """Weighted-majority merge of several drafters' proposals (see the module docstring)."""

    def __init__(self, drafters: list[Drafter], config: MinionsConfig | None = None,
                 weights: list[float] | None = None, name: str = "minions"):
        if not drafters:
            raise ValueError("Minions needs at least one drafter")
        self.drafters = drafters
        # Feature drafters (Medusa heads, ...) get the target hidden states they ask for.
        self.hidden_layers = tuple(sorted({layer for d in drafters for layer in d.hidden_layers}))
        self.config = config or MinionsConfig()
        self.name = name
        self.weights = list(weights) if weights is not None else [1.0] * len(drafters)
        if len(self.weights) != len(drafters):
            raise ValueError("one initial weight per drafter")
        tokenizers = [d.tokenizer for d in drafters if d.tokenizer is not None]
        for other in tokenizers[1:]:
            check_same_tokenizer(tokenizers[0], other, what="Minions sub-drafter")
        self.tokenizer = tokenizers[0] if tokenizers else None
        self.selector = LengthSelector(self.config)
        self.rates: list[list[float]] = [[] for _ in drafters]
        self.rounds = 0
        self.voted_counts = [0] * len(drafters)
        self._pending = None  # last round: proposals, voted, accepted tokens, timings

    @property
    def speculation_length(self) -> int:
        return self.selector.length

    def begin(self, prompt_ids):
        for drafter in self.drafters:
            drafter.begin(prompt_ids)
        self._pending = None

    def observe(self, tokens, hidden):
        for drafter in self.drafters:
            drafter.observe(tokens, {layer: hidden[layer] for layer in drafter.hidden_layers})
        if self._pending is not None and self._pending.get("verify_end") is None:
            self._pending["verify_end"] = time.perf_counter()
            self._pending["accepted"] = tokens[1:].tolist()  # the root comes first

    def _feedback(self, bonus: int) -> None:
        """Score the previous round now that its bonus token (this round's root) is known."""
        pending, config = self._pending, self.config
        committed = pending["accepted"] + [bonus]
        credited = range(len(self.drafters)) if config.feedback == "all" else pending["voted"]
        for i in credited:
            if pending["proposals"][i]:
                self.rates[i].append(acceptance_rate(pending["proposals"][i], committed))
        self.rounds += 1
        if self.rounds % config.update_interval == 0:
            self.weights = update_weights(self.weights, self.rates, config)
            self.rates = [[] for _ in self.drafters]
        verify_s = pending["verify_end"] - pending["propose_end"]
        cost = verify_s if config.cost == "verify" else verify_s + pending["draft_s"]
        self.selector.record(cost, len(committed))

    @torch.inference_mode()
    def propose(self, root: int, context: torch.Tensor, sampling: Sampling | None, generator) -> DraftTree:
        start = time.perf_counter()
        if self._pending is not None and self._pending.get("verify_end") is not None:
            self._feedback(root)
        length = self.selector.length
        proposals = []
        for drafter in self.drafters:
            if hasattr(drafter, "num_tokens"):
                drafter.num_tokens = length
            tree = drafter.propose(root, context, None, None)  # greedy proposals: deterministic nodes
            proposals.append(first_child_path(tree)[:length])
        merged = merge_proposals(proposals, self.weights)
        path = majority_path(merged)
        voted = voted_drafters(merged, path)
        for i in voted:
            self.voted_counts[i] += 1
        device = context.device
        if self.config.verify == "path" or not merged.tokens:
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


# ---------------------------------------------------------------------------------------------
# Building sub-drafters from names (shared with eval.drafters.llmcad)
# ---------------------------------------------------------------------------------------------

_MODEL_CACHE: dict[tuple, tuple] = {}


def small_model(name: str, target, draft):
    """(model, tokenizer) for a drafter name: `draft` (the bench's --draft model), `everyN` (a
    copy of the target keeping every N-th decoder layer, models.student), or a zoo name / model
    dir (loaded in the target's dtype and device, e.g. outputs/distill_x/final)."""
    from draftsmith.models.student import every_nth_layer, layer_subset_student
    from draftsmith.models.target import TargetModel

    if name == "draft":
        if draft is None:
            raise ValueError("drafter 'draft' needs the bench's --draft model")
        return draft.model, draft.tokenizer
    key = (id(target.model), name)
    if key not in _MODEL_CACHE:
        if name.startswith("every") and name[len("every"):].isdigit():
            layers = every_nth_layer(target.num_layers, int(name[len("every"):]))
            _MODEL_CACHE[key] = (layer_subset_student(target.model, layers), target.tokenizer)
        else:
            loaded = TargetModel.from_pretrained(name, dtype=target.dtype, device=target.device)
            _MODEL_CACHE[key] = (loaded.model, loaded.tokenizer)
    return _MODEL_CACHE[key]


def sub_drafter(name: str, target, draft, ngram_n: int = 3) -> Drafter:
    """A drafter for one entry of `models=`: `ngram`, `medusa@<dir>` (trained Medusa heads; their
    first-child path is the proposal) or a small model (see small_model) drafting a chain."""
    from draftsmith.eval.drafters.lm import LMDrafter
    from draftsmith.eval.drafters.ngram import NgramDrafter

    if name == "ngram":
        return NgramDrafter(max_ngram=ngram_n, num_tokens=4, name="ngram")
    if name.startswith("medusa@"):
        from draftsmith.eval.drafters.medusa import load_medusa_drafter

        return load_medusa_drafter(name[len("medusa@"):], target, name=name)
    model, tokenizer = small_model(name, target, draft)
    return LMDrafter(model, tokenizer, mode="chain", num_tokens=4, name=name)


def _cast(field_type, value: str):
    if field_type in (bool, "bool"):
        if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"expected a boolean, got {value!r}")
        return value.lower() in ("1", "true", "yes")
    if field_type in (int, "int"):
        return int(value)
    if field_type in (float, "float"):
        return float(value)
    return value


def config_from_options(cls, options: dict, aliases: dict[str, str] | None = None):
    """Pop the dataclass's fields (or their aliases) from bench options; cast by field type."""
    aliases = aliases or {}
    kwargs = {}
    for spec_key, field_name in list(aliases.items()) + [(f.name, f.name) for f in fields(cls)]:
        if spec_key in options:
            field_type = next(f.type for f in fields(cls) if f.name == field_name)
            kwargs[field_name] = _cast(field_type, options.pop(spec_key))
    return cls(**kwargs)


MINIONS_ALIASES = {"s": "speculation_length", "k": "speculation_length", "min_s": "min_length",
                   "max_s": "max_length", "decision": "decision_threshold"}


def build_from_spec(options: dict, target, draft, name: str):
    """Bench method `minions:models=A+B+C[,key=value...]`.

    models (alias drafters): '+'-separated sub-drafters, each `draft` (the --draft model),
    `everyN` (layer-subset student of the target), `ngram` (prompt lookup), `medusa@<dir>`
    (trained Medusa heads), or a zoo name / model dir (e.g. qwen2.5-coder-0.5b-instruct,
    outputs/distill_x/final). Default
    `every2+every3+ngram`. weights: optional '+'-separated initial weights. ngram_n: n-gram
    length for `ngram` (3). Every MinionsConfig field is an option (aliases: s/k =
    speculation_length, min_s, max_s, decision = decision_threshold), e.g.
    `minions:models=draft+every4+ngram,s=4,verify=tree,adaptive=0,cost=round`.
    """
    names = (options.pop("models", None) or options.pop("drafters", None) or "every2+every3+ngram").split("+")
    weights = options.pop("weights", None)
    ngram_n = int(options.pop("ngram_n", 3))
    config = config_from_options(MinionsConfig, options, MINIONS_ALIASES)
    drafters = [sub_drafter(n.strip(), target, draft, ngram_n) for n in names]
    return MinionsDrafter(drafters, config, weights=[float(w) for w in weights.split("+")] if weights else None,
                          name=name)
