"""Export trained drafters into the layouts serving engines and reference implementations load
(thin CLI over models/exports.py and models/export_medusa.py).

    python scripts/export.py student outputs/distill_qwen/run/final exports/qwen-student \\
        --target qwen2.5-coder-1.5b-instruct          # plain HF dir; checks generate(assistant_model=...)
    python scripts/export.py student drafters/pard_qwen_cpu exports/pard_qwen_cpu --dtype bfloat16
                                                      # a LoRA adapter (train/distill.py final/adapter) merged
                                                      # into its base (--base names another)
    python scripts/export.py medusa outputs/medusa_smollm2_cpu/final exports/smollm2-medusa
                                                      # FasterDecoding layout (medusa_lm_head.safetensors)
    python scripts/export.py dgf outputs/dgf/<run>/final exports/eagle --target smollm2-135m-instruct
                                                      # auto: EAGLE-1/2 (fusion linear), EAGLE-3 in vLLM's
                                                      # speculators format (fusion eagle3), else DGF layout
    python scripts/export.py dgf <final> exports/sglang --layout sglang   # EAGLE-3 for SGLang
    python scripts/export.py dgf <final> models/bundled/smollm2-135m-instruct-dgf --layout dgf \
        --dtype bfloat16 --target smollm2-135m-instruct   # how the bundled drafter is made
    python scripts/export.py dflash drafters/dflash_smollm2_human/loss_tokens_4000000 exports/dflash
                                                      # z-lab's layout (llama.cpp's converter; --layout
                                                      # speculators for vLLM's speculators format)
    python scripts/export.py gguf smollm2-135m-instruct exports/smollm2-q8_0.gguf --type q8_0
                                                      # llama.cpp: a target, draft model or student as GGUF
    python scripts/export.py gguf exports/eagle3 exports/eagle3.gguf --target smollm2-135m-instruct
                                                      # llama.cpp: an EAGLE-3 export (--spec-type draft-eagle3)
    python scripts/export.py gguf exports/dflash exports/dflash.gguf --target smollm2-135m-instruct
                                                      # llama.cpp: a DFlash export (--spec-type draft-dflash)

GGUF files are written by the pinned llama.cpp's own converter (`python -m draftsmith.models.engines.llamacpp build`
once) and are kept only after llama.cpp has loaded and decoded them: plain greedy decoding for a model, and
for an EAGLE-3 drafter speculative decoding of its target whose output must equal the target's plain output.

Each export is reloaded and checked for parity (same logits on a fixed seeded input) before it is
moved into place with export_manifest.json and a model card (README.md); with `--bench-method` naming a
dgf method, its tree shape is recorded as the export's tree, the one `dgf` decodes with by default. A
failed check leaves no output directory. `--push-to-hub REPO` uploads the finished directory (the
export stays on disk when the hub cannot be reached). Bad input ends in one line `error: ...` and exit
status 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from huggingface_hub import HfApi

from draftsmith.errors import UserError, exit_with, one_line
from draftsmith.eval.decode.drafters.dgf import drafter_tree
from draftsmith.eval.bench.methods import parse_method
from draftsmith.fileio import refuse_overwrite
from draftsmith.models import export_dflash, export_medusa
from draftsmith.models import exports as export
from draftsmith.models.artifacts import read_json
from draftsmith.models.engines import llamacpp
from draftsmith.models.trees import TreeShape
from draftsmith.models.registry import resolve_model_path


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    student = sub.add_parser("student", help="distilled student / any HF causal LM / LoRA adapter -> plain HF "
                                              "directory")
    student.add_argument("--target", help="registry name or dir: tokenizer check + assisted-generate check")
    student.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    student.add_argument("--base", help="a LoRA adapter source only: the registry name or dir it is merged into (default: "
                                        "the base its draftsmith_adapter.json or adapter_config.json names)")
    medusa = sub.add_parser("medusa", help="train/medusa.py final/ -> FasterDecoding Medusa layout")
    medusa.add_argument("--base-model", help="base_model_name_or_path to write (default: the target's hub id)")
    dgf = sub.add_parser("dgf", help="train/dgf.py final/ -> EAGLE-1/2, EAGLE-3 (speculators / sglang) or DGF layout")
    dgf.add_argument("--target", help="registry name or dir (parity through its embedding and LM head)")
    dgf.add_argument("--layout", default="auto", choices=list(export.DGF_LAYOUTS))
    dgf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                     help="stored weights (layout dgf; bfloat16 halves a bundled drafter)")
    dflash = sub.add_parser("dflash", help="train/dflash.py final/ -> z-lab's layout (llama.cpp) or speculators")
    dflash.add_argument("--layout", default="zlab", choices=list(export_dflash.DFLASH_LAYOUTS))
    gguf = sub.add_parser("gguf", help="HF causal LM, EAGLE-3 or DFlash export -> one GGUF file, decoded in llama.cpp")
    gguf.add_argument("--type", default="float32", choices=list(llamacpp.GGUF_TYPES), help="GGUF tensor type")
    gguf.add_argument("--target", help="EAGLE-3 and DFlash only: the target's registry name or model directory")
    gguf.add_argument("--overwrite", action="store_true", help="replace an existing GGUF file")
    gguf.add_argument("source", help="registry name or model directory")
    gguf.add_argument("out", help="the .gguf file to write")
    for p in (student, medusa, dgf, dflash):
        p.add_argument("source")
        p.add_argument("out")
        p.add_argument("--tolerance", type=float, default=0.0, help="max |logit difference| allowed in the parity check")
        p.add_argument("--push-to-hub", metavar="REPO", help="upload the finished export to this hub repository")
        p.add_argument("--bench", metavar="BENCH_JSON", help="a bench.json whose tau and speedup go into the model card")
        p.add_argument("--bench-method", metavar="LABEL", help="the method of --bench measured for this drafter")
    args = parser.parse_args(argv)
    if args.kind != "gguf" and not args.tolerance >= 0:
        raise UserError(f"--tolerance {args.tolerance}: must be >= 0")
    return args


def bench_entry(path: str | Path | None, method: str | None) -> dict | None:
    """The summary entry of `method` in a bench.json (for the model card); None without a path."""
    if path is None:
        return None
    results = read_json(Path(path), "bench results")
    summary = results.get("summary", {})
    if method not in summary:
        raise UserError(f"--bench-method {method!r} is not in {path}; its methods: {', '.join(summary)}")
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
        raise UserError(f"--push-to-hub {repo}: the upload failed ({one_line(err)[:200]}); the export is complete in "
                        f"{out}: upload it where the hub is reachable with `hf upload {repo} {out}`") from err
    print(f"uploaded {out} to https://huggingface.co/{repo}")


def measured_tree(source: str, bench_method: str | None) -> dict | None:
    """The tree shape of the dgf bench method whose numbers go into the model card: the export records it,
    and `dgf` without tree options decodes with it."""
    if bench_method is None:
        return None
    spec = parse_method(bench_method)
    if spec.name != "dgf":
        return None
    o = spec.options
    depth, topk, budget = drafter_tree(o.path or source, o.depth, o.topk, o.budget)
    return TreeShape(depth, topk, budget).to_manifest()


def export_gguf(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.suffix != ".gguf":
        raise UserError(f"{out}: a GGUF export is one file ending in .gguf")
    refuse_overwrite(out, args.overwrite, instead="pass --overwrite or another path")
    target = Path(resolve_model_path(args.target)) if args.target else None
    result = llamacpp.export_gguf(Path(resolve_model_path(args.source)), out, args.type, target)
    print(json.dumps(result, indent=2))
    print(f"exported {result['kind']} to {out} ({args.type}); llama.cpp {result['llama_cpp']} decoded it")
    return 0


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.kind == "gguf":
        return export_gguf(args)
    bench = bench_entry(args.bench, args.bench_method)
    command = shlex.join(["python", "scripts/export.py", *argv])  # into the card: the command that made the export
    if args.kind == "student":
        result = export.export_student(args.source, args.out, target=args.target, dtype=args.dtype,
                                       tolerance=args.tolerance, bench=bench, command=command, base=args.base)
    elif args.kind == "dflash":
        result = export_dflash.export_dflash(args.source, args.out, layout=args.layout, tolerance=args.tolerance,
                                             bench=bench, command=command)
    elif args.kind == "medusa":
        result = export_medusa.export_medusa(args.source, args.out, base_model=args.base_model,
                                             tolerance=args.tolerance, bench=bench, command=command)
    else:
        result = export.export_dgf(args.source, args.out, target=args.target, layout=args.layout,
                                   tree=measured_tree(args.source, args.bench_method), tolerance=args.tolerance,
                                   bench=bench, dtype=args.dtype, command=command)
    print(json.dumps({"out": str(result.out_dir), "layout": result.manifest["layout"],
                      "files": result.manifest["files"], "parity": result.manifest["parity"]}, indent=2))
    print(f"exported {args.kind} to {result.out_dir} (parity max |diff| {result.max_abs_diff:.3g})")
    if args.push_to_hub:
        push_to_hub(result.out_dir, args.push_to_hub)
    return 0


if __name__ == "__main__":
    exit_with(main)
