"""Export trained drafters into the layouts serving engines and reference implementations load
(thin CLI over models/exports.py, models/export_medusa.py, models/export_dflash.py and llama.cpp's converter).

    python scripts/export.py <kind> SOURCE OUT [key=value ...]     # `python scripts/export.py <kind> --help`

    python scripts/export.py student outputs/distill_qwen/run/final exports/qwen-student \
        target=qwen2.5-coder-1.5b-instruct             # plain HF dir; checks generate(assistant_model=...)
    python scripts/export.py student drafters/pard_qwen_cpu exports/pard_qwen_cpu dtype=bfloat16
                                                      # a LoRA adapter (train/distill.py final/adapter) merged
                                                      # into its base (base= names another)
    python scripts/export.py medusa outputs/medusa_smollm2_cpu/final exports/smollm2-medusa
                                                      # FasterDecoding layout (medusa_lm_head.safetensors)
    python scripts/export.py dgf outputs/dgf/<run>/final exports/eagle target=smollm2-135m-instruct
                                                      # auto: EAGLE-1/2 (fusion linear), EAGLE-3 in vLLM's
                                                      # speculators format (fusion eagle3), else DGF layout
    python scripts/export.py dgf <final> exports/sglang layout=sglang   # EAGLE-3 for SGLang
    python scripts/export.py dgf <final> models/bundled/smollm2-135m-instruct-dgf layout=dgf \
        dtype=bfloat16 target=smollm2-135m-instruct   # how the bundled drafter is made
    python scripts/export.py dflash drafters/dflash_smollm2_human/loss_tokens_4000000 exports/dflash
                                                      # z-lab's layout (llama.cpp's converter; layout=speculators
                                                      # for vLLM's speculators format)
    python scripts/export.py gguf smollm2-135m-instruct exports/smollm2-q8_0.gguf type=q8_0
                                                      # llama.cpp: a target, draft model or student as GGUF
    python scripts/export.py gguf exports/eagle3 exports/eagle3.gguf target=smollm2-135m-instruct
                                                      # llama.cpp: an EAGLE-3 export (--spec-type draft-eagle3)
    python scripts/export.py gguf exports/dflash exports/dflash.gguf target=smollm2-135m-instruct
                                                      # llama.cpp: a DFlash export (--spec-type draft-dflash)

The older `--key value` spelling of each key still works. GGUF files are written by the pinned llama.cpp's own
converter (`python -m draftsmith.models.engines.llamacpp build` once) and are kept only after llama.cpp has loaded
and decoded them: plain greedy decoding for a model, and for an EAGLE-3 or DFlash drafter speculative decoding of
its target whose output must equal the target's plain output.

Each export is reloaded and checked for parity (same logits on a fixed seeded input) before it is moved into place
with export_manifest.json and a model card (README.md); with `bench_method` naming a dgf method, its tree shape is
recorded as the export's tree, the one `dgf` decodes with by default. A failed check leaves no output directory.
`push_to_hub=REPO` uploads the finished directory (the export stays on disk when the hub cannot be reached). Bad
input ends in one line `error: ...` and exit status 2.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from huggingface_hub import HfApi

from draftsmith.config import ConfigError, check_config, option, parse_script
from draftsmith.errors import UserError, exit_with, one_line
from draftsmith.eval.bench.methods import DGFOptions, parse_method
from draftsmith.eval.decode.drafters.dgf import drafter_tree
from draftsmith.fileio import refuse_overwrite
from draftsmith.models import export_dflash, export_medusa
from draftsmith.models import exports as export
from draftsmith.models.artifacts import read_json
from draftsmith.models.engines import llamacpp
from draftsmith.models.registry import resolve_model_path
from draftsmith.models.trees import TreeShape

StoredDtype = Literal["float32", "bfloat16", "float16"]


@dataclass
class ExportSettings:
    """What every export into a directory takes: where from, where to, the parity check, the model card's numbers
    and the upload."""

    source: str = option(help="the trained drafter or model (also the first bare word)")
    out: str = option(help="the export directory to write (also the second bare word)")
    tolerance: float = option(0.0, "max |logit difference| allowed in the parity check", ge=0.0)
    push_to_hub: str | None = option(None, "upload the finished export to this hub repository")
    bench: str | None = option(None, "a bench.json whose tau and speedup go into the model card")
    bench_method: str | None = option(None, "the method of `bench` measured for this drafter")

    def __post_init__(self) -> None:
        check_config(self)
        if (self.bench is None) != (self.bench_method is None):
            raise ConfigError("bench and bench_method: give both (the bench.json and its method's label) or neither")


@dataclass
class StudentExport(ExportSettings):
    target: str | None = option(None, "registry name or dir: tokenizer check + assisted-generate check")
    dtype: StoredDtype = option("float32", "stored weights")
    base: str | None = option(None, "a LoRA adapter source only: the registry name or dir it is merged into "
                                    "(default: the base its draftsmith_adapter.json or adapter_config.json names)")


@dataclass
class MedusaExport(ExportSettings):
    base_model: str | None = option(None, "base_model_name_or_path to write (default: the target's hub id)")


@dataclass
class DgfExport(ExportSettings):
    target: str | None = option(None, "registry name or dir (parity through its embedding and LM head)")
    layout: export.DgfLayout = option(export.DgfLayout.AUTO, "auto: EAGLE-1/2 (fusion linear), EAGLE-3 in "
                                                              "speculators' format (fusion eagle3), else dgf")
    dtype: StoredDtype = option("float32", "stored weights (layout dgf; bfloat16 halves a bundled drafter)")


@dataclass
class DFlashExport(ExportSettings):
    layout: export_dflash.DFlashLayout = option(export_dflash.DFlashLayout.ZLAB,
                                                "zlab (llama.cpp's converter) or speculators (vLLM)")


@dataclass
class GgufExport:
    source: str = option(help="registry name or model directory (also the first bare word)")
    out: str = option(help="the .gguf file to write (also the second bare word)")
    type: str = option("float32", f"GGUF tensor type: {', '.join(llamacpp.GGUF_TYPES)}")
    target: str | None = option(None, "EAGLE-3 and DFlash only: the target's registry name or model directory")
    overwrite: bool = option(False, "replace an existing GGUF file")

    def __post_init__(self) -> None:
        check_config(self)
        if self.type not in llamacpp.GGUF_TYPES:
            raise ConfigError(f"type={self.type}: not a GGUF type; one of {', '.join(llamacpp.GGUF_TYPES)}")


def bench_entry(path: str | Path | None, method: str | None) -> dict | None:
    """The summary entry of `method` in a bench.json (for the model card); None without a path."""
    if path is None:
        return None
    results = read_json(Path(path), "bench results")
    summary = results.get("summary", {})
    if method not in summary:
        raise UserError(f"bench_method={method!r} is not in {path}; its methods: {', '.join(summary)}")
    machine = results.get("machine", {})
    where = (f"{machine.get('device', 'an unrecorded device')} ({machine.get('processor', 'unrecorded processor')}, "
             f"{machine.get('cpu_count', '?')} cores), {machine.get('torch_threads', '?')} threads")
    return {**summary[method], "method": method, "machine": where, "file": str(path)}


def push_to_hub(out: Path, repo: str) -> None:
    """Upload the export; a hub that cannot be reached is one line, the export stays where it is."""
    try:
        api = HfApi()
        api.create_repo(repo, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=str(out))
    except Exception as err:  # the hub client raises many types (offline, auth, HTTP)
        raise UserError(f"push_to_hub={repo}: the upload failed ({one_line(err)[:200]}); the export is complete in "
                        f"{out}: upload it where the hub is reachable with `hf upload {repo} {out}`") from err
    print(f"uploaded {out} to https://huggingface.co/{repo}")


def measured_tree(source: str, bench_method: str | None) -> dict | None:
    """The tree shape of the dgf bench method whose numbers go into the model card: the export records it,
    and `dgf` without tree options decodes with it."""
    if bench_method is None:
        return None
    spec = parse_method(bench_method)
    if not isinstance(spec.options, DGFOptions):
        return None
    o = spec.options
    depth, topk, budget = drafter_tree(o.path or source, o.depth, o.topk, o.budget)
    return TreeShape(depth, topk, budget).to_manifest()


def export_gguf(args: GgufExport, command: str) -> int:
    out = Path(args.out)
    if out.suffix != ".gguf":
        raise UserError(f"{out}: a GGUF export is one file ending in .gguf")
    refuse_overwrite(out, args.overwrite, instead="pass overwrite=true or another path")
    target = Path(resolve_model_path(args.target)) if args.target else None
    result = llamacpp.export_gguf(Path(resolve_model_path(args.source)), out, args.type, target)
    print(json.dumps(result, indent=2))
    print(f"exported {result['kind']} to {out} ({args.type}); llama.cpp {result['llama_cpp']} decoded it")
    return 0


def export_student(args: StudentExport, command: str) -> export.ExportResult:
    return export.export_student(args.source, args.out, target=args.target, dtype=args.dtype, tolerance=args.tolerance,
                                 bench=bench_entry(args.bench, args.bench_method), command=command, base=args.base)


def export_medusa_heads(args: MedusaExport, command: str) -> export.ExportResult:
    return export_medusa.export_medusa(args.source, args.out, base_model=args.base_model, tolerance=args.tolerance,
                                       bench=bench_entry(args.bench, args.bench_method), command=command)


def export_feature_drafter(args: DgfExport, command: str) -> export.ExportResult:
    return export.export_dgf(args.source, args.out, target=args.target, layout=args.layout,
                             tree=measured_tree(args.source, args.bench_method), tolerance=args.tolerance,
                             bench=bench_entry(args.bench, args.bench_method), dtype=args.dtype, command=command)


def export_block_drafter(args: DFlashExport, command: str) -> export.ExportResult:
    return export_dflash.export_dflash(args.source, args.out, layout=args.layout, tolerance=args.tolerance,
                                       bench=bench_entry(args.bench, args.bench_method), command=command)


@dataclass(frozen=True)
class ExportKind:
    settings: type
    run: Callable
    help: str


KINDS = {
    "student": ExportKind(StudentExport, export_student, "distilled student / any HF causal LM / LoRA adapter -> "
                                                         "plain HF directory"),
    "medusa": ExportKind(MedusaExport, export_medusa_heads, "train/medusa.py final/ -> FasterDecoding Medusa layout"),
    "dgf": ExportKind(DgfExport, export_feature_drafter, "train/dgf.py final/ -> EAGLE-1/2, EAGLE-3 (speculators / "
                                                         "sglang) or DGF layout"),
    "dflash": ExportKind(DFlashExport, export_block_drafter, "train/dflash.py final/ -> z-lab's layout (llama.cpp) "
                                                             "or speculators"),
    "gguf": ExportKind(GgufExport, export_gguf, "HF causal LM, EAGLE-3 or DFlash export -> one GGUF file, decoded "
                                                "in llama.cpp"),
}


def usage() -> str:
    kinds = "\n".join(f"  {name:8} {kind.help}" for name, kind in KINDS.items())
    return f"{__doc__}\nKinds (`python scripts/export.py <kind> --help` lists each one's keys):\n{kinds}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in KINDS:
        raise UserError(f"{argv[0]!r}: not an export kind; one of {', '.join(KINDS)} (see --help)")
    kind = KINDS[argv[0]]
    args = parse_script(f"scripts/export.py {argv[0]}", kind.help, kind.settings, argv[1:], positional=("source", "out"))
    command = shlex.join(["python", "scripts/export.py", *argv])  # into the card: the command that made the export
    if isinstance(args, GgufExport):
        return export_gguf(args, command)
    result = kind.run(args, command)
    print(json.dumps({"out": str(result.out_dir), "layout": result.manifest["layout"],
                      "files": result.manifest["files"], "parity": result.manifest["parity"]}, indent=2))
    print(f"exported {argv[0]} to {result.out_dir} (parity max |diff| {result.max_abs_diff:.3g})")
    if args.push_to_hub:
        push_to_hub(result.out_dir, args.push_to_hub)
    return 0


if __name__ == "__main__":
    exit_with(main)
