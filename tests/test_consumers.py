"""Every export format loaded by its consumer's own code (not draftsmith's loader), outputs compared
with draftsmith's module on the same inputs; formats whose consumer is a server that cannot run on
this CPU-only machine are checked key by key against the loader source cited at each test.

Consumers installed `--no-deps` by scripts/install.sh (their pins clash with ours): speculators 0.9.0
(vLLM's EAGLE-3 and DFlash formats), eagle-llm 1.2.1 (SafeAILab EAGLE-1/2), medusa-llm 0.1 (FasterDecoding).
Tolerances: 1e-5 absolute on float32 logits / features (the same arithmetic in another module order).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from draftsmith.models import export_dflash, export_medusa
from draftsmith.models import exports as export
from draftsmith.models.artifacts import save_dflash, save_dgf, target_block
from draftsmith.models.dflash import DFlashConfig, DFlashModel
from draftsmith.models.dgf import DGFConfig, DGFModel
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.target import TargetModel
from draftsmith.models.tiny import TinyTokenizer, build_tiny_causal_lm
from draftsmith.models.vocab import DraftVocab
from tests.conftest import write_medusa_final

TOLERANCE = 1e-5
LAYERS = [1, 3, 4]  # target hidden-state indices (decoder-layer inputs) of a 6-layer tiny target


def eagle3_final(tmp_path, family: str, head: str):
    """A saved fusion=eagle3 drafter over a draft vocabulary (every other token) of a tiny target."""
    model = build_tiny_causal_lm(family, num_layers=6)
    target = TargetModel(model, TinyTokenizer(96), name=f"tiny-{family}")
    vocab = DraftVocab.from_ids(range(0, 96, 2), 96)
    torch.manual_seed(0)
    config = DGFConfig.for_target(model.config, fusion="eagle3", feature_layers=LAYERS, layer_fusion="linear",
                                  draft_vocab_size=vocab.size, head=head)
    drafter = DGFModel(config).attach_target(model).set_vocab(vocab)
    for name, parameter in drafter.named_parameters():
        if "norm" not in name:
            torch.nn.init.normal_(parameter, std=0.1)
    save_dgf(drafter.eval(), tmp_path / "final", target_block(target, target.name, LAYERS))
    return model, target, drafter


def parity_inputs(hidden: int, k: int = len(LAYERS), length: int = 8):
    generator = torch.Generator().manual_seed(0)
    return torch.randn(1, length, k, hidden, generator=generator), torch.randint(0, 96, (1, length), generator=generator)


@pytest.mark.parametrize("family,head", [("llama", "own"), ("qwen2", "slice")])
def test_speculators_loads_eagle3_vocab_export(tmp_path, family, head):
    """vLLM's format, loaded by the speculators package's Eagle3DraftModel (speculators/models/eagle3/core.py)."""
    eagle3 = pytest.importorskip("speculators.models.eagle3")
    model, target, drafter = eagle3_final(tmp_path, family, head)
    result = export.export_dgf(tmp_path / "final", tmp_path / "spec", target=target)
    assert result.manifest["layout"] == "speculators-eagle3"
    model.save_pretrained(tmp_path / "verifier")  # the verifier speculators resolves its embedding from
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == LAYERS and config["draft_vocab_size"] == 48
    config["speculators_config"]["verifier"]["name_or_path"] = str(tmp_path / "verifier")
    config["transformer_layer_config"]["_attn_implementation"] = "eager"  # flex attention is GPU-first
    (tmp_path / "spec" / "config.json").write_text(json.dumps(config))
    loaded = eagle3.Eagle3DraftModel.from_pretrained(str(tmp_path / "spec")).eval()
    assert not loaded.lm_head.weight.isnan().any()  # the draft head comes from the export
    # the embedding is the verifier's (not exported; vLLM shares the target's): set it as the engine does
    loaded.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    assert torch.equal(loaded.d2t + torch.arange(48), drafter.draft_to_target)
    assert int(loaded.t2d.sum()) == 48 and bool(loaded.t2d[drafter.draft_to_target].all())
    features, ids = parity_inputs(48)
    captured = []
    loaded.lm_head.register_forward_hook(lambda module, inputs, output: captured.append(output))
    with torch.no_grad():
        loaded(features.flatten(-2), ids, torch.zeros_like(ids), ttt_steps=1)
        ours = drafter.logits(drafter(drafter.fuse_layers(features), ids))
    assert (captured[0].float() - ours).abs().max().item() <= TOLERANCE


def test_sglang_eagle3_layout_matches_its_loader(tmp_path):
    """SGLang python/sglang/srt/models/llama_eagle3.py (LlamaForCausalLMEagle3): fc over 3 target layers,
    one `midlayer` whose q/k/v read 2H with no bias, `hidden_norm`, `norm`, a draft-vocabulary `lm_head`,
    d2t offsets (hot_token_id = d2t + arange), t2d skipped; config.draft_vocab_size and
    eagle_config.eagle_aux_hidden_state_layer_ids. The server cannot run here: names and shapes checked."""
    _, target, drafter = eagle3_final(tmp_path, "qwen2", "own")
    result = export.export_dgf(tmp_path / "final", tmp_path / "sgl", target=target, layout="sglang")
    assert result.manifest["layout"] == "sglang-eagle3" and result.max_abs_diff <= TOLERANCE
    config = json.loads((tmp_path / "sgl" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["draft_vocab_size"] == 48 and config["num_hidden_layers"] == 1
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == LAYERS
    assert config["rope_theta"] == drafter.block_config.rope_parameters["rope_theta"]
    state = load_file(str(tmp_path / "sgl" / "model.safetensors"))
    hidden = 48
    assert state["fc.weight"].shape == (hidden, 3 * hidden)
    for name in ("q_proj", "k_proj", "v_proj"):
        assert state[f"midlayer.self_attn.{name}.weight"].shape[1] == 2 * hidden
        assert f"midlayer.self_attn.{name}.bias" not in state  # SGLang's qkv_proj has bias=False
    assert {"midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight", "norm.weight",
            "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight"} <= set(state)
    assert state["lm_head.weight"].shape == (48, hidden)
    assert torch.equal(state["d2t"] + torch.arange(48), drafter.draft_to_target) and state["t2d"].dtype == torch.bool
    assert not any(name.startswith("layers.") for name in state)


def test_eagle3_refusals_are_one_clear_error(tmp_path):
    _, target, _ = eagle3_final(tmp_path, "llama", "own")
    with pytest.raises(export.UserError, match="fusion 'linear' only"):
        export.export_dgf(tmp_path / "final", tmp_path / "e1", target=target, layout="eagle")
    assert not (tmp_path / "e1").exists() and not (tmp_path / "e1.tmp").exists()


def test_eagle_llm_loads_eagle1_export(tmp_path):
    """SafeAILab EAGLE-1/2 as eagle-llm ships it (eagle/model/cnets.py Model, configs.py EConfig, built as
    ea_model.py builds it: Model(config, bias=config.bias if present else True)). That release uses a
    rotary base of 10000 whatever the config says (EAGLE's GitHub cnets1.py reads rope_theta, which the
    export writes), so the tiny target here has rope_theta 10000."""
    cnets = pytest.importorskip("eagle.model.cnets")
    configs = pytest.importorskip("eagle.model.configs")
    model = build_tiny_causal_lm("llama")
    assert model.config.rope_parameters["rope_theta"] == 10000.0
    target = TargetModel(model, TinyTokenizer(96), name="tiny-llama")
    torch.manual_seed(0)
    drafter = DGFModel(DGFConfig.for_target(model.config, fusion="linear", num_blocks=2)).attach_target(model).eval()
    save_dgf(drafter, tmp_path / "final", target_block(target, target.name, [-1]))
    export.export_dgf(tmp_path / "final", tmp_path / "eagle", target=target)
    config = configs.EConfig.from_pretrained(str(tmp_path / "eagle"))
    assert config.to_dict().get("rope_theta", config.rope_parameters["rope_theta"]) == 10000.0
    # Under transformers 5 every PretrainedConfig turns rope_scaling into the rope_parameters dict, which
    # this transformers-4 code indexes with ["type"] and crashes on, whatever the file says; the file
    # has rope_scaling null, which is what a transformers-4 reader sees:
    assert json.loads((tmp_path / "eagle" / "config.json").read_text())["rope_scaling"] is None
    config.rope_scaling = None
    loaded = cnets.Model(config, bias=getattr(config, "bias", True)).eval()
    state = load_file(str(tmp_path / "eagle" / "model.safetensors"))
    state["embed_tokens.weight"] = model.get_input_embeddings().weight.detach()  # EAGLE loads it from the base
    loaded.load_state_dict(state, strict=True)
    features, ids = torch.randn(1, 8, 48, generator=torch.Generator().manual_seed(0)), torch.randint(0, 96, (1, 8))
    with torch.no_grad():
        theirs = loaded(features, ids)
        ours = drafter(features, ids)
    assert (theirs - ours).abs().max().item() <= TOLERANCE


def test_eagle1_config_for_qwen2_and_vllm_readers(tmp_path):
    """Keys the other EAGLE-1/2 readers need (servers not run here): EAGLE GitHub cnets1.py builds q/k/v
    with bias=config.qkv_bias and rotary with config.rope_theta; vLLM model_executor/models/llama.py reads
    `bias`/`attention_bias` as attention bias and llama_eagle.py has no fc bias (skips fc.bias); SGLang
    llama_eagle.py / qwen2_eagle.py always build fc with a bias and dispatch on *ForCausalLMEagle."""
    model = build_tiny_causal_lm("qwen2")
    target = TargetModel(model, TinyTokenizer(96), name="tiny-qwen2")
    drafter = DGFModel(DGFConfig.for_target(model.config, fusion="linear", fusion_bias=False)).attach_target(model)
    save_dgf(drafter.eval(), tmp_path / "final", target_block(target, target.name, [-1]))
    export.export_dgf(tmp_path / "final", tmp_path / "eagle", target=target)
    config = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert config["qkv_bias"] is True and "bias" not in config and not config.get("attention_bias")
    assert config["rope_theta"] == model.config.rope_parameters["rope_theta"] and config["rope_scaling"] is None
    assert config["architectures"] == ["Qwen2ForCausalLMEagle", "LlamaForCausalLM"]
    with safe_open(str(tmp_path / "eagle" / "model.safetensors"), "pt") as f:
        assert not f.get_tensor("fc.bias").any()  # zeros: every reader computes the same
        assert "layers.0.self_attn.q_proj.bias" in f.keys()
        assert f.metadata()["format"] == "pt" and f.metadata()["producer"] == "draftsmith"


def word_level_tokenizer(directory, vocab_size: int):
    tokenizer = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(str(directory))
    return str(directory)


def test_medusa_llm_loads_fasterdecoding_export(tmp_path):
    """medusa-llm (FasterDecoding) medusa/model/medusa_model.py MedusaModel builds the heads over a base
    model; the export's medusa_lm_head.safetensors loads into them with strict=True (FasterDecoding's
    GitHub loader reads the safetensors file; the 0.1 release on PyPI reads a .pt of the same state dict)."""
    medusa_model = pytest.importorskip("medusa.model.medusa_model")
    base = build_tiny_causal_lm("llama")
    heads = MedusaHeads(MedusaConfig(hidden_size=48, vocab_size=96, num_heads=3, num_layers=1))
    torch.manual_seed(0)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    write_medusa_final(tmp_path / "final", heads)
    export_medusa.export_medusa(tmp_path / "final", tmp_path / "fd")
    config = json.loads((tmp_path / "fd" / "config.json").read_text())
    theirs = medusa_model.MedusaModel(base, config["medusa_num_heads"], config["medusa_num_layers"],
                                      word_level_tokenizer(tmp_path / "tok", 96))
    theirs.medusa_head.load_state_dict(load_file(str(tmp_path / "fd" / "medusa_lm_head.safetensors")), strict=True)
    hidden = torch.randn(1, 5, 48)
    with torch.no_grad():
        their_logits = torch.stack([head(hidden) for head in theirs.medusa_head])
        ours = heads(hidden)
    assert (their_logits - ours).abs().max().item() <= TOLERANCE


def test_medusa_llm_loads_draft_vocabulary_heads(tmp_path):
    """Heads over a draft vocabulary (a frozen slice of the target's LM head) are written over the full vocabulary:
    medusa-llm's MedusaModel loads them strictly, and its logits of the draft tokens are the heads' own."""
    medusa_model = pytest.importorskip("medusa.model.medusa_model")
    base = build_tiny_causal_lm("llama")
    heads = MedusaHeads(MedusaConfig(hidden_size=48, vocab_size=96, num_heads=3, num_layers=1, draft_vocab_size=40,
                                     head="slice"))
    torch.manual_seed(0)
    for parameter in heads.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    heads.set_vocab(DraftVocab(torch.arange(0, 80, 2), 96))
    write_medusa_final(tmp_path / "final", heads)
    export_medusa.export_medusa(tmp_path / "final", tmp_path / "fd", target_model=TargetModel(base, None))
    theirs = medusa_model.MedusaModel(base, 3, 1, word_level_tokenizer(tmp_path / "tok", 96))
    theirs.medusa_head.load_state_dict(load_file(str(tmp_path / "fd" / "medusa_lm_head.safetensors")), strict=True)
    heads.init_lm_heads(base.get_output_embeddings().weight)
    hidden = torch.randn(1, 5, 48)
    with torch.no_grad():
        their_logits = torch.stack([head(hidden) for head in theirs.medusa_head])
        ours = heads(hidden)
    assert (their_logits[..., torch.arange(0, 80, 2)] - ours).abs().max().item() <= TOLERANCE


def test_student_export_is_readable_by_transformers4(tmp_path):
    """transformers 4 reads top-level rope_theta (else 10000) and cannot resolve `TokenizersBackend`."""
    model = build_tiny_causal_lm("llama")
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 100000.0}
    model.save_pretrained(tmp_path / "student")
    word_level_tokenizer(tmp_path / "student", 96)
    export.export_student(tmp_path / "student", tmp_path / "out", check_assisted=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_theta"] == 100000.0 and config["rope_parameters"]["rope_theta"] == 100000.0
    tokenizer_config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tmp_path / "out" / "README.md").is_file()


TRANSFORMERS4_CHECK = """
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, __version__
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
with torch.no_grad():
    logits = model(torch.tensor([[1, 5, 7, 9, 11]])).logits
print(json.dumps([__version__, model.config.rope_theta, tokenizer("t3").input_ids,
                  float((logits - torch.tensor(json.load(open(sys.argv[2])))).abs().max())]))
"""


@pytest.mark.slow
def test_student_export_loads_under_transformers_456(tmp_path):
    """The student export read by transformers 4.56.2 itself, in a subprocess over a side install:
    `pip install --no-deps --target DIR transformers==4.56.2 tokenizers==0.22.1 huggingface_hub==0.35.3`
    and DRAFTSMITH_TRANSFORMERS4=DIR (skipped without it)."""
    import os
    import subprocess
    import sys

    side = os.environ.get("DRAFTSMITH_TRANSFORMERS4")
    if not side:
        pytest.skip("set DRAFTSMITH_TRANSFORMERS4 to a transformers==4.56.2 --target install")
    model = build_tiny_causal_lm("llama")
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 100000.0}
    model.save_pretrained(tmp_path / "student")
    word_level_tokenizer(tmp_path / "student", 96)
    export.export_student(tmp_path / "student", tmp_path / "out", check_assisted=False)
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    with torch.no_grad():
        reference = reloaded(torch.tensor([[1, 5, 7, 9, 11]])).logits
    (tmp_path / "reference.json").write_text(json.dumps(reference.tolist()))
    run = subprocess.run([sys.executable, "-c", TRANSFORMERS4_CHECK, str(tmp_path / "out"), str(tmp_path / "reference.json")],
                         env={**os.environ, "PYTHONPATH": side}, capture_output=True, text=True, check=True)
    version, rope_theta, ids, difference = json.loads(run.stdout.strip().splitlines()[-1])
    assert version == "4.56.2" and rope_theta == 100000.0 and ids == [3]
    assert difference <= TOLERANCE


def dflash_final(tmp_path):
    """A saved DFlash drafter (2 layers, blocks of 4, reading layers 1 and 3) of a tiny 6-layer target."""
    model = build_tiny_causal_lm("llama", num_layers=6)
    target = TargetModel(model, TinyTokenizer(96), name="tiny-llama")
    torch.manual_seed(0)
    config = DFlashConfig.from_target(model.config, num_layers=2, block_size=4, target_layer_ids=[1, 3],
                                      mask_token_id=95)
    drafter = DFlashModel(config).attach_target(model).eval()
    save_dflash(drafter, tmp_path / "final", target_block(target, target.name, config.hidden_layers))
    return model, target, drafter


def test_speculators_loads_the_dflash_export(tmp_path):
    """vLLM's format, loaded by the speculators package's DFlashDraftModel (speculators/models/dflash/core.py): its
    anchored-block forward gives our drafter's block logits (anchors, context and block masks as ours)."""
    dflash = pytest.importorskip("speculators.models.dflash")
    model, target, drafter = dflash_final(tmp_path)
    result = export_dflash.export_dflash(tmp_path / "final", tmp_path / "spec", layout="speculators",
                                         target_model=target)
    assert result.manifest["layout"] == "speculators-dflash" and result.max_abs_diff == 0
    model.save_pretrained(tmp_path / "verifier")
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [2, 4] and config["block_size"] == 4
    config["speculators_config"]["verifier"]["name_or_path"] = str(tmp_path / "verifier")
    config["transformer_layer_config"]["_attn_implementation"] = "eager"  # flex attention is GPU-first
    (tmp_path / "spec" / "config.json").write_text(json.dumps(config))
    loaded = dflash.DFlashDraftModel.from_pretrained(str(tmp_path / "spec")).eval()
    # the embedding and the full-vocabulary head are the verifier's (not exported): set them as the engine does
    loaded.embed_tokens.weight.data.copy_(model.get_input_embeddings().weight)
    loaded.lm_head.weight.data.copy_(model.get_output_embeddings().weight)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 90, (1, 16), generator=generator)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    features = torch.cat([hidden[i] for i in drafter.config.hidden_layers], -1)
    loss_mask = torch.zeros(1, 16, dtype=torch.long)
    loss_mask[0, [3, 7, 9]] = 1  # exactly as many answer positions as anchors: speculators' draw takes them all
    with torch.no_grad():
        _, theirs, *_ = loaded._backbone_forward(features, ids, loss_mask, hidden[-1], torch.zeros_like(ids),
                                                 max_anchors=3)
        ours = drafter.lm_head(drafter(features, ids, torch.ones_like(ids), torch.tensor([[3, 7, 9]]),
                                       torch.ones(1, 3, dtype=torch.bool)))
    assert (theirs.float().view(1, 3, 4, -1) - ours).abs().max().item() <= TOLERANCE
