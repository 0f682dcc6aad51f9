"""Collect a distillation run + its side-by-side benches into one JSON and markdown tables.

    python scripts/distill_report.py --run outputs/distill_qwen/run --bench results/distill_qwen_bench_gsm8k.json \
        results/distill_qwen_bench_mt-bench.json --extra outputs/distill_qwen/data_choice.json \
        --out results/distill_qwen.json
Prints the tables (training summary; per suite: original vs distilled draft, chain and tree).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="train/distill.py output_dir")
    ap.add_argument("--bench", nargs="*", default=[], help="eval.bench JSON files")
    ap.add_argument("--extra", nargs="*", default=[], help="more JSON files to embed (e.g. the data choice)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    run = Path(args.run)
    manifest = json.loads((run / "final" / "manifest.json").read_text())
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [m for m in metrics if "train/loss" in m]
    doc = {"run": str(run), "manifest": manifest, "train_metrics": train,
           "extra": {p: json.loads(Path(p).read_text()) for p in args.extra},
           "bench": {p: json.loads(Path(p).read_text()) for p in args.bench}}
    Path(args.out).write_text(json.dumps(doc, indent=2))
    kind = manifest["training"]["loss"]["kind"]
    before, after = manifest["eval"]["before"], manifest["eval"]["after"]
    print("| held-out | before | after |\n|---|---|---|")
    for key in (f"eval/{kind}", "eval/ce", "eval/agreement"):
        print(f"| {key} | {before[key]:.4f} | {after[key]:.4f} |")
    print(f"\n{manifest['training']['steps']} steps, {manifest['training']['samples_seen']} sequences seen, "
          f"{sum(m['train/tokens'] for m in train)} distilled tokens, "
          f"{train[-1].get('train/elapsed_s', float('nan')):.0f} s of training; held-out tokens {after['eval/tokens']}")
    for path, bench in doc["bench"].items():
        cfg, machine = bench["config"], bench["machine"]
        print(f"\n{cfg['suite']}: {cfg['num_prompts']} prompts x {cfg['max_new_tokens']} new tokens, {machine['dtype']}, "
              f"{machine['torch_threads']} threads, load average at start {machine.get('load_average_at_start')}")
        print("| method | draft | tokens/s | tau | speedup (95% CI) | per-depth acceptance | lossless |\n"
              "|---|---|---|---|---|---|---|")
        for method, e in bench["summary"].items():
            draft = "distilled" if "draft=" in method else ("-" if method == "plain" else "original 0.5B")
            name = method.split(",draft=")[0]
            accept = " ".join(f"{v:.2f}" for v in e["depth_acceptance"].values()) or "-"
            lossless = "yes" if not e["mismatches"] else f"NO ({len(e['mismatches'])})"
            print(f"| {name} | {draft} | {e['tokens_per_s']:.2f} | {e['tau']:.2f} | {e.get('speedup', 1):.2f}x "
                  f"(±{e.get('speedup_ci95', 0):.2f}) | {accept} | {lossless} |")
    return doc


if __name__ == "__main__":
    main()
