"""The n-gram prior over training answers and the DFlash drafter's candidates re-ranked by it."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import build_spec, tiny_model
from draftsmith.config import ConfigError
from draftsmith.data.ngram_prior import SMOOTHING, NgramPrior, count_ngrams
from draftsmith.data.ngram_prior import main as ngram_prior_main
from draftsmith.errors import UserError, run_main
from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.dflash import DFlashDrafter
from draftsmith.eval.decode.drafters.prior import CandidatePrior
from draftsmith.models.artifacts import save_dflash, target_block
from draftsmith.models.target import TargetModel
from draftsmith.models.tiny import TinyTokenizer
from test_dflash import random_drafter, token_paths

VOCAB = 96


def records(seed: int = 0, count: int = 40) -> list[dict]:
    """Answers that mostly walk +1 (mod 90) with some noise, after a 3-token prompt out of the loss."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        start = int(torch.randint(0, 90, (1,), generator=generator))
        ids = [(start + step) % 90 for step in range(30)]
        for noise in torch.randint(3, 30, (3,), generator=generator).tolist():
            ids[noise] = int(torch.randint(0, 90, (1,), generator=generator))
        out.append({"input_ids": ids, "loss_mask": [0, 0, 0] + [1] * 27})
    return out


def reference_log_prob(data: list[dict], a: int, b: int, c: int, min_trigram: int) -> float:
    """The module docstring's interpolation, counted the slow way."""
    uni, first, pairs, history, triples = {}, {}, {}, {}, {}
    for record in data:
        ids, mask = record["input_ids"], record["loss_mask"]
        for i, token in enumerate(ids):
            if not mask[i]:
                continue
            uni[token] = uni.get(token, 0) + 1
            if i >= 1:
                first[ids[i - 1]] = first.get(ids[i - 1], 0) + 1
                pairs[ids[i - 1], token] = pairs.get((ids[i - 1], token), 0) + 1
            if i >= 2:
                history[ids[i - 2], ids[i - 1]] = history.get((ids[i - 2], ids[i - 1]), 0) + 1
                triples[ids[i - 2], ids[i - 1], token] = triples.get((ids[i - 2], ids[i - 1], token), 0) + 1
    p1 = (uni.get(c, 0) + 1) / (sum(uni.values()) + VOCAB)
    n = first.get(b, 0)
    p2 = n / (n + SMOOTHING) * pairs.get((b, c), 0) / max(n, 1) + SMOOTHING / (n + SMOOTHING) * p1
    n = history.get((a, b), 0)
    seen = triples.get((a, b, c), 0)
    seen = seen if seen >= min_trigram else 0
    return math.log(n / (n + SMOOTHING) * seen / max(n, 1) + SMOOTHING / (n + SMOOTHING) * p2)


@pytest.mark.parametrize("min_trigram", [1, 2])
def test_the_prior_is_the_interpolated_counts_of_the_answers_and_survives_a_save(tmp_path, min_trigram):
    data = records()
    prior = count_ngrams(data, VOCAB, min_trigram)
    prior.save(tmp_path)
    loaded = NgramPrior.load(tmp_path)
    for a, b in [(5, 6), (40, 41), (1, 2), (95, 94)]:
        candidates = [(b + 1) % 90, (b + 2) % 90, 0, 95]
        got = loaded.log_prob(a, b, candidates)
        assert got == pytest.approx([reference_log_prob(data, a, b, c, min_trigram) for c in candidates], rel=1e-12)
    assert loaded.log_prob(5, 6, [7])[0] > loaded.log_prob(5, 6, [8])[0]  # the walk's next token is the likeliest
    assert np.array_equal(prior.trigram_keys, loaded.trigram_keys)


def test_the_command_writes_a_prior_and_refuses_bad_input_in_one_line(tmp_path, capsys):
    assert run_main(ngram_prior_main, ["sources=[]", f"output={tmp_path}"]) == 2
    assert "sources: give at least one" in capsys.readouterr().err
    assert run_main(ngram_prior_main, ["sources=[records:nowhere.npz]", f"output={tmp_path}"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(UserError, match="no n-gram prior"):
        NgramPrior.load(tmp_path)


def test_the_context_counts_pairs_and_triples_and_the_trained_prior_waits_for_depth_two():
    prior = CandidatePrior(count_ngrams(records(), VOCAB, 2), weight=0.2, context_weight=0.5)
    prior.extend([1, 2, 3, 1, 2])
    prior.extend([1, 2, 3, 1, 2, 4])  # only the new token is counted
    assert prior.pairs[1, 2] == 2 and prior.pairs[2, 4] == 1 and prior.triples[3, 1, 2] == 1
    candidates = [3, 4, 50]
    at_one = prior.scores(1, 1, 2, candidates)
    assert at_one[0] == pytest.approx(0.5 * (math.log(2) + math.log(2)))  # (2, 3) once, (1, 2, 3) once
    assert at_one[1] == at_one[0] and at_one[2] == 0  # (2, 4), (1, 2, 4) once; (2, 50) never
    assert prior.scores(1, 3, 2, candidates)[1] == pytest.approx(0.5 * math.log(2))  # (3, 2, 4) never
    trained = [0.2 * value for value in prior.ngrams.log_prob(1, 2, candidates)]
    assert prior.scores(2, 1, 2, candidates) == pytest.approx([a + b for a, b in zip(at_one, trained)])
    prior.extend([7])  # a shorter context is another request
    assert prior.tokens == [7] and not prior.pairs


@pytest.mark.parametrize("topk, nodes, keep_above", [(1, None, None), (3, None, 0.05), (3, 6, None), (3, 6, 0.02)])
def test_a_prior_of_no_weight_grows_the_drafters_own_chain_and_trees(topk, nodes, keep_above):
    """The re-ranked probabilities keep the candidates' share of the drafter's: with nothing to add, the chain,
    the spine tree and the product tree are the drafter's own, keep_above cutting them alike."""
    model = tiny_model("llama", seed=2, num_layers=4)
    context = torch.randint(0, 90, (12,), generator=torch.Generator().manual_seed(4))
    generator = torch.Generator().manual_seed(5)
    own = DFlashDrafter(random_drafter(model), topk=topk, nodes=nodes, keep_above=keep_above)
    ranked = DFlashDrafter(random_drafter(model), topk=topk, nodes=nodes, keep_above=keep_above,
                           prior=CandidatePrior(None, 0.2, 0.0))
    for _ in range(10):
        logits = 3 * torch.randn(3, VOCAB, generator=generator)
        tree = ranked._prior_tree(logits, context)
        if topk == 1:
            assert tree.tokens.tolist() == logits.argmax(-1).tolist() and tree.parents.tolist() == [-1, 0, 1]
        else:
            expected = own._greedy_tree(torch.softmax(logits, -1), torch.device("cpu"))
            assert sorted(token_paths(tree)) == sorted(token_paths(expected))


@pytest.mark.parametrize("topk, nodes, keep_above, stop_below", [(1, None, None, None), (3, None, 0.05, None),
                                                                  (3, 5, None, None), (3, 8, 0.02, 0.05)])
def test_dflash_with_the_prior_decodes_like_plain(topk, nodes, keep_above, stop_below):
    """The chain, the spine tree and the product tree re-ranked by a trained prior and the context: lossless; a
    sampled decode refuses the prior in one line."""
    model = tiny_model("llama", seed=2, num_layers=4)
    target = TargetModel(model, tokenizer=None)
    prompt = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(4))
    plain = SpeculativeDecoder(target, None, DecodeConfig(max_new_tokens=24)).generate(prompt)
    prior = CandidatePrior(count_ngrams(records(), VOCAB, 2), weight=0.5, context_weight=0.6)
    drafter = DFlashDrafter(random_drafter(model), topk=topk, nodes=nodes, keep_above=keep_above,
                            stop_below=stop_below, prior=prior)
    result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=24)).generate(prompt)
    assert result.tokens == plain.tokens
    assert result.stats.tree_tokens / result.stats.verify_forwards <= (nodes or 3 * topk)
    with pytest.raises(UserError, match="(prior|nodes|keep_above).*greed"):
        SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=4, temperature=0.8)).generate(prompt)


def test_the_bench_option_loads_the_prior_and_refuses_a_weight_without_one(tmp_path):
    model = tiny_model("llama", seed=2, num_layers=4)
    target = TargetModel(model, tokenizer=TinyTokenizer(VOCAB))
    drafter_dir = tmp_path / "dflash"
    dflash = random_drafter(model)
    save_dflash(dflash, drafter_dir, target_block(target, "tiny:llama", dflash.config.hidden_layers))
    count_ngrams(records(), VOCAB, 2).save(tmp_path)
    built = build_spec(f"dflash:{drafter_dir},prior={tmp_path},context_weight=0.5", target)
    assert built.prior.weight == 0.2 and built.prior.context_weight == 0.5 and built.prior.ngrams is not None
    assert build_spec(f"dflash:{drafter_dir}", target).prior is None
    with pytest.raises(ConfigError, match="prior_weight=0.3 weighs a prior"):
        build_spec(f"dflash:{drafter_dir},prior_weight=0.3", target)


@pytest.fixture(scope="module")
def fitted_dgf():
    from test_dgf import fit_drafter, make_drafter

    model = tiny_model("llama", seed=3)
    return model, fit_drafter(model, make_drafter(model, num_blocks=2))


@pytest.mark.parametrize("depth, topk, budget, keep_above", [(3, 1, 3, None), (4, 2, 6, None), (6, 2, 8, 0.1)])
def test_the_feature_drafter_re_ranked_by_the_context_decodes_like_plain(fitted_dgf, depth, topk, budget,
                                                                          keep_above):
    """dgf with context_weight: each expanded node's children re-ranked by the request's own pairs and triples;
    lossless as a chain and as trees; a sampled decode refuses it in one line."""
    from draftsmith.eval.decode.drafters.dgf import DGFDrafter
    from test_dgf import greedy_reference

    model, fitted = fitted_dgf
    target = TargetModel(model, tokenizer=None)
    drafter = DGFDrafter(fitted, depth=depth, topk=topk, budget=budget, keep_above=keep_above,
                         prior=CandidatePrior(None, 0.2, 1.0))
    for seed in range(2):
        prompt = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(seed))
        prompt = torch.cat([prompt, prompt], 1)  # a context that repeats itself: the counts have work to do
        result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=20)).generate(prompt)
        assert result.tokens == greedy_reference(model, prompt, 20)
    with pytest.raises(UserError, match="(prior|keep_above).*greed"):
        SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=4, temperature=0.8)).generate(prompt)


@pytest.mark.parametrize("topk, budget, keep_above", [(1, 4, None), (3, 6, None), (3, 8, 0.05)])
def test_a_prior_with_nothing_to_add_grows_the_feature_drafters_own_tree(fitted_dgf, topk, budget, keep_above):
    """Re-ranking keeps the candidates' share of the drafter's probability: with every gain 0, the tree grown
    through the re-ranking is the drafter's own (tokens, shape and keep_above's cut)."""
    from draftsmith.eval.decode.drafters.dgf import DGFDrafter

    model, fitted = fitted_dgf
    for seed in range(3):
        context = torch.randint(0, 96, (10,), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            features = model(context[None, :-1], output_hidden_states=True).hidden_states[-1][0]
        trees = []
        for prior in (None, CandidatePrior(None, 0.2, 0.0)):
            drafter = DGFDrafter(fitted, depth=4, topk=topk, budget=budget, keep_above=keep_above, prior=prior)
            drafter.begin(context)
            drafter.observe(context[:-1], {-1: features})
            trees.append(drafter.propose(int(context[-1]), context, None, None))
        assert sorted(token_paths(trees[0])) == sorted(token_paths(trees[1]))


def test_the_feature_drafter_option_builds_its_context_prior(tmp_path):
    from draftsmith.models.artifacts import save_dgf
    from test_dgf import make_drafter

    model = tiny_model("llama")
    target = TargetModel(model, TinyTokenizer(VOCAB))
    save_dgf(make_drafter(model), tmp_path / "d", target_block(target, "t", [-1]))
    drafter = build_spec(f"dgf:path={tmp_path / 'd'},depth=3,topk=2,budget=4,context_weight=0.5", target)
    assert drafter.prior.context_weight == 0.5 and drafter.prior.ngrams is None
    assert build_spec(f"dgf:path={tmp_path / 'd'},depth=3,topk=2,budget=4", target).prior is None
