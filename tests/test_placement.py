"""Dovetail placement: drafter on another device (both "cpu" here, same code path), lossless, bytes counted."""

import pytest
import torch

from conftest import build_spec, tiny_model
from draftsmith.eval.decode.decoder import DecodeConfig, DecodeStats
from draftsmith.eval.decode.drafters.lm import LMDrafter
from draftsmith.eval.decode.drafters.medusa import MedusaDrafter
from draftsmith.eval.policies.hcmp import HcmpPolicy
from draftsmith.eval.policies.placement import DovetailPolicy, PlacedDrafter, move_drafter, tensor_bytes
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.student import layer_subset_student
from draftsmith.models.target import TargetModel

NEW_TOKENS = 20


def _setup(family, seed=0):
    model = tiny_model(family, seed=seed, num_layers=3)
    target = TargetModel(model, tokenizer=None)
    prompt = torch.randint(0, 96, (1, 10), generator=torch.Generator().manual_seed(seed))
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                               do_sample=False)[0, prompt.shape[1]:].tolist()
    return model, target, prompt, reference


@pytest.mark.parametrize("kind", ["lm-tree", "medusa"])
def test_dovetail_is_lossless_and_counts_bytes(family, kind):
    model, target, prompt, reference = _setup(family)
    if kind == "lm-tree":
        inner = LMDrafter(layer_subset_student(model, [0]), mode="tree", depth=3, topk=2, budget=8)
    else:
        torch.manual_seed(0)
        heads = MedusaHeads(MedusaConfig(model.config.hidden_size, model.config.vocab_size, num_heads=3))
        heads.init_lm_heads(model.lm_head.weight)
        inner = MedusaDrafter(heads)
    policy = DovetailPolicy(inner, "cpu")
    result = policy.make_decoder(target, DecodeConfig(max_new_tokens=NEW_TOKENS)).generate(prompt)
    assert result.tokens == reference
    stats = result.stats
    assert stats.transfer_bytes > 0
    # at least: the prompt, every tree (3 int64 tensors per node) and, for Medusa, the final hidden states
    minimum = tensor_bytes(prompt) + 3 * 8 * stats.tree_tokens
    if kind == "medusa":
        minimum += 4 * model.config.hidden_size * (prompt.shape[1] + stats.round_tokens)
    assert stats.transfer_bytes >= minimum
    assert "transfer_bytes" in stats.to_dict()
    # a second request starts counting from zero
    again = policy.make_decoder(target, DecodeConfig(max_new_tokens=NEW_TOKENS)).generate(prompt)
    assert again.stats.transfer_bytes == stats.transfer_bytes


def test_stats_merge_sums_transfer_bytes():
    a, b = DecodeStats(transfer_bytes=5), DecodeStats(transfer_bytes=7)
    a.merge(b)
    assert a.transfer_bytes == 12


def test_move_drafter_copies_only_across_devices():
    model = tiny_model("llama")
    drafter = LMDrafter(model, mode="chain")
    assert move_drafter(drafter, torch.device("cpu")).model is model  # same device: shared, no copy
    drafter.model = model.to(torch.float64)
    placed = PlacedDrafter(drafter, "cpu")
    assert placed.inner.model is model


def test_bench_specs_build_policies():
    model, target, prompt, reference = _setup("llama", seed=1)
    draft = TargetModel(tiny_model("llama", seed=1, num_layers=1), tokenizer=None)
    policy = build_spec("dovetail:device=cpu,inner=(lm-tree:depth=3,topk=2,budget=6)", target, draft)
    assert isinstance(policy, DovetailPolicy) and isinstance(policy.inner, LMDrafter)
    assert policy.inner.budget == 6
    hcmp = build_spec("hcmp:inner=(lm-chain:budget=3),ratio=0.4,threads=true", target, draft)
    assert isinstance(hcmp, HcmpPolicy) and hcmp.config.ratios["mlp"] == 0.4 and hcmp.config.threads
    for method in (policy, hcmp):
        tokens = method.make_decoder(target, DecodeConfig(max_new_tokens=NEW_TOKENS)).generate(prompt).tokens
        assert tokens == reference
    with pytest.raises(ValueError, match="inner"):
        build_spec("dovetail:device=cpu", target, draft)
    with pytest.raises(ValueError, match="not a drafter"):
        build_spec("dovetail:inner=(loop-plain)", target, draft)
