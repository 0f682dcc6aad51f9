"""The EAGLE family's checkpoint layouts, as their loaders read them (library behind models.exports).

  eagle        EAGLE-1/2 (SafeAILab/EAGLE `eagle/model/cnets1.py` `Model`; SGLang `models/llama_eagle.py`,
               `models/qwen2_eagle.py`; vLLM `model_executor/models/llama_eagle.py`): config.json +
               model.safetensors with `fc.*`, `layers.{i}.*` (layer 0 without input norm).
  speculators  EAGLE-3 in vLLM's speculators format (`speculators/models/eagle3/core.py`
               `Eagle3DraftModel`, read by vLLM's `speculators` config path): config.json with
               `speculators_model_type: eagle3`, `transformer_layer_config`, `draft_vocab_size`,
               `eagle_aux_hidden_state_layer_ids`, `speculators_config`; weights `fc.weight`,
               `layers.{i}.*` (`layers.0.hidden_norm`, q/k/v of 2H inputs), `norm.weight`,
               `lm_head.weight`, `d2t`, `t2d`.
  sglang       EAGLE-3 as SGLang's `models/llama_eagle3.py` `LlamaForCausalLMEagle3` reads it: a Llama
               config with `architectures: [LlamaForCausalLMEagle3]`, `draft_vocab_size`,
               `eagle_config.eagle_aux_hidden_state_layer_ids`; weights `fc.weight`, `midlayer.*`,
               `norm.weight`, `lm_head.weight`, `d2t`, `t2d` (one decoder layer only).

Config keys are written for readers of both transformers layouts: a top-level `rope_theta` and
`rope_scaling` (transformers 4, EAGLE's code) besides `rope_parameters` where transformers 5 readers
want it. d2t holds offsets (target id = draft id + d2t[draft id]), t2d a boolean mask over the target
vocabulary, as EAGLE-3, speculators, vLLM and SGLang define them.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.config import TextEnum, enum_member
from draftsmith.errors import UserError
from draftsmith.models.artifacts import CONFIG_FILE, float_state, load_weights
from draftsmith.models.dgf import DROP_CONFIG_KEYS, DGFConfig, DGFModel, Fusion, LayerFusion, eagle3_layer_config
from draftsmith.models.vocab import DraftHead


class DgfLayout(TextEnum):
    """The directory layout a feature drafter is exported in (scripts/export.py dgf ... layout=)."""

    AUTO = "auto"  # picked by the drafter: EAGLE-1/2 for fusion linear, speculators for eagle3, else dgf
    EAGLE = "eagle"  # EAGLE-1/2 (EAGLE's cnets, SGLang, vLLM)
    SPECULATORS = "speculators"  # EAGLE-3 in speculators' format (vLLM)
    SGLANG = "sglang"  # EAGLE-3 for SGLang's LlamaForCausalLMEagle3
    DGF = "dgf"  # draftsmith's own (models.artifacts.load_dgf)


EAGLE_WEIGHTS = "model.safetensors"
EAGLE1_ARCHITECTURES = {"llama": ["LlamaForCausalLMEagle", "LlamaForCausalLM"],  # SGLang name first; vLLM
                        "qwen2": ["Qwen2ForCausalLMEagle", "LlamaForCausalLM"]}  # prefixes "Eagle" to each
SGLANG_EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_VERSION = "0.9.0"  # the speculators release the format was checked against


def tensor_metadata(**fields) -> dict[str, str]:
    """safetensors header metadata: strings only; `format: pt` as transformers expects."""
    return {"format": "pt", **{key: value if isinstance(value, str) else json.dumps(value)
                               for key, value in fields.items() if value is not None}}


def transformers4_rope(config: dict) -> dict:
    """A HF config dict with top-level rope_theta / rope_scaling (transformers 4 and EAGLE's code read
    these; transformers 5 reads them too and rebuilds rope_parameters)."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters", None) or {})
    config["rope_theta"] = float(rope.pop("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = rope.pop("rope_type", rope.pop("type", "default"))
    config["rope_scaling"] = None if rope_type == "default" else {"type": rope_type, "rope_type": rope_type, **rope}
    return config


# ---------------------------------------------------------------------------------------------
# EAGLE-1/2
# ---------------------------------------------------------------------------------------------


def eagle_config(model: DGFModel) -> dict:
    """config.json of an EAGLE-1/2 export: the block config with both rope layouts, `qkv_bias` (EAGLE's
    cnets1.py and vLLM's Llama read it for Qwen2-style q/k/v biases), no `bias` key (vLLM's Llama would
    read it as attention bias; EAGLE's own default for fc is true, and fc.bias is always written)."""
    config = transformers4_rope(model.block_config.to_dict())
    for key in ("bias", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        config.pop(key, None)
    config["qkv_bias"] = model.layers[0].self_attn.q_proj.bias is not None
    config["architectures"] = EAGLE1_ARCHITECTURES.get(config["model_type"], ["LlamaForCausalLM"])
    return config


def export_eagle(model, out_dir: str | Path, metadata: dict | None = None) -> Path:
    """Write a `fusion: linear` drafter in EAGLE-1/2's layout. fc.bias is always stored (zeros for a
    drafter without one), so EAGLE (bias on by default) and SGLang (always a bias) compute the same as
    vLLM (no fc bias: it skips the tensor) exactly when the drafter has no fc bias."""
    model = getattr(model, "model", model)  # a DGFDrafter works too
    if model.config.fusion is not Fusion.LINEAR:
        raise UserError(f"EAGLE-1/2's layout holds fusion 'linear' only, this drafter has "
                        f"{model.config.fusion.value!r}: use layout dgf (draftsmith) or, for fusion eagle3, "
                        "speculators / sglang")
    if model.config.first_block_norm or model.config.multi_layer or model.config.draft_vocab_size is not None:
        raise UserError("EAGLE-1/2's layout has no block-0 input norm, one feature layer and the target's full "
                         "LM head; this drafter has first_block_norm, several feature layers or a draft vocabulary")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name.removeprefix("fusion."): t for name, t in float_state(model).items()}
    state.setdefault("fc.bias", torch.zeros(model.config.hidden_size))
    save_file(state, str(out / EAGLE_WEIGHTS), metadata=tensor_metadata(**(metadata or {})))
    (out / CONFIG_FILE).write_text(json.dumps(eagle_config(model), indent=2, default=str))
    return out


def load_eagle(path: str | Path, target_model=None) -> DGFModel:
    """A `fusion: linear` DGFModel from an EAGLE-1/2 directory (config.json + model.safetensors)."""
    path = Path(path)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE} (expected an EAGLE checkpoint directory)")
    hf = json.loads(config_file.read_text())
    bias = bool(hf.pop("bias", True))
    hf.pop("qkv_bias", None)
    target_config = {k: v for k, v in hf.items() if k not in DROP_CONFIG_KEYS}
    config = DGFConfig(hidden_size=hf["hidden_size"], vocab_size=hf["vocab_size"], target_config=target_config,
                       num_blocks=int(hf["num_hidden_layers"]), fusion=Fusion.LINEAR, fusion_bias=bias)
    model = DGFModel(config)
    state = load_weights(path / EAGLE_WEIGHTS)
    state.pop("embed_tokens.weight", None)  # EAGLE's own files may carry the base model's embedding
    if not bias:
        state.pop("fc.bias", None)
    state = {(f"fusion.{k}" if k.startswith("fc.") else k): v for k, v in state.items()}
    _load_strict(model, state, path / EAGLE_WEIGHTS)
    if target_model is not None:
        model.attach_target(target_model)
    return model.eval()


def _load_strict(model: torch.nn.Module, state: dict, file: Path) -> None:
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise UserError(f"{file} does not fit its {CONFIG_FILE}: {' '.join(str(err).split())}") from err


# ---------------------------------------------------------------------------------------------
# EAGLE-3: vLLM speculators and SGLang
# ---------------------------------------------------------------------------------------------


def check_eagle3(model: DGFModel, target_layers: int, layout: DgfLayout) -> None:
    """Refuse, in one line, a drafter the EAGLE-3 layouts cannot carry."""
    config = model.config
    if config.fusion is not Fusion.EAGLE3:
        raise UserError(f"the {layout} layout holds EAGLE-3 drafters (drafter.fusion=eagle3); this one has fusion "
                         f"{config.fusion.value!r}: use layout eagle (fusion linear) or dgf")
    if not config.multi_layer or config.layer_fusion is not LayerFusion.LINEAR:
        raise UserError(f"the {layout} layout fuses several target layers with one linear fc; this drafter reads "
                         f"{config.layers_read} with layer_fusion {config.layer_fusion.value!r}")
    if min(config.layers_read) < 1 or max(config.layers_read) >= target_layers:
        raise UserError(f"feature layers {config.layers_read}: EAGLE-3 loaders capture decoder-layer inputs 1.."
                         f"{target_layers - 1} (not the embedding or the final normed state)")
    if layout is DgfLayout.SGLANG and (config.num_blocks != 1 or len(config.layers_read) != 3):
        raise UserError(f"SGLang's LlamaForCausalLMEagle3 has one decoder layer and a 3-layer fc; this drafter has "
                         f"{config.num_blocks} blocks and {len(config.layers_read)} layers: use layout speculators")


def eagle3_state(model: DGFModel) -> dict[str, torch.Tensor]:
    """The drafter's tensors in speculators' names (SGLang renames layers.0 to midlayer)."""
    state = {name.replace("layer_fusion.fc.", "fc."): t for name, t in float_state(model).items()
             if not name.startswith(("draft_head.", "draft_to_target"))}
    head = model.config.head
    weight = (model.draft_head.weight if head is DraftHead.OWN else model.sliced_head if head is DraftHead.SLICE
              else model._lm_head.weight)
    state["lm_head.weight"] = weight.detach().float().cpu().contiguous()
    if model.draft_vocab is not None:
        state["d2t"], state["t2d"] = model.draft_vocab.eagle3_maps()
    return state


def layer_config(model: DGFModel) -> dict:
    """The drafter's Llama decoder-layer config with both rope layouts."""
    config = model.block_config.to_dict()
    for key in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "architectures"):
        config.pop(key, None)
    return {**config, **{key: value for key, value in transformers4_rope(config).items()
                         if key in ("rope_theta", "rope_scaling") and value is not None}}


def speculators_config(model: DGFModel, verifier: str | None, verifier_architectures: list[str],
                       speculative_tokens: int) -> dict:
    config = model.config
    greedy = {"proposal_type": "greedy", "speculative_tokens": speculative_tokens, "verifier_accept_k": 1,
              "accept_tolerance": 0.0}
    return {"architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer_config(model),
            "draft_vocab_size": config.draft_vocab_size or config.vocab_size, "norm_before_residual": False,
            "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
            "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": list(config.layers_read),
            "speculators_config": {"algorithm": "eagle3", "proposal_methods": [greedy],
                                   "default_proposal_method": "greedy",
                                   "verifier": {"name_or_path": verifier, "architectures": verifier_architectures}}}


def sglang_eagle3_config(model: DGFModel) -> dict:
    config = model.config
    return {**layer_config(model), "architectures": [SGLANG_EAGLE3_ARCHITECTURE], "num_hidden_layers": 1,
            "draft_vocab_size": config.draft_vocab_size or config.vocab_size, "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.layers_read),
                             "use_aux_hidden_state": True}}


def export_eagle3(model: DGFModel, out_dir: str | Path, layout: DgfLayout, target_layers: int, verifier: str | None,
                  verifier_architectures: list[str], speculative_tokens: int, metadata: dict | None = None) -> Path:
    """Write an eagle3 drafter in `layout` "speculators" or "sglang" (config.json + model.safetensors)."""
    layout = enum_member(DgfLayout, layout, "layout")
    check_eagle3(model, target_layers, layout)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = eagle3_state(model)
    if layout is DgfLayout.SGLANG:
        state = {name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name: t
                 for name, t in state.items()}
        config = sglang_eagle3_config(model)
    else:
        config = speculators_config(model, verifier, verifier_architectures, speculative_tokens)
    save_file(state, str(out / EAGLE_WEIGHTS), metadata=tensor_metadata(**(metadata or {})))
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str))
    return out


def load_eagle3(path: str | Path, target_model=None) -> DGFModel:
    """A `fusion: eagle3` DGFModel from a speculators or SGLang EAGLE-3 directory (own head; the
    draft vocabulary from d2t)."""
    path = Path(path)
    hf = json.loads((path / CONFIG_FILE).read_text())
    speculators = hf.get("speculators_model_type") == "eagle3"
    layer = dict(hf["transformer_layer_config"] if speculators else hf)
    layers = hf["eagle_aux_hidden_state_layer_ids"] if speculators else hf["eagle_config"][
        "eagle_aux_hidden_state_layer_ids"]
    state = load_weights(path / EAGLE_WEIGHTS)
    if not speculators:
        state = {name.replace("midlayer.", "layers.0.", 1): t for name, t in state.items()}
    vocab_size, size = layer["vocab_size"], hf["draft_vocab_size"]
    reduced = size != vocab_size
    config = DGFConfig(hidden_size=layer["hidden_size"], vocab_size=vocab_size,
                       target_config=eagle3_layer_config(layer), num_blocks=int(layer["num_hidden_layers"]),
                       fusion=Fusion.EAGLE3, feature_layers=list(layers), layer_fusion=LayerFusion.LINEAR,
                       draft_vocab_size=size if reduced else None, head=DraftHead.OWN if reduced else DraftHead.TARGET)
    model = DGFModel(config)
    d2t = state.pop("d2t", None)
    state.pop("t2d", None)
    head = state.pop("lm_head.weight")
    state = {name.replace("fc.", "layer_fusion.fc.", 1) if name.startswith("fc.") else name: t
             for name, t in state.items()}
    if reduced:
        state["draft_to_target"] = d2t + torch.arange(size)
        state["draft_head.weight"] = head
    _load_strict(model, state, path / EAGLE_WEIGHTS)
    if target_model is not None:
        model.attach_target(target_model)
    return model.eval()
