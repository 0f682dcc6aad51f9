"""Exports of trained drafters into the layouts other projects load (library behind scripts/export.py).

  student  any HF causal LM directory (or a train/distill.py `final/` with its manifest) ->
           a plain `save_pretrained` directory (safetensors + tokenizer), loadable with
           `AutoModelForCausalLM.from_pretrained` and usable as `generate(assistant_model=...)`.
  medusa   a train/medusa.py `final/` -> the FasterDecoding Medusa layout (models/export_medusa.py, which uses
           the shared steps here).
  dgf      a train/dgf.py `final/` -> EAGLE's checkpoint layout (`export_eagle`: config.json +
           model.safetensors) when fusion=linear, else a copy in draftsmith's own DGF layout
           (models.artifacts.save_dgf: weights + config + manifest).

Every export is written to `<out>.tmp`, reloaded from disk and checked for parity (the same logits
on a fixed seeded input as the source, within `tolerance`), and only then renamed to `<out>`, with
`export_manifest.json` (target id, hidden layer ids, vocab hash, fusion type, tree config, parity
result). A failed check leaves no `<out>`.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.config import enum_member
from draftsmith.errors import UserError, first_detail
from draftsmith.models.artifacts import (ADAPTER_CONFIG, EXPORT_FORMAT, EXPORT_MANIFEST, load_dgf, manifest_layers,
                                         read_adapter_sidecar, read_export_manifest, read_json, read_student_manifest,
                                         save_dgf)
from draftsmith.models import eagle_layouts
from draftsmith.models.eagle_layouts import DgfLayout
from draftsmith.models.dgf import DGFModel, Fusion
from draftsmith.models.target import TargetModel, check_same_tokenizer, resolve_dtype, resolve_model_path, vocab_fingerprint
from draftsmith.models.trees import DGF_TREE, LM_CHAIN_SPEC, LM_TREE_SPEC
from draftsmith.models.registry import REGISTRY

MODEL_CARD = "README.md"
ARCHITECTURE_OF = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
LAYOUT_NAMES = {DgfLayout.EAGLE: "eagle", DgfLayout.SPECULATORS: "speculators-eagle3",
                DgfLayout.SGLANG: "sglang-eagle3", DgfLayout.DGF: "draftsmith.dgf"}
# Which consumer's own code loads each layout in the tests (tests/test_consumers.py) and which is only
# checked key by key against its loader's source (servers that cannot run on a CPU-only machine).
CONSUMERS = {
    "eagle": {"loaded": ["eagle-llm (PyPI): eagle.model.cnets.Model, outputs compared"],
              "checked": ["SGLang models/llama_eagle.py + qwen2_eagle.py (architectures, fc.bias)",
                          "vLLM models/llama_eagle.py (EagleLlamaForCausalLM; has no fc bias: exact only for a "
                          "drafter trained with drafter.fusion_bias=false)",
                          "EAGLE GitHub eagle/model/cnets1.py (rope_theta, qkv_bias)"]},
    "speculators": {"loaded": ["speculators (PyPI): Eagle3DraftModel.from_pretrained, logits compared"],
                    "checked": ["vLLM speculators config path (speculators_model_type eagle3)"]},
    "sglang": {"loaded": [], "checked": ["SGLang models/llama_eagle3.py LlamaForCausalLMEagle3 (weight names, "
                                         "draft_vocab_size, eagle_config)"]},
    "dgf": {"loaded": ["draftsmith (models.artifacts.load_dgf)"], "checked": []},
    "medusa": {"loaded": ["medusa-llm (PyPI): medusa.model.medusa_model.MedusaModel heads, logits compared"],
               "checked": ["FasterDecoding GitHub medusa_model.py (medusa_lm_head.safetensors)", "TGI medusa loader"]},
    "student": {"loaded": ["transformers AutoModelForCausalLM + generate(assistant_model=...)"], "checked": []},
}
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


def _tmp_of(out_dir: str | Path) -> Path:
    out_dir = Path(out_dir)
    return out_dir.with_name(out_dir.name + ".tmp")


def removes_tmp_on_error(export):
    """An export that raises (a parity failure, a bad tokenizer, Ctrl-C) leaves no `<out>.tmp` behind."""
    @functools.wraps(export)
    def wrapped(source, out_dir, *args, **kwargs):
        try:
            return export(source, out_dir, *args, **kwargs)
        except BaseException:
            shutil.rmtree(_tmp_of(out_dir), ignore_errors=True)
            raise
    return wrapped


def fresh_tmp(out_dir: Path) -> Path:
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ExportExistsError(f"{out_dir} exists and is not empty: choose a new output directory or remove it")
    tmp = _tmp_of(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def finish_export(tmp: Path, out_dir: Path, manifest: dict, reference: torch.Tensor, reloaded: torch.Tensor,
            tolerance: float, what: str) -> ExportResult:
    """Compare logits, write the manifest, rename tmp -> out_dir (or raise: the export's wrapper removes tmp)."""
    if reference.shape != reloaded.shape:
        raise ParityError(f"{what}: reloaded logits have shape {tuple(reloaded.shape)}, the source's "
                          f"{tuple(reference.shape)}")
    diff = (reference.float() - reloaded.float()).abs().max().item()
    if not diff <= tolerance:  # NaN fails too
        raise ParityError(f"{what}: reloaded export differs from the source by {diff:.3g} > {tolerance:g} in logits")
    manifest["parity"].update(max_abs_diff=diff, tolerance=tolerance, ok=True)
    manifest["files"] = sorted(p.name for p in tmp.iterdir()) + [EXPORT_MANIFEST]
    (tmp / EXPORT_MANIFEST).write_text(json.dumps(manifest, indent=2, default=str))
    if out_dir.exists():
        out_dir.rmdir()  # empty (checked by fresh_tmp)
    tmp.rename(out_dir)
    return ExportResult(out_dir, manifest)


def hub_id(name: str | None) -> str | None:
    """The hub id a serving engine resolves for a registry name (other names are returned as they are)."""
    entry = REGISTRY.get(name or "")
    return entry.hub_id if entry is not None and entry.hub_id else name


LIBRARY_OF = {"eagle": "sglang", "speculators-eagle3": "vllm", "sglang-eagle3": "sglang", "draftsmith.dgf": "draftsmith",
              "fasterdecoding-medusa": "medusa", "hf": "transformers"}


def measured(source_manifest: dict | None, bench: dict | None) -> list[str]:
    """Card lines with tau from training's held-out evaluation and tau/speedup from a bench summary entry."""
    lines = []
    after = ((source_manifest or {}).get("eval") or {}).get("after") or {}
    if after.get("eval/tau") is not None:
        lines.append(f"- tau on {after.get('eval/tau_prompts')} held-out prompts at the end of training: "
                     f"{after['eval/tau']:.2f} (greedy, draftsmith's decoder)")
    if bench:
        lines.append(f"- bench `{bench['method']}` on {bench['machine']}: tau {bench.get('tau') or float('nan'):.2f}, "
                     f"speedup {bench.get('headline_speedup') or float('nan'):.2f}x vs {bench.get('headline_baseline')} "
                     f"({bench['file']})")
        lines.append("- that speedup is draftsmith's decoder running these weights with the settings the method "
                     "names (its draft precision, vocabulary slice, stop rule and graphs are decoding settings, not "
                     "part of the weights); another engine decodes them its own way and its speedup differs")
    return lines or ["- tau / speedup: not measured for this export (`scripts/export.py ... bench=bench.json "
                     "bench_method=LABEL` adds them)"]


def provenance(manifest: dict, source_manifest: dict | None) -> list[str]:
    """Where the weights come from (a draftsmith training output, or a model exported as it is) and the command
    that made the export."""
    merge = (manifest.get("student") or {}).get("adapter_merge")
    if merge is not None:
        pard = merge.get("pard_token")
        lines = [f"- the LoRA adapter `{merge['adapter']}` merged into `{merge['base']}` (merged minus applied by PEFT: "
                 f"max |logit diff| {merge['merge_max_abs_diff']:.2g})"
                 + (f"; a parallel (PARD) draft model, mask token {pard} (`config.pard_token`)" if pard is not None
                    else "")]
    elif source_manifest is None:
        lines = [f"- not trained by draftsmith: `{Path(manifest['source']).name}` exported as it is (no draftsmith "
                 "training manifest beside it)"]
    else:
        training = source_manifest.get("training") or {}
        lines = ["- trained by draftsmith against its registry copy of the target (its GGUF quantisation, dequantised): "
                 "against the upstream checkpoint acceptance can be a little lower, the output is unchanged "
                 "(verification is lossless)",
                 f"- training command: `{training.get('command', 'not recorded')}` ({training.get('steps')} steps)"]
    return lines + [f"- export command: `{manifest.get('command') or 'not recorded'}`"]


def write_model_card(directory: Path, manifest: dict, source_manifest: dict | None = None,
                     bench: dict | None = None) -> None:
    """README.md: front matter (base_model, library_name, tags), what the export is, the training command,
    the tau and speedup measured for it, how each consumer loads it, how it was checked."""
    target, consumers = manifest["target"], manifest.get("consumers", {})
    tags = ["speculative-decoding", "draftsmith", manifest["kind"], manifest["layout"]]
    lines = ["---", f"base_model: {target.get('hub_id') or target.get('name')}",
             f"library_name: {LIBRARY_OF.get(manifest['layout'], 'draftsmith')}",
             "tags:", *[f"- {tag}" for tag in tags], "---", "",
             f"# draftsmith {manifest['kind']} drafter ({manifest['layout']} layout)", "",
             f"- target: `{target.get('hub_id') or target.get('name')}` (draftsmith name `{target.get('name')}`, "
             f"vocab {target.get('vocab_size')}, hidden layers read {target.get('hidden_layers')})",
             f"- weights: safetensors, {manifest.get('weights_dtype', 'float32')}",
             *provenance(manifest, source_manifest),
             *measured(source_manifest, bench)]
    lines += ["", "## Loaded by", ""] + [f"- {item}" for item in consumers.get("loaded", [])]
    if consumers.get("checked"):
        lines += ["", "## Checked against the loader's source (not run here)", ""]
        lines += [f"- {item}" for item in consumers["checked"]]
    lines += ["", f"Parity: {json.dumps(manifest.get('parity', {}), default=str)}", "",
              "Produced by `python scripts/export.py` (draftsmith); `export_manifest.json` has the details.", ""]
    (directory / MODEL_CARD).write_text("\n".join(lines))


def base_manifest(kind: str, layout: str, source: Path, target: dict, fusion: str | None, tree: dict | None,
                   command: str | None) -> dict:
    return {"format": EXPORT_FORMAT, "kind": kind, "layout": layout, "source": str(source), "target": target,
            "fusion": fusion, "tree": tree, "command": command,
            "parity": {"input": f"seed {PARITY_SEED}, {PARITY_TOKENS} positions"}}


def parity_ids(vocab_size: int) -> torch.Tensor:
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


def readable_by_transformers4(directory: Path) -> None:
    """transformers 5 writes `rope_parameters` only and the tokenizer class `TokenizersBackend`; readers on
    transformers 4 (inside `>=4.56`) then use rope_theta 10000 and fail on the tokenizer. Add the top-level
    rope keys and name the fast-tokenizer class both versions know."""
    config_file, tokenizer_file = directory / "config.json", directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    if config.get("rope_parameters"):
        rope = eagle_layouts.transformers4_rope(config)
        config.update(rope_theta=rope["rope_theta"], rope_scaling=rope["rope_scaling"])
        config_file.write_text(json.dumps(config, indent=2))
    if tokenizer_file.is_file():
        tokenizer_config = json.loads(tokenizer_file.read_text())
        if tokenizer_config.get("tokenizer_class") == "TokenizersBackend":
            tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
            tokenizer_file.write_text(json.dumps(tokenizer_config, indent=2))


def _student_tokenizer(source_path: Path, target, distilled: dict | None):
    """The student's own tokenizer, else the target's; checked against the target and the manifest."""
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
    return tokenizer


@removes_tmp_on_error
def export_student(source: str | Path, out_dir: str | Path, target=None, dtype: str = "float32",
                   tree: dict | None = None, tolerance: float = 0.0, check_assisted: bool = True,
                   bench: dict | None = None, command: str | None = None, base: str | None = None) -> ExportResult:
    """A distilled (or any) student -> plain HF directory. `source`: a HF model dir / registry name, a
    train/distill.py `final/` (its manifest names the target), or a LoRA adapter directory (PEFT's format,
    e.g. a run's `final/adapter`), merged into `base` (default: the base its sidecar or adapter_config.json
    names). `target`: a TargetModel (or registry name / dir) for the tokenizer check and the
    `generate(assistant_model=...)` check (greedy output of the target with the reloaded student as
    assistant == without it)."""
    source_path = Path(resolve_model_path(str(source))) if not Path(source).exists() else Path(source)
    if isinstance(target, (str, Path)):
        target = TargetModel.from_pretrained(str(target), dtype=dtype)
    if (source_path / ADAPTER_CONFIG).is_file() and not (source_path / "config.json").is_file():
        model, tokenizer, merge = _merged_adapter(source_path, base, resolve_dtype(dtype))
        distilled = None
    else:
        if base is not None:
            raise UserError(f"--base {base}: read only when the source is a LoRA adapter directory "
                            f"({ADAPTER_CONFIG}), and {source_path} is not one")
        if not (source_path / "config.json").is_file():
            raise FileNotFoundError(f"{source_path} has no config.json: expected a HF model directory, a "
                                    "train/distill.py final/ directory or a LoRA adapter directory")
        distilled = read_student_manifest(source_path)  # None: a plain HF directory (or another project's manifest)
        model, merge = _load_hf_model(str(source_path), resolve_dtype(dtype)), None
        tokenizer = _student_tokenizer(source_path, target, distilled)
    if merge is not None and target is not None:
        check_same_tokenizer(target.tokenizer, tokenizer, what=f"adapter {source_path} on {merge['base']}")
    return _write_student(model, tokenizer, source_path, Path(out_dir), target, dtype, tree, tolerance,
                          check_assisted, bench, command, distilled, merge)


def _write_student(model, tokenizer, source_path: Path, out_dir: Path, target, dtype: str, tree: dict | None,
                   tolerance: float, check_assisted: bool, bench: dict | None, command: str | None,
                   distilled: dict | None, merge: dict | None) -> ExportResult:
    """save_pretrained of a loaded student, reloaded and checked (logits, and assisted generate with a target)."""
    torch_dtype = resolve_dtype(dtype)
    tmp = fresh_tmp(out_dir)
    if target is not None:  # stop on the target's end-of-turn tokens, as train/distill.py does
        model.generation_config.eos_token_id = target.model.generation_config.eos_token_id
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    readable_by_transformers4(tmp)

    reloaded = _load_hf_model(str(tmp), torch_dtype)
    ids = parity_ids(model.config.vocab_size)
    with torch.inference_mode():
        reference_logits = model(ids).logits
        reloaded_logits = reloaded(ids).logits
    target_name = (target.name if target is not None else None) or (distilled or {}).get("target", {}).get("name")
    block = {"name": target_name, "vocab_fingerprint": vocab_fingerprint(tokenizer), "vocab_size": len(tokenizer),
             "hidden_size": getattr(target.config, "hidden_size", None) if target is not None else None,
             "hidden_layers": []}  # a standalone LM: it reads no target hidden state
    manifest = base_manifest("student", "hf", source_path, block, None,
                              tree or {"bench_methods": [LM_CHAIN_SPEC, LM_TREE_SPEC]}, command)
    manifest["student"] = {"model_type": model.config.model_type, "num_hidden_layers": model.config.num_hidden_layers,
                           "parameters": sum(p.numel() for p in model.parameters()), "dtype": dtype,
                           "pard_token": getattr(model.config, "pard_token", None),
                           "distillation": distilled.get("training") if distilled else None, "adapter_merge": merge}
    if check_assisted and target is not None:
        _check_assisted_generate(target, reloaded)
        manifest["parity"]["assisted_generate"] = "greedy output with assistant_model == plain greedy (12 tokens)"
    manifest["target"]["hub_id"] = hub_id(target_name)
    manifest["weights_dtype"] = dtype
    manifest["consumers"] = CONSUMERS["student"]
    write_model_card(tmp, manifest, distilled, bench)
    return finish_export(tmp, out_dir, manifest, reference_logits, reloaded_logits, tolerance, f"student {source_path}")


def _check_assisted_generate(target, assistant) -> None:
    prompt = parity_ids(assistant.config.vocab_size)[:, :8].to(target.device)
    common = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=12)
    plain = target.model.generate(prompt, **common)
    assisted = target.model.generate(prompt, assistant_model=assistant.to(target.device), **common)
    if not torch.equal(plain, assisted):
        raise ParityError("the target's greedy output with the exported student as assistant_model differs from "
                          "its plain greedy output")


MERGE_TOLERANCE = 1e-3  # max |logit difference| between the adapter applied by PEFT and merged in, relative


def adapter_base(adapter: Path, base: str | None, sidecar: dict) -> str:
    """The model an adapter is merged into: `base`, else its sidecar's, else the registry model whose hub id its
    adapter_config.json names (else that name, a hub id or directory)."""
    if base is None and sidecar:
        if sidecar.get("base") is None:
            raise UserError(f"{adapter}: its student was not a loadable model (student.init pruned or layers), so "
                            "there is no base to merge it into: export the run's final/ (the merged student) instead")
        base = sidecar["base"]
    if base is None:
        named = read_json(adapter / ADAPTER_CONFIG, "adapter config").get("base_model_name_or_path")
        if not named:
            raise UserError(f"{adapter}: the adapter names no base model; pass --base <registry name or directory>")
        base = next((entry.name for entry in REGISTRY.values() if entry.hub_id == named), named)
    return base


def _merged_adapter(adapter: Path, base: str | None, dtype: torch.dtype):
    """(model with the adapter merged in `dtype`, the base's tokenizer, the merge's record). The merge is done in
    fp32 and checked against PEFT applying the unmerged adapter on the parity input."""
    from peft import PeftModel

    sidecar = read_adapter_sidecar(adapter)
    base = adapter_base(adapter, base, sidecar)
    loaded = TargetModel.from_pretrained(base, dtype=torch.float32)
    try:
        peft_model = PeftModel.from_pretrained(loaded.model, str(adapter)).eval()
    except (RuntimeError, ValueError, KeyError) as err:
        raise UserError(f"{adapter}: the adapter does not fit the base {base} ({first_detail(err)}); pass the "
                        "--base it was trained on") from err
    ids = parity_ids(loaded.model.config.vocab_size)
    with torch.inference_mode():
        unmerged = peft_model(ids).logits
        model = peft_model.merge_and_unload().eval()
        merged = model(ids).logits
    diff = (unmerged - merged).abs().max().item()
    if not diff <= MERGE_TOLERANCE * max(1.0, unmerged.abs().max().item()):
        raise ParityError(f"{adapter}: merging the adapter into {base} changed the logits by {diff:.3g}")
    pard_token = sidecar.get("pard_token")
    if pard_token is not None:
        model.config.pard_token = pard_token
    merge = {"adapter": str(adapter), "base": base, "pard_token": pard_token, "merge_max_abs_diff": diff}
    with torch.no_grad():  # weights only: `model.to(dtype)` would also round the rotary inv_freq, which
        for param in model.parameters():  # from_pretrained(dtype=...) keeps in fp32 (0.19 in bf16 logits)
            param.data = param.data.to(dtype)
    return model, loaded.tokenizer, merge


# ---------------------------------------------------------------------------------------------
# DGF / EAGLE feature drafters
# ---------------------------------------------------------------------------------------------

EAGLE3_SPECULATIVE_TOKENS = 3  # speculators' greedy proposal length written into its config


def _pick_layout(config, layout: DgfLayout | str) -> DgfLayout:
    """The layout asked for (its text accepted), or for `auto` the one the drafter's architecture fits."""
    layout = enum_member(DgfLayout, layout, "layout")
    if layout is not DgfLayout.AUTO:
        return layout
    if config.fusion is Fusion.EAGLE3:
        return DgfLayout.SPECULATORS
    eagle_ok = (config.fusion is Fusion.LINEAR and not config.first_block_norm and not config.multi_layer
                and config.draft_vocab_size is None)
    return DgfLayout.EAGLE if eagle_ok else DgfLayout.DGF


def _stand_in_target(config) -> nn.Module:
    """A seeded embedding + LM head of the target's shape, for parity without the target."""
    torch.manual_seed(PARITY_SEED)
    stand_in = nn.Module()
    embed = nn.Embedding(config.vocab_size, config.hidden_size)
    head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    stand_in.get_input_embeddings, stand_in.get_output_embeddings = (lambda: embed), (lambda: head)
    return stand_in


def _dgf_logits(model: DGFModel, layers: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Logits of the drafter on target features of the layers it reads (1, T, k, H) and token ids (1, T)."""
    with torch.inference_mode():
        return model.logits(model(model.fuse_layers(layers), ids))


def round_state(model: nn.Module, dtype: torch.dtype) -> None:
    """Round the module's saved tensors to `dtype` in place (kept in their own dtype): the drafter the
    reduced-precision file will give back."""
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.copy_(tensor.to(dtype))


def _write_dgf_layout(model: DGFModel, tmp: Path, layout: DgfLayout, source_manifest: dict, target_model,
                      dtype: torch.dtype = torch.float32) -> DGFModel:
    """Write `layout` into tmp and reload it with draftsmith's reader of that layout."""
    want = source_manifest["target"]
    vocab = model.draft_vocab
    metadata = {"producer": "draftsmith", "layout": layout.value, "target": hub_id(want.get("name")),
                "target_vocab_fingerprint": want.get("vocab_fingerprint"), "feature_layers": model.config.layers_read,
                "draft_vocab_size": model.config.draft_vocab_size, "draft_vocab_sha256": vocab.digest() if vocab else None}
    if layout is DgfLayout.EAGLE:
        eagle_layouts.export_eagle(model, tmp, metadata)
        return eagle_layouts.load_eagle(tmp, target_model=target_model)
    if layout in (DgfLayout.SPECULATORS, DgfLayout.SGLANG):
        eagle_layouts.export_eagle3(model, tmp, layout, int(want.get("num_hidden_layers") or 0),
                                    hub_id(want.get("name")), [ARCHITECTURE_OF.get(want.get("model_type"), "")],
                                    EAGLE3_SPECULATIVE_TOKENS, metadata)
        return eagle_layouts.load_eagle3(tmp, target_model=target_model)
    save_dgf(model, tmp, want, dtype=dtype, **{k: v for k, v in source_manifest.items()
                                               if k not in ("format", "method", "target", "drafter", "draft_vocab")})
    reloaded, _ = load_dgf(tmp)
    return reloaded.attach_target(target_model)


@removes_tmp_on_error
def export_dgf(source: str | Path, out_dir: str | Path, target=None, layout: DgfLayout | str = DgfLayout.AUTO,
               tree: dict | None = None, tolerance: float = 0.0, bench: dict | None = None,
               dtype: str = "float32", command: str | None = None) -> ExportResult:
    """train/dgf.py `final/` -> EAGLE-1/2 (`eagle`, fusion linear), EAGLE-3 (`speculators` for vLLM,
    `sglang`; fusion eagle3) or draftsmith's DGF layout (`dgf`); "auto" picks by the drafter. Parity runs
    the drafter through the target's embedding and LM head when `target` (TargetModel, or registry name /
    dir) is given, else through a seeded stand-in of the same shape. `dtype` (layout dgf): the stored
    weights' dtype (bfloat16 halves a bundled drafter); parity is then against the rounded drafter."""
    source = Path(source)
    if isinstance(target, (str, Path)):
        target = TargetModel.from_pretrained(str(target))
    model, source_manifest = load_dgf(source, target=target)
    config = model.config
    layout = _pick_layout(config, layout)
    stored = resolve_dtype(dtype)
    if stored != torch.float32:
        if layout is not DgfLayout.DGF:
            raise UserError(f"--dtype {dtype}: only the dgf layout stores reduced-precision weights (the {layout} "
                            f"layout is float32)")
        round_state(model, stored)
    target_model = target.model if target is not None else _stand_in_target(config)
    if target is None:  # load_dgf attached the real target already
        model.attach_target(target_model)
    out_dir = Path(out_dir)
    tmp = fresh_tmp(out_dir)
    reloaded = _write_dgf_layout(model, tmp, layout, source_manifest, target_model, stored)
    reloaded = reloaded.to(device=model.device, dtype=model.dtype)
    generator = torch.Generator().manual_seed(PARITY_SEED)
    layers = torch.randn(1, PARITY_TOKENS, len(config.layers_read), config.hidden_size, generator=generator)
    ids = parity_ids(config.vocab_size).to(model.device)
    reference_logits = _dgf_logits(model, layers.to(model.device), ids)
    reloaded_logits = _dgf_logits(reloaded, layers.to(model.device), ids)
    want = source_manifest["target"]
    block = {key: want.get(key) for key in ("name", "model_type", "hidden_size", "vocab_size", "num_hidden_layers",
                                            "vocab_fingerprint")}
    block["hidden_layers"] = manifest_layers(want) or config.layers_read
    block["hub_id"] = hub_id(want.get("name"))
    manifest = base_manifest(config.method, LAYOUT_NAMES[layout], source, block, config.fusion.value,
                             tree or source_manifest.get("tree") or DGF_TREE.to_manifest(), command)
    manifest["drafter"] = {"num_blocks": config.num_blocks, "fusion_act": config.fusion_act,
                           "feature_layers": config.layers_read, "draft_vocab_size": config.draft_vocab_size,
                           "parameters": model.num_parameters()}
    manifest["weights_dtype"] = dtype
    manifest["consumers"] = CONSUMERS[layout.value]
    manifest["parity"]["embedding_and_head"] = "target" if target is not None else f"seeded stand-in ({PARITY_SEED})"
    write_model_card(tmp, manifest, source_manifest, bench)
    return finish_export(tmp, out_dir, manifest, reference_logits, reloaded_logits, tolerance, f"DGF drafter {source}")
