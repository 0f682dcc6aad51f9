"""HCMP (Ghidorah III-B): online-softmax merge, split forward == unsplit forward, lossless decoding."""

import pytest
import torch
from torch import nn

from conftest import build_spec, tiny_model
from draftsmith.eval.decode.decoder import DecodeConfig
from draftsmith.eval.decode.drafters.lm import LMDrafter
from draftsmith.eval.policies.hcmp import (HcmpConfig, HcmpPlan, HcmpPolicy, SplitLinear, _Units, hcmp_mode,
                       merge_attention_partials, partial_attention)
from draftsmith.eval.decode.tree import node_depths, tree_attention_mask, tree_position_ids
from draftsmith.models.student import layer_subset_student
from draftsmith.models.engine import additive_mask
from draftsmith.models.target import TargetModel

PARENTS = torch.tensor([-1, -1, 0, 0, 1, 2, -1, 5])  # an 8-node tree


def reference_attention(query, key, value, mask, scaling):
    scores = query @ key.transpose(-1, -2) * scaling + mask
    return torch.softmax(scores, -1) @ value


@pytest.mark.parametrize("split", [0, 1, 5, 12, 19, 20])
def test_online_softmax_merge_equals_full_softmax(split):
    gen = torch.Generator().manual_seed(split)
    query, key, value = (torch.randn(2, 3, 6, 8, generator=gen) for _ in range(3))
    key, value = torch.randn(2, 3, 20, 8, generator=gen), torch.randn(2, 3, 20, 8, generator=gen)
    allowed = torch.rand(2, 1, 6, 20, generator=gen) > 0.3
    allowed[..., -1] = True  # every query sees at least one key overall
    mask = additive_mask(allowed, torch.float32)
    expected = reference_attention(query, key, value, mask, 0.3)
    parts = [partial_attention(query, key[..., :split, :], value[..., :split, :], mask[..., :split], 0.3),
             partial_attention(query, key[..., split:, :], value[..., split:, :], mask[..., split:], 0.3)]
    merged = merge_attention_partials([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)


def test_merge_three_slices_and_empty_slice():
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 2, 4, 8, generator=gen)
    key, value = torch.randn(1, 2, 9, 8, generator=gen), torch.randn(1, 2, 9, 8, generator=gen)
    zero = torch.zeros(1, 1, 4, 9)
    expected = reference_attention(query, key, value, zero, 0.5)
    cuts = [(0, 0), (0, 3), (3, 7), (7, 9)]
    parts = [partial_attention(query, key[..., a:b, :], value[..., a:b, :], None, 0.5) for a, b in cuts]
    merged = merge_attention_partials([p[0] for p in parts], [p[1] for p in parts])
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)


def test_split_linear_is_column_split_without_copy():
    linear = nn.Linear(6, 10)
    split = SplitLinear(linear, 0.3, torch.device("cpu"), torch.device("cpu"), _Units(False))
    assert split.split == 3 and split.weight0.data_ptr() == linear.weight.data_ptr()  # a view, no copy
    x = torch.randn(2, 5, 6)
    torch.testing.assert_close(split(x), linear(x))
    threaded = SplitLinear(linear, 0.5, torch.device("cpu"), torch.device("cpu"), _Units(True))
    torch.testing.assert_close(threaded(x), linear(x))


def _tree_forward(target, prompt, tree_ids, hidden_layers=(-1, -2)):
    cache = target.new_cache()
    target.forward(prompt, cache)
    past = prompt.shape[1]
    allowed = tree_attention_mask(PARENTS, past)
    positions = tree_position_ids(node_depths(PARENTS), past)
    return target.forward(tree_ids, cache, positions, allowed, hidden_layers=hidden_layers)


@pytest.mark.parametrize("ratios", [
    {"qkv": 0.5, "o": 0.5, "mlp": 0.5, "attention": 1.0},
    {"qkv": 0.25, "o": 0.75, "mlp": 0.4, "attention": 0.5},
    {"qkv": 1.0, "o": 0.0, "mlp": 1.0, "attention": 0.0},
])
@pytest.mark.parametrize("threads", [False, True])
def test_split_forward_equals_unsplit(family, ratios, threads):
    model = tiny_model(family, seed=3)
    target = TargetModel(model, tokenizer=None)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 96, (1, 11), generator=gen)
    tree_ids = torch.randint(0, 96, (1, PARENTS.numel() + 1), generator=gen)
    expected = _tree_forward(target, prompt, tree_ids)
    with hcmp_mode(model, HcmpConfig(ratios=ratios, threads=threads)):
        assert isinstance(model.model.layers[0].mlp.down_proj, SplitLinear)
        got = _tree_forward(target, prompt, tree_ids)
        plain_cache = target.new_cache()  # prefill without a mask: causal attention inside hcmp
        causal = target.forward(prompt, plain_cache).logits
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-4, rtol=1e-4)
    for layer in expected.hidden:
        torch.testing.assert_close(got.hidden[layer], expected.hidden[layer], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(causal, target.forward(prompt, target.new_cache()).logits, atol=1e-4, rtol=1e-4)
    # the stock modules and attention implementation are back
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    assert model.config._attn_implementation == "sdpa"


def test_hcmp_is_really_used(monkeypatch):
    import draftsmith.eval.policies.hcmp as hcmp

    calls = []
    original = hcmp.partial_attention
    monkeypatch.setattr(hcmp, "partial_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    model = tiny_model("llama")
    with hcmp_mode(model, HcmpConfig()):
        model(torch.randint(0, 96, (1, 5)))
    assert len(calls) == 2 * model.config.num_hidden_layers  # dense + sparse part per layer


@pytest.mark.parametrize("ratio", [0.3, 0.5])
def test_hcmp_decoding_is_lossless(family, ratio):
    model = tiny_model(family, seed=4, num_layers=3)
    target = TargetModel(model, tokenizer=None)
    prompt = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20, do_sample=False)
    drafter = LMDrafter(layer_subset_student(model, [1]), mode="tree", depth=3, topk=2, budget=8)
    policy = build_spec(f"hcmp:ratio={ratio},attention=0.5", target, None)
    policy.drafter = drafter
    result = policy.make_decoder(target, DecodeConfig(max_new_tokens=20)).generate(prompt)
    assert result.tokens == reference[0, prompt.shape[1]:].tolist()
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear


def test_config_validation():
    with pytest.raises(ValueError, match="unknown HCMP layer type"):
        HcmpConfig(ratios={"ffn": 0.5})
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        HcmpConfig(ratios={"mlp": 1.5})
    with pytest.raises(ValueError, match="decoder layer list"):
        HcmpPlan(nn.Linear(2, 2), HcmpConfig())


@pytest.mark.slow
def test_real_smollm2_split_forward_and_decoding():
    from draftsmith.models.registry import is_fetched

    if not is_fetched("smollm2-135m-instruct"):
        pytest.skip("smollm2-135m-instruct not in the registry cache")
    target = TargetModel.from_pretrained("smollm2-135m-instruct", dtype="float32")
    prompt = torch.tensor([target.tokenizer.encode("Write a short poem about the sea and the wind.")])
    tree_ids = torch.randint(0, 1000, (1, PARENTS.numel() + 1), generator=torch.Generator().manual_seed(0))
    expected = _tree_forward(target, prompt, tree_ids)
    with hcmp_mode(target.model, HcmpConfig(ratios={"qkv": 0.3, "o": 0.6, "mlp": 0.5, "attention": 0.7})):
        got = _tree_forward(target, prompt, tree_ids)
    torch.testing.assert_close(got.logits, expected.logits, atol=2e-3, rtol=1e-3)
    reference = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24,
                                      do_sample=False)[0, prompt.shape[1]:].tolist()
    drafter = LMDrafter(layer_subset_student(target.model, list(range(0, target.num_layers, 2))), mode="tree",
                        depth=3, topk=2, budget=8)
    decoder = HcmpPolicy(drafter, HcmpConfig.uniform(0.5)).make_decoder(target, DecodeConfig(max_new_tokens=24))
    assert decoder.generate(prompt).tokens == reference

