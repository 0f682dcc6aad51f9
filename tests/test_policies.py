"""The seed papers' decoder policies: Minions, LLMCad, Self-Draft, the speculative generation pipeline.

Greedy equivalence with generate(do_sample=False) for each policy (both tiny families, several
seeds), speculative sampling == target distribution for the tree policies, and unit tests of
the pieces that carry the papers' formulas.
"""

import pytest
import torch

from conftest import pooled_chisquare_pvalue, repetitive_prompt, tiny_model
from draftsmith.eval.decode.decoder import DecodeConfig, DrafterMethod, Method, SpeculativeDecoder
from draftsmith.eval.decode.drafters.base import Drafter
from draftsmith.eval.decode.drafters.llmcad import LLMCadConfig, LLMCadDrafter, pacer_pick, update_alpha
from draftsmith.eval.decode.drafters.lm import LMDrafter
from draftsmith.eval.decode.drafters.medusa import MedusaDrafter
from draftsmith.eval.decode.drafters.minions import (LengthSelector, MinionsConfig, MinionsDrafter, acceptance_rate, fit_slope,
                                   majority_path, merge_proposals, update_weights, voted_drafters)
from draftsmith.eval.decode.drafters.ngram import NgramDrafter
from draftsmith.eval.decode.drafters.union import UnionDrafter, credit_accepted, merge_trees
from draftsmith.eval.bench.methods import BuildContext, build_method
from draftsmith.eval.policies.pipeline import PipelinePolicy, first_child_nodes, reroot
from draftsmith.eval.policies.selfdraft import (CorpusCache, NgramCache, SelfDraftConfig, SelfDraftPolicy, branch_grams, candidate_trie,
                            selfdraft_mask, selfdraft_positions)
from draftsmith.eval.decode.tree import DraftTree
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.student import layer_subset_student
from draftsmith.models.target import TargetModel
from draftsmith.models.vocab import DraftVocab, with_sliced_head

from test_decoder_greedy import reference_greedy
from test_decoder_sampling import PROMPT, SAMPLES, TEMPERATURE, VOCAB, exact_joint

NEW_TOKENS = 24
POLICIES = ["minions-path", "minions-tree", "llmcad", "llmcad-nofallback", "llmcad-vocab", "self-draft", "self-draft-corpus",
            "pipeline-tree", "pipeline-chain", "union", "union-first"]


def make_policy(kind, model, seed):
    shallow = layer_subset_student(model, [seed % 2])
    if kind == "minions-path":
        drafters = [LMDrafter(shallow, mode="chain", name="shallow"), LMDrafter(model, mode="chain", name="self"),
                    NgramDrafter(name="ngram")]
        return MinionsDrafter(drafters, MinionsConfig(decision_threshold=2, window=6))
    if kind == "minions-tree":  # with a feature drafter (Medusa heads read the target's hidden states)
        torch.manual_seed(seed)
        heads = MedusaHeads(MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3))
        heads.init_lm_heads(model.lm_head.weight)
        drafters = [LMDrafter(shallow, mode="chain", name="shallow"), MedusaDrafter(heads),
                    LMDrafter(tiny_model(model.config.model_type, seed=seed + 40), mode="chain", name="other"),
                    NgramDrafter(name="ngram")]
        return MinionsDrafter(drafters, MinionsConfig(verify="tree", feedback="voted", budget=3 + seed))
    if kind == "union":  # a tree, a chain and lookup in one trie; a small budget cuts it
        drafters = [LMDrafter(shallow, mode="tree", depth=3, topk=2, budget=5, name="shallow"),
                    LMDrafter(model, mode="chain", budget=3, name="self"), NgramDrafter(name="ngram")]
        return UnionDrafter(drafters, budget=6 + seed)
    if kind == "union-first":  # lookup on a 2-gram repeat, else the shallow chain
        return UnionDrafter([NgramDrafter(min_ngram=2, name="ngram"), LMDrafter(shallow, mode="chain", name="shallow")],
                            mode="first")
    if kind == "llmcad":
        return LLMCadDrafter(shallow, config=LLMCadConfig(alpha=0.001, threshold=0.1, budget=10))
    if kind == "llmcad-vocab":  # the draft LM's head sliced to a draft vocabulary: its candidates map back
        vocab = DraftVocab.from_ids(range(0, model.config.vocab_size, 2), model.config.vocab_size)
        return LLMCadDrafter(with_sliced_head(shallow, vocab), config=LLMCadConfig(threshold=0.1, budget=10),
                             vocab=vocab)
    if kind == "llmcad-nofallback":
        return LLMCadDrafter(model, config=LLMCadConfig(fallback=False, threshold=0.05, budget=12))
    if kind == "self-draft":
        return SelfDraftPolicy(SelfDraftConfig(branches=2 + seed % 2, length=3 + seed, gram=3 + seed % 2, seed=seed))
    if kind == "self-draft-corpus":
        policy = SelfDraftPolicy(SelfDraftConfig(branches=1, length=4, pad="vocab", seed=seed))
        policy.corpus = CorpusCache([reference_greedy(model, torch.tensor([[seed + 1, 2, 3]]), 30)], gram=4, top=2)
        return policy
    if kind == "pipeline-tree":  # the target drafting for itself: pre-drafts get used
        return PipelinePolicy(LMDrafter(model, mode="tree", depth=3, topk=2, budget=8))
    if kind == "pipeline-chain":
        return PipelinePolicy(LMDrafter(shallow, mode="chain", budget=3))
    raise ValueError(kind)


def decoder_for(policy, target, config):
    if isinstance(policy, Method):
        return policy.make_decoder(target, config)
    return SpeculativeDecoder(target, policy, config)


@pytest.mark.parametrize("kind", POLICIES)
@pytest.mark.parametrize("seed", range(3))
def test_greedy_equivalence(family, kind, seed):
    model = tiny_model(family, seed=seed, num_layers=3)
    target = TargetModel(model, tokenizer=None)
    prompt = repetitive_prompt(seed)
    policy = make_policy(kind, model, seed)
    expected = reference_greedy(model, prompt)
    for _ in range(2 if seed == 0 else 1):  # a second request: carried-over weights / alpha / s must not matter
        result = decoder_for(policy, target, DecodeConfig(max_new_tokens=NEW_TOKENS)).generate(prompt)
        assert result.tokens == expected
        stats = result.stats
        assert stats.new_tokens == NEW_TOKENS and stats.round_tokens >= stats.verify_forwards
    if kind == "pipeline-tree":
        assert policy.hits > 0 and stats.tau > 2.0


def test_eos_stops_like_generate(family):
    model = tiny_model(family, seed=3)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7]])
    eos = reference_greedy(model, prompt, 30)[10]
    model.generation_config.eos_token_id = eos
    expected = reference_greedy(model, prompt, 30)
    target = TargetModel(model, tokenizer=None)
    for kind in ("minions-path", "llmcad", "self-draft", "pipeline-tree"):
        result = decoder_for(make_policy(kind, model, 0), target, DecodeConfig(max_new_tokens=30)).generate(prompt)
        assert result.tokens == expected, kind


@pytest.mark.parametrize("kind", ["self-draft", "pipeline-chain"])
def test_policies_with_their_own_loop_start_from_their_last_request(kind):
    """A conversation's next turn: the policy's loop prefills only what follows its last request's cache."""
    model = tiny_model("llama", seed=0, num_layers=3)
    target = TargetModel(model, tokenizer=None)
    policy, first = make_policy(kind, model, 0), repetitive_prompt(0)
    config = DecodeConfig(max_new_tokens=NEW_TOKENS)
    answer = policy.make_decoder(target, config).generate(first)
    second = torch.cat([first[0], torch.tensor(answer.tokens + [5, 6])])[None]
    result = policy.make_decoder(target, config).generate(second)
    assert result.stats.reused_tokens >= first.shape[1]
    assert result.tokens == reference_greedy(model, second)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_a_draft_lm_keeps_its_cache_for_the_next_request_unless_the_prefix_cache_is_off(prefix_cache):
    model = tiny_model("llama", seed=0, num_layers=3)
    target = TargetModel(model, tokenizer=None)
    drafter = LMDrafter(layer_subset_student(model, [0]), mode="chain", budget=3)
    config = DecodeConfig(max_new_tokens=NEW_TOKENS, prefix_cache=prefix_cache)
    decoder, first = SpeculativeDecoder(target, drafter, config), repetitive_prompt(0)
    answer = decoder.generate(first)
    second = torch.cat([first[0], torch.tensor(answer.tokens + [5, 6])])[None]
    widths, forward = [], drafter.lm.forward
    drafter.lm.forward = lambda input_ids, *args, **kwargs: widths.append(input_ids.shape[1]) or forward(
        input_ids, *args, **kwargs)
    assert decoder.generate(second).tokens == reference_greedy(model, second)
    reused = first.shape[1] + len(answer.tokens) - 1  # all but the answer's last token, which the drafter never fed
    assert widths[0] == (second.shape[1] + 1 - reused if prefix_cache else second.shape[1] + 1)


@pytest.mark.parametrize("kind", ["minions-tree", "pipeline", "union", "union-first", pytest.param("llmcad", marks=pytest.mark.slow),
                                  pytest.param("self-draft", marks=pytest.mark.slow)])
def test_sampling_matches_target_distribution(kind):
    model = tiny_model("llama", seed=5, vocab_size=VOCAB, num_layers=1, hidden_size=32)
    target = TargetModel(model, tokenizer=None)
    other = tiny_model("llama", seed=12, vocab_size=VOCAB, num_layers=1)
    if kind == "minions-tree":
        policy = MinionsDrafter([LMDrafter(other, mode="chain", budget=2), LMDrafter(model, mode="chain"),
                                 NgramDrafter(max_ngram=2)], MinionsConfig(verify="tree", budget=2))
    elif kind == "union":  # greedy sub-proposals merged: point masses
        policy = UnionDrafter([LMDrafter(other, mode="chain", budget=2), LMDrafter(model, mode="chain", budget=2),
                               NgramDrafter(max_ngram=2)])
    elif kind == "union-first":  # a sampled tree with q rows whenever lookup has no 2-gram match
        policy = UnionDrafter([NgramDrafter(max_ngram=2, min_ngram=2),
                               LMDrafter(model, mode="tree", depth=2, topk=2, beam=2)], mode="first")
    elif kind == "llmcad":
        policy = LLMCadDrafter(other, config=LLMCadConfig(threshold=0.2, budget=6, depth=2))
    elif kind == "self-draft":
        policy = SelfDraftPolicy(SelfDraftConfig(branches=2, length=3, gram=2))
    else:  # q rows (sampled tree) + pre-drafted trees
        policy = PipelinePolicy(LMDrafter(model, mode="tree", depth=2, topk=2, beam=2))
    exact = exact_joint(model)
    counts = dict.fromkeys(exact, 0)
    accepted_any = 0
    for seed in range(SAMPLES):
        config = DecodeConfig(max_new_tokens=3, temperature=TEMPERATURE, seed=seed)
        result = decoder_for(policy, target, config).generate(PROMPT)
        counts[tuple(result.tokens)] += 1
        accepted_any += result.stats.round_tokens > result.stats.verify_forwards
    assert accepted_any > SAMPLES // 20, "drafts were (almost) never accepted: the test would prove little"
    if kind == "pipeline":
        assert policy.hits > SAMPLES // 20
    if kind.startswith("union"):
        assert min(policy.proposed) > 0, policy.summary()  # every sub-drafter's tree was verified
    assert pooled_chisquare_pvalue(counts, exact, SAMPLES) > 1e-3


# ----------------------------------------------------------------------------------- Minions

def test_merge_and_majority_vote_follow_figure_5():
    # Three SSMs: 1 and 2 agree on the first token ("like"), 3 differs ("likes"); below "like",
    # SSM 1 says "apple", SSM 2 "pear". w1 + w2 > w3 picks "like"; w1 > w2 picks "apple".
    merged = merge_proposals([[10, 20], [10, 21], [11, 22]], [0.5, 0.3, 0.6])
    like = merged.tokens.index(10)
    assert merged.weights[like] == pytest.approx(0.8) and sorted(merged.members[like]) == [0, 1]
    path = majority_path(merged)
    assert [merged.tokens[n] for n in path] == [10, 20]
    assert voted_drafters(merged, path) == [0]
    # Topological, heaviest-first sibling order, shared prefixes merged.
    assert len(merged.tokens) == 5 and all(p < i for i, p in enumerate(merged.parents))
    assert merged.tokens[:2] == [10, 11]
    # A stronger third drafter flips the vote.
    flipped = merge_proposals([[10, 20], [10, 21], [11, 22]], [0.5, 0.3, 0.9])
    assert [flipped.tokens[n] for n in majority_path(flipped)] == [11, 22]
    assert majority_path(merge_proposals([[], []], [1.0, 1.0])) == []


def test_acceptance_rate_and_weight_thresholds():
    assert acceptance_rate([1, 2, 3, 4], [1, 2, 9, 4, 5]) == 0.5
    assert acceptance_rate([1, 2], [1, 2, 3]) == 1.0
    assert acceptance_rate([], [1]) == 0.0
    config = MinionsConfig(reward_threshold=0.6, punish_threshold=0.3, reward_factor=2.0, punish_factor=0.5,
                           min_weight=0.2)
    # ACR (equation 1) = mean of each drafter's rates: 0.75 -> reward, 0.1 -> punish, 0.45 -> keep, none -> keep.
    new = update_weights([1.0, 1.0, 1.0, 1.0], [[1.0, 0.5], [0.0, 0.2], [0.4, 0.5], []], config)
    assert new == [2.0, 0.5, 1.0, 1.0]
    assert update_weights([0.3], [[0.0]], config) == [0.2]  # clamped at min_weight


def test_length_selector_follows_the_slope():
    config = MinionsConfig(budget=4, decision_threshold=2, window=4, s_reward=1, s_punish=1)
    selector = LengthSelector(config)
    selector.record(1.0, 2)
    assert selector.record(1.0, 2) == 5  # a single s seen: explore upward
    selector.record(3.0, 2)  # s = 5 costs more per verified token: slope > 0 -> back down
    assert selector.record(3.0, 2) == 4
    assert selector.decisions[-1][1] > 0
    config = MinionsConfig(budget=4, decision_threshold=2, window=4)
    selector = LengthSelector(config)
    selector.record(2.0, 1), selector.record(2.0, 1)
    selector.record(1.0, 1)
    assert selector.record(1.0, 1) == 6  # cheaper per token at s = 5: keep growing
    assert fit_slope([1, 1], [2, 3]) is None and fit_slope([1, 2], [1, 3]) == pytest.approx(2.0)
    fixed = LengthSelector(MinionsConfig(adaptive=False, decision_threshold=1))
    assert fixed.record(1.0, 1) == 4


class FixedDrafter(Drafter):
    def __init__(self, tokens, name):
        self.tokens, self.name = tokens, name

    def propose(self, root, context, sampling, generator):
        return DraftTree.chain(torch.tensor(self.tokens))


def test_minions_feedback_rewards_the_drafter_the_target_agrees_with():
    good, bad = FixedDrafter([7], "good"), FixedDrafter([5, 5, 5], "bad")
    minions = MinionsDrafter([bad, good], MinionsConfig(adaptive=False, budget=3), weights=[1.0, 0.9])
    context = torch.tensor([1, 2])
    tree = minions.propose(2, context, None, None)
    assert tree.tokens.tolist() == [5, 5, 5]  # the heavier (bad) drafter wins the first vote
    minions.observe(torch.tensor([2]), {})  # nothing accepted; the target's next token is 7
    minions.propose(7, torch.tensor([1, 2, 7]), None, None)  # feedback happens here (bonus now known)
    assert minions.weights[0] < 1.0 and minions.weights[1] > 0.9
    assert minions.propose(7, torch.tensor([1, 2, 7]), None, None).tokens.tolist() == [7]


# ------------------------------------------------------------------------------------ LLMCad

def test_llmcad_alpha_update_equation_3():
    assert update_alpha(0.01, 0.2, 5, 5) == pytest.approx(0.005)  # no error: halve
    # Errors: alpha / T_c ** ((N_all - N_correct) / N_all).
    assert update_alpha(0.01, 0.25, 2, 4) == pytest.approx(0.01 / 0.25 ** 0.5)
    assert update_alpha(0.01, 0.25, 0, 4) == pytest.approx(0.01 / 0.25)
    assert update_alpha(0.4, 0.01, 0, 4, alpha_max=0.5) == 0.5
    assert update_alpha(1e-5, 0.5, 3, 3, alpha_min=1e-5) == 1e-5


def test_llmcad_pacer_gives_the_token_to_the_most_underserved_branch():
    # f(x) = M * C_x / sum C - T_x: branch 0 (C 0.6, 3 tokens), branch 1 (C 0.4, 0 tokens), M = 4.
    assert pacer_pick([0.6, 0.4], [3, 0], 4, [True, True]) == 1
    assert pacer_pick([0.6, 0.4], [1, 1], 4, [True, True]) == 0
    assert pacer_pick([0.6, 0.4], [1, 1], 4, [False, True]) == 1
    assert pacer_pick([0.6], [1], 2, [False]) is None


def test_llmcad_fallback_threshold_controls_tree_size():
    model = tiny_model("llama", seed=0, num_layers=2)
    context = torch.tensor([3, 4, 5, 6])
    sizes = []
    for alpha in (0.4, 1e-30):
        drafter = LLMCadDrafter(model, config=LLMCadConfig(alpha=alpha, alpha_min=1e-30, budget=12, depth=12))
        drafter.begin(context)
        tree = drafter.propose(6, context, None, None)
        tree.validate()
        sizes.append(tree.size)
    assert sizes[0] < sizes[1] == 12
    # After a verification that rejects the first token alpha grows, after a full accept it halves.
    drafter.observe(torch.tensor([6]), {})
    assert drafter.alpha > 1e-30


# -------------------------------------------------------------------------------- Self-Draft

def test_ngram_cache_is_lru_per_prefix_token():
    cache = NgramCache(capacity=2)
    cache.insert([1, 2, 3, 4])
    cache.insert([1, 5, 6, 7])
    cache.insert([9, 9, 9, 9])
    assert cache.lookup(1, 5) == [(5, 6, 7), (2, 3, 4)]  # most recent first
    cache.insert([1, 2, 3, 4])  # touch: becomes most recent
    cache.insert([1, 8, 8, 8])  # evicts the least recently used (5, 6, 7)
    assert cache.lookup(1, 5) == [(8, 8, 8), (2, 3, 4)]
    assert cache.lookup(1, 1) == [(8, 8, 8)] and cache.lookup(4, 3) == []
    assert cache.lookup(9, 3) == [(9, 9, 9)]


def test_branch_grams_and_corpus_cache():
    # Branch tau = [a, b, c, d] with draft tokens D = [p, q, r, s]; G = 4 -> [a, b, c, r], [b, c, d, s].
    assert branch_grams([1, 2, 3, 4], [11, 12, 13, 14], 4) == [[1, 2, 3, 13], [2, 3, 4, 14]]
    assert branch_grams([1, 2], [11, 12], 4) == []
    corpus = CorpusCache([[1, 2, 3, 4, 5], [7, 2, 3, 4, 6], [8, 2, 9, 9, 9]], gram=3, top=2)
    assert corpus.lookup([0, 1, 2], 4)[0] == (3, 4)  # 2-token prefix (1, 2) first
    assert corpus.lookup([5, 2], 4) == [(3, 4), (9, 9)]  # 1-token prefix, most frequent first
    assert candidate_trie([(3, 4), (3, 5), (6,)]) == ([3, 4, 5, 6], [-1, 0, 0, -1])


def test_selfdraft_mask_is_block_diagonal_over_branches():
    parents = torch.tensor([-1, 0, -1])  # trie: root -> n0 -> n1, root -> n2
    allowed = selfdraft_mask(parents, [2, 3], past_len=4)[0, 0]
    assert allowed.shape == (9, 13)
    assert allowed[:, :4].all()  # everyone sees the committed cache
    new = allowed[:, 4:]
    trie = new[:4, :4].int().tolist()
    assert trie == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    assert not new[:4, 4:].any()  # candidates never see branches
    first, second = slice(4, 6), slice(6, 9)
    assert new[first, 0].all() and new[second, 0].all()  # branches see the root
    assert not new[4:, 1:4].any()  # ... but not the candidates
    assert new[first, first].int().tolist() == [[1, 0], [1, 1]]
    assert new[second, second].int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert not new[first, second].any() and not new[second, first].any()
    positions = selfdraft_positions(torch.tensor([1, 2, 1]), [2, 3], 4)
    assert positions.tolist() == [[4, 5, 6, 5, 5, 6, 5, 6, 7]]


def test_selfdraft_forward_matches_separate_sequences(family):
    """Branch logits from the packed forward == each branch run alone after the context."""
    model = tiny_model(family, seed=1)
    target = TargetModel(model, tokenizer=None)
    context, root = torch.tensor([[4, 8, 15, 16, 23]]), 42
    branches, parents = [[7, 9], [11, 12, 13]], torch.tensor([-1, 0])
    trie_tokens = [30, 31]
    cache = target.new_cache()
    target.forward(context, cache)
    inputs = torch.tensor([[root] + trie_tokens + branches[0] + branches[1]])
    out = target.forward(inputs, cache, selfdraft_positions(torch.tensor([1, 2]), [2, 3], 5),
                         selfdraft_mask(parents, [2, 3], 5))
    with torch.no_grad():
        alone = [model(torch.cat([context, torch.tensor([[root] + seq]).long()], 1)).logits[0, 5:]
                 for seq in (trie_tokens, *branches)]
    torch.testing.assert_close(out.logits[0, :3], alone[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[0, 3:5], alone[1][1:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.logits[0, 5:8], alone[2][1:], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------- pipeline

def test_reroot_and_first_child_path():
    #          root
    #        0      1
    #      2   3     4
    #      5
    tree = DraftTree.from_parents(torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([-1, -1, 0, 0, 1, 2]))
    assert first_child_nodes(tree.parents) == [0, 2, 5]
    sub = reroot(tree, 0)
    assert sub.tokens.tolist() == [12, 13, 15] and sub.parents.tolist() == [-1, -1, 0]
    assert sub.depths.tolist() == [1, 1, 2]
    assert reroot(tree, 5).size == 0


# ------------------------------------------------------------------------------------- union

def test_merge_trees_shares_prefixes_keeps_priority_and_cuts_at_budget():
    first = DraftTree.from_parents(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0]))  # 5 -> {6, 7}
    second = DraftTree.chain(torch.tensor([5, 6, 8, 9]))  # 5 -> 6 -> 8 -> 9
    merged = merge_trees([first, second], budget=16)
    assert merged.tokens == [5, 6, 7, 8, 9] and merged.parents == [-1, 0, 0, 1, 3]
    assert merged.owners == [0, 0, 0, 1, 1]
    cut = merge_trees([second, first], budget=4)  # priority to the chain; 7 does not fit
    assert cut.tokens == [5, 6, 8, 9] and cut.parents == [-1, 0, 1, 2]
    assert merge_trees([DraftTree.empty(), second], budget=2).tokens == [5, 6]
    assert credit_accepted(merged, [5, 6, 8]) == [0, 0, 1]
    assert credit_accepted(merged, [5, 7, 1]) == [0, 0]
    assert credit_accepted(merged, [4]) == []


def test_union_credits_each_drafter_and_first_mode_skips_later_drafters(family):
    model = tiny_model(family, seed=1, num_layers=2)
    target = TargetModel(model, tokenizer=None)
    prompt = torch.tensor([[3, 4, 5, 6, 7, 3, 4, 5, 6, 7, 3, 4]])
    union = make_policy("union", model, 0)
    result = decoder_for(union, target, DecodeConfig(max_new_tokens=NEW_TOKENS)).generate(prompt)
    summary = union.summary()
    assert sum(summary["accepted_tokens"].values()) == result.stats.round_tokens - result.stats.verify_forwards
    cascade = UnionDrafter([NgramDrafter(min_ngram=2, budget=3), NgramDrafter(budget=2, name="unigram")],
                           mode="first")
    repeat = cascade.propose(4, torch.tensor([3, 4, 5, 6, 7, 9, 3, 4]), None, None)  # "3 4" seen before
    assert repeat.tokens.tolist() == [5, 6, 7]
    fallback = cascade.propose(1, torch.tensor([1, 2, 3, 1]), None, None)  # only "1" repeats
    assert fallback.tokens.tolist() == [2, 3] and cascade.proposed == [1, 1]


# ------------------------------------------------------------------------------------- bench

def test_bench_specs_build_each_policy():
    model = tiny_model("llama", seed=0, num_layers=4)
    target = TargetModel(model, tokenizer=None)
    context = BuildContext(target)

    def build_drafter(spec, target, draft):  # the built drafter (or policy) of a bench method spec
        method = build_method(spec, context)
        return method.drafter if isinstance(method, DrafterMethod) else method

    minions = build_drafter("minions:drafters=[(lm-chain:every=2),(lm-chain:every=3),ngram],budget=3,verify=tree,"
                            "adaptive=false", target, None)
    assert isinstance(minions, MinionsDrafter) and len(minions.drafters) == 3
    assert minions.config.budget == 3 and minions.config.adaptive is False
    assert build_drafter("minions:drafters=[(lm-chain:every=2),ngram],weights=[2,1]", target, None).weights == [2.0, 1.0]
    llmcad = build_drafter("llmcad:every=2,threshold=0.2,budget=8,alpha=0.05,fallback=false", target, None)
    assert llmcad.config.threshold == 0.2 and llmcad.config.budget == 8 and not llmcad.config.fallback
    llmcad = build_drafter("llmcad:every=2,precision=bfloat16", target, None)
    assert llmcad.model.dtype == torch.bfloat16 and target.model.dtype == torch.float32
    selfdraft = build_drafter("self-draft:branches=2,length=5,candidates=3", target, None)
    assert (selfdraft.config.branches, selfdraft.config.length, selfdraft.config.candidates) == (2, 5, 3)
    pipeline = build_drafter("pipeline:inner=(lm-chain:budget=3,every=2)", target, None)
    assert isinstance(pipeline, PipelinePolicy) and pipeline.drafter.budget == 3
    union = build_drafter("union:drafters=[(lm-chain:every=2),(ngram:budget=6)],budget=5", target, None)
    assert isinstance(union, UnionDrafter) and union.mode == "union" and union.budget == 5
    cascade = build_drafter("cascade:drafters=[(ngram:min_n=2),(lm-chain:every=2)]", target, None)
    assert cascade.mode == "first" and cascade.drafters[0].min_ngram == 2
    with pytest.raises(ValueError, match="min_n=4 is larger than n=3"):
        build_drafter("ngram:min_n=4", target, None)
    with pytest.raises(ValueError, match="unknown option"):
        build_drafter("union:drafters=[ngram],mode=first", target, None)
    with pytest.raises(ValueError, match="unknown option"):
        build_drafter("minions:drafters=[ngram],colour=red", target, None)
    with pytest.raises(ValueError, match="needs the bench's draft"):
        build_drafter("llmcad:model=draft", target, None)
    with pytest.raises(ValueError, match="verify"):
        build_drafter("minions:drafters=[ngram],verify=forest", target, None)
    with pytest.raises(ValueError, match="inner"):
        build_drafter("pipeline", target, None)
    with pytest.raises(ValueError, match="depth: expected an integer"):
        build_drafter("lm-tree:depth=abc,every=2", target, None)
    with pytest.raises(ValueError, match="need length >= gram - 1 = 3"):  # its branches would never fill the cache
        build_drafter("self-draft:branches=1,length=2,gram=4", target, None)
