"""Medusa heads -> the FasterDecoding layout (the shared export steps are models/exports.py's).

A train/medusa.py `final/` becomes `config.json` with `medusa_num_heads`, `medusa_num_layers`,
`base_model_name_or_path` (their MedusaConfig) and `medusa_lm_head.safetensors` holding the `medusa_head`
ModuleList's state dict: `{k}.{j}.linear.weight|bias` (ResBlock j of head k) and `{k}.{num_layers}.weight` (the
head's LM head) - the file FasterDecoding's training script writes and TGI / TensorRT-LLM read; inside
FasterDecoding's MedusaModel the same tensors are `medusa_head.{k}.{j}...` (the loader here accepts both
spellings). Heads over a draft vocabulary are written over the full vocabulary (models.medusa.full_vocabulary_heads).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoTokenizer

from draftsmith.errors import UserError
from draftsmith.models import eagle_layouts
from draftsmith.models.artifacts import ACCURACY_FILE, load_medusa_heads, load_weights, manifest_layers, read_json
from draftsmith.models.exports import (CONSUMERS, PARITY_SEED, PARITY_TOKENS, ExportResult, base_manifest,
                                       finish_export, fresh_tmp, hub_id, removes_tmp_on_error, write_model_card)
from draftsmith.models.medusa import (DEFAULT_MEDUSA_PATHS, MedusaConfig, MedusaHeads, arca_paths,
                                      full_vocabulary_heads, load_rank_accuracy)
from draftsmith.models.target import TargetModel, resolve_model_path
from draftsmith.models.vocab import DraftHead

MEDUSA_FD_WEIGHTS = "medusa_lm_head.safetensors"
MEDUSA_FD_CONFIG = "config.json"


def load_fasterdecoding_medusa(path: str | Path):
    """MedusaHeads (float32) from a FasterDecoding-layout directory (config.json + medusa_lm_head.safetensors)."""
    path = Path(path)
    config_file = path / MEDUSA_FD_CONFIG
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no {MEDUSA_FD_CONFIG} (expected a FasterDecoding Medusa directory)")
    config = read_json(config_file, "Medusa config")
    missing = [k for k in ("medusa_num_heads", "medusa_num_layers") if k not in config]
    if missing:
        raise UserError(f"{config_file} lacks {missing}: not a FasterDecoding Medusa config")
    state = load_weights(path / MEDUSA_FD_WEIGHTS)
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    num_heads, num_layers = int(config["medusa_num_heads"]), int(config["medusa_num_layers"])
    head_key = f"0.{num_layers}.weight"
    if head_key not in state:
        raise UserError(f"{path / MEDUSA_FD_WEIGHTS} has no {head_key!r}: it does not fit {MEDUSA_FD_CONFIG} "
                         f"(medusa_num_layers={num_layers})")
    vocab_size, hidden_size = state[head_key].shape
    heads = MedusaHeads(MedusaConfig(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=num_heads,
                                     num_layers=num_layers))
    try:
        heads.medusa_head.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise UserError(f"{path / MEDUSA_FD_WEIGHTS} does not fit {MEDUSA_FD_CONFIG}: {err}") from err
    return heads.eval(), config


def _check_medusa_exportable(source: Path, heads: MedusaHeads, source_manifest: dict) -> None:
    """FasterDecoding's head cannot carry a LoRA adapter or several distinct ResBlocks (a draft vocabulary is
    written over the full vocabulary)."""
    config = heads.config
    if source_manifest.get("target_adapter"):
        raise UserError(f"{source} holds Medusa-2 heads trained with a LoRA adapter on the target; the FasterDecoding "
                         "head file cannot carry it: merge the adapter into the base model and export that model too")
    if config.num_layers > 1:
        raise UserError(f"{source}: heads.num_layers={config.num_layers}; FasterDecoding builds a head from ONE ResBlock "
                         "repeated ([ResBlock(h)] * n shares its weights), so these heads would load and compute "
                         "something else: export heads trained with heads.num_layers=1")


def _save_tokenizer(name: str | None, out: Path) -> bool:
    """The target's tokenizer beside the heads (FasterDecoding and TGI load it from the directory)."""
    try:
        local = Path(resolve_model_path(str(name)))
    except UserError:
        return False
    if not local.is_dir():  # a hub id: never looked up from here (the engine resolves it itself)
        return False
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(local))
    except (OSError, ValueError):
        return False
    tokenizer.save_pretrained(str(out))
    return True


@removes_tmp_on_error
def export_medusa(source: str | Path, out_dir: str | Path, base_model: str | None = None,
                  tolerance: float = 0.0, bench: dict | None = None, command: str | None = None,
                  target_model: TargetModel | None = None) -> ExportResult:
    """train/medusa.py `final/` -> FasterDecoding layout. `base_model`: `base_model_name_or_path`
    to write (default: the hub id of the manifest's target). The manifest records the Medusa choices
    built from the saved head accuracies (models.medusa.arca_paths) when they are there. Heads over a draft
    vocabulary are written over the full vocabulary (models.medusa.full_vocabulary_heads), with the LM head of
    `target_model` (default: the manifest's target, loaded)."""
    source = Path(source)
    heads, source_manifest = load_medusa_heads(source)
    _check_medusa_exportable(source, heads, source_manifest)
    out_dir = Path(out_dir)
    target = source_manifest["target"]
    exported, vocab = heads, heads.draft_vocab
    if vocab is not None:
        lm_head = (target_model or TargetModel.from_pretrained(target["name"])).model.get_output_embeddings().weight
        if heads.config.head is DraftHead.SLICE:
            heads.init_lm_heads(lm_head)
        exported = full_vocabulary_heads(heads, lm_head)
    config = exported.config
    tmp = fresh_tmp(out_dir)
    state = {name: t.detach().float().contiguous() for name, t in exported.medusa_head.state_dict().items()}
    save_file(state, str(tmp / MEDUSA_FD_WEIGHTS), metadata=eagle_layouts.tensor_metadata(
        producer="draftsmith", layout="fasterdecoding-medusa", target=hub_id(target.get("name")),
        target_vocab_fingerprint=target.get("vocab_fingerprint"), feature_layers=manifest_layers(target) or [-1]))
    fd_config = {"medusa_num_heads": config.num_heads, "medusa_num_layers": config.num_layers,
                 "base_model_name_or_path": base_model or hub_id(target.get("name")),
                 "hidden_size": config.hidden_size, "vocab_size": config.vocab_size}
    (tmp / MEDUSA_FD_CONFIG).write_text(json.dumps(fd_config, indent=2))
    tokenizer_saved = _save_tokenizer(target.get("name"), tmp)
    tree = None
    if (source / ACCURACY_FILE).is_file():
        shutil.copy(source / ACCURACY_FILE, tmp / ACCURACY_FILE)
        tree = arca_paths(load_rank_accuracy(source / ACCURACY_FILE), len(DEFAULT_MEDUSA_PATHS))

    reloaded, _ = load_fasterdecoding_medusa(tmp)
    generator = torch.Generator().manual_seed(PARITY_SEED)
    hidden = torch.randn(1, PARITY_TOKENS, config.hidden_size, generator=generator)
    with torch.inference_mode():  # a draft vocabulary: its tokens' logits, as the heads score them
        reference_logits, reloaded_logits = heads(hidden), reloaded(hidden)
        if vocab is not None:
            reloaded_logits = reloaded_logits[..., vocab.draft_to_target]
    block = {key: target.get(key) for key in ("name", "model_type", "hidden_size", "vocab_size", "num_hidden_layers",
                                              "vocab_fingerprint")}
    block.update(hidden_layers=manifest_layers(target) or [-1], hub_id=hub_id(target.get("name")))
    manifest = base_manifest("medusa", "fasterdecoding-medusa", source, block, None,
                              {"medusa_choices": tree} if tree else None, command)
    manifest["medusa"] = {"method": source_manifest.get("method"), **config.to_dict(),
                          "trained_draft_vocab_size": vocab and vocab.size}
    manifest["tokenizer_saved"] = tokenizer_saved
    manifest["consumers"] = CONSUMERS["medusa"]
    write_model_card(tmp, manifest, source_manifest, bench)
    return finish_export(tmp, out_dir, manifest, reference_logits, reloaded_logits, tolerance, f"Medusa heads {source}")
