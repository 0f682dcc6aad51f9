"""DGF / EAGLE feature drafter in the decoder: EAGLE-2 dynamic draft trees (Dovetail: depth 7, top-k 10, g 16).

State per request: the target features of committed tokens (from `observe`) and the drafter's own
KV cache over "pairs" i = (f_i, x_{i+1}) of committed positions. `propose(root, context)` feeds the
pairs it has not seen (context = committed tokens + the root, so the last pair is (f_last, root)),
whose output is the predicted feature at the root's position, then drafts a tree:

greedy (EAGLE-2):  level 1 = the top-k tokens after the root; then `depth - 1` times: the top-k
    nodes of the newest level by cumulative log-probability (the product of draft probabilities
    along the path) are expanded in one drafter forward (tree mask over the cache + their
    ancestors), each gets top-k children. Finally all nodes are re-ranked by cumulative
    log-probability and the best g (ancestor-closed) are sent to verification.
sampling: the same expansion order, but each expanded node draws its children from q without
    replacement (Gumbel-top-k) and every drawn node is kept, so the number of children of a node
    is fixed before it is drawn: the budget g is handed out in score order among the nodes chosen
    for expansion (root first: min(k, g) children). Nothing drawn is dropped, which keeps the
    q-rows honest for `verify_sampling` (as `LMDrafter` does).

`depth` = the maximum depth of a drafted node (drafter forwards per round: 1 + depth - 1). Greedy
trees cap depth and top-k at g (exact: no node beyond them can be among the g kept).
The decoder verifies every proposal, so the output is the target's whatever the drafter says.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftsmith.eval.drafters.base import Drafter, Sampling, draw_children
from draftsmith.eval.tree import DraftTree, select_top_nodes, subtree
from draftsmith.models.artifacts import load_dgf
from draftsmith.models.dgf import DGFModel
from draftsmith.models.target import crop_cache


class DGFDrafter(Drafter):
    def __init__(self, model: DGFModel, depth: int = 7, topk: int = 10, budget: int = 16, name: str | None = None):
        if depth < 1 or topk < 1 or budget < 1:
            raise ValueError(f"depth, topk and g must be >= 1 (got {depth}, {topk}, {budget})")
        model._need_target()
        self.model = model.eval()
        self.depth, self.topk, self.budget = depth, topk, budget
        self.cap_at_budget = True  # greedy: cap depth and top-k at g (same tree; False only for tests)
        self.hidden_layers = (model.config.feature_layer,)
        self.name = name or f"dgf-{model.config.fusion}-m{model.config.num_blocks}"
        self.cache = None
        self.features: list[torch.Tensor] = []  # committed target features, chunks of (m, H)
        self.num_features = 0
        self.fed = 0  # pairs in the cache
        self.root_feature: torch.Tensor | None = None  # the drafter's output for the last pair

    @property
    def device(self) -> torch.device:
        return self.model.device

    def begin(self, prompt_ids):
        self.cache = self.model.new_cache()
        self.features, self.num_features, self.fed = [], 0, 0

    def observe(self, tokens, hidden):
        feature = hidden[self.hidden_layers[0]]  # (m, H)
        self.features.append(feature.to(self.device, self.model.dtype))
        self.num_features += feature.shape[0]

    def _pending_features(self) -> torch.Tensor:
        """Features of positions fed .. num_features - 1, (n, H); keeps only what is still needed."""
        allf = torch.cat(self.features) if len(self.features) > 1 else self.features[0]
        start = self.fed - (self.num_features - allf.shape[0])
        self.features = [allf]
        return allf[start:]

    @torch.inference_mode()
    def propose(self, root: int, context: torch.Tensor, sampling: Sampling | None, generator) -> DraftTree:
        model, device = self.model, self.device
        length = context.numel()  # committed + root
        if self.num_features != length - 1:
            raise RuntimeError(f"DGFDrafter has features for {self.num_features} positions but the context holds "
                               f"{length - 1} committed tokens (observe() must see every committed token)")
        # Feed pairs (f_i, x_{i+1}) for i = fed .. length - 2; the last output predicts the root's feature.
        features = self._pending_features()
        if features.shape[0]:  # nothing pending only when proposing twice for the same context
            tokens = context[self.fed + 1:].to(device)
            self.root_feature = model(features[None], tokens[None], cache=self.cache)[0, -1]  # (H,)
            self.fed = length - 1
        root_feature = self.root_feature
        root_logits = model.logits(root_feature)  # (V,)
        try:
            tree = self._tree(root_feature, root_logits, length, sampling, generator)
        finally:
            crop_cache(self.cache, self.fed)  # drop the tree entries
        return tree

    def _tree(self, root_feature, root_logits, length, sampling, generator) -> DraftTree:
        model, device, k, depth = self.model, self.device, self.topk, self.depth
        if sampling is None and self.cap_at_budget:
            # Exact shortcut: the final g nodes are ancestor-closed and scores fall along paths, so a
            # kept node has depth <= g, lies in the top g of its level and among its parent's top g
            # children. Capping depth and top-k at g gives the same tree (up to score ties), cheaper.
            k, depth = min(k, self.budget), min(depth, self.budget)
        committed = length - 1  # cache entries that every tree node may attend to
        tokens: list[torch.Tensor] = []  # per level: (n_level,) tokens
        parents: list[torch.Tensor] = []  # per level: (n_level,) global parent ids (-1 = root)
        scores: list[torch.Tensor] = []  # per level: (n_level,) cumulative log-probs
        rows: list[torch.Tensor] = []  # sampling: q rows
        total = 0
        budget_left = self.budget
        # Level 1 children of the root.
        if sampling is None:
            logp = torch.log_softmax(root_logits, -1)
            top = torch.topk(logp, min(k, logp.numel()))
            level_tokens, level_scores = top.indices, top.values
        else:
            probs = sampling.probs(root_logits)
            count = min(k, budget_left)
            level_tokens, q = draw_children(probs, count, sampling, generator)
            level_scores = torch.log(probs[level_tokens].clamp(min=1e-30))
            rows.append(q)
            budget_left -= level_tokens.numel()
        tokens.append(level_tokens)
        parents.append(torch.full_like(level_tokens, -1))
        scores.append(level_scores)
        level_start, total = 0, level_tokens.numel()
        fed_ids: list[int] = []  # global ids of tree nodes in the cache, in order
        fed_reach = torch.zeros(0, 0, dtype=torch.bool, device=device)  # (fed, fed) ancestor-or-self
        fed_features: dict[int, torch.Tensor] = {-1: root_feature}  # node -> its predicted feature
        for level in range(1, depth):
            if sampling is not None and budget_left <= 0:
                break
            # Expand the best k nodes of the newest level in one forward.
            best_local = torch.topk(level_scores, min(k, level_scores.numel())).indices.sort().values
            best = (best_local + level_start).tolist()
            level_parents = parents[-1][best_local].tolist()
            n_new = len(best)
            # Ancestor rows of the new entries over the fed tree entries, then themselves.
            fed_index = {node: i for i, node in enumerate(fed_ids)}
            reach = torch.zeros(n_new, len(fed_ids) + n_new, dtype=torch.bool, device=device)
            for i, parent in enumerate(level_parents):
                if parent >= 0:
                    reach[i, : len(fed_ids)] = fed_reach[fed_index[parent]]
                reach[i, len(fed_ids) + i] = True
            allowed = torch.cat([torch.ones(n_new, committed, dtype=torch.bool, device=device), reach], 1)
            in_features = torch.stack([fed_features[p] for p in level_parents])  # (n_new, H)
            in_tokens = tokens[-1][best_local]
            positions = torch.full((1, n_new), committed - 1 + level, dtype=torch.long, device=device)
            out = model(in_features[None], in_tokens[None], positions, self.cache, allowed[None, None])[0]  # (n_new, H)
            logits = model.logits(out)  # (n_new, V)
            grown = torch.zeros(len(fed_ids) + n_new, len(fed_ids) + n_new, dtype=torch.bool, device=device)
            grown[: len(fed_ids), : len(fed_ids)] = fed_reach
            grown[len(fed_ids):] = reach
            fed_reach = grown
            fed_ids.extend(best)
            for i, node in enumerate(best):
                fed_features[node] = out[i]
            # Children of the expanded nodes.
            base = torch.cat(scores)[best]  # (n_new,)
            if sampling is None:
                logp = torch.log_softmax(logits, -1)
                top = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)  # (n_new, k)
                level_tokens = top.indices.reshape(-1)
                level_scores = (base[:, None] + top.values).reshape(-1)
                level_parents_t = torch.tensor(best, device=device).repeat_interleave(top.indices.shape[1])
            else:
                order = torch.argsort(base, descending=True).tolist()  # budget handed out in score order
                new_tokens, new_scores, new_parents = [], [], []
                for i in order:
                    if budget_left <= 0:
                        break
                    probs = sampling.probs(logits[i])
                    children, q = draw_children(probs, min(k, budget_left), sampling, generator)
                    budget_left -= children.numel()
                    new_tokens.append(children)
                    new_scores.append(base[i] + torch.log(probs[children].clamp(min=1e-30)))
                    new_parents.append(torch.full_like(children, best[i]))
                    rows.append(q)
                level_tokens, level_scores = torch.cat(new_tokens), torch.cat(new_scores)
                level_parents_t = torch.cat(new_parents)
            tokens.append(level_tokens)
            parents.append(level_parents_t)
            scores.append(level_scores)
            level_start, total = total, total + level_tokens.numel()
        all_parents = torch.cat(parents).long()
        tree = DraftTree.from_parents(torch.cat(tokens), all_parents.cpu(),
                                      torch.cat(rows) if rows else None)
        tree = DraftTree(tree.tokens, tree.parents.to(device), tree.depths.to(device), tree.draft_probs)
        if sampling is None:
            tree = subtree(tree, select_top_nodes(torch.cat(scores), tree.parents, self.budget))
        return tree


def load_dgf_drafter(path: str | Path, target, depth: int = 7, topk: int = 10, budget: int = 16,
                     name: str | None = None) -> DGFDrafter:
    """A DGFDrafter for `target` from a recipe's final/ directory (refuses another target's drafter).
    The drafter runs in the target's dtype on the target's device."""
    model, _ = load_dgf(path, target, dtype=target.dtype)
    return DGFDrafter(model, depth=depth, topk=topk, budget=budget, name=name or f"dgf:{path}")


def build_from_spec(options: dict, target, draft, name: str):
    """Bench method `dgf:<dir>[,depth=7,topk=10,g=16]` (see eval.bench.EXTERNAL_METHODS)."""
    return load_dgf_drafter(options.pop("path"), target, depth=int(options.pop("depth", 7)),
                            topk=int(options.pop("topk", 10)), budget=int(options.pop("g", 16)), name=name)
