"""Draft LM precisions (models/precision.py): weight-only int8 against its own dequantized weights."""

from dataclasses import replace

import pytest
import torch
from torch import nn
from transformers import LlamaForCausalLM

from draftsmith.config import ConfigError
from draftsmith.eval.bench.build_context import BuildContext, draft_lm_storage
from draftsmith.eval.bench.methods import drafter_settings, parse_method
from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.lm import LMDrafter
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import InvariantLinear, Kernels, WeightPrecision, invariant_model
from draftsmith.models.target import TargetModel
from draftsmith.models.precision import (DraftPrecision, Int8WeightLinear, weight_count, with_int8_weights,
                                        with_precision)
from tests.conftest import repetitive_prompt, tiny_config, tiny_model


def test_an_int8_weight_linear_computes_with_its_dequantized_weight():
    torch.manual_seed(0)
    linear = nn.Linear(64, 40, bias=True)
    quantized = Int8WeightLinear(linear)
    x = torch.randn(2, 3, 64)
    dequantized = quantized.weight_int8.float() * quantized.scales.float()[:, None]
    reference = x.bfloat16().float() @ dequantized.T + quantized.bias.float()
    out = quantized(x)
    assert out.shape == (2, 3, 40) and out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), reference, atol=0.05, rtol=0.02)
    assert (dequantized - linear.weight).abs().max() <= quantized.scales.float().max() / 2 + 1e-3


def test_linears_the_kernel_cannot_take_stay_bf16_and_the_original_is_untouched():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 24), nn.Linear(24, 8))  # 24 inputs: not a multiple of 16
    converted = with_int8_weights(model.to(torch.bfloat16))
    assert [type(layer) for layer in converted] == [Int8WeightLinear, Int8WeightLinear, nn.Linear]
    assert weight_count(converted) == 64 * 32 + 32 * 24 + 24 * 8 + 8  # int8 buffers + the bf16 layer's weight, bias


def test_a_tied_head_gets_its_own_int8_copy_and_the_source_model_keeps_its_weights():
    config = tiny_config("llama", hidden_size=48)
    config.tie_word_embeddings = True
    model = LlamaForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    converted = with_precision(model, DraftPrecision.INT8_WEIGHTS)
    assert isinstance(converted.lm_head, Int8WeightLinear) and not converted.config.tie_word_embeddings
    assert model.config.tie_word_embeddings and all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert converted(ids).logits.argmax(-1).shape == model(ids).logits.argmax(-1).shape


def test_int8_weights_on_the_compiled_kernels_are_their_own_int8_under_a_bf16_copy():
    """precision=int8-weights: on the compiled backend with the batch-invariant kernels, a bf16 copy whose kernels
    store int8 weights (bf16 activations, as torch's kernel computes); elsewhere torch's weight-only int8 path."""
    compiled = CompileSettings()
    assert draft_lm_storage(DraftPrecision.INT8_WEIGHTS, Backend.COMPILED, compiled) == (
        DraftPrecision.BFLOAT16, replace(compiled, weights=WeightPrecision.INT8))
    inductor = replace(compiled, kernels=Kernels.INDUCTOR)
    assert draft_lm_storage(DraftPrecision.INT8_WEIGHTS, Backend.COMPILED, inductor) == (
        DraftPrecision.INT8_WEIGHTS, inductor)
    assert draft_lm_storage(DraftPrecision.INT8_WEIGHTS, Backend.EAGER, compiled)[0] is DraftPrecision.INT8_WEIGHTS
    assert draft_lm_storage(DraftPrecision.BFLOAT16, Backend.COMPILED, compiled) == (DraftPrecision.BFLOAT16, compiled)


@pytest.mark.parametrize("activations", [DraftPrecision.BFLOAT16, DraftPrecision.FLOAT32])
def test_a_draft_lm_on_the_int8_kernels_keeps_decoding_lossless(activations):
    """precision=int8-weights (bf16 activations) and weights=int8 (the draft LM's float32 ones)."""
    target = TargetModel(tiny_model("llama", seed=1, num_layers=3), tokenizer=None)
    draft = invariant_model(with_precision(tiny_model("llama", seed=1, num_layers=1), activations),
                            WeightPrecision.INT8)
    assert {m.packed.dtype for m in draft.modules() if isinstance(m, InvariantLinear)} == {torch.int8}
    assert next(draft.parameters()).dtype == getattr(torch, activations.value)
    prompt = repetitive_prompt(2)
    plain = SpeculativeDecoder(target, None, DecodeConfig(max_new_tokens=24)).generate(prompt)
    result = SpeculativeDecoder(target, LMDrafter(draft, mode="chain", budget=3),
                                DecodeConfig(max_new_tokens=24)).generate(prompt)
    assert result.tokens == plain.tokens and result.stats.verify_forwards < 24


def test_a_draft_lms_weights_option_stores_its_weights_on_the_kernels_under_its_own_activations():
    """lm-chain:...,weights=int8: int8 weights on the batch-invariant kernels under the draft LM's float32 (or bf16)
    activations; with precision=int8-weights, or where no such kernels run, refused in one line."""
    compiled = CompileSettings()
    assert draft_lm_storage(DraftPrecision.FLOAT32, Backend.COMPILED, compiled, WeightPrecision.INT8) == (
        DraftPrecision.FLOAT32, replace(compiled, weights=WeightPrecision.INT8, head=None))
    assert draft_lm_storage(DraftPrecision.BFLOAT16, Backend.COMPILED, compiled, WeightPrecision.W8A8)[1].weights is (
        WeightPrecision.W8A8)
    with pytest.raises(ConfigError, match="both set how the draft LM's weights are stored"):
        draft_lm_storage(DraftPrecision.INT8_WEIGHTS, Backend.COMPILED, compiled, WeightPrecision.INT8)
    with pytest.raises(ConfigError, match="weights=int8 is read by the compiled backend's batch-invariant"):
        draft_lm_storage(DraftPrecision.FLOAT32, Backend.EAGER, compiled, WeightPrecision.INT8, "lm-chain")
    for spec in ("lm-chain:budget=4,weights=int8", "lm-tree:weights=int8", "lm-parallel:weights=int8",
                 "llmcad:weights=int8"):
        assert parse_method(spec).options.weights is WeightPrecision.INT8


def test_a_feature_block_or_medusa_drafters_weights_option_sets_its_kernels_precision():
    """dgf:/dflash:/medusa:...,weights=int8: the drafter's engine stores int8 weights on the batch-invariant kernels
    (the run's settings otherwise); refused in one line where no such kernels run."""
    target = TargetModel(tiny_model("llama", seed=0, num_layers=2), tokenizer=None)
    compiled = BuildContext(target, backend=Backend.COMPILED)
    for name in ("dgf", "dflash:some/dir", "medusa:some/dir"):
        spec = parse_method(f"{name},weights=int8" if ":" in name else f"{name}:weights=int8")
        assert drafter_settings(spec, compiled) == replace(compiled.settings, weights=WeightPrecision.INT8)
        assert drafter_settings(parse_method(name), compiled) is compiled.settings
        with pytest.raises(ConfigError, match="weights=int8 is read by the compiled backend's batch-invariant"):
            drafter_settings(spec, BuildContext(target))
