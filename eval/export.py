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
  dgf      a train/dgf.py `final/` -> EAGLE's checkpoint layout (models.dgf.export_eagle:
           config.json + model.safetensors) when fusion=linear, else a copy in draftsmith's own DGF
           layout (models.dgf.save_dgf: weights + config + manifest).

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

EXPORT_MANIFEST = "export_manifest.json"
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


class ParityError(RuntimeError):
    """The reloaded export does not reproduce the source's logits."""


# ---------------------------------------------------------------------------------------------
# Shared steps
# ---------------------------------------------------------------------------------------------


def _fresh_tmp(out_dir: Path) -> Path:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty: choose a new output directory or remove it")
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
        raise ValueError(f"{file} is corrupt ({err})") from err
    if manifest.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{file}: format {manifest.get('format')!r} is not {EXPORT_FORMAT!r}")
    return manifest


def _base_manifest(kind: str, layout: str, source: Path, target: dict, fusion: str | None, tree: dict | None) -> dict:
    return {"format": EXPORT_FORMAT, "kind": kind, "layout": layout, "source": str(source), "target": target,
            "fusion": fusion, "tree": tree, "parity": {"input": f"seed {PARITY_SEED}, {PARITY_TOKENS} positions"}}


def _parity_ids(vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(PARITY_SEED)
    return torch.randint(0, vocab_size, (1, PARITY_TOKENS), generator=generator)


def _load_weights(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        raise FileNotFoundError(f"{file.parent} is incomplete: {file.name} is missing")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"{file} is corrupt or truncated ({err})") from err


# ---------------------------------------------------------------------------------------------
# Distilled students (plain HF format)
# ---------------------------------------------------------------------------------------------


def _read_json(file: Path, what: str) -> dict:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} ({what}) is corrupt ({err})") from err


def _load_hf_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    except OSError as err:
        raise FileNotFoundError(f"{path} is not a loadable HF causal LM directory ({err})") from err
    except Exception as err:  # safetensors header errors etc. surface as various types
        if "safetensors" in repr(err).lower() or "header" in str(err).lower() or "deserializ" in str(err).lower():
            raise ValueError(f"{path}: weights are corrupt or truncated ({err})") from err
        raise


def export_student(source: str | Path, out_dir: str | Path, target=None, dtype: str = "float32",
                   tree: dict | None = None, tolerance: float = 0.0, check_assisted: bool = True) -> ExportResult:
    """A distilled (or any) student -> plain HF directory. `source`: a HF model dir / zoo name or a
    train/distill.py `final/` (its manifest names the target). `target`: a TargetModel (or zoo name /
    dir) for the tokenizer check and the `generate(assistant_model=...)` check (greedy output of the
    target with the reloaded student as assistant == without it)."""
    from draftsmith.models.target import TargetModel, check_same_tokenizer, resolve_dtype, vocab_fingerprint
    from draftsmith.models.zoo import resolve_model_path

    source_path = Path(resolve_model_path(str(source))) if not Path(source).exists() else Path(source)
    if not (source_path / "config.json").is_file():
        raise FileNotFoundError(f"{source_path} has no config.json: expected a HF model directory or a "
                                "train/distill.py final/ directory")
    distilled = None
    if (source_path / "manifest.json").is_file():
        distilled = _read_json(source_path / "manifest.json", "distillation manifest")
        if distilled.get("format") != "draftsmith.distilled/1":
            distilled = None  # another project's manifest: not ours to interpret
    if isinstance(target, (str, Path)):
        target = TargetModel.from_pretrained(str(target), dtype=dtype)
    torch_dtype = resolve_dtype(dtype)
    model = _load_hf_model(str(source_path), torch_dtype)
    tokenizer = None
    if (source_path / "tokenizer_config.json").is_file() or (source_path / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(source_path))
    elif target is not None:
        tokenizer = target.tokenizer
    if tokenizer is None:
        raise ValueError(f"{source_path} has no tokenizer: pass --target (the student uses the target's tokenizer)")
    if target is not None:
        check_same_tokenizer(target.tokenizer, tokenizer, what=f"student {source_path}")
    if distilled and distilled["target"].get("vocab_fingerprint") not in (None, vocab_fingerprint(tokenizer)):
        raise ValueError(f"{source_path}: the tokenizer does not match the vocab fingerprint in its manifest")

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
    from draftsmith.models.medusa import MedusaConfig, MedusaHeads

    path = Path(path)
    config_file = path / MEDUSA_FD_CONFIG
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no {MEDUSA_FD_CONFIG} (expected a FasterDecoding Medusa directory)")
    config = _read_json(config_file, "Medusa config")
    missing = [k for k in ("medusa_num_heads", "medusa_num_layers") if k not in config]
    if missing:
        raise ValueError(f"{config_file} lacks {missing}: not a FasterDecoding Medusa config")
    state = _load_weights(path / MEDUSA_FD_WEIGHTS)
    state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    num_heads, num_layers = int(config["medusa_num_heads"]), int(config["medusa_num_layers"])
    head_key = f"0.{num_layers}.weight"
    if head_key not in state:
        raise ValueError(f"{path / MEDUSA_FD_WEIGHTS} has no {head_key!r}: it does not fit {MEDUSA_FD_CONFIG} "
                         f"(medusa_num_layers={num_layers})")
    vocab_size, hidden_size = state[head_key].shape
    heads = MedusaHeads(MedusaConfig(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=num_heads,
                                     num_layers=num_layers))
    try:
        heads.medusa_head.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{path / MEDUSA_FD_WEIGHTS} does not fit {MEDUSA_FD_CONFIG}: {err}") from err
    return heads.eval(), config


def export_medusa(source: str | Path, out_dir: str | Path, base_model: str | None = None,
                  tolerance: float = 0.0) -> ExportResult:
    """train/medusa.py `final/` -> FasterDecoding layout. `base_model`: `base_model_name_or_path`
    to write (default: the target name in the manifest)."""
    from safetensors.torch import save_file

    from draftsmith.models.medusa import ACCURACY_FILE, load_medusa_heads

    source = Path(source)
    heads, source_manifest = load_medusa_heads(source)
    if source_manifest.get("target_adapter"):
        raise ValueError(f"{source} holds Medusa-2 heads trained with a LoRA adapter on the target; the FasterDecoding "
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
        from draftsmith.eval.arca import arca_paths, load_rank_accuracy
        from draftsmith.eval.drafters.medusa import DEFAULT_MEDUSA_PATHS

        shutil.copy(source / ACCURACY_FILE, tmp / ACCURACY_FILE)
        tree = {"medusa_choices": arca_paths(load_rank_accuracy(source / ACCURACY_FILE), len(DEFAULT_MEDUSA_PATHS))}

    reloaded, _ = load_fasterdecoding_medusa(tmp)
    generator = torch.Generator().manual_seed(PARITY_SEED)
    hidden = torch.randn(1, PARITY_TOKENS, config.hidden_size, generator=generator)
    with torch.inference_mode():
        reference_logits, reloaded_logits = heads(hidden), reloaded(hidden)
    block = {key: target.get(key) for key in ("name", "model_type", "hidden_size", "vocab_size", "num_hidden_layers",
                                              "vocab_fingerprint")}
    block["hidden_layers"] = [target.get("hidden_layer", -1)]
    manifest = _base_manifest("medusa", "fasterdecoding-medusa", source, block, None, tree)
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
    from draftsmith.models import dgf

    source = Path(source)
    if isinstance(target, (str, Path)):
        from draftsmith.models.target import TargetModel

        target = TargetModel.from_pretrained(str(target))
    model, source_manifest = dgf.load_dgf(source, target=target)
    config = model.config
    eagle_ok = config.fusion == "linear" and not config.first_block_norm
    if layout == "auto":
        layout = "eagle" if eagle_ok else "dgf"
    if layout not in ("eagle", "dgf"):
        raise ValueError(f"layout must be auto, eagle or dgf, got {layout!r}")
    if layout == "eagle" and not eagle_ok:
        raise ValueError(f"{source}: fusion={config.fusion!r}, first_block_norm={config.first_block_norm}: EAGLE's "
                         "layout holds only linear fusion without a block-0 input norm; use layout='dgf'")
    stand_in = None
    if target is None:
        from torch import nn

        torch.manual_seed(PARITY_SEED)
        stand_in = nn.Module()
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        stand_in.get_input_embeddings, stand_in.get_output_embeddings = (lambda: embed), (lambda: head)
        model.attach_target(stand_in)
    out_dir = Path(out_dir)
    tmp = _fresh_tmp(out_dir)
    if layout == "eagle":
        dgf.export_eagle(model, tmp)
        reloaded = dgf.load_eagle(tmp, target_model=target.model if target is not None else stand_in)
    else:
        dgf.save_dgf(model, tmp, source_manifest["target"],
                     extra={k: v for k, v in source_manifest.items() if k not in ("format", "method", "target", "drafter")})
        reloaded, _ = dgf.load_dgf(tmp)
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
    block["hidden_layers"] = want.get("hidden_layers") or [want.get("hidden_layer", config.feature_layer)]
    manifest = _base_manifest("dgf" if config.fusion == "dgf" else "eagle", "eagle" if layout == "eagle" else
                              "draftsmith.dgf", source, block, config.fusion,
                              tree or source_manifest.get("tree") or {"depth": 7, "topk": 10, "g": 16})
    manifest["drafter"] = {"num_blocks": config.num_blocks, "fusion_act": config.fusion_act,
                           "parameters": model.num_parameters()}
    manifest["parity"]["embedding_and_head"] = "target" if target is not None else f"seeded stand-in ({PARITY_SEED})"
    return _finish(tmp, out_dir, manifest, reference_logits, reloaded_logits, tolerance, f"DGF drafter {source}")
