"""DGF / EAGLE feature drafter: fusion formulas, blocks from transformers, KV cache and tree masks,
manifest checks, EAGLE export round trip, lossless greedy and sampled decoding."""

import itertools
import json

import pytest
import torch

from conftest import build_spec, pooled_chisquare_pvalue, tiny_model
from draftsmith.errors import UserError
from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.dgf import DGFDrafter
from draftsmith.eval.decode.tree import ancestor_matrix
from draftsmith.eval.decode.verify import logits_to_probs
from draftsmith.models.artifacts import load_dgf, save_dgf, target_block
from draftsmith.models.dgf import DGFConfig, DGFModel, family_classes
from draftsmith.models.eagle_layouts import export_eagle, load_eagle
from draftsmith.models.target import TargetModel
from draftsmith.models.tiny import TinyTokenizer
from draftsmith.train.losses import feature_regression_loss, soft_cross_entropy


def make_drafter(model, fusion="dgf", num_blocks=2, seed=0, **kwargs):
    torch.manual_seed(seed)
    config = DGFConfig.for_target(model.config, fusion=fusion, num_blocks=num_blocks, **kwargs)
    return DGFModel(config).attach_target(model).eval()


def fit_drafter(model, drafter, steps=60, seed=0):
    """A few Adam steps on the target's own sampled sequences (EAGLE loss), so drafts get accepted."""
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    with torch.no_grad():
        ids = torch.randint(0, vocab, (16, 4), generator=gen)
        for _ in range(20):
            probs = torch.softmax(model(ids).logits[:, -1] / 0.5, -1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=gen)], 1)
        feats = model(ids, output_hidden_states=True).hidden_states[-1]
    optimizer = torch.optim.Adam(drafter.parameters(), lr=1e-2)
    drafter.train()
    for _ in range(steps):
        pred = drafter(feats[:, :-1], ids[:, 1:])  # predicts f_{t+1}
        logits = drafter.logits(pred[:, :-1])
        target_logp = torch.log_softmax(drafter.logits(feats[:, 1:-1]), -1)
        mask = torch.ones(pred.shape[:2])
        loss = feature_regression_loss(pred, feats[:, 1:], mask) + soft_cross_entropy(logits, target_logp, mask[:, :-1])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def trained():
    """(model, fitted drafter) per family, shared by the decoding tests."""
    out = {}
    for family in ("llama", "qwen2"):
        model = tiny_model(family, seed=3)
        out[family] = (model, fit_drafter(model, make_drafter(model, num_blocks=2)))
    return out


def test_blocks_are_transformers_classes(family):
    model = tiny_model(family)
    drafter = make_drafter(model, num_blocks=3)
    layer_cls, rotary_cls = family_classes(model.config)
    assert layer_cls.__name__ == {"llama": "LlamaDecoderLayer", "qwen2": "Qwen2DecoderLayer"}[family]
    assert all(type(layer) is layer_cls for layer in drafter.layers) and len(drafter.layers) == 3
    assert type(drafter.rotary_emb) is rotary_cls
    assert isinstance(drafter.layers[0].input_layernorm, torch.nn.Identity)
    assert not isinstance(drafter.layers[1].input_layernorm, torch.nn.Identity)
    names = set(drafter.state_dict())
    assert not any("embed" in n or "lm_head" in n for n in names), "the target's modules must not be saved"
    out = drafter(torch.randn(2, 5, 48), torch.randint(0, 96, (2, 5)))
    assert out.shape == (2, 5, 48) and drafter.logits(out).shape == (2, 5, 96)


def test_fusion_formulas():
    model = tiny_model("llama")
    f, e = torch.randn(3, 48), torch.randn(3, 48)
    gated = make_drafter(model, "dgf").fusion
    h1 = f @ gated.feature_proj.weight.T + gated.feature_proj.bias
    h2 = torch.nn.functional.silu(e @ gated.token_proj.weight.T + gated.token_proj.bias)
    z = torch.sigmoid(torch.cat([h1, h2], -1) @ gated.gate.weight.T + gated.gate.bias)
    torch.testing.assert_close(gated(f, e), z * h1 + (1 - z) * h2)
    linear = make_drafter(model, "linear").fusion
    torch.testing.assert_close(linear(f, e), torch.cat([e, f], -1) @ linear.fc.weight.T + linear.fc.bias)
    identity = make_drafter(model, "dgf", fusion_act="identity").fusion
    h2 = e @ identity.token_proj.weight.T + identity.token_proj.bias
    h1 = f @ identity.feature_proj.weight.T + identity.feature_proj.bias
    z = torch.sigmoid(torch.cat([h1, h2], -1) @ identity.gate.weight.T + identity.gate.bias)
    torch.testing.assert_close(identity(f, e), z * h1 + (1 - z) * h2)
    with pytest.raises(ValueError, match="fusion must be one of"):
        DGFConfig.for_target(model.config, fusion="sum")


def test_kv_cache_drafting_equals_full_forward(family):
    model = tiny_model(family)
    drafter = make_drafter(model, num_blocks=2)
    feats, ids = torch.randn(1, 11, 48), torch.randint(0, 96, (1, 11))
    full = drafter(feats, ids)
    cache = drafter.new_cache()
    parts = [drafter(feats[:, a:b], ids[:, a:b], cache=cache) for a, b in [(0, 4), (4, 5), (5, 11)]]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_tree_mask_equals_sequential_paths(family):
    """Tree entries after a cached prefix, each attending to its ancestors = each path run causally."""
    model = tiny_model(family)
    drafter = make_drafter(model, num_blocks=2)
    prefix_f, prefix_t = torch.randn(1, 6, 48), torch.randint(0, 96, (1, 6))
    parents = torch.tensor([-1, -1, 0, 0, 2])
    tree_f, tree_t = torch.randn(1, 5, 48), torch.randint(0, 96, (1, 5))
    depths = torch.tensor([1, 1, 2, 2, 3])
    cache = drafter.new_cache()
    drafter(prefix_f, prefix_t, cache=cache)
    allowed = torch.cat([torch.ones(5, 6, dtype=torch.bool), ancestor_matrix(parents)[1:, 1:]], 1)
    out = drafter(tree_f, tree_t, (5 + depths)[None], cache, allowed[None, None])[0]
    for node, path in enumerate([[0], [1], [0, 2], [0, 3], [0, 2, 4]]):
        seq = drafter(torch.cat([prefix_f, tree_f[:, path]], 1), torch.cat([prefix_t, tree_t[:, path]], 1))
        torch.testing.assert_close(out[node], seq[0, -1], atol=1e-5, rtol=1e-5)


def test_save_load_and_manifest_refuses_other_target(tmp_path, family):
    model = tiny_model(family)
    target = TargetModel(model, TinyTokenizer(96), name=f"tiny-{family}")
    drafter = make_drafter(model, num_blocks=2)
    save_dgf(drafter, tmp_path / "d", target_block(target, target.name, [-1]))
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["drafter"]["fusion"] == "dgf" and manifest["drafter"]["num_blocks"] == 2
    assert manifest["target"]["hidden_layers"] == [-1] and manifest["target"]["vocab_fingerprint"]
    loaded, _ = load_dgf(tmp_path / "d", target)
    x, ids = torch.randn(1, 4, 48), torch.randint(0, 96, (1, 4))
    torch.testing.assert_close(loaded(x, ids), drafter(x, ids))
    other = TargetModel(tiny_model(family, hidden_size=32), TinyTokenizer(96))
    with pytest.raises(ValueError, match="hidden_size"):
        load_dgf(tmp_path / "d", other)
    other_vocab = TargetModel(model, TinyTokenizer(97))
    with pytest.raises(ValueError, match="vocab"):
        load_dgf(tmp_path / "d", other_vocab)
    (tmp_path / "d" / "dgf.safetensors").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="corrupt"):
        load_dgf(tmp_path / "d", target)


def test_eagle_export_round_trip(tmp_path, family):
    model = tiny_model(family)
    drafter = make_drafter(model, "linear", num_blocks=2)
    export_eagle(drafter, tmp_path / "eagle")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "eagle" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.1.input_layernorm.weight",
            "layers.0.mlp.gate_proj.weight", "layers.0.post_attention_layernorm.weight"} <= names
    assert "layers.0.input_layernorm.weight" not in names  # EAGLE's layer 0 has no input norm
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    # no "bias" key (vLLM's Llama reads it as attention bias; EAGLE's fc bias defaults to on), rope for
    # transformers-4 readers, qkv_bias for EAGLE's cnets1.py / vLLM, the names SGLang and vLLM dispatch on
    assert config["num_hidden_layers"] == 2 and "bias" not in config and "rope_theta" in config
    assert config["qkv_bias"] is (family == "qwen2")
    assert config["architectures"][0] == {"llama": "LlamaForCausalLMEagle", "qwen2": "Qwen2ForCausalLMEagle"}[family]
    loaded = load_eagle(tmp_path / "eagle", model)
    x, ids = torch.randn(1, 6, 48), torch.randint(0, 96, (1, 6))
    torch.testing.assert_close(loaded.logits(loaded(x, ids)), drafter.logits(drafter(x, ids)))
    with pytest.raises(ValueError, match="fusion 'linear' only"):
        export_eagle(make_drafter(model, "dgf"), tmp_path / "nope")


@pytest.mark.parametrize("depth,topk,budget", [(7, 10, 16), (3, 2, 5), (1, 4, 4)])
def test_greedy_decoding_is_lossless(trained, family, depth, topk, budget):
    model, fitted = trained[family]
    target = TargetModel(model, tokenizer=None)
    drafter = DGFDrafter(fitted, depth=depth, topk=topk, budget=budget)
    taus = []
    for seed in range(3):
        prompt = torch.randint(0, 96, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
        result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=24)).generate(prompt)
        assert result.tokens == greedy_reference(model, prompt, 24)
        assert result.stats.tree_tokens <= budget * result.stats.verify_forwards
        taus.append(result.stats.tau)
    assert max(taus) > 1.0, "no draft was ever accepted: the test would prove little"


@pytest.mark.parametrize("budget", [3, 5, 8])
def test_capping_depth_and_topk_at_g_keeps_the_tree(trained, budget):
    model, fitted = trained["llama"]
    context = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(budget))
    with torch.no_grad():
        feats = model(context[None, :-1], output_hidden_states=True).hidden_states[-1][0]
    trees = []
    for cap in (True, False):
        drafter = DGFDrafter(fitted, depth=7, topk=6, budget=budget)
        drafter.cap_at_budget = cap
        drafter.begin(context)
        drafter.observe(context[:-1], {-1: feats})
        trees.append(drafter.propose(int(context[-1]), context, None, None))
    assert torch.equal(trees[0].tokens, trees[1].tokens) and torch.equal(trees[0].parents, trees[1].parents)


@pytest.mark.parametrize("depth,budget,stop_below,keep_above", [(3, 3, None, None), (6, 6, 0.03, None),
                                                                (6, 6, None, 0.03), (7, 4, None, None)])
def test_chain_steps_draft_the_tree_the_growth_would(trained, depth, budget, stop_below, keep_above):
    """A greedy top-1 tree drafted by causal steps (no tree bookkeeping) is the tree Growth grows: the same tokens
    and shape after every context, whatever stop_below and keep_above cut (and uncapped depths cut to the budget)."""
    model, fitted = trained["llama"]
    for seed in range(4):
        context = torch.randint(0, 96, (9 + seed,), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            feats = model(context[None, :-1], output_hidden_states=True).hidden_states[-1][0]
        trees = []
        for chain_steps, cap in ((True, True), (False, True), (True, False)):
            drafter = DGFDrafter(fitted, depth=depth, topk=1, budget=budget, stop_below=stop_below,
                                 keep_above=keep_above)
            drafter.chain_steps, drafter.cap_at_budget = chain_steps, cap
            drafter.begin(context)
            drafter.observe(context[:-1], {-1: feats})
            trees.append(drafter.propose(int(context[-1]), context, None, None))
        for tree in trees[1:]:
            assert torch.equal(tree.tokens, trees[0].tokens) and torch.equal(tree.parents, trees[0].parents)
            assert torch.equal(tree.depths, trees[0].depths)


def test_build_from_spec_and_option_errors(tmp_path):
    model = tiny_model("llama")
    target = TargetModel(model, TinyTokenizer(96))
    save_dgf(make_drafter(model), tmp_path / "d", target_block(target, "t", [-1]))
    drafter = build_spec(f"dgf:path={tmp_path / 'd'},depth=3,topk=2,budget=4", target)
    assert (drafter.depth, drafter.topk, drafter.budget) == (3, 2, 4)
    assert drafter.hidden_layers == (-1,)
    with pytest.raises(ValueError, match="unknown option 'g'"):
        build_spec(f"dgf:{tmp_path / 'd'},g=4", target)


def saved_drafter_methods(trained, tmp_path):
    """The trained tiny llama, its target, and a build function for `dgf:path=<its saved drafter>,<options>`
    methods sharing one BuildContext (as one bench run does)."""
    from draftsmith.eval.bench.methods import BuildContext, build_method

    model, fitted = trained["llama"]
    target = TargetModel(model, TinyTokenizer(96))
    save_dgf(fitted, tmp_path / "d", target_block(target, "t", [-1]))
    context = BuildContext(target)
    return model, target, context, lambda options: build_method(f"dgf:path={tmp_path / 'd'},{options}", context)


def greedy_reference(model, prompt, new_tokens):
    return model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                          do_sample=False)[0, prompt.shape[1]:].tolist()


def test_tree_shapes_of_one_drafter_share_its_weights_and_stay_lossless(trained, tmp_path):
    """A bench run holds one model and one engine per drafter path (the 1.5B's compiled drafter is 2 GB);
    decoding interleaved per prompt, as the bench does, both shapes reproduce plain greedy."""
    model, target, context, build = saved_drafter_methods(trained, tmp_path)
    chain = build("depth=3,topk=1,budget=3").drafter
    tree = build("depth=3,topk=2,budget=5").drafter
    assert chain.model is tree.model and chain.engine is tree.engine and len(context.drafter_engines) == 1
    assert (chain.topk, chain.budget, tree.topk, tree.budget) == (1, 3, 2, 5)
    for seed in range(2):
        prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(seed))
        reference = greedy_reference(model, prompt, 16)
        for drafter in (chain, tree):
            assert SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=16)).generate(prompt).tokens == reference


def lossless_tokens_per_round(trained, tmp_path, seed: int, *options: str) -> tuple[dict, object, object]:
    """(drafter -> tree tokens verified a round, build, target) for one drafter per `options` spec, each decoding
    one prompt greedily, checked token by token against plain greedy."""
    model, target, _, build = saved_drafter_methods(trained, tmp_path)
    prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(seed))
    reference = greedy_reference(model, prompt, 20)
    drafted = {}
    for spec in options:
        drafter = build(spec).drafter
        result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=20)).generate(prompt)
        assert result.tokens == reference, spec
        drafted[spec] = result.stats.tree_tokens / result.stats.verify_forwards
    return drafted, build, target


def test_stop_below_gives_a_dynamic_depth_and_stays_lossless(trained, tmp_path):
    """dgf:...,stop_below=p stops growing the tree once its best path's draft probability is below p: a deep
    chain drafts fewer tokens per round, greedy output unchanged; same weights as the plain spec."""
    full, dynamic = "depth=6,topk=1,budget=6", "depth=6,topk=1,budget=6,stop_below=0.6"
    drafted, build, _ = lossless_tokens_per_round(trained, tmp_path, 1, full, dynamic)
    assert drafted[dynamic] < drafted[full] == 6
    assert build(dynamic).drafter.engine is build(full).drafter.engine and build(dynamic).drafter.stop_below == 0.6
    with pytest.raises(ValueError, match="stop_below"):
        build("stop_below=1.5")


def test_keep_above_gives_a_dynamic_size_and_stays_lossless(trained, tmp_path):
    """dgf:...,keep_above=p verifies only the budget's nodes whose path probability is above p: fewer tokens a round
    than the full budget, never none, greedy output unchanged; a sampled decode refuses it in one line."""
    full, trimmed = "depth=4,topk=2,budget=8", "depth=4,topk=2,budget=8,keep_above=0.3"
    drafted, build, target = lossless_tokens_per_round(trained, tmp_path, 2, full, trimmed)
    assert 1 <= drafted[trimmed] < drafted[full] == 8
    drafter = build(trimmed).drafter
    assert drafter.cut.keep_above == 0.3
    with pytest.raises(UserError, match="keep_above"):
        SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=4, temperature=0.8)).generate(
            torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="keep_above"):
        build("keep_above=0")


def test_round_costs_cut_a_round_and_stay_lossless(trained, tmp_path):
    """dgf:...,round_costs=[...]: a verify that costs much more from three tokens on keeps rounds of one node, a
    flat cost the whole budget (a tree and a chain); greedy output unchanged; a sampled decode refuses them."""
    steep, flat = "round_costs=[1,9,9,9,9,9,9,9]", "round_costs=[1,1,1,1,1,1,1,1]"
    tree, chain = "depth=4,topk=2,budget=8", "depth=6,topk=1,budget=6"
    specs = [f"{shape},{costs}" for shape in (tree, chain) for costs in (steep, flat)]
    drafted, build, target = lossless_tokens_per_round(trained, tmp_path, 2, *specs)
    assert drafted[specs[0]] == drafted[specs[2]] == 1
    assert drafted[specs[1]] == 8 and drafted[specs[3]] == 6
    with pytest.raises(UserError, match="round_costs"):
        SpeculativeDecoder(target, build(specs[0]).drafter, DecodeConfig(max_new_tokens=4, temperature=0.8)).generate(
            torch.tensor([[1, 2, 3]]))


VOCAB, NEW, TEMPERATURE, SAMPLES = 5, 3, 0.9, 1200
PROMPT = torch.tensor([[1, 3, 0, 2, 1, 3]])


@pytest.mark.slow  # ~20 s: 1200 sampled decodes
def test_sampling_matches_target_distribution():
    """x1 from the prefill, x2/x3 through DGF trees + verification: chi-square vs the exact joint."""
    model = tiny_model("llama", seed=5, vocab_size=VOCAB, num_layers=1, hidden_size=32)
    target = TargetModel(model, tokenizer=None)
    drafter = DGFDrafter(make_drafter(model, num_blocks=1, seed=7), depth=2, topk=2, budget=5)
    sequences = torch.tensor(list(itertools.product(range(VOCAB), repeat=NEW)))
    with torch.no_grad():
        logits = model(torch.cat([PROMPT.expand(len(sequences), -1), sequences], 1)).logits
    start = PROMPT.shape[1] - 1
    probs = logits_to_probs(logits[:, start:start + NEW], TEMPERATURE).gather(-1, sequences[..., None])[..., 0].prod(-1)
    exact = {tuple(s.tolist()): float(p) for s, p in zip(sequences, probs)}
    counts = dict.fromkeys(exact, 0)
    accepted_any = 0
    for seed in range(SAMPLES):
        config = DecodeConfig(max_new_tokens=NEW, temperature=TEMPERATURE, seed=seed)
        result = SpeculativeDecoder(target, drafter, config).generate(PROMPT)
        counts[tuple(result.tokens)] += 1
        accepted_any += result.stats.round_tokens > result.stats.verify_forwards
    assert accepted_any > SAMPLES // 10
    assert pooled_chisquare_pvalue(counts, exact, SAMPLES) > 1e-3

