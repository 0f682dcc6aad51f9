"""Self-Draft: training-free multi-branch drafting inside the target's own forward pass.

Spec: Self-Draft (`../shared/papers/003_26c0a1964e9679f6.txt`), "Methods" and Algorithm 1.

One target forward per step processes, after the committed cache,
    [root | candidate trie | branch_1 | ... | branch_N]
  - root: the last committed token (its logits give the next token, x_t);
  - candidate trie: the drafts C retrieved from the caches for the root, merged into a trie
    (the paper verifies each candidate as its own block; a trie of the same candidates gives the
    same longest accepted prefix with fewer slots); positions past + depth, tree mask;
  - draft branches tau_i (i = 1..N): each a short token sequence started from random padding
    tokens, placed right after the root (positions past + 1 ...). Attention: every branch token
    sees the committed cache, the root, and the preceding tokens of its own branch only - N
    lower-triangular blocks on the diagonal (paper Figure 3b); branches and candidates never
    see each other. The prediction at branch token j is the draft token D_{i,j}
    ("x_t, D = S(P_M(Y | [X; T]))").
Branch update: tau_i <- [tau_i; D_{i,|tau_i|}] (only the last draft token is appended); once a
branch holds L tokens its first token is dropped (maximum branch length L).
Context cache: every window of the branch ending at token j gives the gram
d = [tau_{i, j-G+2 .. j}; D_{i,j}] of length G (global gram length G = 4, the paper's choice);
its first token is the key and the remaining G - 1 tokens the value, kept in an LRU queue per
key token (`cache_size` entries). Candidates for the next step are the LRU entries keyed by the
root (most recent first), then the optional corpus cache (section "Draft Cache
Initialization": n-gram co-occurrence statistics of a corpus; longer prefixes and higher
frequencies first), at most `max_candidates` distinct ones. The decoded tokens of a step are the
longest accepted candidate prefix plus the target's next token.

Only the root and the accepted trie path are committed to the KV cache (`commit_kv`); branch and
rejected candidate slots are dropped. Losslessness: candidates and branch tokens are
deterministic functions of the history (argmax even when sampling), so candidates are point
masses for `verify_sampling`; at temperature 0 the output equals greedy decoding.
tau = tokens per target forward (as in eval.decode.decoder); the "tree_tokens" stat counts every
speculative slot (candidates + branch tokens), since all of them cost verification compute.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from draftsmith.config import ConfigError, TextEnum, check_config, option
from draftsmith.data.sources import load_source
from draftsmith.eval.decode.decoder import DecodeConfig, DecodeResult, Generation, Method
from draftsmith.eval.decode.tree import DraftTree, ancestor_matrix, trie
from draftsmith.models.kernels import argmax_last
from draftsmith.models.target import TargetModel


class PadSource(TextEnum):
    """Where a branch's random padding tokens come from."""

    PROMPT = "prompt"
    VOCAB = "vocab"


@dataclass
class SelfDraftConfig:
    # The defaults: the best measured on the compiled CPU engine (a forward of at most 9 tokens: the root, 2 candidates
    # of 2 tokens, 2 branches of 2; results/drafter_families_zen4 "Self-Draft's settings"); the paper's GPU setting
    # (N = 6 branches, G = 4) verifies ~25 tokens a forward, which costs a CPU ~1.6 target steps. On the AVX2 EPYC,
    # where a forward of 3 tokens already costs 1.28 steps, forwards of 3-5 (grams of 2, one branch) were no better:
    # 0.91-1.01x against this default's 0.97x (results/drafter_families_epyc_avx2, "Self-Draft's narrow settings").
    branches: int = option(2, "N draft branches (the paper uses 6 on a GPU)", ge=0)
    length: int = option(2, "L, maximum branch length", ge=1)
    gram: int = option(3, "G, global gram length (key token + G - 1 continuation tokens; the paper's 4)", ge=2)
    cache_size: int = option(8, "LRU entries per key token", ge=1)
    candidates: int = option(2, "candidates verified per forward", ge=0)
    init_length: int = option(1, "random padding tokens per branch at the start", ge=1)
    pad: PadSource = option(PadSource.PROMPT, "where random padding tokens come from")
    corpus: str | None = option(None, "data.sources spec for the corpus cache, e.g. gsm8k:train (optional)")
    corpus_limit: int = option(1000, "conversations read for the corpus cache", ge=1)
    corpus_top: int = option(4, "continuations kept per corpus prefix", ge=1)
    seed: int = option(0, "seed of the random padding tokens")

    def __post_init__(self):
        check_config(self)
        if self.init_length > self.length:
            raise ConfigError("self-draft: need init_length <= length")
        if self.branches > 0 and self.length < self.gram - 1:
            raise ConfigError(f"self-draft: need length >= gram - 1 = {self.gram - 1} (a gram takes gram - 1 tokens "
                              "of one branch: shorter branches never fill the context cache)")


class NgramCache:
    """Context cache: an LRU queue of continuations per prefix token."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.entries: dict[int, OrderedDict] = {}

    def insert(self, gram: list[int]) -> None:
        """gram = [key, c_1, ..., c_{G-1}]: (re)inserted as the most recently used entry of key."""
        key, value = int(gram[0]), tuple(int(t) for t in gram[1:])
        queue = self.entries.setdefault(key, OrderedDict())
        queue.pop(value, None)
        queue[value] = None
        while len(queue) > self.capacity:
            queue.popitem(last=False)  # least recently used

    def lookup(self, key: int, limit: int) -> list[tuple[int, ...]]:
        """Up to `limit` continuations of key, most recently used first."""
        queue = self.entries.get(int(key))
        return list(reversed(queue))[:limit] if queue else []


class CorpusCache:
    """Static n-gram statistics of a corpus: prefix (1 or 2 tokens) -> frequent continuations."""

    def __init__(self, sequences: list[list[int]], gram: int, top: int, max_prefix: int = 2):
        self.max_prefix = max_prefix
        counts: dict[tuple, Counter] = {}
        follow = gram - 1
        for seq in sequences:
            for prefix_len in range(1, max_prefix + 1):
                for start in range(len(seq) - prefix_len - follow + 1):
                    prefix = tuple(seq[start:start + prefix_len])
                    continuation = tuple(seq[start + prefix_len:start + prefix_len + follow])
                    counts.setdefault(prefix, Counter())[continuation] += 1
        self.table = {prefix: [c for c, _ in counter.most_common(top)] for prefix, counter in counts.items()}

    def lookup(self, context: list[int], limit: int) -> list[tuple[int, ...]]:
        """Longer prefixes first, then higher frequency (the paper's retrieval priority)."""
        found = []
        for prefix_len in range(self.max_prefix, 0, -1):
            if len(context) >= prefix_len:
                found.extend(self.table.get(tuple(context[-prefix_len:]), []))
        return found[:limit]


def candidate_trie(candidates: list[tuple[int, ...]]) -> tuple[list[int], list[int]]:
    """(tokens, parents) of the trie of candidate sequences, in first-seen (topological) order."""
    return trie(candidates)


def selfdraft_mask(tree_parents: torch.Tensor, branch_lengths: list[int], past_len: int) -> torch.Tensor:
    """Bool (1, 1, S, past + S) 'may attend' mask for [root | trie | branches], S = 1 + n + sum(lengths).

    The root and trie follow the tree mask; each branch is a causal block that also sees the
    root, and nothing else of the new slots (block-diagonal branches).
    """
    n = tree_parents.numel()
    total = 1 + n + sum(branch_lengths)
    allowed = torch.zeros(total, past_len + total, dtype=torch.bool, device=tree_parents.device)
    allowed[:, :past_len] = True
    allowed[: n + 1, past_len: past_len + n + 1] = ancestor_matrix(tree_parents)
    start = 1 + n
    for length in branch_lengths:
        rows = slice(start, start + length)
        allowed[rows, past_len] = True  # the root
        block = torch.ones(length, length, dtype=torch.bool, device=tree_parents.device).tril()
        allowed[rows, past_len + start: past_len + start + length] = block
        start += length
    return allowed[None, None]


def selfdraft_positions(tree_depths: torch.Tensor, branch_lengths: list[int], past_len: int) -> torch.Tensor:
    """Position ids (1, S): root past, trie node past + depth, branch token j past + 1 + j."""
    parts = [torch.zeros(1, dtype=torch.long), tree_depths.long().cpu()]
    parts += [torch.arange(1, length + 1) for length in branch_lengths]
    return (torch.cat(parts) + past_len)[None].to(tree_depths.device)


def branch_grams(branch: list[int], drafts: list[int], gram: int) -> list[list[int]]:
    """Grams [tau_{j-G+2..j}; D_j] (length G) from one branch and its per-token draft tokens."""
    span = gram - 1  # branch tokens per gram
    return [branch[j - span + 1: j + 1] + [drafts[j]] for j in range(span - 1, len(branch))]


class SelfDraftDecoder:
    """The Self-Draft loop (Algorithm 1) on the decoder's Generation; `.generate((1, T)) -> DecodeResult`."""

    def __init__(self, target: TargetModel, config: DecodeConfig, policy: "SelfDraftPolicy"):
        self.target, self.config, self.policy = target, config, policy
        self.sd = policy.config

    def _initial_branches(self, prompt: list[int], generator: torch.Generator) -> list[list[int]]:
        sd = self.sd
        if sd.pad is PadSource.PROMPT:
            pool = torch.tensor(prompt)
            picks = torch.randint(0, pool.numel(), (sd.branches, sd.init_length), generator=generator)
            return pool[picks].tolist()
        vocab = self.target.model.config.vocab_size
        return torch.randint(0, vocab, (sd.branches, sd.init_length), generator=generator).tolist()

    def _candidates(self, root: int, context: list[int], context_cache: NgramCache) -> DraftTree:
        """The candidate trie for the root: LRU context-cache entries, then corpus-cache entries."""
        sd, device = self.sd, self.target.device
        candidates = list(dict.fromkeys(context_cache.lookup(root, sd.candidates)))
        if self.policy.corpus is not None and len(candidates) < sd.candidates:
            for candidate in self.policy.corpus.lookup(context, sd.candidates):
                if candidate not in candidates and len(candidates) < sd.candidates:
                    candidates.append(candidate)
        tokens, parents = candidate_trie(candidates)
        return DraftTree.from_parents(torch.tensor(tokens, dtype=torch.long, device=device),
                                      torch.tensor(parents, dtype=torch.long, device=device))

    def _update_branches(self, branches: list[list[int]], branch_logits: torch.Tensor,
                         context_cache: NgramCache) -> None:
        """Branch drafts (argmax: deterministic) -> context-cache grams, then each branch grows by one."""
        predicted = argmax_last(branch_logits).tolist()
        offset = 0
        for i, branch in enumerate(branches):
            drafts = predicted[offset: offset + len(branch)]
            offset += len(branch)
            for gram in branch_grams(branch, drafts, self.sd.gram):
                context_cache.insert(gram)
            branches[i] = (branch + [drafts[-1]])[-self.sd.length:]

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor) -> DecodeResult:
        gen = Generation(self.target, self.config, input_ids, prompt_cache=self.policy.kept_prompt(self.config))
        branches = self._initial_branches(gen.prompt.tolist(), torch.Generator().manual_seed(self.sd.seed))
        context_cache = NgramCache(self.sd.cache_size)
        context = gen.context.tolist()
        while not gen.done:
            with gen.drafting():
                tree = self._candidates(gen.root, context, context_cache)
                lengths = [len(b) for b in branches]
                gen.check_budget(tree, "self-draft", slots=tree.size + sum(lengths))
                past = self.target.cache_length(gen.cache)
                allowed = selfdraft_mask(tree.parents, lengths, past)
                positions = selfdraft_positions(tree.depths, lengths, past)
            round = gen.verify(tree, extra_tokens=[t for b in branches for t in b], allowed=allowed,
                               positions=positions)
            with gen.drafting():
                self._update_branches(branches, round.logits[tree.size + 1:], context_cache)
            gen.stats.tree_tokens += sum(lengths)  # branch slots cost verification compute too
            gen.advance(round)
            context.extend(round.new_tokens)
        return gen.result()


class SelfDraftPolicy(Method):
    """A decoding method: holds the config and the shared corpus cache."""

    def __init__(self, config: SelfDraftConfig | None = None, tokenizer=None, name: str = "self-draft"):
        self.config = config or SelfDraftConfig()
        self.name = name
        self.corpus = None
        if self.config.corpus:
            if tokenizer is None:
                raise ConfigError("self-draft: a corpus cache needs the target's tokenizer")
            self.corpus = CorpusCache(corpus_sequences(self.config.corpus, tokenizer, self.config.corpus_limit),
                                      self.config.gram, self.config.corpus_top)

    def make_decoder(self, target: TargetModel, config: DecodeConfig) -> SelfDraftDecoder:
        return SelfDraftDecoder(target, config, self)


def corpus_sequences(spec: str, tokenizer, limit: int) -> list[list[int]]:
    """Token ids of every message text of a data.sources spec (no chat template: plain text)."""
    conversations = load_source(spec, limit=limit)
    return [tokenizer(message["content"], add_special_tokens=False)["input_ids"]
            for conv in conversations for message in conv.messages if message.get("content")]
