"""Export trained drafters into other projects' layouts (thin CLI over models/exports.py).

    python scripts/export.py student outputs/distill_qwen/run/final exports/qwen-student \
        --target qwen2.5-coder-1.5b-instruct          # plain HF dir; checks generate(assistant_model=...)
    python scripts/export.py medusa outputs/medusa_smollm2_cpu/final exports/smollm2-medusa
                                                      # FasterDecoding layout (medusa_lm_head.safetensors)
    python scripts/export.py dgf outputs/dgf/<run>/final exports/eagle --target smollm2-135m-instruct
                                                      # EAGLE layout for fusion=linear, else DGF layout

Each export is reloaded and checked for parity (same logits on a fixed seeded input) before it is
moved into place with export_manifest.json; a failed check exits non-zero and leaves no output dir.
"""

from __future__ import annotations

import argparse
import json
import sys

from draftsmith.models import exports as export


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="kind", required=True)
    student = sub.add_parser("student", help="distilled student / any HF causal LM -> plain HF directory")
    student.add_argument("source")
    student.add_argument("out")
    student.add_argument("--target", help="zoo name or dir: tokenizer check + assisted-generate check")
    student.add_argument("--dtype", default="float32")
    medusa = sub.add_parser("medusa", help="train/medusa.py final/ -> FasterDecoding Medusa layout")
    medusa.add_argument("source")
    medusa.add_argument("out")
    medusa.add_argument("--base-model", help="base_model_name_or_path to write (default: the manifest's target)")
    dgf = sub.add_parser("dgf", help="train/dgf.py final/ -> EAGLE layout (fusion=linear) or DGF layout")
    dgf.add_argument("source")
    dgf.add_argument("out")
    dgf.add_argument("--target", help="zoo name or dir (parity through its embedding and LM head)")
    dgf.add_argument("--layout", default="auto", choices=["auto", "eagle", "dgf"])
    for p in (student, medusa, dgf):
        p.add_argument("--tolerance", type=float, default=0.0, help="max |logit difference| allowed in the parity check")
    args = parser.parse_args(argv)
    try:
        if args.kind == "student":
            result = export.export_student(args.source, args.out, target=args.target, dtype=args.dtype,
                                           tolerance=args.tolerance)
        elif args.kind == "medusa":
            result = export.export_medusa(args.source, args.out, base_model=args.base_model, tolerance=args.tolerance)
        else:
            result = export.export_dgf(args.source, args.out, target=args.target, layout=args.layout,
                                       tolerance=args.tolerance)
    except (FileNotFoundError, FileExistsError, ValueError, export.ParityError) as err:
        print(f"export failed: {err}", file=sys.stderr)
        return 1
    print(json.dumps({"out": str(result.out_dir), "layout": result.manifest["layout"],
                      "files": result.manifest["files"], "parity": result.manifest["parity"]}, indent=2))
    print(f"exported {args.kind} to {result.out_dir} (parity max |diff| {result.max_abs_diff:.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
