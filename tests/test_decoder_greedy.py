"""Greedy equivalence: every drafter + the tree decoder == model.generate(do_sample=False)."""

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import repetitive_prompt, tiny_model
from draftsmith.errors import UserError
from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.base import InputError
from draftsmith.eval.decode.drafters.lm import LMDrafter
from draftsmith.eval.decode.drafters.medusa import MedusaDrafter
from draftsmith.eval.decode.drafters.ngram import NgramDrafter
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.student import layer_subset_student
from draftsmith.models.target import TargetModel

NEW_TOKENS = 24


def reference_greedy(model, prompt, max_new_tokens=NEW_TOKENS):
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=max_new_tokens,
                         do_sample=False)
    return out[0, prompt.shape[1]:].tolist()


def make_drafter(kind, model, seed):
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    if kind == "none":
        return None
    if kind == "chain-shallow":
        return LMDrafter(layer_subset_student(model, [0]), mode="chain", budget=3 + seed % 3)
    if kind == "chain-other":  # an unrelated random model: mostly rejected drafts
        return LMDrafter(tiny_model(model.config.model_type, seed=seed + 50), mode="chain", budget=4)
    if kind == "chain-stop":  # a dynamic chain length: stops once the chain's draft probability drops
        return LMDrafter(layer_subset_student(model, [0]), mode="chain", budget=6, stop_below=0.3 + 0.2 * seed)
    if kind == "tree-shallow":
        return LMDrafter(layer_subset_student(model, [1]), mode="tree", depth=3 + seed % 2, topk=2 + seed % 3,
                         budget=6 + 4 * seed)
    if kind == "tree-self":  # the target drafting for itself: long acceptances, exercises deep commits
        return LMDrafter(model, mode="tree", depth=4, topk=3, budget=24)
    if kind == "ngram":
        return NgramDrafter(max_ngram=2 + seed % 2, budget=4, num_branches=1 + seed % 3)
    if kind == "parallel":  # PARD: one forward over mask tokens (untrained here: proposals are poor, output exact)
        draft = layer_subset_student(model, [0, 1])
        draft.config.pard_token = 95
        return LMDrafter(draft, mode="parallel", budget=2 + seed)
    if kind == "medusa":
        torch.manual_seed(seed)
        heads = MedusaHeads(MedusaConfig(hidden, vocab, num_heads=5))
        heads.init_lm_heads(model.lm_head.weight)
        return MedusaDrafter(heads)
    raise ValueError(kind)


KINDS = ["none", "chain-shallow", "chain-other", "chain-stop", "tree-shallow", "tree-self", "ngram", "parallel", "medusa"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_greedy_equivalence(family, kind, seed):
    model = tiny_model(family, seed=seed, num_layers=3)
    target = TargetModel(model, tokenizer=None)
    prompt = repetitive_prompt(seed)  # something for the n-gram drafter to find
    decoder = SpeculativeDecoder(target, make_drafter(kind, model, seed), DecodeConfig(max_new_tokens=NEW_TOKENS))
    result = decoder.generate(prompt)
    assert result.tokens == reference_greedy(model, prompt)
    stats = result.stats
    assert stats.new_tokens == NEW_TOKENS
    assert stats.round_tokens >= stats.verify_forwards  # at least the bonus token each round
    if kind == "none":
        assert stats.tau == 1.0
    if kind == "tree-self":
        assert stats.tau > 2.0  # the target agrees with itself


def test_eos_stops_like_generate(family):
    """With an EOS id that the model emits, output stops right after it, as generate does."""
    model = tiny_model(family, seed=3)
    prompt = torch.tensor([[5, 6, 7, 8]])
    free_run = reference_greedy(model, prompt, 30)
    eos = free_run[10]  # a token the greedy run does emit
    model.generation_config.eos_token_id = eos
    expected = reference_greedy(model, prompt, 30)
    assert expected[-1] == eos and len(expected) <= 11
    target = TargetModel(model, tokenizer=None)
    for drafter in (None, LMDrafter(model, mode="chain", budget=5), NgramDrafter()):
        assert SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=30)).generate(prompt).tokens == expected


class SlowObserver(NgramDrafter):
    """A drafter whose bookkeeping after each round (observe) takes a known time."""

    PAUSE_S = 0.01

    def observe(self, tokens, hidden):
        time.sleep(self.PAUSE_S)
        super().observe(tokens, hidden)


def test_the_drafters_observe_counts_as_drafting():
    """draft_s holds everything a drafter does (its prompt, its bookkeeping after each round), not only propose:
    a feature drafter's context work would otherwise fall into the unexplained rest."""
    model = tiny_model(seed=1)
    decoder = SpeculativeDecoder(TargetModel(model, None), SlowObserver(), DecodeConfig(max_new_tokens=12))
    stats = decoder.generate(repetitive_prompt(1)).stats
    observed = (stats.verify_forwards + 1) * SlowObserver.PAUSE_S  # each round's observe and the prompt's
    assert stats.draft_s >= observed
    assert stats.other_s < observed / 2


def test_tree_budget_is_enforced():
    model = tiny_model(seed=0)
    drafter = LMDrafter(model, mode="tree", depth=3, topk=4, budget=20)
    decoder = SpeculativeDecoder(TargetModel(model, None), drafter, DecodeConfig(budget_limit=8))
    with pytest.raises(ValueError, match="budget_limit=8"):
        decoder.generate(torch.tensor([[1, 2, 3]]))


def test_medusa_tree_must_use_rank_prefixes():
    heads = MedusaHeads(MedusaConfig(48, 96, num_heads=3))
    with pytest.raises(ValueError, match="ranks"):
        MedusaDrafter(heads, paths=[[0], [2]])
    with pytest.raises(ValueError, match="num_heads"):
        MedusaDrafter(heads, paths=[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])


def test_medusa_keep_above_trims_its_tree_and_stays_lossless():
    """Medusa with keep_above (greedy): of its static tree only the nodes whose path probability under the heads is
    above it, never none; output unchanged; a sampled decode refuses it in one line."""
    model = tiny_model("llama", seed=4, num_layers=3)
    target = TargetModel(model, tokenizer=None)
    torch.manual_seed(4)
    heads = MedusaHeads(MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3))
    heads.init_lm_heads(model.lm_head.weight)
    prompt = repetitive_prompt(1)
    full, trimmed = MedusaDrafter(heads), MedusaDrafter(heads, keep_above=0.02)
    drafted = {}
    for drafter in (full, trimmed):
        result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=NEW_TOKENS)).generate(prompt)
        assert result.tokens == reference_greedy(model, prompt)
        drafted[drafter] = result.stats.tree_tokens / result.stats.verify_forwards
    assert 1 <= drafted[trimmed] < drafted[full] == full.budget
    with pytest.raises(UserError, match="keep_above"):
        SpeculativeDecoder(target, trimmed, DecodeConfig(max_new_tokens=4, temperature=0.8)).generate(prompt)
    with pytest.raises(ValueError, match="keep_above"):
        MedusaDrafter(heads, keep_above=1.0)


def test_chain_stop_below_shortens_chains_and_is_checked():
    """stop_below drafts fewer tokens per round than the budget when the drafter is unsure, and is refused
    in one line outside a chain or outside (0, 1)."""
    model = tiny_model("llama", seed=4, num_layers=3)
    prompt = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(4))
    drafter = LMDrafter(layer_subset_student(model, [0]), mode="chain", budget=6, stop_below=0.9)
    result = SpeculativeDecoder(TargetModel(model, tokenizer=None), drafter,
                                DecodeConfig(max_new_tokens=NEW_TOKENS)).generate(prompt)
    assert result.tokens == reference_greedy(model, prompt)
    assert result.stats.tree_tokens < 6 * result.stats.verify_forwards
    for bad in ({"mode": "tree", "stop_below": 0.5}, {"mode": "chain", "stop_below": 1.0}):
        with pytest.raises(InputError, match="stop_below"):
            LMDrafter(model, **bad)


def reference_continuations(context: list[int], min_ngram: int, max_ngram: int, budget: int,
                            branches: int) -> list[list[int]]:
    """Prompt lookup's definition, searched anew: the last n tokens (n from max_ngram down) matched against every
    earlier window, most recent first, the distinct `budget` tokens after each match."""
    found: list[list[int]] = []
    for n in range(min(max_ngram, len(context) - 1), min_ngram - 1, -1):
        for start in range(len(context) - 1 - n, -1, -1):
            follow = context[start + n: start + n + budget]
            if context[start:start + n] == context[-n:] and follow not in found:
                found.append(follow)
                if len(found) == branches:
                    return found
    return found


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 3), min_size=1, max_size=4)), min_size=1,
                max_size=30), st.integers(1, 3), st.integers(0, 2), st.integers(1, 5), st.integers(1, 3))
def test_prompt_lookup_index_finds_what_a_search_anew_finds(steps, min_ngram, more, budget, branches):
    """NgramDrafter's index, kept from round to round, gives the continuations a search of the whole context gives,
    whether the next context extends the one before (a round's tokens) or not (another request)."""
    drafter = NgramDrafter(max_ngram=min_ngram + more, min_ngram=min_ngram, budget=budget, num_branches=branches)
    context: list[int] = []
    for extends, tokens in steps:
        context = context + tokens if extends else tokens
        expected = reference_continuations(context, min_ngram, min_ngram + more, budget, branches)
        assert drafter.continuations(torch.tensor(context)) == expected
