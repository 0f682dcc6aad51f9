"""The speculative decoding loop: prefill, then {propose, verify in one target forward, commit}.

Batch size 1. The loop is thin: trees, masks and verification are pure functions in
`eval.tree` / `eval.verify`; drafters plug in through `eval.drafters.base.Drafter`.

Metrics (one definition everywhere, see README):
  tau          = tokens produced by verification forwards / verification forwards (the bonus token
                 included, the prefill's first token excluded); plain decoding has tau = 1.
  depth accept = a_k = P(node at depth k accepted | depth k-1 accepted), over rounds whose tree
                 reached depth k.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import torch

from draftsmith.eval.drafters.base import Drafter, NoDrafter, Sampling
from draftsmith.eval.tree import DraftTree, tree_attention_mask, tree_position_ids
from draftsmith.eval.verify import verify_greedy, verify_sampling
from draftsmith.models.target import TargetModel, check_same_tokenizer, commit_kv


@dataclass
class DecodeConfig:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0
    top_p: float = 1.0
    max_tree_tokens: int = 64  # refuse larger proposals (verification cost grows with tree size)
    stop_on_eos: bool = True
    seed: int = 0

    @property
    def sampling(self) -> Sampling | None:
        return Sampling(self.temperature, self.top_k, self.top_p) if self.temperature > 0 else None


@dataclass
class DecodeStats:
    new_tokens: int = 0
    verify_forwards: int = 0
    round_tokens: int = 0  # tokens emitted by verification rounds (accepted + bonus)
    accepted_hist: Counter = field(default_factory=Counter)  # accepted draft length -> rounds
    depth_attempts: Counter = field(default_factory=Counter)  # depth k -> rounds reaching k - 1
    depth_accepts: Counter = field(default_factory=Counter)  # depth k -> rounds accepting depth k
    tree_tokens: int = 0  # draft nodes sent to verification, summed
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    transfer_bytes: int = 0  # bytes crossing devices (eval.placement: placed drafters), summed

    @property
    def tau(self) -> float:
        return self.round_tokens / max(self.verify_forwards, 1)

    @property
    def depth_acceptance(self) -> dict[int, float]:
        return {k: self.depth_accepts[k] / self.depth_attempts[k] for k in sorted(self.depth_attempts)
                if self.depth_attempts[k]}

    @property
    def other_s(self) -> float:
        return max(self.total_s - self.prefill_s - self.draft_s - self.verify_s, 0.0)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def merge(self, other: "DecodeStats") -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in ("accepted_hist", "depth_attempts", "depth_accepts"):
            out[name] = {str(k): v for k, v in sorted(getattr(self, name).items())}
        out.update(tau=self.tau, depth_acceptance={str(k): v for k, v in self.depth_acceptance.items()},
                   other_s=self.other_s, tokens_per_s=self.tokens_per_s)
        return out


@dataclass
class DecodeResult:
    tokens: list[int]  # the new tokens (prompt excluded)
    stats: DecodeStats


class SpeculativeDecoder:
    def __init__(self, target: TargetModel, drafter: Drafter | None = None, config: DecodeConfig | None = None):
        self.target = target
        self.drafter = drafter or NoDrafter()
        self.config = config or DecodeConfig()
        if self.drafter.tokenizer is not None:
            check_same_tokenizer(target.tokenizer, self.drafter.tokenizer, what=f"{self.drafter.name} drafter")

    def _pick(self, logits: torch.Tensor, generator: torch.Generator | None) -> int:
        """First token after the prompt: target argmax, or a sample from the warped target."""
        sampling = self.config.sampling
        if sampling is None:
            return int(logits.argmax())
        return int(torch.multinomial(sampling.probs(logits), 1, generator=generator))

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor) -> DecodeResult:
        """input_ids (1, T) -> up to max_new_tokens new tokens (stops after an EOS)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError("SpeculativeDecoder.generate takes input_ids of shape (1, T)")
        config, target, drafter = self.config, self.target, self.drafter
        sampling = config.sampling
        device = target.device
        generator = torch.Generator(device=device).manual_seed(config.seed) if sampling else None
        eos = target.eos_token_ids if config.stop_on_eos else set()
        layers = tuple(drafter.hidden_layers)
        stats = DecodeStats()
        start = time.perf_counter()

        prompt = input_ids.to(device)
        cache = target.new_cache()
        out = target.forward(prompt, cache, hidden_layers=layers)
        root = self._pick(out.logits[0, -1], generator)
        drafter.begin(prompt[0])
        drafter.observe(prompt[0], {k: v[0] for k, v in out.hidden.items()})
        generated = [root]
        context = torch.cat([prompt[0], torch.tensor([root], device=device)])
        stats.prefill_s = time.perf_counter() - start

        while len(generated) < config.max_new_tokens and root not in eos:
            tick = time.perf_counter()
            tree = drafter.propose(root, context, sampling, generator)
            if tree.size > config.max_tree_tokens:
                raise ValueError(f"{drafter.name} proposed {tree.size} tree tokens; the budget is "
                                 f"max_tree_tokens={config.max_tree_tokens}")
            tock = time.perf_counter()
            accepted, next_token, hidden = self._verify(tree, root, cache, layers, generator)
            stats.verify_s += time.perf_counter() - tock
            stats.draft_s += tock - tick

            new_tokens = tree.tokens[accepted].tolist() + [next_token]
            drafter.observe(torch.tensor([root] + new_tokens[:-1], device=device), hidden)
            self._record(stats, tree, len(accepted))
            for token in new_tokens:  # stop at max_new_tokens or just after an EOS
                if len(generated) >= config.max_new_tokens:
                    break
                generated.append(token)
                if token in eos:
                    break
            root = generated[-1]
            context = torch.cat([context, torch.tensor(new_tokens, device=device)])
        stats.total_s = time.perf_counter() - start
        stats.new_tokens = len(generated)
        return DecodeResult(tokens=generated, stats=stats)

    def _verify(self, tree: DraftTree, root: int, cache, layers, generator):
        """One target forward over [root, tree]; commit the accepted path's KV.

        Returns (accepted node ids, next token, hidden states of the committed slots).
        """
        target, device = self.target, self.target.device
        past = cache.get_seq_length()
        input_ids = torch.cat([torch.tensor([root], device=device), tree.tokens.to(device)])[None]
        is_chain = bool((tree.parents == torch.arange(tree.size, device=tree.parents.device) - 1).all())
        if is_chain:  # a chain is ordinary causal attention at consecutive positions
            out = target.forward(input_ids, cache, hidden_layers=layers)
        else:
            allowed = tree_attention_mask(tree.parents.to(device), past)
            positions = tree_position_ids(tree.depths.to(device), past)
            out = target.forward(input_ids, cache, positions, allowed, hidden_layers=layers)
        logits = out.logits[0]  # (n+1, V)
        sampling = self.config.sampling
        if sampling is None:
            accepted, next_token = verify_greedy(tree, logits)
        else:
            accepted, next_token = verify_sampling(tree, sampling.probs(logits), generator)
        slots = torch.tensor([0] + [node + 1 for node in accepted], device=device)
        commit_kv(cache, torch.cat([torch.arange(past, device=device), past + slots]))
        hidden = {k: v[0, slots] for k, v in out.hidden.items()}  # (m, H) per layer
        return accepted, next_token, hidden

    @staticmethod
    def _record(stats: DecodeStats, tree: DraftTree, accepted: int) -> None:
        stats.verify_forwards += 1
        stats.round_tokens += accepted + 1
        stats.tree_tokens += tree.size
        stats.accepted_hist[accepted] += 1
        for depth in range(1, tree.max_depth + 1):
            if accepted >= depth - 1:
                stats.depth_attempts[depth] += 1
                stats.depth_accepts[depth] += int(accepted >= depth)
