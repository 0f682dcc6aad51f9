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
    depth: a chain, topk=1, drafts as many tokens as the drafter is sure of, up to `depth`).
sampling: the same expansion order, but each expanded node draws its children from q without
    replacement (Gumbel-top-k) and every drawn node is kept, so the number of children of a node
    is fixed before it is drawn: the budget g is handed out in score order among the nodes chosen
    for expansion (root first: min(k, g) children). Nothing drawn is dropped, which keeps the
    q-rows honest for `verify_sampling` (as `LMDrafter` does).

`depth` = the maximum depth of a drafted node (drafter forwards per round: 1 + depth - 1). Greedy
trees cap depth and top-k at g (exact: no node beyond them can be among the g kept). A greedy tree of top-k 1
is a chain: it is drafted by causal steps without the tree bookkeeping (the same nodes, scores and drafter
inputs, bit for bit: each node sees the cache and the chain before it, which is causal attention).
The decoder verifies every proposal, so the output is the target's whatever the drafter says.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from draftsmith.eval.decode.drafters.base import (TREE_BUDGET, Drafter, Sampling, check_open_unit, check_sizes,
                                                  draw_children, keep_confident, refuse_sampled_trim)
from draftsmith.eval.decode.tree import DraftTree
from draftsmith.models.artifacts import EXPORT_MANIFEST, load_dgf, read_export_manifest
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
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
                 keep_above: float | None = None):
        check_sizes(name or "dgf", depth=depth, topk=topk, budget=budget)
        check_open_unit(name or "dgf", "stop_below", stop_below)
        check_open_unit(name or "dgf", "keep_above", keep_above)
        self.stop_below = stop_below  # dynamic depth: no deeper level once the best path's q falls below it
        self.keep_above = keep_above  # dynamic size (greedy): only nodes whose path's q is above it are verified
        model._need_target()
        self.model = model.eval()
        self.engine = engine or EagerDGFEngine(self.model)  # eager or compiled forwards of the drafter
        self.depth, self.topk, self.budget = depth, topk, budget
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

    @property
    def device(self) -> torch.device:
        return self.model.device

    def begin(self, prompt_ids):
        self.cache = self.engine.new_cache()
        self.features, self.num_features, self.fed = [], 0, 0

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
        if features.shape[0]:  # nothing pending only when proposing twice for the same context
            tokens = context[self.fed + 1:].to(device)
            hidden, logits = self.engine.forward(features[None], tokens[None], self.cache, last_only=True)
            self.root_feature, self.root_logits = hidden[0, -1], logits[0, -1]  # (H,), (V,)
            self.fed = length - 1
        try:
            tree = self._tree(self.root_feature, self.root_logits, length, sampling, generator)
        finally:
            self.engine.truncate(self.cache, self.fed)  # drop the tree entries
        return tree

    def _tree(self, root_feature, root_logits, length, sampling, generator) -> DraftTree:
        k, depth = self.topk, self.depth
        if sampling is None and self.cap_at_budget:
            # Exact shortcut: the final g nodes are ancestor-closed and scores fall along paths, so a
            # kept node has depth <= g, lies in the top g of its level and among its parent's top g
            # children. Capping depth and top-k at g gives the same tree (up to score ties), cheaper.
            k, depth = min(k, self.budget), min(depth, self.budget)
        if sampling is None and k == 1 and self.chain_steps:
            return self._chain(root_feature, root_logits, depth)
        refuse_sampled_trim(self.name, self.keep_above, sampling)
        growth = Growth(self.device, root_feature, self.budget, self.vocab)
        if sampling is None:
            growth.greedy_children([-1], torch.log_softmax(root_logits, -1)[None], torch.zeros(1, device=self.device), k)
        else:
            growth.sampled_children([-1], root_logits[None], torch.zeros(1, device=self.device), k, sampling, generator)
        for level in range(1, depth):
            if sampling is not None and growth.budget_left <= 0:
                break
            if self.stop_below is not None and float(growth.level_scores.max()) < math.log(self.stop_below):
                break  # the drafter's own odds of reaching this level are low: skip the forward
            best, logits = self._expand(growth, level, k, length - 1)
            base = growth.all_scores()[best]  # (n_new,)
            if sampling is None:
                growth.greedy_children(best, torch.log_softmax(logits, -1), base, k)
            else:
                growth.sampled_children(best, logits, base, k, sampling, generator)
        return growth.tree(sampling is None, self.keep_above)

    def _chain(self, root_feature: torch.Tensor, root_logits: torch.Tensor, depth: int) -> DraftTree:
        """The greedy chain Growth grows at top-k 1 (the best token after each node, its path score the sum of the
        log-probabilities along it; stop_below and keep_above as for a tree), each level one causal drafter step on
        its parent's predicted feature: the cache holds the committed pairs and the chain so far, all visible."""
        best = torch.topk(torch.log_softmax(root_logits, -1), 1)
        tokens, scores = [target_ids(self.vocab, best.indices)], [best.values]
        feature = root_feature
        for _ in range(1, depth):
            if self.stop_below is not None and float(scores[-1]) < math.log(self.stop_below):
                break
            out, logits = self.engine.forward(feature[None, None], tokens[-1][None], self.cache)
            feature = out[0, 0]
            best = torch.topk(torch.log_softmax(logits[0, 0], -1), 1)
            tokens.append(target_ids(self.vocab, best.indices))
            scores.append(scores[-1] + best.values)
        kept = min(len(tokens), self.budget)  # path scores fall along a chain: the nodes kept are a prefix
        if self.keep_above is not None:
            kept = min(kept, max(1, int((torch.cat(scores) > math.log(self.keep_above)).sum())))
        return DraftTree.chain(torch.cat(tokens[:kept]))

    def _expand(self, growth: "Growth", level: int, k: int, committed: int) -> tuple[list[int], torch.Tensor]:
        """One drafter forward over the best k nodes of the newest level (tree mask over the cache and
        their expanded ancestors); returns (their node ids, their next-token logits (n_new, V))."""
        device = self.device
        best_local = torch.topk(growth.level_scores, min(k, growth.level_scores.numel())).indices.sort().values
        best = (best_local + growth.level_start).tolist()
        level_parents = growth.parents[-1][best_local].tolist()
        reach = growth.reach_rows(level_parents)  # (n_new, fed + n_new)
        allowed = torch.cat([torch.ones(len(best), committed, dtype=torch.bool, device=device), reach], 1)
        in_features = torch.stack([growth.fed_features[p] for p in level_parents])  # (n_new, H)
        positions = torch.full((1, len(best)), committed - 1 + level, dtype=torch.long, device=device)
        out, logits = self.engine.forward(in_features[None], growth.tokens[-1][best_local][None], self.cache,
                                          positions, allowed[None, None])  # (1, n_new, H), (1, n_new, V)
        growth.add_fed(best, reach, out[0])
        return best, logits[0]


class Growth:
    """A dynamic draft tree under construction: its levels of nodes and the expanded nodes' cache entries."""

    def __init__(self, device: torch.device, root_feature: torch.Tensor, budget: int, vocab: DraftVocab | None = None):
        self.device, self.vocab = device, vocab  # vocab: logits score a draft vocabulary (ids mapped here)
        self.tokens: list[torch.Tensor] = []  # per level: (n_level,) tokens
        self.parents: list[torch.Tensor] = []  # per level: (n_level,) global parent ids (-1 = root)
        self.scores: list[torch.Tensor] = []  # per level: (n_level,) cumulative log-probs
        self.rows: list[torch.Tensor] = []  # sampling: q rows
        self.level_start, self.total = 0, 0
        self.budget, self.budget_left = budget, budget
        self.fed_ids: list[int] = []  # global ids of tree nodes in the cache, in order
        self.fed_reach = torch.zeros(0, 0, dtype=torch.bool, device=device)  # (fed, fed) ancestor-or-self
        self.fed_features: dict[int, torch.Tensor] = {-1: root_feature}  # node -> its predicted feature

    @property
    def level_scores(self) -> torch.Tensor:
        return self.scores[-1]

    def all_scores(self) -> torch.Tensor:
        return torch.cat(self.scores)

    def add_level(self, tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> None:
        self.tokens.append(tokens)
        self.parents.append(parents)
        self.scores.append(scores)
        self.level_start, self.total = self.total, self.total + tokens.numel()

    def greedy_children(self, nodes: list[int], logp: torch.Tensor, base: torch.Tensor, k: int) -> None:
        """The top-k children of each node (logp (n, V) its next-token log-probs, base (n,) its score)."""
        top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)  # (n, k)
        parents = torch.tensor(nodes, device=self.device).repeat_interleave(top.indices.shape[1])
        self.add_level(target_ids(self.vocab, top.indices.reshape(-1)), parents,
                       (base[:, None] + top.values).reshape(-1))

    def sampled_children(self, nodes: list[int], logits: torch.Tensor, base: torch.Tensor, k: int,
                         sampling: Sampling, generator) -> None:
        """Children drawn without replacement; the budget is handed out in score order and every drawn
        node is kept (the q rows stay honest for verify_sampling)."""
        tokens, scores, parents = [], [], []
        for i in torch.argsort(base, descending=True).tolist():
            if self.budget_left <= 0:
                break
            probs = sampling.probs(logits[i])
            children, q = draw_children(probs, min(k, self.budget_left), sampling, generator)
            self.budget_left -= children.numel()
            tokens.append(target_ids(self.vocab, children))
            scores.append(base[i] + torch.log(probs[children].clamp(min=1e-30)))
            parents.append(torch.full_like(children, nodes[i]))
            self.rows.append(q if self.vocab is None else self.vocab.scatter(q))
        self.add_level(torch.cat(tokens), torch.cat(parents), torch.cat(scores))

    def reach_rows(self, level_parents: list[int]) -> torch.Tensor:
        """Ancestor rows of new entries over the fed tree entries, then themselves: (n_new, fed + n_new)."""
        n_new, fed = len(level_parents), len(self.fed_ids)
        index = {node: i for i, node in enumerate(self.fed_ids)}
        reach = torch.zeros(n_new, fed + n_new, dtype=torch.bool, device=self.device)
        for i, parent in enumerate(level_parents):
            if parent >= 0:
                reach[i, :fed] = self.fed_reach[index[parent]]
            reach[i, fed + i] = True
        return reach

    def add_fed(self, nodes: list[int], reach: torch.Tensor, features: torch.Tensor) -> None:
        fed = len(self.fed_ids)
        grown = torch.zeros(fed + len(nodes), fed + len(nodes), dtype=torch.bool, device=self.device)
        grown[:fed, :fed] = self.fed_reach
        grown[fed:] = reach
        self.fed_reach = grown
        self.fed_ids.extend(nodes)
        for i, node in enumerate(nodes):
            self.fed_features[node] = features[i]

    def tree(self, greedy: bool, keep_above: float | None = None) -> DraftTree:
        """The grown tree; greedy trees keep the `budget` best nodes (EAGLE-2's re-ranking), and with `keep_above`
        only those whose path probability is above it (a path's probability falls along it, so they stay closed
        under ancestors): a confident round verifies a wide tree, a doubtful one a narrow one."""
        tree = DraftTree.from_parents(torch.cat(self.tokens), torch.cat(self.parents).long().cpu(),
                                      torch.cat(self.rows) if self.rows else None)
        tree = DraftTree(tree.tokens, tree.parents.to(self.device), tree.depths.to(self.device), tree.draft_probs)
        if greedy:
            tree = keep_confident(tree, self.all_scores(), keep_above, self.budget)
        return tree


def same_weights(drafter: DGFDrafter, depth: int, topk: int, budget: int, name: str | None = None,
                 stop_below: float | None = None, keep_above: float | None = None) -> DGFDrafter:
    """Another tree shape over `drafter`'s model and engine (a bench comparing shapes holds one copy of the
    weights and, compiled, one package: the engine keeps no decode state, each drafter its own cache)."""
    return DGFDrafter(drafter.model, depth=depth, topk=topk, budget=budget, name=name, engine=drafter.engine,
                      stop_below=stop_below, keep_above=keep_above)


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
                     dtype: torch.dtype | None = None, keep_above: float | None = None) -> DGFDrafter:
    """A DGFDrafter for `target` from a recipe's final/ directory or a dgf-layout export (refuses another
    target's drafter); tree shape as `drafter_tree`. The drafter runs in `dtype` (default: the target's) on the
    target's device, on the `backend` engine."""
    model, _ = load_dgf(path, target, dtype=dtype or target.dtype)
    engine = make_engine(model.eval(), backend, settings)
    depth, topk, budget = drafter_tree(path, depth, topk, budget)
    return DGFDrafter(model, depth=depth, topk=topk, budget=budget, name=name or f"dgf:{path}", engine=engine,
                      stop_below=stop_below, keep_above=keep_above)
