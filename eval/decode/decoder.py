"""The speculative decoding loop: prefill, then {propose, verify in one target forward, commit}.

Batch size 1. The loop is thin: trees, masks and verification are pure functions in
`eval.decode.tree` / `eval.decode.verify`; drafters plug in through `eval.decode.drafters.base.Drafter`.
The pieces of the loop are public so that policies which change the loop itself
(`eval.policies.pipeline`, `eval.policies.selfdraft`) and the profiler reuse them instead of copying it:

    gen = Generation(target, config, input_ids, hidden_layers)   # prefill, first token
    while not gen.done:
        with gen.drafting():
            tree = drafter.propose(gen.root, gen.context, gen.sampling, gen.generator)
        round = gen.verify(tree, hidden_layers)                   # one forward, verification, KV commit
        with gen.drafting():                                      # the drafter's bookkeeping is drafting too
            drafter.observe(round.committed, round.hidden)
        gen.advance(round)                                        # stats, emission with EOS/max stops
    result = gen.result()

Metrics (one definition everywhere, see README):
  tau          = tokens produced by verification forwards / verification forwards (the bonus token
                 included, the prefill's first token excluded); plain decoding has tau = 1.
  depth accept = a_k = P(node at depth k accepted | depth k-1 accepted), over rounds whose tree
                 reached depth k.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields

import torch

from draftsmith.config import check_config, option
from draftsmith.errors import UserError
from draftsmith.eval.decode.drafters.base import Drafter, InputError, NoDrafter, Sampling, check_types
from draftsmith.eval.decode.tree import DraftTree, tree_attention_mask, tree_position_ids
from draftsmith.eval.decode.verify import greedy_path, verify_greedy, verify_sampling
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import KernelIsa, argmax_last
from draftsmith.models.target import TargetModel, check_same_tokenizer


BUDGET_LIMIT = 63  # the largest draft tree by default: with its root, the compiled engine's largest bucket (64)
PREFIX_CACHE = True  # requests start from the slots they share with the decoder's last one (DecodeConfig)


@dataclass
class DecodeConfig:
    max_new_tokens: int = option(128, "new tokens per request (the prefill's first token included)", ge=1)
    temperature: float = option(0.0, "0 = greedy; > 0 = speculative sampling at this temperature", ge=0)
    top_k: int = option(0, "sampling: keep the k most likely tokens (0: off)", ge=0)
    top_p: float = option(1.0, "sampling: nucleus mass", gt=0, le=1)
    budget_limit: int = option(BUDGET_LIMIT, "the largest tree a drafter may propose (+ the root: the compiled "
                                             "engine's largest bucket; verification cost grows with it)", ge=0)
    stop_on_eos: bool = option(True, "stop after an end-of-sequence token")
    seed: int = option(0, "sampling seed")
    prefix_cache: bool = option(PREFIX_CACHE, "start each request from the KV cache of the method's last one where "
                                              "their tokens agree (a conversation's next turn, a shared system "
                                              "prompt), as llama.cpp's cache_prompt and vLLM's prefix caching do")

    def __post_init__(self):
        check_config(self)

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
    reused_tokens: int = 0  # prompt tokens whose KV came from the decoder's last request (DecodeConfig.prefix_cache)
    draft_s: float = 0.0  # everything the drafter does: begin and observe (its own context), propose
    verify_s: float = 0.0
    total_s: float = 0.0
    transfer_bytes: int = 0  # bytes crossing devices (eval.policies.placement: placed drafters), summed
    verify_width_rounds: Counter = field(default_factory=Counter)  # tokens in a verify forward -> rounds
    verify_width_s: Counter = field(default_factory=Counter)  # tokens in a verify forward -> seconds, summed

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

    @property
    def draft_ms_per_round(self) -> float:
        return 1000 * self.draft_s / self.verify_forwards if self.verify_forwards else 0.0

    COUNTERS = ("accepted_hist", "depth_attempts", "depth_accepts", "verify_width_rounds", "verify_width_s")

    @property
    def verify_ms_by_width(self) -> dict[int, float]:
        """The mean cost of a verify forward of w tokens (root included) in the decode loop: the in-loop T(w)."""
        return {w: 1000 * self.verify_width_s[w] / n for w, n in sorted(self.verify_width_rounds.items()) if n}

    @classmethod
    def from_dict(cls, data: dict) -> "DecodeStats":
        """The inverse of to_dict (derived entries such as tau are recomputed, not read)."""
        known = {item.name for item in fields(cls)}
        return cls(**{name: Counter({int(k): v for k, v in value.items()}) if name in cls.COUNTERS else value
                      for name, value in data.items() if name in known})

    def merge(self, other: "DecodeStats") -> None:
        for name, value in vars(other).items():
            setattr(self, name, getattr(self, name) + value)

    def record(self, tree: DraftTree, accepted: int) -> None:
        """One verification round that accepted `accepted` draft tokens of `tree`."""
        self.verify_forwards += 1
        self.round_tokens += accepted + 1
        self.tree_tokens += tree.size
        self.accepted_hist[accepted] += 1
        for depth in range(1, tree.max_depth + 1):
            if accepted >= depth - 1:
                self.depth_attempts[depth] += 1
                self.depth_accepts[depth] += int(accepted >= depth)

    def to_dict(self) -> dict:
        out = asdict(self)
        for name in self.COUNTERS:
            out[name] = {str(k): v for k, v in sorted(getattr(self, name).items())}
        out.update(tau=self.tau, depth_acceptance={str(k): v for k, v in self.depth_acceptance.items()},
                   other_s=self.other_s, tokens_per_s=self.tokens_per_s)
        return out


@dataclass
class DecodeResult:
    tokens: list[int]  # the new tokens (prompt excluded)
    stats: DecodeStats | None  # None for decoders that are not ours (HF generate baselines)


@dataclass
class Round:
    """One verification round: the tree, what the target accepted, and the forward's outputs."""

    root: int
    tree: DraftTree
    accepted: list[int]  # accepted node ids, root's child first
    next_token: int  # the target's token after the accepted path (bonus / correction)
    hidden: dict[int, torch.Tensor]  # layer -> (m, H) hidden states of the committed slots
    logits: torch.Tensor | None  # (slots, V) float32 logits of the whole forward (extra slots included); None
    # where a greedy verify read its accepted path's tokens row by row (models.engine.GreedyRows)

    @property
    def new_tokens(self) -> list[int]:
        return self.tree.tokens[self.accepted].tolist() + [self.next_token]

    @property
    def committed(self) -> torch.Tensor:
        """The tokens now in the target's cache for this round: the root and the accepted nodes."""
        return torch.tensor([self.root] + self.new_tokens[:-1], device=self.tree.tokens.device)


def check_input_ids(input_ids, vocab_size: int, max_positions: int | None, max_new_tokens: int) -> None:
    """Refuse, in one line naming the value and what is valid, prompt ids the decoder cannot take."""
    if not isinstance(input_ids, torch.Tensor):
        raise InputError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise InputError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise InputError(f"input_ids must have shape (1, T): one request at a time, got {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise InputError("input_ids is empty: give at least one prompt token")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise InputError(f"input_ids holds ids from {low} to {high}; the target's vocabulary is 0..{vocab_size - 1}")
    if max_positions is not None and input_ids.shape[1] + max_new_tokens > max_positions:
        raise InputError(f"{input_ids.shape[1]} prompt tokens + max_new_tokens={max_new_tokens} exceed the target's "
                         f"{max_positions} positions: shorten the prompt or lower max_new_tokens")


def check_parts(target, drafter, config) -> None:
    """A decoder's parts are the toolkit's types (a name or a dict in their place is one line, not an
    AttributeError from inside the loop)."""
    check_types("", [("target", target, TargetModel, "TargetModel.from_pretrained(...)"),
                     ("drafter", drafter, (Drafter, type(None)), "a Drafter, e.g. NgramDrafter() (None: plain)"),
                     ("config", config, (DecodeConfig, type(None)), "DecodeConfig(max_new_tokens=...)")])


class PromptCache:
    """The target's KV cache after a decoder's last request, the tokens it holds and their hidden states (the
    layers that decoder's drafter reads). The next request takes the slots of their longest common prefix and
    prefills only the rest. With batch-invariant forwards (the compiled engine's kernels) a slot holds the same
    bits whether a prefill, a step or a verify wrote it, so outputs are the same with or without the cache."""

    def __init__(self):
        self.target: TargetModel | None = None
        self.cache = None
        self.tokens = torch.empty(0, dtype=torch.long)
        self.hidden: dict[int, torch.Tensor] = {}

    def take(self, target: TargetModel, prompt: torch.Tensor, layers: tuple[int, ...], max_length: int):
        """(cache, reused slots, {layer: their hidden states}) for a request of `prompt` (at least its last token
        is left to prefill, for the first token's logits); (None, 0, {}) where nothing can be reused."""
        cache, self.cache = self.cache, None  # the request owns it now
        usable = (cache is not None and self.target is target and set(layers) <= set(self.hidden)
                  and target.fits(max_length))
        n = min(self.tokens.numel(), prompt.numel() - 1) if usable else 0
        same = (self.tokens[:n] == prompt[:n].to(self.tokens.device)).long().cumprod(0)
        reused = int(same.sum())
        if reused == 0:
            return None, 0, {}
        target.truncate(cache, reused)
        return cache, reused, {k: self.hidden[k][:reused] for k in layers}

    def keep(self, target: TargetModel, cache, tokens: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self.target, self.cache, self.tokens, self.hidden = target, cache, tokens, hidden


class Generation:
    """One request: prefill, then verification rounds, token emission with the EOS / max-token stop,
    stats. The loops of SpeculativeDecoder, the pipeline and Self-Draft are built from it. With a `prompt_cache`
    the request starts from the slots it shares with the last one and leaves its own cache there when done."""

    def __init__(self, target: TargetModel, config: DecodeConfig, input_ids: torch.Tensor,
                 hidden_layers: tuple[int, ...] = (), prompt_cache: PromptCache | None = None):
        check_input_ids(input_ids, target.config.vocab_size, target.max_positions, config.max_new_tokens)
        self.target, self.config = target, config
        self.sampling = config.sampling
        device = target.device
        self.generator = torch.Generator(device=device).manual_seed(config.seed) if self.sampling else None
        self.eos = target.eos_token_ids if config.stop_on_eos else set()
        self.stats = DecodeStats()
        self.start = time.perf_counter()
        self.prompt = input_ids.to(device)[0]
        self.prompt_cache, self.layers = prompt_cache, tuple(hidden_layers)
        max_length = self.prompt.numel() + config.max_new_tokens + config.budget_limit + 1
        self.cache, reused, earlier = (prompt_cache.take(target, self.prompt, self.layers, max_length)
                                       if prompt_cache is not None else (None, 0, {}))
        self.cache = self.cache if self.cache is not None else target.new_cache(max_length)
        out = target.forward(self.prompt[None, reused:], self.cache, hidden_layers=self.layers, last_only=True,
                             argmax_only=self.sampling is None)
        self.prefill_hidden = {k: torch.cat([earlier[k], v[0]]) if reused else v[0] for k, v in out.hidden.items()}
        self.kept_hidden = {k: [v] for k, v in self.prefill_hidden.items()}  # every cache slot's, for prompt_cache
        self.stats.reused_tokens = reused
        self.root = self.pick(out.logits[0, -1])
        self.generated = [self.root]
        self.context = torch.cat([self.prompt, torch.tensor([self.root], device=device)])
        self.stats.prefill_s = time.perf_counter() - self.start

    def pick(self, logits: torch.Tensor) -> int:
        """A token from the target's logits (V,): argmax, or a draw from the warped target."""
        if self.sampling is None:
            return int(argmax_last(logits))
        return int(torch.multinomial(self.sampling.probs(logits), 1, generator=self.generator))

    @property
    def done(self) -> bool:
        return len(self.generated) >= self.config.max_new_tokens or self.root in self.eos

    @contextlib.contextmanager
    def drafting(self) -> Iterator[None]:
        """Time spent inside the block counts as drafting time."""
        tick = time.perf_counter()
        try:
            yield
        finally:
            self.stats.draft_s += time.perf_counter() - tick

    def check_budget(self, tree: DraftTree, name: str, slots: int | None = None) -> None:
        used = tree.size if slots is None else slots
        if used > self.config.budget_limit:
            raise UserError(f"{name} proposed {used} tree tokens; the limit is budget_limit="
                            f"{self.config.budget_limit}")

    def verify(self, tree: DraftTree, hidden_layers: tuple[int, ...] = (), extra_tokens: list[int] | None = None,
               allowed: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> Round:
        """One target forward over [root, tree (, extra slots)], verification of the tree, KV commit of the
        accepted path. `extra_tokens` with their full `allowed` mask and `positions` (Self-Draft's
        branches) ride along in the same forward; their logits come back in Round.logits (a greedy verify without
        them may read only its accepted path's tokens: models.engine.GreedyRows, no logits)."""
        tick = time.perf_counter()
        target, device = self.target, self.target.device
        past = target.cache_length(self.cache)
        ids = [self.root] + tree.tokens.tolist() + list(extra_tokens or [])
        input_ids = torch.tensor([ids], device=device)
        is_chain = tree.parents.tolist() == list(range(-1, tree.size - 1))
        greedy = self.sampling is None
        rows = greedy and extra_tokens is None  # no slot's logits are read: only the accepted path's tokens
        if allowed is None and is_chain and not extra_tokens:  # a chain is plain causal attention
            out = target.forward(input_ids, self.cache, hidden_layers=hidden_layers, argmax_only=greedy,
                                 greedy_rows=rows)
        else:
            if allowed is None:
                allowed = tree_attention_mask(tree.parents.to(device), past)
                positions = tree_position_ids(tree.depths.to(device), past)
            out = target.forward(input_ids, self.cache, positions, allowed, hidden_layers=hidden_layers,
                                 argmax_only=greedy, greedy_rows=rows)
        logits = None if out.logits is None else out.logits[0]  # (slots, V)
        if out.greedy is not None:
            accepted, next_token = greedy_path(tree, out.greedy)
        elif self.sampling is None:
            accepted, next_token = verify_greedy(tree, logits[: tree.size + 1])
        else:
            probs = self.sampling.probs(logits[: tree.size + 1])
            accepted, next_token = verify_sampling(tree, probs, self.generator)
        slots = torch.tensor([0] + [node + 1 for node in accepted], device=device)
        if accepted == list(range(len(accepted))):  # the path is the slots right after the root: nothing moves
            target.truncate(self.cache, past + 1 + len(accepted))
        else:
            target.commit(self.cache, torch.cat([torch.arange(past, device=device), past + slots]))
        hidden = {k: v[0, slots] for k, v in out.hidden.items()}  # (m, H) per layer
        if self.prompt_cache is not None:
            for k in self.layers:
                self.kept_hidden[k].append(hidden[k])
        seconds = time.perf_counter() - tick
        self.stats.verify_s += seconds
        self.stats.verify_width_s[len(ids)] += seconds
        self.stats.verify_width_rounds[len(ids)] += 1
        return Round(self.root, tree, accepted, next_token, hidden, logits)

    def advance(self, round: Round) -> list[int]:
        """Record the round and emit its tokens, stopping at max_new_tokens or just after an EOS;
        returns the emitted tokens."""
        self.stats.record(round.tree, len(round.accepted))
        emitted = []
        for token in round.new_tokens:
            if len(self.generated) >= self.config.max_new_tokens:
                break
            self.generated.append(token)
            emitted.append(token)
            if token in self.eos:
                break
        self.root = self.generated[-1]
        self.context = torch.cat([self.context, torch.tensor(round.new_tokens, device=self.context.device)])
        return emitted

    def result(self) -> DecodeResult:
        if self.prompt_cache is not None:  # the cache holds the context but its last token (the next root)
            held = self.target.cache_length(self.cache)
            self.prompt_cache.keep(self.target, self.cache, self.context[:held].cpu(),
                                   {k: torch.cat(v)[:held] for k, v in self.kept_hidden.items()})
        self.stats.total_s = time.perf_counter() - self.start
        self.stats.new_tokens = len(self.generated)
        return DecodeResult(tokens=list(self.generated), stats=self.stats)


class SpeculativeDecoder:
    """Speculative decoding of one target with one drafter (NoDrafter: plain decoding in our loop)."""

    def __init__(self, target: TargetModel, drafter: Drafter | None = None, config: DecodeConfig | None = None,
                 prompt_cache: PromptCache | None = None):
        check_parts(target, drafter, config)
        self.target = target
        self.drafter = drafter or NoDrafter()
        self.config = config or DecodeConfig()
        self.prompt_cache = (prompt_cache or PromptCache()) if self.config.prefix_cache else None
        if self.drafter.tokenizer is not None:
            check_same_tokenizer(target.tokenizer, self.drafter.tokenizer, what=f"{self.drafter.name} drafter")

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor) -> DecodeResult:
        """input_ids (1, T) -> up to max_new_tokens new tokens (stops after an EOS)."""
        drafter, layers = self.drafter, tuple(self.drafter.hidden_layers)
        gen = Generation(self.target, self.config, input_ids, layers, self.prompt_cache)
        with gen.drafting():  # the drafter's work on the prompt (a feature drafter's context) is drafting too
            if self.prompt_cache is None:
                drafter.forget()
            drafter.begin(gen.prompt)
            drafter.observe(gen.prompt, gen.prefill_hidden)
        while not gen.done:
            with gen.drafting():
                tree = drafter.propose(gen.root, gen.context, gen.sampling, gen.generator)
            gen.check_budget(tree, drafter.name)
            round = gen.verify(tree, layers)
            with gen.drafting():
                drafter.observe(round.committed, round.hidden)
            gen.advance(round)
        return gen.result()


class Method:
    """What a method spec builds (eval.bench.methods): a way to decode one request at a time.

    `make_decoder(target, config)` returns an object with `generate(input_ids (1, T)) -> DecodeResult`;
    `summary()` reports a policy's internal state (weights, thresholds, hit counts) for the bench.
    """

    name = "method"
    drafter: Drafter | None = None
    backend: Backend | None = None  # the engine this method's target needs (None: the run's backend)
    kernel_isa: KernelIsa | None = None  # the batch-invariant kernels' instruction set it runs on (None: the run's)

    def make_decoder(self, target: TargetModel, config: DecodeConfig):
        raise NotImplementedError

    def kept_prompt(self, config: DecodeConfig) -> PromptCache | None:
        """This method's PromptCache, kept from request to request (None where config.prefix_cache is off)."""
        if not config.prefix_cache:
            return None
        if "_prompt_cache" not in vars(self):
            self._prompt_cache = PromptCache()
        return self._prompt_cache

    def summary(self) -> dict | None:
        return self.drafter.summary() if self.drafter is not None else None


class DrafterMethod(Method):
    """A drafter run by the SpeculativeDecoder (None: our loop without a drafter)."""

    def __init__(self, drafter: Drafter | None, name: str, backend: Backend | None = None,
                 kernel_isa: KernelIsa | None = None):
        self.drafter, self.name, self.backend, self.kernel_isa = drafter, name, backend, kernel_isa

    def make_decoder(self, target: TargetModel, config: DecodeConfig) -> SpeculativeDecoder:
        return SpeculativeDecoder(target, self.drafter, config, self.kept_prompt(config))
