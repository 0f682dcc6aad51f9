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
tau = tokens per target forward (as in eval.decoder); the "tree_tokens" stat counts every
speculative slot (candidates + branch tokens), since all of them cost verification compute.
"""

from __future__ import annotations

import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from draftsmith.eval.decoder import DecodeConfig, DecodeResult, DecodeStats, SpeculativeDecoder
from draftsmith.eval.tree import DraftTree, ancestor_matrix
from draftsmith.eval.verify import verify_greedy, verify_sampling
from draftsmith.models.target import TargetModel, commit_kv


@dataclass
class SelfDraftConfig:
    branches: int = 3  # N draft branches (the paper uses 6 on a GPU; CPU verification cost grows fast)
    length: int = 4  # L, maximum branch length
    gram: int = 4  # G, global gram length (key token + G - 1 continuation tokens)
    cache_size: int = 8  # LRU entries per key token
    max_candidates: int = 4  # candidates verified per forward
    init_length: int = 1  # random padding tokens per branch at the start
    pad: str = "prompt"  # where random padding tokens come from: prompt | vocab
    corpus: str | None = None  # optional data.sources spec for the corpus cache, e.g. gsm8k:train
    corpus_limit: int = 1000  # conversations read for the corpus cache
    corpus_top: int = 4  # continuations kept per corpus prefix
    seed: int = 0

    def __post_init__(self):
        if self.branches < 0 or self.length < 1 or self.gram < 2 or self.max_candidates < 0:
            raise ValueError("need branches >= 0, length >= 1, gram >= 2, max_candidates >= 0")
        if not 1 <= self.init_length <= self.length:
            raise ValueError("need 1 <= init_length <= length")
        if self.pad not in ("prompt", "vocab"):
            raise ValueError(f"pad must be 'prompt' or 'vocab', got {self.pad!r}")


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
    tokens, parents, index = [], [], {}
    for candidate in candidates:
        parent = -1
        for token in candidate:
            key = (parent, token)
            if key not in index:
                index[key] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = index[key]
    return tokens, parents


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
    """The Self-Draft loop (Algorithm 1); `.generate((1, T)) -> DecodeResult`."""

    def __init__(self, target: TargetModel, config: DecodeConfig, policy: "SelfDraftPolicy"):
        self.target, self.config, self.policy = target, config, policy
        self.sd = policy.config

    def _initial_branches(self, prompt: list[int], generator: torch.Generator) -> list[list[int]]:
        sd = self.sd
        if sd.pad == "prompt":
            pool = torch.tensor(prompt)
            picks = torch.randint(0, pool.numel(), (sd.branches, sd.init_length), generator=generator)
            return pool[picks].tolist()
        vocab = self.target.model.config.vocab_size
        return torch.randint(0, vocab, (sd.branches, sd.init_length), generator=generator).tolist()

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor) -> DecodeResult:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError("SelfDraftDecoder.generate takes input_ids of shape (1, T)")
        config, target, sd = self.config, self.target, self.sd
        sampling = config.sampling
        device = target.device
        generator = torch.Generator(device=device).manual_seed(config.seed) if sampling else None
        pad_generator = torch.Generator().manual_seed(sd.seed)
        eos = target.eos_token_ids if config.stop_on_eos else set()
        stats = DecodeStats()
        start = time.perf_counter()

        prompt = input_ids.to(device)
        cache = target.new_cache()
        out = target.forward(prompt, cache)
        last = out.logits[0, -1]  # (V,) the first new token: argmax, or a draw from the warped target
        root = int(last.argmax()) if sampling is None else int(
            torch.multinomial(sampling.probs(last), 1, generator=generator))
        context = prompt[0].tolist() + [root]
        generated = [root]
        branches = self._initial_branches(prompt[0].tolist(), pad_generator)
        context_cache = NgramCache(sd.cache_size)
        stats.prefill_s = time.perf_counter() - start

        while len(generated) < config.max_new_tokens and root not in eos:
            tick = time.perf_counter()
            candidates = list(dict.fromkeys(context_cache.lookup(root, sd.max_candidates)))
            if self.policy.corpus is not None and len(candidates) < sd.max_candidates:
                for candidate in self.policy.corpus.lookup(context, sd.max_candidates):
                    if candidate not in candidates and len(candidates) < sd.max_candidates:
                        candidates.append(candidate)
            trie_tokens, trie_parents = candidate_trie(candidates)
            tree = DraftTree.from_parents(torch.tensor(trie_tokens, dtype=torch.long, device=device),
                                          torch.tensor(trie_parents, dtype=torch.long, device=device))
            lengths = [len(b) for b in branches]
            slots = tree.size + sum(lengths)
            if slots > config.max_tree_tokens:
                raise ValueError(f"self-draft uses {slots} speculative slots per forward; the budget is "
                                 f"max_tree_tokens={config.max_tree_tokens}")
            past = cache.get_seq_length()
            inputs = torch.tensor([root] + trie_tokens + [t for b in branches for t in b], device=device)[None]
            allowed = selfdraft_mask(tree.parents, lengths, past)
            positions = selfdraft_positions(tree.depths, lengths, past)
            tock = time.perf_counter()
            out = target.forward(inputs, cache, positions, allowed)
            logits = out.logits[0]  # (S, V)
            n = tree.size
            if sampling is None:
                accepted, next_token = verify_greedy(tree, logits[: n + 1])
            else:
                accepted, next_token = verify_sampling(tree, sampling.probs(logits[: n + 1]), generator)
            keep = torch.tensor([0] + [node + 1 for node in accepted], device=device)
            commit_kv(cache, torch.cat([torch.arange(past, device=device), past + keep]))
            stats.verify_s += time.perf_counter() - tock
            # Branch drafts, context-cache update, branch update (argmax: deterministic).
            predicted = logits[n + 1:].argmax(-1).tolist()
            offset = 0
            for i, branch in enumerate(branches):
                drafts = predicted[offset: offset + len(branch)]
                offset += len(branch)
                for gram in branch_grams(branch, drafts, sd.gram):
                    context_cache.insert(gram)
                branches[i] = (branch + [drafts[-1]])[-sd.length:]
            stats.draft_s += tock - tick

            new_tokens = tree.tokens[accepted].tolist() + [next_token]
            SpeculativeDecoder._record(stats, tree, len(accepted))
            stats.tree_tokens += sum(lengths)
            for token in new_tokens:
                if len(generated) >= config.max_new_tokens:
                    break
                generated.append(token)
                if token in eos:
                    break
            root = generated[-1]
            context.extend(new_tokens)
        stats.total_s = time.perf_counter() - start
        stats.new_tokens = len(generated)
        return DecodeResult(tokens=generated, stats=stats)


class SelfDraftPolicy:
    """A decoding policy (see eval.bench): holds the config and the shared corpus cache."""

    def __init__(self, config: SelfDraftConfig | None = None, tokenizer=None, name: str = "self-draft"):
        self.config = config or SelfDraftConfig()
        self.name = name
        self.corpus = None
        if self.config.corpus:
            if tokenizer is None:
                raise ValueError("a corpus cache needs the target's tokenizer")
            self.corpus = CorpusCache(corpus_sequences(self.config.corpus, tokenizer, self.config.corpus_limit),
                                      self.config.gram, self.config.corpus_top)

    def make_decoder(self, target: TargetModel, decode_config: DecodeConfig) -> SelfDraftDecoder:
        return SelfDraftDecoder(target, decode_config, self)


def corpus_sequences(spec: str, tokenizer, limit: int) -> list[list[int]]:
    """Token ids of every message text of a data.sources spec (no chat template: plain text)."""
    from draftsmith.data.sources import load_source

    conversations = load_source(spec, limit=limit)
    return [tokenizer(message["content"], add_special_tokens=False)["input_ids"]
            for conv in conversations for message in conv.messages if message.get("content")]


SELFDRAFT_ALIASES = {"n": "branches", "l": "length", "g": "gram", "candidates": "max_candidates"}


def build_from_spec(options: dict, target, draft, name: str):
    """Bench method `self-draft[:branches=3,length=4,gram=4,candidates=4,cache_size=8,corpus=gsm8k:train]`.

    Every SelfDraftConfig field is an option (aliases: n = branches, l = length, g = gram,
    candidates = max_candidates). `corpus` is a data.sources spec whose message texts build the
    corpus cache (optional); `pad=prompt|vocab` picks the random padding tokens' pool.
    """
    from draftsmith.eval.drafters.minions import config_from_options

    config = config_from_options(SelfDraftConfig, options, SELFDRAFT_ALIASES)
    return SelfDraftPolicy(config, tokenizer=target.tokenizer, name=name)
