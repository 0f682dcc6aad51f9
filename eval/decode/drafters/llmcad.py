"""LLMCad: a token tree from one small LM, paced by confidence, with a self-adaptive fallback.

Spec: LLMCad (`../shared/papers/001_a88a75caa93b83d8.txt`), sections 3.2 and 3.3.

Tree generation (section 3.2). The small ("memory-resident") LM extends one branch per step,
one token per forward, over its own KV cache with a tree mask (the paper's "tree decoder": each
new token attends to the context and its own branch only). A branch is a root-to-leaf path; its
cumulative confidence C_i is the product of the small LM's probabilities of its tokens. When a
node is expanded, its top-1 token extends the branch and every other candidate with probability
>= `threshold` (the paper: "any candidate token with a confidence higher than a threshold
(e.g., 30%) generates a branch", `threshold`) opens a new branch. Confidence-based branch pacer, equations
1-2: with M tokens in the tree and T^B_x the tokens generated for branch x since it forked,
f(x) = M * C_x / sum_i C_i - T^B_x is how far branch x is below its confidence-proportional
share; under max-min fairness the next token goes to the most under-served branch,
argmax_x f(x) (we evaluate f with M + 1, the total after this allocation).

Fallback (section 3.3). After each generated token the tree-cumulative confidence
T_c = max_i C_i is compared with the threshold alpha; T_c < alpha stops drafting and the target
verifies (our verification forward checks the whole tree; greedy verification returns the
longest verified path, the paper's depth-first search, and its bonus token is the "rectified"
token). After verification alpha is updated by equation 3:
    alpha <- alpha * 0.5                               if N_correct == N_all
    alpha <- alpha / T_c ** ((N_all - N_correct) / N_all)   otherwise,
where N_all / N_correct are the tokens / verified tokens of the most matching branch (the
branch sharing the longest prefix with the accepted path; ties: the shorter branch). Initial
alpha 0.01 is the paper's default; we clamp alpha to [alpha_min, alpha_max]. Drafting also stops
at `budget` tree nodes or `depth` (the verification budget on a CPU, see DESIGN.md).
`fallback=False` disables the threshold (a fixed-budget paced tree).

Sampling (temperature > 0): confidences come from the warped draft distribution, tokens are
still the deterministic top candidates, so the tree carries point masses and `verify_sampling`
stays exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from draftsmith.config import ConfigError, check_config, option
from draftsmith.eval.decode.drafters.base import TREE_BUDGET, Sampling
from draftsmith.eval.decode.drafters.lm import LMDrafter
from draftsmith.eval.decode.tree import DraftTree, ancestor_matrix
from draftsmith.models.vocab import DraftVocab


@dataclass
class LLMCadConfig:
    threshold: float = option(0.3, "candidates above this confidence open a branch (the paper: 30%)", gt=0, le=1)
    alpha: float = option(0.01, "initial fallback threshold (the paper's default)", gt=0, lt=1)
    alpha_min: float = option(1e-6, "alpha is clamped to [alpha_min, alpha_max]", gt=0, lt=1)
    alpha_max: float = option(0.5, "our cap (the paper gives none): errors cannot shrink trees to nothing", gt=0,
                              lt=1)
    fallback: bool = option(True, "stop drafting when the tree confidence falls below alpha")
    budget: int = option(TREE_BUDGET, "tree nodes per verification", ge=1)
    depth: int = option(8, "deepest tree node", ge=1)
    children: int = option(3, "candidates per expanded node (top-1 + alternatives above the threshold)", ge=1)

    def __post_init__(self):
        check_config(self)
        if not self.alpha_min <= self.alpha <= self.alpha_max:
            raise ConfigError("llmcad: need alpha_min <= alpha <= alpha_max")


def update_alpha(alpha: float, tree_confidence: float, n_correct: int, n_all: int,
                 alpha_min: float = 0.0, alpha_max: float = 1.0) -> float:
    """LLMCad equation 3 (then clamped to [alpha_min, alpha_max])."""
    if n_all <= 0:
        return alpha
    if n_correct >= n_all:
        new = alpha * 0.5
    else:
        new = alpha / max(tree_confidence, 1e-30) ** ((n_all - n_correct) / n_all)
    return min(max(new, alpha_min), alpha_max)


def pacer_pick(confidences: list[float], own_tokens: list[int], total_tokens: int,
               eligible: list[bool]) -> int | None:
    """Branch to extend: argmax_x f(x) = M * C_x / sum C - T^B_x over eligible branches (eq. 1-2)."""
    total_conf = sum(confidences)
    best, best_value = None, None
    for x, (conf, own, ok) in enumerate(zip(confidences, own_tokens, eligible)):
        if not ok:
            continue
        value = total_tokens * conf / total_conf - own
        if best_value is None or value > best_value:
            best, best_value = x, value
    return best


class LLMCadDrafter(LMDrafter):
    """LMDrafter's cache handling plus the LLMCad tree, pacer and fallback."""

    def __init__(self, model: PreTrainedModel, tokenizer=None, config: LLMCadConfig | None = None,
                 name: str = "llmcad", vocab: DraftVocab | None = None):
        self.config = config or LLMCadConfig()
        super().__init__(model, tokenizer, mode="tree", budget=self.config.budget, name=name, vocab=vocab)
        self.alpha = self.config.alpha  # persists across requests (history of the task)
        self.alpha_history: list[float] = []
        self._last = None  # (tokens, parents, branch leaves, T_c) of the last proposal

    def summary(self) -> dict:
        history = self.alpha_history
        return {"alpha_final": self.alpha, "alpha_min_seen": min(history, default=None),
                "alpha_max_seen": max(history, default=None), "rounds": len(history)}

    @torch.inference_mode()
    def propose(self, root: int, context: torch.Tensor, sampling: Sampling | None, generator) -> DraftTree:
        context_list = context.tolist()
        logits = self._sync(context_list)
        tokens, parents, branches, tree_conf = self._grow(logits, len(context_list), sampling)
        self.lm.truncate(self.cache, len(context_list))  # drop the tree slots; keep the committed context
        self._last = (tokens, parents, [b["leaf"] for b in branches], tree_conf)
        if not tokens:
            return DraftTree.empty(context.device)
        return DraftTree.from_parents(torch.tensor(tokens, device=context.device),
                                      torch.tensor(parents, device=context.device))

    def _candidates(self, logits: torch.Tensor, sampling: Sampling | None) -> tuple[list[int], list[float]]:
        """Top-1 plus alternatives above the branch threshold, with their confidences."""
        probs = torch.softmax(logits, -1) if sampling is None else sampling.probs(logits)
        top = torch.topk(probs, self.config.children)
        ids = top.indices if self.vocab is None else self.vocab.to_target(top.indices)  # target token ids
        tokens, confs = [], []
        for rank, (p, t) in enumerate(zip(top.values.tolist(), ids.tolist())):
            if rank == 0 or p >= self.config.threshold:
                if p > 0:
                    tokens.append(t)
                    confs.append(p)
        return tokens, confs

    def _grow(self, root_logits, context_len: int, sampling):
        config = self.config
        tokens, parents, cum, depth = [], [], [], []
        branches: list[dict] = []  # {"leaf": node, "own": tokens generated for it}
        fed: list[int] = []  # node ids whose KV follows the context in the drafter cache

        def add_children(parent: int, logits: torch.Tensor, branch: dict | None) -> None:
            cand_tokens, cand_confs = self._candidates(logits, sampling)
            base = 1.0 if parent < 0 else cum[parent]
            for rank, (token, conf) in enumerate(zip(cand_tokens, cand_confs)):
                if len(tokens) >= self.budget:
                    return
                node = len(tokens)
                tokens.append(token)
                parents.append(parent)
                cum.append(base * conf)
                depth.append(1 if parent < 0 else depth[parent] + 1)
                if rank == 0 and branch is not None:
                    branch["leaf"], branch["own"] = node, branch["own"] + 1
                else:
                    branches.append({"leaf": node, "own": 1})

        add_children(-1, root_logits, None)
        tree_conf = max((cum[b["leaf"]] for b in branches), default=0.0)
        while len(tokens) < self.budget:
            tree_conf = max(cum[b["leaf"]] for b in branches)
            if config.fallback and tree_conf < self.alpha:
                break  # fallback: verify now
            eligible = [depth[b["leaf"]] < config.depth for b in branches]
            pick = pacer_pick([cum[b["leaf"]] for b in branches], [b["own"] for b in branches],
                              len(tokens) + 1, eligible)
            if pick is None:
                break
            leaf = branches[pick]["leaf"]
            # One small-LM forward for the leaf: attends to the context + its own ancestors.
            parents_t = torch.tensor(parents, dtype=torch.long)
            reach = ancestor_matrix(parents_t)[1:, 1:]  # (n, n) ancestor-or-self among nodes
            cols = torch.tensor(fed + [leaf], dtype=torch.long)
            allowed = torch.ones(1, context_len + len(cols), dtype=torch.bool)
            allowed[:, context_len:] = reach[leaf][cols][None]
            positions = torch.tensor([[context_len - 1 + depth[leaf]]], device=self.device)
            leaf_logits = self._forward(torch.tensor([[tokens[leaf]]], device=self.device), positions,
                                        allowed[None, None].to(self.device))[-1]
            fed.append(leaf)
            add_children(leaf, leaf_logits, branches[pick])
        if tokens:
            tree_conf = max(cum[b["leaf"]] for b in branches)
        return tokens, parents, branches, tree_conf

    def observe(self, tokens, hidden):
        if self._last is None:
            return
        draft_tokens, parents, leaves, tree_conf = self._last
        self._last = None
        accepted_tokens = tokens[1:].tolist()  # the root comes first
        # Walk the accepted tokens down the tree: accepted node ids (siblings hold distinct tokens).
        accepted, node = [], -1
        for token in accepted_tokens:
            node = next((i for i, p in enumerate(parents) if p == node and draft_tokens[i] == token), None)
            if node is None:
                break
            accepted.append(node)
        accepted_set = set(accepted)
        best = None  # (n_correct, -n_all)
        for leaf in leaves:
            path, cursor = [], leaf
            while cursor >= 0:
                path.append(cursor)
                cursor = parents[cursor]
            n_all = len(path)
            n_correct = sum(1 for n in path if n in accepted_set)
            if best is None or (n_correct, -n_all) > best:
                best = (n_correct, -n_all)
        if best is None:
            return
        self.alpha = update_alpha(self.alpha, tree_conf, best[0], -best[1], self.config.alpha_min,
                                  self.config.alpha_max)
        self.alpha_history.append(self.alpha)
