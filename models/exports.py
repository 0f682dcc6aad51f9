"""Exports of trained drafters into the layouts other projects load (library behind scripts/export.py).

  student  any HF causal LM directory (or a train/distill.py `final/` with its manifest) ->
           a plain `save_pretrained` directory (safetensors + tokenizer), loadable with
           `AutoModelForCausalLM.from_pretrained` and usable as `generate(assistant_model=...)`.
  medusa   a train/medusa.py `final/` -> the FasterDecoding Medusa layout: `config.json` with
           `medusa_num_heads`, `medusa_num_layers`, `base_model_name_or_path` (their MedusaConfig)
           and `medusa_lm_head.safetensors` holding the `medusa_head` ModuleList's state dict:
           `{k}.{j}.linear.weight|bias` (ResBlock j of head k) and `{k}.{num_layers}.weight` (the
           head's LM head) - the file FasterDecoding's training script writes and TGI / TensorRT-LLM
           read; inside FasterDecoding's MedusaModel the same tensors are `medusa_head.{k}.{j}...`
           (the loader here accepts both spellings).
  dgf      a train/dgf.py `final/` -> EAGLE's checkpoint layout (`export_eagle`: config.json +
           model.safetensors) when fusion=linear, else a copy in draftsmith's own DGF layout
           (models.artifacts.save_dgf: weights + config + manifest).

Every export is written to `<out>.tmp`, reloaded from disk and checked for parity (the same logits
on a fixed seeded input as the source, within `tolerance`), and only then renamed to `<out>`, with
`export_manifest.json` (target id, hidden layer ids, vocab hash, fusion type, tree config, parity
result). A failed check leaves no `<out>`.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.errors import UserError
from draftsmith.models.artifacts import (ACCURACY_FILE, CONFIG_FILE, float_state, load_dgf, load_medusa_heads,
                                         load_weights, manifest_layers, read_json, read_student_manifest,
                                         save_dgf)
from draftsmith.models.dgf import DROP_CONFIG_KEYS, DGFConfig, DGFModel
from draftsmith.models.medusa import DEFAULT_MEDUSA_PATHS, MedusaConfig, MedusaHeads, arca_paths, load_rank_accuracy
from draftsmith.models.target import TargetModel, check_same_tokenizer, resolve_dtype, resolve_model_path, vocab_fingerprint

EXPORT_MANIFEST = "export_manifest.json"
EAGLE_WEIGHTS = "model.safetensors"
EXPORT_FORMAT = "draftsmith.export/1"
MEDUSA_FD_WEIGHTS = "medusa_lm_head.safetensors"
MEDUSA_FD_CONFIG = "config.json"
PARITY_TOKENS = 16  # length of the fixed parity input
PARITY_SEED = 1234


@dataclass
class ExportResult:
    out_dir: Path
    manifest: dict

    @property
    def max_abs_diff(self) -> float:
        return self.manifest["parity"]["max_abs_diff"]


class ExportExistsError(UserError, FileExistsError):
    """The export directory exists and is not empty (an export never replaces another)."""


class ParityError(UserError):
    """The reloaded export does not reproduce the source's logits."""


# ---------------------------------------------------------------------------------------------
# Shared steps
# ---------------------------------------------------------------------------------------------


def _fresh_tmp(out_dir: Path) -> Path:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ExportExistsError(f"{out_dir} exists and is not empty: choose a new output directory or remove it")
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _finish(tmp: Path, out_dir: Path, manifest: dict, reference: torch.Tensor, reloaded: torch.Tensor,
            tolerance: float, what: str) -> ExportResult:
    """Compare logits, write the manifest, rename tmp -> out_dir (or remove tmp and raise)."""
    if reference.shape != reloaded.shape:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ParityError(f"{what}: reloaded logits have shape {tuple(reloaded.shape)}, the source's "
                          f"{tuple(reference.shape)}")
    diff = (reference.float() - reloaded.float()).abs().max().item()
    if not diff <= tolerance:  # NaN fails too
        shutil.rmtree(tmp, ignore_errors=True)
        raise ParityError(f"{what}: reloaded export differs from the source by {diff:.3g} > {tolerance:g} in logits")
    manifest["parity"].update(max_abs_diff=diff, tolerance=tolerance, ok=True)
    manifest["files"] = sorted(p.name for p in tmp.iterdir()) + [EXPORT_MANIFEST]
    (tmp / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked by _fresh_tmp)
    tmp.rename(out_dir)
    return ExportResult(out_dir, manifest)


def read_export_manifest(path: str | Path) -> dict:
    file = Path(path) / EXPORT_MANIFEST
    if not file.is_file():
        raise FileNotFoundError(f"no {EXPORT_MANIFEST} in {path}: not a scripts/export.py output")
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{file} is corrupt ({err})") from err
    if manifest.get("format") != EXPORT_FORMAT:
        raise UserError(f"{file}: format {manifest.get('format')!r} is not {EXPORT_FORMAT!r}")
    return manifest


def _base_manifest(kind: str, layout: str, source: Path, target: dict, fusion: str | None, tree: dict | None) -> dict:
    return {"format": EXPORT_FORMAT, "kind": kind, "layout": layout, "source": str(source), "target": target,
            "fusion": fusion, "tree": tree, "parity": {"input": f"seed {PARITY_SEED}, {PARITY_TOKENS} positions"}}


def _parity_ids(vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(PARITY_SEED)
    return torch.randint(0, vocab_size, (1, PARITY_TOKENS), generator=generator)


# ---------------------------------------------------------------------------------------------
# Distilled students (plain HF format)
# ---------------------------------------------------------------------------------------------


def _load_hf_model(path: str, dtype: torch.dtype):
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    except OSError as err:
        raise FileNotFoundError(f"{path} is not a loadable HF causal LM directory ({err})") from err
    except Exception as err:  # safetensors header errors etc. surface as various types
        if "safetensors" in repr(err).lower() or "header" in str(err).lower() or "deserializ" in str(err).lower():
            raise UserError(f"{path}: weights are corrupt or truncated ({err})") from err
        raise


def export_student(source: str | Path, out_dir: str | Path, target=None, dtype: str = "float32",
                   tree: dict | None = None, tolerance: float = 0.0, check_assisted: bool = True) -> ExportResult:
    """A distilled (or any) student -> plain HF directory. `source`: a HF model dir / zoo name or a
    train/distill.py `final/` (its manifest names the target). `target`: a TargetModel (or zoo name /
    dir) for the tokenizer check and the `generate(assistant_model=...)` check (greedy output of the
    target with the reloaded student as assistant == without it)."""
    source_path = Path(resolve_model_path(str(source))) if not Path(source).exists() else Path(source)
    if not (source_path / "config.json").is_file():
        raise FileNotFoundError(f"{source_path} has no config.json: expected a HF model directory or a "
                                "train/distill.py final/ directory")
    distilled = read_student_manifest(source_path)  # None: a plain HF directory (or another project's manifest)
    if isinstance(target, (str, Path)):
        target = TargetModel.from_pretrained(str(target), dtype=dtype)
    torch_dtype = resolve_dtype(dtype)
    model = _load_hf_model(str(source_path), torch_dtype)
    tokenizer = None
    if (source_path / "tokenizer_config.json").is_file() or (source_path / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(source_path))
    elif target is not None:
        tokenizer = target.tokenizer
    if tokenizer is None:
        raise UserError(f"{source_path} has no tokenizer: pass --target (the student uses the target's tokenizer)")
    if target is not None:
        check_same_tokenizer(target.tokenizer, tokenizer, what=f"student {source_path}")
    if distilled and distilled["target"].get("vocab_fingerprint") not in (None, vocab_fingerprint(tokenizer)):
        raise UserError(f"{source_path}: the tokenizer does not match the vocab fingerprint in its manifest")

    out_dir = Path(out_dir)
    tmp = _fresh_tmp(out_dir)
    if target is not None:  # stop on the target's end-of-turn tokens, as train/distill.py does
        model.generation_config.eos_token_id = target.model.generation_config.eos_token_id
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))

    reloaded = _load_hf_model(str(tmp), torch_dtype)
    ids = _parity_ids(model.config.vocab_size)
    with torch.inference_mode():
        reference_logits = model(ids).logits
        reloaded_logits = reloaded(ids).logits
    target_name = (target.name if target is not None else None) or (distilled or {}).get("target", {}).get("name")
    block = {"name": target_name, "vocab_fingerprint": vocab_fingerprint(tokenizer), "vocab_size": len(tokenizer),
             "hidden_size": getattr(target.config, "hidden_size", None) if target is not None else None,
             "hidden_layers": []}  # a standalone LM: it reads no target hidden state
    manifest = _base_manifest("student", "hf", source_path, block, None,
                              tree or {"bench_methods": ["lm-chain:k=4", "lm-tree:depth=4,topk=3,budget=16"]})
    manifest["student"] = {"model_type": model.config.model_type, "num_hidden_layers": model.config.num_hidden_layers,
                           "parameters": sum(p.numel() for p in model.parameters()), "dtype": dtype,
                           "distillation": distilled.get("training") if distilled else None}
    if check_assisted and target is not None:
        prompt = _parity_ids(model.config.vocab_size)[:, :8].to(target.device)
        common = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12)
        plain = target.model.generate(prompt, **common)
        assisted = target.model.generate(prompt, assistant_model=reloaded.to(target.device), **common)
        if not torch.equal(plain, assisted):
            shutil.rmtree(tmp, ignore_errors=True)
            raise ParityError("the target's greedy output with the exported student as assistant_model differs from "
                              "its plain greedy output")
        manifest["parity"]["assisted_generate"] = "greedy output with assistant_model == plain greedy (12 tokens)"
    return _finish(tmp, out_dir, manifest, reference_logits, reloaded_logits, tolerance, f"student {source_path}")


# ---------------------------------------------------------------------------------------------
# Medusa heads (FasterDecoding layout)
# ---------------------------------------------------------------------------------------------


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


def export_medusa(source: str | Path, out_dir: str | Path, base_model: str | None = None,
                  tolerance: float = 0.0) -> ExportResult:
    """train/medusa.py `final/` -> FasterDecoding layout. `base_model`: `base_model_name_or_path`
    to write (default: the target name in the manifest). The manifest records the Medusa choices
    built from the saved head accuracies (models.medusa.arca_paths) when they are there."""
    source = Path(source)
    heads, source_manifest = load_medusa_heads(source)
    if source_manifest.get("target_adapter"):
        raise UserError(f"{source} holds Medusa-2 heads trained with a LoRA adapter on the target; the FasterDecoding "
                         "head file cannot carry it: merge the adapter into the base model and export that model too")
    config = heads.config
    out_dir = Path(out_dir)
    tmp = _fresh_tmp(out_dir)
    target = source_manifest["target"]
    state = {name: t.detach().float().contiguous() for name, t in heads.medusa_head.state_dict().items()}
    save_file(state, str(tmp / MEDUSA_FD_WEIGHTS), metadata={"format": "pt"})
    fd_config = {"medusa_num_heads": config.num_heads, "medusa_num_layers": config.num_layers,
                 "base_model_name_or_path": base_model or target.get("name"),
                 "hidden_size": config.hidden_size, "vocab_size": config.vocab_size}
    (tmp / MEDUSA_FD_CONFIG).write_text(json.dumps(fd_config, indent=2))
    tree = None
    if (source / ACCURACY_FILE).is_file():
        shutil.copy(source / ACCURACY_FILE, tmp / ACCURACY_FILE)
        tree = arca_paths(load_rank_accuracy(source / ACCURACY_FILE), len(DEFAULT_MEDUSA_PATHS))

    reloaded, _ = load_fasterdecoding_medusa(tmp)
    generator = torch.Generator().manual_seed(PARITY_SEED)
    hidden = torch.randn(1, PARITY_TOKENS, config.hidden_size, generator=generator)
    with torch.inference_mode():
        reference_logits, reloaded_logits = heads(hidden), reloaded(hidden)
    block = {key: target.get(key) for key in ("name", "model_type", "hidden_size", "vocab_size", "num_hidden_layers",
                                              "vocab_fingerprint")}
    block["hidden_layers"] = manifest_layers(target) or [-1]
    manifest = _base_manifest("medusa", "fasterdecoding-medusa", source, block, None,
                              {"medusa_choices": tree} if tree else None)
    manifest["medusa"] = {"method": source_manifest.get("method"), **config.to_dict()}
    return _finish(tmp, out_dir, manifest, reference_logits, reloaded_logits, tolerance, f"Medusa heads {source}")


# ---------------------------------------------------------------------------------------------
# DGF / EAGLE feature drafters
# ---------------------------------------------------------------------------------------------


def export_dgf(source: str | Path, out_dir: str | Path, target=None, layout: str = "auto",
               tree: dict | None = None, tolerance: float = 0.0) -> ExportResult:
    """train/dgf.py `final/` -> EAGLE layout (`layout="eagle"`, fusion=linear only) or draftsmith's
    DGF layout (`layout="dgf"`); "auto" picks EAGLE when it can. Parity runs the drafter through the
    target's embedding and LM head when `target` (TargetModel, or zoo name / dir) is given, else
    through a seeded stand-in embedding/head of the same shape (the drafter's own weights are what
    the export carries)."""
    source = Path(source)
    if isinstance(target, (str, Path)):
        target = TargetModel.from_pretrained(str(target))
    model, source_manifest = load_dgf(source, target=target)
    config = model.config
    eagle_ok = config.fusion == "linear" and not config.first_block_norm
    if layout == "auto":
        layout = "eagle" if eagle_ok else "dgf"
    if layout not in ("eagle", "dgf"):
        raise UserError(f"layout must be auto, eagle or dgf, got {layout!r}")
    if layout == "eagle" and not eagle_ok:
        raise UserError(f"{source}: fusion={config.fusion!r}, first_block_norm={config.first_block_norm}: EAGLE's "
                         "layout holds only linear fusion without a block-0 input norm; use layout='dgf'")
    stand_in = None
    if target is None:
        torch.manual_seed(PARITY_SEED)
        stand_in = nn.Module()
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        stand_in.get_input_embeddings, stand_in.get_output_embeddings = (lambda: embed), (lambda: head)
        model.attach_target(stand_in)
    out_dir = Path(out_dir)
    tmp = _fresh_tmp(out_dir)
    if layout == "eagle":
        export_eagle(model, tmp)
        reloaded = load_eagle(tmp, target_model=target.model if target is not None else stand_in)
    else:
        save_dgf(model, tmp, source_manifest["target"],
                 **{k: v for k, v in source_manifest.items() if k not in ("format", "method", "target", "drafter")})
        reloaded, _ = load_dgf(tmp)
        reloaded.attach_target(target.model if target is not None else stand_in)
    reloaded = reloaded.to(device=model.device, dtype=model.dtype)
    generator = torch.Generator().manual_seed(PARITY_SEED)
    features = torch.randn(1, PARITY_TOKENS, config.hidden_size, generator=generator).to(model.device)
    ids = _parity_ids(config.vocab_size).to(model.device)
    with torch.inference_mode():
        reference_logits = model.logits(model(features, ids))
        reloaded_logits = reloaded.logits(reloaded(features, ids))
    want = source_manifest["target"]
    block = {key: want.get(key) for key in ("name", "model_type", "hidden_size", "vocab_size", "num_hidden_layers",
                                            "vocab_fingerprint")}
    block["hidden_layers"] = manifest_layers(want) or config.layers_read
    manifest = _base_manifest("dgf" if config.fusion == "dgf" else "eagle", "eagle" if layout == "eagle" else
                              "draftsmith.dgf", source, block, config.fusion,
                              tree or source_manifest.get("tree") or {"depth": 7, "topk": 10, "g": 16})
    manifest["drafter"] = {"num_blocks": config.num_blocks, "fusion_act": config.fusion_act,
                           "parameters": model.num_parameters()}
    manifest["parity"]["embedding_and_head"] = "target" if target is not None else f"seeded stand-in ({PARITY_SEED})"
    return _finish(tmp, out_dir, manifest, reference_logits, reloaded_logits, tolerance, f"DGF drafter {source}")


# ---------------------------------------------------------------------------------------------
# EAGLE checkpoint layout
# ---------------------------------------------------------------------------------------------


def export_eagle(model, out_dir: str | Path) -> Path:
    """Write a `fusion: linear` drafter in EAGLE's checkpoint layout (SafeAILab/EAGLE `cnets.py`).

    config.json: the target family's HF config with num_hidden_layers = M (as EAGLE's configs are),
    plus `"bias"` (EAGLE reads it for `fc`). model.safetensors: `fc.weight`, `fc.bias`,
    `layers.{i}.self_attn.{q,k,v,o}_proj.*`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
    `layers.{i}.post_attention_layernorm.weight` and, for i > 0, `layers.{i}.input_layernorm.weight`
    - the names of EAGLE's `Model`. Differences from EAGLE's own files: weights are safetensors
    (EAGLE-1 ships pytorch_model.bin), float32, and `embed_tokens.weight` is not stored (EAGLE copies
    it from the base model at load time too); the feature is the target's final normed state,
    as in EAGLE's code.
    """
    model = getattr(model, "model", model)  # a DGFDrafter works too
    if model.config.fusion != "linear":
        raise UserError("EAGLE's layout has no gated fusion: only fusion='linear' drafters export to it "
                         "(save DGF drafters with save_dgf and their manifest)")
    if model.config.first_block_norm:
        raise UserError("EAGLE's layer 0 has no input norm; this drafter has one (first_block_norm=true)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name.removeprefix("fusion."): t for name, t in float_state(model).items()}
    save_file(state, str(out / EAGLE_WEIGHTS), metadata={"format": "pt"})
    config = model.block_config.to_dict()
    config.update(bias=model.config.fusion_bias, architectures=["LlamaForCausalLM"] if config["model_type"] == "llama"
                  else config.get("architectures"))
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str))
    return out


def load_eagle(path: str | Path, target_model=None) -> DGFModel:
    """A `fusion: linear` DGFModel from an EAGLE-layout directory (config.json + model.safetensors)."""
    path = Path(path)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE} (expected an EAGLE checkpoint directory)")
    hf = json.loads(config_file.read_text())
    num_blocks = int(hf["num_hidden_layers"])
    bias = bool(hf.pop("bias", True))
    target_config = {k: v for k, v in hf.items() if k not in DROP_CONFIG_KEYS}
    config = DGFConfig(hidden_size=hf["hidden_size"], vocab_size=hf["vocab_size"], target_config=target_config,
                       num_blocks=num_blocks, fusion="linear", fusion_bias=bias)
    model = DGFModel(config)
    state = load_weights(path / EAGLE_WEIGHTS)
    state.pop("embed_tokens.weight", None)  # EAGLE's own files may carry the base model's embedding
    state = {(f"fusion.{k}" if k.startswith("fc.") else k): v for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise UserError(f"{path / EAGLE_WEIGHTS} does not fit its {CONFIG_FILE}: {err}") from err
    if target_model is not None:
        model.attach_target(target_model)
    return model.eval()
