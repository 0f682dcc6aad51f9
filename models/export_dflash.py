"""DFlash block drafters -> the layouts llama.cpp and speculators load (the shared export steps are models/exports.py's).

Both layouts hold the drafter's tensors under z-lab's names (`fc.weight`, `hidden_norm.weight`,
`layers.N.self_attn.q_proj.weight` ..., `norm.weight`; no embedding or LM head: both are the target's) in
`model.safetensors`, and differ in config.json:

    zlab         z-lab's DFlashDraftModel config (a Qwen3 config + `dflash_config` {block_size, target_layer_ids,
                 mask_token_id}), what llama.cpp's converter reads (conversion/qwen.py DFlashModel; `python
                 scripts/export.py gguf <export> <out.gguf> target=<target>` then runs it and decodes with
                 `--spec-type draft-dflash`)
    speculators  vLLM's speculators format (speculators/models/dflash/config.py DFlashSpeculatorConfig):
                 `transformer_layer_config`, `aux_hidden_state_layer_ids` (hidden-state indices: layer id + 1),
                 `block_size`, `mask_token_id`, `sample_from_anchor: false` (the root is the bonus token)

`target_layer_ids` are the decoder layers whose outputs the drafter reads; llama.cpp's converter writes them + 1
(the next layer's input), speculators' `aux_hidden_state_layer_ids` are the same numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from draftsmith.config import TextEnum, enum_member
from draftsmith.models import eagle_layouts
from draftsmith.models.artifacts import float_state, load_dflash, load_state, load_weights, manifest_layers
from draftsmith.models.dflash import DFlashConfig, DFlashModel
from draftsmith.models.exports import (PARITY_SEED, ExportResult, base_manifest, finish_export, fresh_tmp, hub_id,
                                       removes_tmp_on_error, write_model_card)
from draftsmith.models.target import TargetModel


class DFlashLayout(TextEnum):
    """The directory layout a DFlash drafter is exported in (scripts/export.py dflash ... layout=)."""

    ZLAB = "zlab"  # z-lab's config (llama.cpp's converter reads it)
    SPECULATORS = "speculators"  # speculators' DFlash config (vLLM)


WEIGHTS = "model.safetensors"
CONSUMERS = {
    "zlab": {"loaded": ["llama.cpp (pinned): convert_hf_to_gguf.py DFlashModel + llama-server --spec-type "
                        "draft-dflash, speculative output equal to plain"], "checked": []},
    "speculators": {"loaded": ["speculators (PyPI): DFlashDraftModel.from_pretrained, logits compared"],
                    "checked": ["vLLM speculators config path (speculators_model_type dflash)"]},
}


def qwen3_layer_config(config: DFlashConfig) -> dict:
    """The draft layers as a Qwen3 config (what both consumers build their layers from)."""
    return {"model_type": "qwen3", "hidden_size": config.hidden_size, "num_hidden_layers": config.num_layers,
            "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
            "head_dim": config.head_dim, "intermediate_size": config.intermediate_size, "hidden_act": "silu",
            "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
            "max_position_embeddings": config.max_positions, "vocab_size": config.vocab_size,
            "attention_bias": False, "tie_word_embeddings": False}


def zlab_config(config: DFlashConfig) -> dict:
    return {**qwen3_layer_config(config), "architectures": ["DFlashDraftModel"], "block_size": config.block_size,
            "dflash_config": {"block_size": config.block_size, "target_layer_ids": list(config.target_layer_ids),
                              "mask_token_id": config.mask_token_id}}


def speculators_config(config: DFlashConfig, verifier: str | None, verifier_architectures: list[str]) -> dict:
    greedy = {"proposal_type": "greedy", "speculative_tokens": config.block_size - 1, "verifier_accept_k": 1,
              "accept_tolerance": 0.0}
    return {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
            "speculators_version": eagle_layouts.SPECULATORS_VERSION,
            "transformer_layer_config": qwen3_layer_config(config), "draft_vocab_size": config.vocab_size,
            "block_size": config.block_size, "target_hidden_size": None,
            "aux_hidden_state_layer_ids": list(config.hidden_layers), "mask_token_id": config.mask_token_id,
            "sliding_window_non_causal": False, "sample_from_anchor": False,
            "speculators_config": {"algorithm": "dflash", "proposal_methods": [greedy],
                                   "default_proposal_method": "greedy",
                                   "verifier": {"name_or_path": verifier, "architectures": verifier_architectures}}}


def read_exported_config(directory: Path) -> DFlashConfig:
    """The DFlashConfig of an export in either layout."""
    raw = json.loads((directory / "config.json").read_text())
    if raw.get("speculators_model_type") == "dflash":
        layer, ids = raw["transformer_layer_config"], [i - 1 for i in raw["aux_hidden_state_layer_ids"]]
        block, mask = raw["block_size"], raw["mask_token_id"]
    else:
        layer, ids = raw, raw["dflash_config"]["target_layer_ids"]
        block, mask = raw["dflash_config"]["block_size"], raw["dflash_config"]["mask_token_id"]
    return DFlashConfig(hidden_size=layer["hidden_size"], num_layers=layer["num_hidden_layers"],
                        num_heads=layer["num_attention_heads"], num_kv_heads=layer["num_key_value_heads"],
                        head_dim=layer["head_dim"], intermediate_size=layer["intermediate_size"],
                        rms_norm_eps=layer["rms_norm_eps"], rope_theta=layer["rope_theta"],
                        vocab_size=layer["vocab_size"], max_positions=layer["max_position_embeddings"],
                        block_size=block, target_layer_ids=tuple(ids), mask_token_id=mask)


def is_dflash_export(directory: Path) -> bool:
    """A zlab-layout DFlash export (what llama.cpp's converter takes)."""
    file = Path(directory) / "config.json"
    return file.is_file() and "DFlashDraftModel" in json.loads(file.read_text()).get("architectures", [])


def parity_logits(model: DFlashModel, target: TargetModel) -> torch.Tensor:
    """The block logits of a seeded context and block (the drafter's whole forward, through the target's head)."""
    config = model.config
    generator = torch.Generator().manual_seed(PARITY_SEED)
    features = torch.randn(1, 12, len(config.target_layer_ids) * config.hidden_size, generator=generator)
    context = model.context_kv(features.to(target.device), torch.arange(12, device=target.device)[None])
    ids = torch.full((1, config.block_size), config.mask_token_id, device=target.device)
    ids[0, 0] = 1
    positions = torch.arange(12, 12 + config.block_size, device=target.device)[None]
    with torch.inference_mode():
        return model.lm_head(model.block_hidden(ids, positions, context, None)).float()


@removes_tmp_on_error
def export_dflash(source: str | Path, out_dir: str | Path, layout: DFlashLayout | str = DFlashLayout.ZLAB,
                  tolerance: float = 0.0, bench: dict | None = None, command: str | None = None,
                  target_model: TargetModel | None = None) -> ExportResult:
    """train/dflash.py `final/` (or a snapshot) -> `layout` (zlab | speculators), reloaded and compared."""
    source, out_dir = Path(source), Path(out_dir)
    layout = enum_member(DFlashLayout, layout, "layout")
    model, source_manifest = load_dflash(source)
    target = source_manifest["target"]
    target_model = target_model or TargetModel.from_pretrained(target["name"])
    model.attach_target(target_model.model)
    tmp = fresh_tmp(out_dir)
    save_file(float_state(model), str(tmp / WEIGHTS), metadata=eagle_layouts.tensor_metadata(
        producer="draftsmith", layout=f"{layout}-dflash", target=hub_id(target.get("name")),
        target_vocab_fingerprint=target.get("vocab_fingerprint"), feature_layers=list(model.config.hidden_layers)))
    config = (zlab_config(model.config) if layout is DFlashLayout.ZLAB else
              speculators_config(model.config, hub_id(target.get("name")),
                                  list(target_model.config.architectures or [type(target_model.model).__name__])))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    reloaded = DFlashModel(read_exported_config(tmp)).attach_target(target_model.model).eval()
    load_state(reloaded, load_weights(tmp / WEIGHTS), tmp / WEIGHTS, tmp / "config.json")
    block = {key: target.get(key) for key in ("name", "model_type", "hidden_size", "vocab_size", "num_hidden_layers",
                                              "vocab_fingerprint")}
    block.update(hidden_layers=manifest_layers(target), hub_id=hub_id(target.get("name")))
    manifest = base_manifest("dflash", f"{layout}-dflash", source, block, None, None, command)
    manifest["dflash"] = model.config.to_dict()
    manifest["consumers"] = CONSUMERS[layout.value]
    write_model_card(tmp, manifest, source_manifest, bench)
    return finish_export(tmp, out_dir, manifest, parity_logits(model, target_model),
                         parity_logits(reloaded, target_model), tolerance, f"DFlash drafter {source}")
