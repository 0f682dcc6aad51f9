"""DGF / EAGLE feature drafter in the decoder: EAGLE-2 dynamic draft trees (Dovetail: depth 7, top-k 10, g 16).

State per request: the target features of committed tokens (from `observe`) and the drafter's own
KV cache over "pairs" i = (f_i, x_{i+1}) of committed positions. `propose(root, context)` feeds the
pairs it has not seen (context = committed tokens + the root, so the last pair is (f_last, root)),
whose output is the predicted feature at the root's position, then drafts a tree:

greedy (EAGLE-2):  level 1 = the top-k tokens after the root; then `depth - 1` times: the top-k
    nodes of the newest level by cumulative log-probability (the product of draft probabilities
    along the path) are expanded in one drafter forward (tree mask over the cache + their
    ancestors), each gets top-k children. Finally all nodes are re-ranked by cumulative
    log-probability and the best g (ancestor-closed) are sent to verification. With `stop_below`, the
    tree stops growing once the newest level's best cumulative probability falls below it (a dynamic
    depth: a chain, topk=1, drafts as many tokens as the drafter is sure of, up to `depth`). `keep_above` and
    `round_costs` then verify fewer of the g: those above a path probability, or the count with the most expected
    tokens per measured round cost (drafters/base.py's costs_cut).
sampling: the same expansion order, but each expanded node draws its children from q without
    replacement (Gumbel-top-k) and every drawn node is kept, so the number of children of a node
    is fixed before it is drawn: the budget g is handed out in score order among the nodes chosen
    for expansion (root first: min(k, g) children). Nothing drawn is dropped, which keeps the
    q-rows honest for `verify_sampling` (as `LMDrafter` does).

`depth` = the maximum depth of a drafted node (drafter forwards per round: 1 + depth - 1). Greedy
trees cap depth and top-k at g (exact: no node beyond them can be among the g kept). A greedy tree of top-k 1
is a chain: it is drafted by causal steps without the tree bookkeeping (the same nodes, scores and drafter
inputs, bit for bit: each node sees the cache and the chain before it, which is causal attention).
With a `prior` (greedy; eval/decode/drafters/prior.py: the request's own pairs and triples, `context_weight`) each
expanded node's children are its top candidates re-ranked given its token and its parent's; a chain then grows as a
tree of top-k 1.
The decoder verifies every proposal, so the output is the target's whatever the drafter says.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from pathlib import Path

import torch

from draftsmith.eval.decode.drafters.base import (TREE_BUDGET, Drafter, Sampling, TreeCut, check_open_unit, check_sizes,
                                                  draw_children)
from draftsmith.eval.decode.drafters.prior import CANDIDATES, CandidatePrior, refuse_sampled_prior, reranked
from draftsmith.eval.decode.tree import DraftTree
from draftsmith.models.artifacts import EXPORT_MANIFEST, load_dgf, read_export_manifest
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import top_log_probs
from draftsmith.models.dgf import DGFModel, EagerDGFEngine
from draftsmith.models.target import make_engine
from draftsmith.models.trees import DGF_TREE, TreeShape
from draftsmith.models.vocab import DraftVocab


DGF_DEPTH, DGF_TOPK = DGF_TREE.depth, DGF_TREE.topk  # Dovetail's dynamic tree (models/trees.py)


def target_ids(vocab: DraftVocab | None, ids: torch.Tensor) -> torch.Tensor:
    """Draft-vocabulary ids as the target's (a drafter scoring the full vocabulary: as they are)."""
    return ids if vocab is None else vocab.to_target(ids)


class DGFDrafter(Drafter):
    def __init__(self, model: DGFModel, depth: int = DGF_DEPTH, topk: int = DGF_TOPK, budget: int = TREE_BUDGET,
                 name: str | None = None, engine=None, stop_below: float | None = None,
                 keep_above: float | None = None, prior: CandidatePrior | None = None,
                 round_costs: Sequence[float] | None = None):
        check_sizes(name or "dgf", depth=depth, topk=topk, budget=budget)
        check_open_unit(name or "dgf", "stop_below", stop_below)
        self.stop_below = stop_below  # dynamic depth: no deeper level once the best path's q falls below it
        self.cut = TreeCut.checked(name or "dgf", keep_above, round_costs)  # dynamic size (greedy)
        model._need_target()
        self.model = model.eval()
        self.engine = engine or EagerDGFEngine(self.model)  # eager or compiled forwards of the drafter
        self.depth, self.topk, self.budget = depth, topk, budget
        self.prior = prior
        self.cap_at_budget = True  # greedy: cap depth and top-k at g (same tree; False only for tests)
        self.chain_steps = True  # greedy top-k 1: causal steps, no tree bookkeeping (same tree; False: tests, A/Bs)
        self.hidden_layers = tuple(model.config.layers_read)
        self.vocab = model.draft_vocab  # None: the drafter scores the full vocabulary
        self.name = name or f"dgf-{model.config.fusion}-m{model.config.num_blocks}"
        self.cache = None
        self.features: list[torch.Tensor] = []  # committed target features, chunks of (m, H)
        self.num_features = 0
        self.fed = 0  # pairs in the cache
        self.root_feature: torch.Tensor | None = None  # the drafter's output for the last pair
        self.root_logits: torch.Tensor | None = None  # and its next-token logits (V,)
        self.root_token: torch.Tensor | None = None  # or, where a round reads only argmaxes, its best token (1,)

    @property
    def device(self) -> torch.device:
        return self.model.device

    def begin(self, prompt_ids):
        self.cache = self.engine.new_cache()
        self.features, self.num_features, self.fed = [], 0, 0
        if self.prior is not None:
            self.prior.begin()

    @torch.inference_mode()
    def observe(self, tokens, hidden):
        layers = torch.stack([hidden[layer].to(self.device) for layer in self.hidden_layers], -2)  # (m, k, H)
        feature = self.engine.fuse_layers(layers)  # (m, H): the layer itself, or EAGLE-3's fused feature
        self.features.append(feature.to(self.device, self.model.dtype))
        self.num_features += feature.shape[0]

    def _pending_features(self) -> torch.Tensor:
        """Features of positions fed .. num_features - 1, (n, H); keeps only those (the ones fed before are never
        read again, so a round copies its few new rows, not the whole context's)."""
        allf = torch.cat(self.features) if len(self.features) > 1 else self.features[0]
        pending = allf[self.fed - (self.num_features - allf.shape[0]):]
        self.features = [pending]
        return pending

    @torch.inference_mode()
    def propose(self, root: int, context: torch.Tensor, sampling: Sampling | None, generator) -> DraftTree:
        device = self.device
        length = context.numel()  # committed + root
        if self.num_features != length - 1:
            raise RuntimeError(f"DGFDrafter has features for {self.num_features} positions but the context holds "
                               f"{length - 1} committed tokens (observe() must see every committed token)")
        # Feed pairs (f_i, x_{i+1}) for i = fed .. length - 2; the last output predicts the root's feature.
        features = self._pending_features()
        argmax = self.reads_argmax_only(sampling)
        if features.shape[0]:  # nothing pending only when proposing twice for the same context
            tokens = context[self.fed + 1:].to(device)
            if argmax:
                hidden, best = self.engine.forward_argmax(features[None], tokens[None], self.cache, last_only=True)
                self.root_logits, self.root_token = None, best[0]  # (1,)
            else:
                hidden, logits = self.engine.forward(features[None], tokens[None], self.cache, last_only=True)
                self.root_logits, self.root_token = logits[0, -1], None  # (V,)
            self.root_feature = hidden[0, -1]  # (H,)
            self.fed = length - 1
        if (self.root_token if argmax else self.root_logits) is None:
            raise RuntimeError(f"{self.name} proposed twice for one context, once greedy and once sampling")
        if self.prior is not None:
            refuse_sampled_prior(self.name, self.prior, sampling, "drop context_weight")
            self.prior.extend(context)
        try:
            tree = self._tree(self.root_feature, self.root_logits, length, sampling, generator)
        finally:
            self.engine.truncate(self.cache, self.fed)  # drop the tree entries
        return tree

    def greedy_shape(self) -> tuple[int, int]:
        """(top-k, depth) of a greedy tree. Exact shortcut: the final g nodes are ancestor-closed and scores fall
        along paths, so a kept node has depth <= g, lies in the top g of its level and among its parent's top g
        children. Capping depth and top-k at g gives the same tree (up to score ties), cheaper."""
        if self.cap_at_budget:
            return min(self.topk, self.budget), min(self.depth, self.budget)
        return self.topk, self.depth

    def reads_argmax_only(self, sampling: Sampling | None) -> bool:
        """Whether a round reads only each drafter step's most likely token: a greedy chain without thresholds
        (stop_below and the cut read its probabilities)."""
        return (sampling is None and self.chain_steps and self.greedy_shape()[0] == 1 and self.stop_below is None
                and not self.cut.cuts and self.prior is None)

    def _tree(self, root_feature, root_logits, length, sampling, generator) -> DraftTree:
        k, depth = self.greedy_shape() if sampling is None else (self.topk, self.depth)
        if self.reads_argmax_only(sampling):
            return self._argmax_chain(root_feature, self.root_token, depth)
        if sampling is None and k == 1 and self.chain_steps and self.prior is None:
            return self._chain(root_feature, root_logits, depth)
        self.cut.refuse_sampling(self.name, sampling)
        growth = Growth(self.device, root_feature, self.budget, self.vocab, self.prior)
        if sampling is None:
            growth.greedy_children([-1], root_logits[None], [0.0], k)
        else:
            growth.sampled_children([-1], root_logits[None], [0.0], k, sampling, generator)
        for level in range(1, depth):
            if sampling is not None and growth.budget_left <= 0:
                break
            if self.stop_below is not None and growth.best_of_level() < math.log(self.stop_below):
                break  # the drafter's own odds of reaching this level are low: skip the forward
            best, logits = self._expand(growth, level, k, length - 1)
            base = [growth.scores[node] for node in best]
            if sampling is None:
                growth.greedy_children(best, logits, base, k)
            else:
                growth.sampled_children(best, logits, base, k, sampling, generator)
        return growth.tree(sampling is None, self.cut)

    def _chain(self, root_feature: torch.Tensor, root_logits: torch.Tensor, depth: int) -> DraftTree:
        """The greedy chain Growth grows at top-k 1 (the best token after each node, its path score the sum of the
        log-probabilities along it; stop_below and the cut as for a tree), each level one causal
        drafter step on its parent's predicted feature: the cache holds the committed pairs and the chain so far, all
        visible."""
        values, indices, _ = top_log_probs(root_logits[None], 1)
        tokens, scores = [target_ids(self.vocab, indices[0])], [values[0]]
        feature = root_feature
        for _ in range(1, depth):
            if self.stop_below is not None and float(scores[-1]) < math.log(self.stop_below):
                break
            out, logits = self.engine.forward(feature[None, None], tokens[-1][None], self.cache)
            feature = out[0, 0]
            values, indices, _ = top_log_probs(logits[0], 1)
            tokens.append(target_ids(self.vocab, indices[0]))
            scores.append(scores[-1] + values[0])
        kept = min(len(tokens), self.budget)  # path scores fall along a chain: the nodes kept are a prefix
        if self.cut.cuts:
            kept = len(self.cut.nodes(torch.cat(scores[:kept]).tolist(), list(range(-1, kept - 1)), kept,
                                      scores[0].dtype))
        return DraftTree.chain(torch.cat(tokens[:kept]))

    def _argmax_chain(self, root_feature: torch.Tensor, root_token: torch.Tensor, depth: int) -> DraftTree:
        """_chain's tokens where nothing reads their scores: each step's argmax (the engine's forward_argmax: a float32
        drafter's greedy head streams a quarter of its head's bytes)."""
        tokens, feature = [target_ids(self.vocab, root_token)], root_feature
        for _ in range(1, min(depth, self.budget)):
            out, best = self.engine.forward_argmax(feature[None, None], tokens[-1][None], self.cache)
            feature = out[0, 0]
            tokens.append(target_ids(self.vocab, best[0]))
        return DraftTree.chain(torch.cat(tokens))

    def _expand(self, growth: "Growth", level: int, k: int, committed: int) -> tuple[list[int], torch.Tensor]:
        """One drafter forward over the best k nodes of the newest level (tree mask over the cache and
        their expanded ancestors); returns (their node ids, their next-token logits (n_new, V))."""
        best = sorted(sorted(growth.level, key=lambda node: -growth.scores[node])[:k])
        parents = [growth.parents[node] for node in best]
        in_features = torch.stack([growth.fed_features[parent] for parent in parents])  # (n_new, H)
        tokens = torch.tensor([[growth.tokens[node] for node in best]], device=growth.device)
        positions = torch.full((1, len(best)), committed - 1 + level, dtype=torch.long, device=growth.device)
        allowed = growth.allowed(parents, committed)[None, None]
        out, logits = self.engine.forward(in_features[None], tokens, self.cache, positions, allowed)  # (1,n,H), (1,n,V)
        growth.add_fed(best, parents, out[0])
        return best, logits[0]


class Growth:
    """A dynamic draft tree under construction: its nodes in Python lists (a round's few nodes cost no tensor op each:
    on a CPU a small op costs more than the arithmetic), and the expanded nodes' cache entries. Scores are float32
    values, summed as the drafter's float32 log-probabilities would be (a float32 sum computed in float64 and rounded
    is the float32 sum)."""

    def __init__(self, device: torch.device, root_feature: torch.Tensor, budget: int, vocab: DraftVocab | None = None,
                 prior: CandidatePrior | None = None):
        self.device, self.vocab = device, vocab  # vocab: logits score a draft vocabulary (ids mapped here)
        self.prior = prior  # greedy re-ranking; its counted tokens end with the root
        self.tokens: list[int] = []  # every node's token (target ids), level after level
        self.parents: list[int] = []  # every node's parent node (-1 = root)
        self.depths: list[int] = []
        self.scores: list[float] = []  # cumulative log-probs
        self.rows: list[torch.Tensor] = []  # sampling: q rows
        self.level_start = 0
        self.budget, self.budget_left = budget, budget
        self.fed = 0  # tree entries in the drafter's cache
        self.fed_slots: dict[int, list[int]] = {-1: []}  # node -> the cache entries of its expanded path (fed order)
        self.fed_features: dict[int, torch.Tensor] = {-1: root_feature}  # node -> its predicted feature

    @property
    def level(self) -> range:
        """The newest level's nodes."""
        return range(self.level_start, len(self.tokens))

    def best_of_level(self) -> float:
        return max(self.scores[self.level_start:])

    def add_level(self, tokens: list[int], parents: list[int], scores: list[float]) -> None:
        self.level_start = len(self.tokens)
        self.tokens += tokens
        self.parents += parents
        self.scores += array("f", scores).tolist()  # float32 values
        self.depths += [1 if parent < 0 else self.depths[parent] + 1 for parent in parents]

    def greedy_children(self, nodes: list[int], logits: torch.Tensor, base: list[float], k: int) -> None:
        """The top-k children of each node (logits (n, V) its next-token logits, base its score), scored by their
        log-probabilities; with a prior, the top-k of its re-ranked candidates."""
        if self.prior is not None:
            return self._reranked_children(nodes, logits, base, k)
        values, indices, _ = top_log_probs(logits, min(k, logits.shape[-1]))  # (n, k)
        width, values = indices.shape[1], values.tolist()
        self.add_level(target_ids(self.vocab, indices.reshape(-1)).tolist(),
                       [node for node in nodes for _ in range(width)],
                       [score + value for score, row in zip(base, values) for value in row])

    def _reranked_children(self, nodes: list[int], logits: torch.Tensor, base: list[float], k: int) -> None:
        values, indices, shares = top_log_probs(logits, min(CANDIDATES, logits.shape[-1]))  # shares: of q
        values, candidates, shares = values.double().tolist(), target_ids(self.vocab, indices).tolist(), shares.tolist()
        tokens, parents, scores = [], [], []
        for row, node in enumerate(nodes):
            before, last = self._two_tokens(node)
            depth = 1 if node < 0 else self.depths[node] + 1
            gains = self.prior.scores(depth, before, last, candidates[row])
            for logp_child, token in reranked(values[row], candidates[row], gains, shares[row], k):
                tokens.append(token)
                parents.append(node)
                scores.append(base[row] + logp_child)
        self.add_level(tokens, parents, scores)

    def _two_tokens(self, node: int) -> tuple[int, int]:
        """(the token before a node's, the node's own): the root is node -1."""
        history = self.prior.tokens[-2:]  # the token before the root, the root
        if node < 0:
            return history[0], history[-1]
        parent = self.parents[node]
        return (self.tokens[parent] if parent >= 0 else history[-1]), self.tokens[node]

    def sampled_children(self, nodes: list[int], logits: torch.Tensor, base: list[float], k: int,
                         sampling: Sampling, generator) -> None:
        """Children drawn without replacement; the budget is handed out in score order and every drawn
        node is kept (the q rows stay honest for verify_sampling)."""
        tokens, scores, parents = [], [], []
        for i in sorted(range(len(nodes)), key=lambda i: -base[i]):
            if self.budget_left <= 0:
                break
            probs = sampling.probs(logits[i])
            children, q = draw_children(probs, min(k, self.budget_left), sampling, generator)
            self.budget_left -= children.numel()
            tokens += target_ids(self.vocab, children).tolist()
            scores += [base[i] + value for value in torch.log(probs[children].clamp(min=1e-30)).tolist()]
            parents += [nodes[i]] * children.numel()
            self.rows.append(q if self.vocab is None else self.vocab.scatter(q))
        self.add_level(tokens, parents, scores)

    def allowed(self, parents: list[int], committed: int) -> torch.Tensor:
        """What new entries (children of `parents`) see: the committed cache, their parents' expanded paths, then
        themselves: (n_new, committed + fed + n_new) bool."""
        n_new = len(parents)
        allowed = torch.zeros(n_new, committed + self.fed + n_new, dtype=torch.bool, device=self.device)
        allowed[:, :committed] = True
        rows = [i for i, parent in enumerate(parents) for _ in self.fed_slots[parent]] + list(range(n_new))
        columns = ([committed + slot for parent in parents for slot in self.fed_slots[parent]]
                   + [committed + self.fed + i for i in range(n_new)])
        allowed[rows, columns] = True
        return allowed

    def add_fed(self, nodes: list[int], parents: list[int], features: torch.Tensor) -> None:
        for i, (node, parent, feature) in enumerate(zip(nodes, parents, features.unbind(0))):
            self.fed_slots[node] = self.fed_slots[parent] + [self.fed + i]
            self.fed_features[node] = feature
        self.fed += len(nodes)

    def tree(self, greedy: bool, cut: TreeCut) -> DraftTree:
        """The grown tree; greedy trees keep the `budget` best nodes (EAGLE-2's re-ranking), then those `cut` keeps
        (base.TreeCut: a confident round verifies a wide tree, a doubtful one a narrow one)."""
        rows = torch.cat(self.rows) if self.rows else None
        if not greedy:
            return DraftTree.from_lists(self.tokens, self.parents, self.depths, rows, self.device)
        keep = cut.nodes(self.scores, self.parents, self.budget, torch.float32)
        index = {node: i for i, node in enumerate(keep)}
        return DraftTree.from_lists([self.tokens[node] for node in keep],
                                    [index[self.parents[node]] if self.parents[node] >= 0 else -1 for node in keep],
                                    [self.depths[node] for node in keep], None, self.device)


def same_weights(drafter: DGFDrafter, depth: int, topk: int, budget: int, name: str | None = None,
                 stop_below: float | None = None, keep_above: float | None = None,
                 prior: CandidatePrior | None = None, round_costs: Sequence[float] | None = None) -> DGFDrafter:
    """Another tree shape over `drafter`'s model and engine (a bench comparing shapes holds one copy of the
    weights and, compiled, one package: the engine keeps no decode state, each drafter its own cache)."""
    return DGFDrafter(drafter.model, depth=depth, topk=topk, budget=budget, name=name, engine=drafter.engine,
                      stop_below=stop_below, keep_above=keep_above, prior=prior, round_costs=round_costs)


def drafter_tree(path: str | Path, depth: int | None = None, topk: int | None = None,
                 budget: int | None = None) -> tuple[int, int, int]:
    """(depth, topk, budget): the values given, else the tree the drafter was exported with (the
    export manifest's `tree`: the shape its bench measured best), else Dovetail's 7 / 10 / 16."""
    exported = Path(path) / EXPORT_MANIFEST
    tree = TreeShape.from_manifest((read_export_manifest(path).get("tree") or {}) if exported.is_file() else {},
                                   DGF_TREE)
    return (depth if depth is not None else tree.depth, topk if topk is not None else tree.topk,
            budget if budget is not None else tree.budget)


def load_dgf_drafter(path: str | Path, target, depth: int | None = None, topk: int | None = None,
                     budget: int | None = None, name: str | None = None, backend: Backend = Backend.EAGER,
                     settings: CompileSettings | None = None, stop_below: float | None = None,
                     dtype: torch.dtype | None = None, keep_above: float | None = None,
                     prior: CandidatePrior | None = None, round_costs: Sequence[float] | None = None) -> DGFDrafter:
    """A DGFDrafter for `target` from a recipe's final/ directory or a dgf-layout export (refuses another
    target's drafter); tree shape as `drafter_tree`. The drafter runs in `dtype` (default: the target's) on the
    target's device, on the `backend` engine."""
    model, _ = load_dgf(path, target, dtype=dtype or target.dtype)
    engine = make_engine(model.eval(), backend, settings)
    depth, topk, budget = drafter_tree(path, depth, topk, budget)
    return DGFDrafter(model, depth=depth, topk=topk, budget=budget, name=name or f"dgf:{path}", engine=engine,
                      stop_below=stop_below, keep_above=keep_above, prior=prior, round_costs=round_costs)
