"""Drafter checkpoints on disk: one manifest for every drafter kind, written, read and checked here.

A trained drafter directory (a recipe's `final/`) holds its weights (safetensors), its config and
`manifest.json`:

    {"format": "draftsmith.<kind>/1", "method": ..., "target": <target block>, <kind sections>}

The target block records what a drafter depends on: the target's name (registry name, dir or hub id),
model type, hidden size, vocabulary size and fingerprint (sha256 of the token -> id map), number of
layers, the hidden-state layers the drafter reads, the dtype it was trained against, and (reduced
draft vocabularies) the draft vocabulary. `check_target` refuses a drafter for another target and
names every difference. Kinds: Medusa heads (`save_medusa` / `load_medusa_heads`), feature drafters
(`save_dgf` / `load_dgf`), block drafters (`save_dflash` / `load_dflash`), distilled students (`write_student_manifest` beside a `save_pretrained`
directory). Exports into the layouts other projects load are in `models.exports`.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from draftsmith.config import option, parse_script
from draftsmith.errors import UserError, exit_with
from draftsmith.fileio import atomic_write_json
from draftsmith.models.dflash import DFlashConfig, DFlashModel
from draftsmith.models.dgf import DGFConfig, DGFModel
from draftsmith.models.vocab import DraftHead, DraftVocab
from draftsmith.models.medusa import HIDDEN_LAYER, MedusaConfig, MedusaHeads
from draftsmith.models.target import dtype_name, resolve_device, vocab_fingerprint

MANIFEST_FILE = "manifest.json"
CONFIG_FILE = "config.json"
MEDUSA_FORMAT = "draftsmith.medusa/1"
MEDUSA_WEIGHTS = "medusa_heads.safetensors"
ACCURACY_FILE = "head_accuracy.json"
DGF_FORMAT = "draftsmith.dgf/1"
DGF_WEIGHTS = "dgf.safetensors"
DFLASH_FORMAT = "draftsmith.dflash/1"
DFLASH_WEIGHTS = "dflash.safetensors"
STUDENT_FORMAT = "draftsmith.distilled/1"
EXPORT_MANIFEST = "export_manifest.json"  # beside a scripts/export.py output (models/exports.py writes it)
EXPORT_FORMAT = "draftsmith.export/1"


class ArtifactError(UserError):
    """A drafter directory is incomplete, corrupt, or for another target; the message names the file."""


class ArtifactMissing(ArtifactError, FileNotFoundError):
    """A file a drafter directory needs is not there."""


# ---------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------


def target_block(target, name: str, hidden_layers: list[int] | tuple[int, ...] = (), dtype: Any = None) -> dict:
    """The manifest's `target` block for a TargetModel (what `check_target` compares at load time)."""
    config = target.config
    layers = [int(layer) for layer in hidden_layers]
    return {"name": name, "model_type": config.model_type, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "num_hidden_layers": config.num_hidden_layers,
            "vocab_fingerprint": vocab_fingerprint(target.tokenizer), "hidden_layers": layers,
            "hidden_layer": layers[0] if len(layers) == 1 else None, "dtype": None if dtype is None else str(dtype)}


def write_manifest(out_dir: str | Path, fmt: str, method: str, target: dict, **sections: Any) -> dict:
    manifest = {"format": fmt, "method": method, "target": target, **sections}
    atomic_write_json(Path(out_dir) / MANIFEST_FILE, manifest)
    return manifest


def read_manifest(path: str | Path, expected_format: str) -> dict:
    """manifest.json of a drafter directory, refusing another format."""
    file = Path(path) / MANIFEST_FILE
    if not file.is_file():
        raise ArtifactMissing(f"no {MANIFEST_FILE} in {path} (expected a recipe's final/ directory of format "
                            f"{expected_format})")
    manifest = read_json(file, "manifest")
    if manifest.get("format") != expected_format:
        raise ArtifactError(f"{file}: format {manifest.get('format')!r} is not {expected_format!r}")
    return manifest


def read_json(file: Path, what: str) -> dict:
    try:
        return json.loads(Path(file).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ArtifactError(f"{file} ({what}) is corrupt ({err})") from err


def manifest_layers(block: dict) -> list[int]:
    """Hidden layers a target block records (older manifests: a single `hidden_layer`)."""
    if block.get("hidden_layers"):
        return [int(layer) for layer in block["hidden_layers"]]
    return [] if block.get("hidden_layer") is None else [int(block["hidden_layer"])]


def check_target(manifest: dict, target, where: str, hidden_layers: list[int] | tuple[int, ...] | None = None) -> None:
    """Refuse a drafter trained for another target: name each of hidden size / vocabulary / depth /
    hidden layers that differs. `hidden_layers`: what the loading drafter will feed (None: no check)."""
    want = manifest["target"]
    config = target.config
    if target.tokenizer is None:
        raise ArtifactError(f"the target has no tokenizer, so its vocabulary cannot be checked against {where}")
    have = {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
            "vocab_fingerprint": vocab_fingerprint(target.tokenizer)}
    if want.get("num_hidden_layers") is not None:  # layer ids only mean the same at the same depth
        have["num_hidden_layers"] = config.num_hidden_layers
    problems = [f"{key}: {want.get(key)!r} in the manifest vs {value!r} for the given target"
                for key, value in have.items() if want.get(key) != value]
    if hidden_layers is not None and manifest_layers(want) != list(hidden_layers):
        problems.append(f"hidden_layers: the checkpoint reads {manifest_layers(want)}, the drafter feeds "
                        f"{list(hidden_layers)}")
    if problems:
        raise ArtifactError(f"{where} was trained for target {want.get('name')!r} and does not fit the given target "
                            f"{getattr(target, 'name', '')!r}: " + "; ".join(problems))


def load_weights(file: Path) -> dict[str, torch.Tensor]:
    """A safetensors file; a missing, corrupt or truncated one is an ArtifactError naming it."""
    file = Path(file)
    if not file.is_file():
        raise ArtifactMissing(f"{file.parent} is incomplete: {file.name} is missing")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ArtifactError(f"{file} is corrupt or truncated ({err})") from err


def float_state(module: torch.nn.Module, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The state dict on the CPU, floating tensors in `dtype`; integer buffers (a draft vocabulary's
    indices) keep their dtype: a float, let alone bfloat16, cannot hold every token id."""
    return {name: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).cpu().contiguous()
            for name, t in module.state_dict().items()}


def load_state(module: torch.nn.Module, state: dict, file: Path, config_file: Path) -> None:
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ArtifactError(f"{file} does not match {config_file.name}: {' '.join(str(err).split())}") from err


# ---------------------------------------------------------------------------------------------
# Medusa heads
# ---------------------------------------------------------------------------------------------


def save_medusa(heads: MedusaHeads, out_dir: str | Path, target: dict, accuracy: dict | None = None,
                **sections: Any) -> dict:
    """Weights (float32) + MedusaConfig + head accuracies (ARCA trees) + manifest into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(float_state(heads), str(out / MEDUSA_WEIGHTS), metadata={"format": MEDUSA_FORMAT})
    atomic_write_json(out / CONFIG_FILE, heads.config.to_dict())
    if accuracy is not None:
        atomic_write_json(out / ACCURACY_FILE, accuracy)
    heads_block = {"file": MEDUSA_WEIGHTS, "config": CONFIG_FILE, "dtype": "float32", **heads.config.to_dict()}
    return write_manifest(out, MEDUSA_FORMAT, sections.pop("method", "medusa-1"), target, heads=heads_block,
                          **vocab_section(heads.draft_vocab, out), **sections)


def load_medusa_heads(path: str | Path, device: str | torch.device | None = None,
                      target=None) -> tuple[MedusaHeads, dict]:
    """(MedusaHeads in float32, manifest) from a Medusa directory; with `target`, refuse another target's."""
    path = Path(path)
    manifest = read_manifest(path, MEDUSA_FORMAT)
    if target is not None:
        check_target(manifest, target, f"Medusa checkpoint {path}", [HIDDEN_LAYER])
    config_file, heads_file = path / manifest["heads"]["config"], path / manifest["heads"]["file"]
    if not config_file.is_file():
        raise ArtifactMissing(f"Medusa checkpoint {path} is incomplete: {config_file.name} is missing")
    heads = MedusaHeads(MedusaConfig(**read_json(config_file, "Medusa config")))
    load_state(heads, load_weights(heads_file), heads_file, config_file)
    if heads.config.head is DraftHead.SLICE and target is not None:  # the frozen slice: the target's own rows
        heads.init_lm_heads(target.model.get_output_embeddings().weight)
    return heads.to(resolve_device(device)).eval(), manifest


# ---------------------------------------------------------------------------------------------
# Feature drafters (DGF / EAGLE-style)
# ---------------------------------------------------------------------------------------------


def save_dgf(model: DGFModel, out_dir: str | Path, target: dict, dtype: torch.dtype = torch.float32,
             **sections: Any) -> dict:
    """Weights (stored in `dtype`, float32 by default; read back as float32) + DGFConfig + manifest into
    `out_dir` (created; files replaced)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(float_state(model, dtype), str(out / DGF_WEIGHTS), metadata={"format": DGF_FORMAT})
    atomic_write_json(out / CONFIG_FILE, model.config.to_dict())
    drafter = {"file": DGF_WEIGHTS, "config": CONFIG_FILE, "dtype": dtype_name(dtype),
               "fusion": model.config.fusion.value,
               "num_blocks": model.config.num_blocks, "parameters": model.num_parameters()}
    drafter.update(feature_layers=model.config.layers_read, head=model.config.head.value)
    return write_manifest(out, DGF_FORMAT, model.config.method, target, drafter=drafter,
                          **vocab_section(model.draft_vocab, out), **sections)


def vocab_section(vocab: DraftVocab | None, out: Path) -> dict:
    """The draft vocabulary's maps written beside the weights, and its manifest entry ({} without one)."""
    if vocab is None:
        return {}
    path = vocab.save(out)
    return {"draft_vocab": {"file": path.name, "size": vocab.size, "target_vocab_size": vocab.target_size,
                            "sha256": vocab.digest()}}


def load_dgf(path: str | Path, target=None, device: str | torch.device | None = None,
             dtype: torch.dtype = torch.float32) -> tuple[DGFModel, dict]:
    """(DGFModel, manifest) from a `save_dgf` directory. With `target` (a TargetModel): refuse a manifest
    for another target, then attach its embedding and LM head and move to its device."""
    model, manifest = load_feature_drafter(path, DGF_FORMAT, "DGF", lambda raw: DGFConfig(**raw),
                                           lambda config: config.layers_read, DGFModel, target)
    device = target.device if device is None and target is not None else device
    return model.to(device=resolve_device(device), dtype=dtype).eval(), manifest


def load_feature_drafter(path: str | Path, fmt: str, what: str, config_of, layers_of, model_of, target):
    """(model, manifest) of a drafter directory whose manifest's `drafter` block names its config and weights:
    the config read (`config_of` its JSON), a manifest for another target refused (the layers `layers_of` the
    config reads), the model built (`model_of`), its weights loaded and, with `target`, its embedding and LM head
    attached."""
    path = Path(path)
    manifest = read_manifest(path, fmt)
    config_file = path / manifest["drafter"]["config"]
    if not config_file.is_file():
        raise ArtifactMissing(f"{what} checkpoint {path} is incomplete: {config_file.name} is missing")
    config = config_of(read_json(config_file, f"{what} config"))
    if target is not None:
        check_target(manifest, target, f"{what} checkpoint {path}", layers_of(config))
    model = model_of(config)
    weights = path / manifest["drafter"]["file"]
    load_state(model, load_weights(weights), weights, config_file)
    if target is not None:
        model.attach_target(target.model)
    return model, manifest


# ---------------------------------------------------------------------------------------------
# Block drafters (DFlash)
# ---------------------------------------------------------------------------------------------


def save_dflash(model: DFlashModel, out_dir: str | Path, target: dict, **sections: Any) -> dict:
    """Weights (float32, z-lab's names) + DFlashConfig + manifest into `out_dir` (created; files replaced)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(float_state(model), str(out / DFLASH_WEIGHTS), metadata={"format": DFLASH_FORMAT})
    atomic_write_json(out / CONFIG_FILE, model.config.to_dict())
    drafter = {"file": DFLASH_WEIGHTS, "config": CONFIG_FILE, "dtype": "float32",
               "parameters": sum(p.numel() for p in model.parameters()), **model.config.to_dict()}
    return write_manifest(out, DFLASH_FORMAT, "dflash", target, drafter=drafter, **sections)


def load_dflash(path: str | Path, target=None, device: str | torch.device | None = None,
                dtype: torch.dtype = torch.float32) -> tuple[DFlashModel, dict]:
    """(DFlashModel in `dtype`, manifest) from a `save_dflash` directory. With `target` (a TargetModel): refuse a
    manifest for another target, then attach its embedding and LM head and move to its device."""
    model, manifest = load_feature_drafter(path, DFLASH_FORMAT, "DFlash", DFlashConfig.from_dict,
                                           lambda config: config.hidden_layers, DFlashModel, target)
    device = target.device if device is None and target is not None else device
    return model.to(device=resolve_device(device), dtype=dtype).eval(), manifest


# ---------------------------------------------------------------------------------------------
# Distilled students (plain HF directories)
# ---------------------------------------------------------------------------------------------


def write_student_manifest(out_dir: str | Path, target: dict, **sections: Any) -> dict:
    """The manifest beside a student's `save_pretrained` files."""
    return write_manifest(out_dir, STUDENT_FORMAT, "distilled-student", target, **sections)


def read_student_manifest(path: str | Path) -> dict | None:
    """The distillation manifest of a student directory, or None for a plain HF model directory."""
    file = Path(path) / MANIFEST_FILE
    if not file.is_file():
        return None
    manifest = read_json(file, "distillation manifest")
    return manifest if manifest.get("format") == STUDENT_FORMAT else None


ADAPTER_CONFIG = "adapter_config.json"  # PEFT's: what makes a directory a LoRA adapter
ADAPTER_SIDECAR = "draftsmith_adapter.json"  # beside a LoRA adapter: its base model and PARD mask token
ADAPTER_FORMAT = "draftsmith.adapter/1"


def write_adapter_sidecar(directory: str | Path, base: str | None, pard_token: int | None) -> None:
    """What merging a PEFT adapter into a standalone model needs and PEFT's adapter_config.json does not hold:
    the base model by registry name or directory (None: the student was not a loadable model) and the PARD mask token."""
    content = {"format": ADAPTER_FORMAT, "base": base, "pard_token": pard_token}
    (Path(directory) / ADAPTER_SIDECAR).write_text(json.dumps(content, indent=2) + "\n")


def read_adapter_sidecar(directory: str | Path) -> dict:
    """The sidecar of an adapter directory; {} where there is none (an adapter from another tool)."""
    file = Path(directory) / ADAPTER_SIDECAR
    return read_json(file, "adapter sidecar") if file.is_file() else {}


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


def store_in_bfloat16(directory: str | Path) -> list[str]:
    """Rewrite a drafter directory's weight files with their floating tensors in bfloat16 (half the bytes to carry
    or commit; loaders read them back into float32 modules) and say so in the manifest. Returns the files."""
    out = Path(directory)
    files = sorted(out.glob("*.safetensors"))
    for file in files:
        weights = load_weights(file)
        save_file({name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in weights.items()},
                  str(file))
    manifest_file = out / MANIFEST_FILE
    if manifest_file.is_file():
        manifest = read_json(manifest_file, "manifest")
        for block in ("drafter", "heads"):
            if isinstance(manifest.get(block), dict):
                manifest[block]["dtype"] = "bfloat16"
        atomic_write_json(manifest_file, manifest)
    return [file.name for file in files]


@dataclass
class StoreCommand:
    command: Literal["to_bfloat16"] = option(help="to_bfloat16: store a drafter directory's weights in bfloat16 (the "
                                                 "first bare word)")
    directory: str = option(help="the drafter directory (the second bare word)")


def main(argv: list[str] | None = None) -> int:
    """`python -m draftsmith.models.artifacts to_bfloat16 <drafter dir>`: store its weights in bfloat16."""
    args = parse_script("python -m draftsmith.models.artifacts", main.__doc__, StoreCommand,
                        sys.argv[1:] if argv is None else argv, positional=("command", "directory"))
    print(" ".join(store_in_bfloat16(args.directory)) or f"no weights in {args.directory}")
    return 0


if __name__ == "__main__":
    exit_with(main)
