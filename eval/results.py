"""Regenerate the RESULTS page: one eval.bench run per target with every drafter found on this machine.

    python -m draftsmith.eval.results --quick     # SmolLM2-135M only, 3 prompts per suite, 64 new tokens: ~10-15 min on 2 cores
    python -m draftsmith.eval.results             # + the Qwen2.5-Coder 1.5B/0.5B pair (if fetched): ~1.5-2 h on 2 cores

On a shared machine wrap it in the CPU lock:
`flock /tmp/draftsmith_cpu.lock env OMP_NUM_THREADS=2 python -m draftsmith.eval.results --quick`.

Per target it runs `eval.bench` once over MT-Bench (both turns) and GSM8K test (seeded sample),
greedy, with: plain HF greedy (the reference every other method must reproduce token by token),
our loop without a drafter, the training-free drafters (prompt lookup, Self-Draft, a layer-subset
student of the target), the decoder policies (LLMCad, Minions; full mode only), HF assisted
generation and the draft LM (for targets with a draft model), and every trained drafter under
`outputs/` whose manifest names that target: Medusa heads (`draftsmith.medusa/1`, at two tree
widths), DGF/EAGLE drafters (`draftsmith.dgf/1`) and distilled students (`draftsmith.distilled/1`).
Untrained baselines (directory names containing "untrained") are skipped with --quick.

Writes `<out-dir>/<run>.json/.md/*.png` (eval.bench's outputs) and `<out-dir>/summary.json`, then
replaces the block between the `<!-- eval.results:begin -->` / `<!-- eval.results:end -->` markers
of the page (RESULTS.md; appended when the markers are missing) with the generated tables.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

BEGIN = "<!-- eval.results:begin -->"
END = "<!-- eval.results:end -->"
MANIFEST_KINDS = {"draftsmith.medusa/1": "medusa", "draftsmith.dgf/1": "dgf", "draftsmith.distilled/1": "student"}


@dataclass
class RunPlan:
    name: str
    target: str
    title: str
    draft: str | None = None
    dtype: str = "float32"
    methods: list[str] = field(default_factory=list)
    full_only_methods: list[str] = field(default_factory=list)
    num_prompts: int = 4
    max_new_tokens: int = 64


PLANS = [
    RunPlan(name="smollm2", target="smollm2-135m-instruct", title="SmolLM2-135M-Instruct (float32)",
            methods=["plain", "loop-plain", "ngram", "ngram:branches=3", "self-draft:branches=3,length=4",
                     "lm-chain:k=4,student=every3"],
            full_only_methods=["llmcad:model=every3", "minions:models=every2+every3+ngram"]),
    RunPlan(name="qwen1.5b", target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
            title="Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft (bfloat16)", dtype="bfloat16",
            methods=["plain", "hf-assisted", "lm-chain:k=4", "lm-tree:depth=4,topk=2,budget=8",
                     "lm-tree:depth=5,topk=3,budget=16", "ngram"],
            full_only_methods=["minions:models=draft+every4+ngram"], num_prompts=3),
]


def discover_drafters(root: Path, target: str, quick: bool) -> list[tuple[str, Path]]:
    """(kind, final dir) of trained drafters under `root` whose manifest names `target`, newest first."""
    found = []
    for manifest_file in sorted(root.glob("**/final/manifest.json")):
        try:
            manifest = json.loads(manifest_file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        kind = MANIFEST_KINDS.get(manifest.get("format"))
        if kind is None or (manifest.get("target") or {}).get("name") != target:
            continue
        if quick and "untrained" in str(manifest_file):
            continue
        found.append((manifest_file.stat().st_mtime, kind, manifest_file.parent))
    return [(kind, path) for _, kind, path in sorted(found, key=lambda item: -item[0])]


def drafter_methods(found: list[tuple[str, Path]], quick: bool, per_kind: int) -> list[str]:
    methods, seen = [], {}
    for kind, path in found:
        if seen.get(kind, 0) >= per_kind:
            continue
        seen[kind] = seen.get(kind, 0) + 1
        if kind == "medusa":
            methods += [f"medusa:{path},width=4", f"medusa:{path},width=12"]
        elif kind == "dgf":
            methods += [f"dgf:{path},depth=5,topk=4,g=8"] + ([] if quick else [f"dgf:{path},depth=7,topk=10,g=16"])
        else:
            methods.append(f"lm-chain:k=4,draft={path}")
    return methods


def plan_runs(args) -> list[tuple[RunPlan, list[str]]]:
    from draftsmith.models.zoo import is_fetched

    runs = []
    for plan in PLANS:
        if args.only and plan.name not in args.only:
            continue
        if args.quick and plan.name != "smollm2":
            continue
        if not all(is_fetched(name) for name in [plan.target] + ([plan.draft] if plan.draft else [])):
            print(f"skip {plan.name}: {plan.target}/{plan.draft} not fetched (python scripts/fetch_models.py --all)")
            continue
        found = discover_drafters(Path(args.drafters_root), plan.target, args.quick)
        methods = list(plan.methods) + ([] if args.quick else plan.full_only_methods)
        methods += drafter_methods(found, args.quick, args.per_kind)
        if args.quick:
            plan = replace(plan, num_prompts=3, max_new_tokens=64)
        runs.append((plan, methods))
    return runs


def render_page_block(entries: list[dict], command: str, elapsed_s: float) -> str:
    from draftsmith.eval.bench import format_table

    lines = [BEGIN, "## Current numbers for every drafter (generated by `python -m draftsmith.eval.results`)", "",
             f"Command: `{command}` (wall time {elapsed_s / 60:.1f} min, finished "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). Everything between the `eval.results` "
             "markers is rewritten by that command. Greedy decoding; every method ran on the same prompts "
             "(MT-Bench both turns: turn 2 continues from plain greedy's turn-1 answer; GSM8K test: seeded "
             "sample), interleaved per prompt after a warm-up, and was compared token by token with plain "
             "greedy. Speedup = plain wall time / method wall time (95% interval over prompts).", ""]
    for entry in entries:
        results = entry["results"]
        machine = results["machine"]
        load = machine.get("load_average_at_start"), machine.get("load_average_at_end")
        lines += [f"### {entry['title']}", "",
                  f"[{entry['markdown']}]({entry['markdown']}) · JSON [{entry['json']}]({entry['json']})"
                  + (f" · load average {load[0][0]:.2f} at start, {load[1][0]:.2f} at end (other jobs "
                     "shared the CPU if these are above the thread count)" if load[0] and load[1] else ""), "",
                  format_table(results), ""]
        lines += [f"![{Path(p).stem}]({p})" for p in entry["plots"]]
        lines.append("")
        if entry["skipped"]:
            lines.append("Not in this run: " + "; ".join(entry["skipped"]))
            lines.append("")
    lines.append(END)
    return "\n".join(lines)


def update_page(page: Path, block: str) -> None:
    text = page.read_text() if page.is_file() else "# Results\n"
    if BEGIN in text and END in text:
        head, _, rest = text.partition(BEGIN)
        _, _, tail = rest.partition(END)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    page.write_text(text)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="SmolLM2 only, 3 prompts per suite, 64 new tokens")
    parser.add_argument("--only", nargs="+", choices=[plan.name for plan in PLANS])
    parser.add_argument("--out-dir", default="results/current")
    parser.add_argument("--page", default="RESULTS.md")
    parser.add_argument("--drafters-root", default="outputs", help="where trained drafters' final/ dirs are searched")
    parser.add_argument("--per-kind", type=int, default=3, help="trained drafters per kind (newest first)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--suite", default="mt-bench,gsm8k")
    parser.add_argument("--dry-run", action="store_true", help="print the planned runs and exit")
    parser.add_argument("--wandb", action="store_true")
    args = parser.parse_args(argv)
    from draftsmith.eval import bench

    runs = plan_runs(args)
    for plan, methods in runs:
        print(f"{plan.name}: {plan.target} draft={plan.draft} {plan.num_prompts} prompts x {args.suite} "
              f"{plan.max_new_tokens} tokens; methods: {' '.join(methods)}", flush=True)
    if args.dry_run or not runs:
        return []
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m draftsmith.eval.results", *(sys.argv[1:] if argv is None else argv)])
    start = time.perf_counter()
    entries = []
    for plan, methods in runs:
        config = bench.BenchConfig(target=plan.target, draft=plan.draft, methods=methods, suite=args.suite,
                                   num_prompts=plan.num_prompts, max_new_tokens=plan.max_new_tokens, dtype=plan.dtype,
                                   threads=args.threads, out=str(out_dir / f"{plan.name}.json"), wandb=args.wandb)
        results = bench.run_benchmark(config)
        results["command"] = command
        written = bench.write_outputs(results, config)
        print(bench.format_table(results), flush=True)
        entries.append({"name": plan.name, "title": plan.title, "results": results,
                        "json": written["json"], "markdown": written["markdown"], "plots": written.get("plots", []),
                        "skipped": [] if plan.draft or plan.name != "smollm2" else
                        ["hf-assisted / draft LM (SmolLM2 has no smaller model with its tokenizer)"]})
    elapsed = time.perf_counter() - start
    (out_dir / "summary.json").write_text(json.dumps(
        {"command": command, "elapsed_s": elapsed, "machine": platform.platform(),
         "runs": [{k: v for k, v in e.items() if k != "results"} | {"summary": e["results"]["summary"]}
                  for e in entries]}, indent=2, default=str))
    update_page(Path(args.page), render_page_block(entries, command, elapsed))
    print(f"updated {args.page} and {out_dir} in {elapsed / 60:.1f} min")
    return entries


if __name__ == "__main__":
    main()
