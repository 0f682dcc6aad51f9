"""Regenerate the RESULTS page: one eval.bench run per target with every drafter found on this machine.

    python -m draftsmith.eval.bench.results_page quick=true   # SmolLM2-135M only, 3 prompts per suite, 64 new
                                                              # tokens: ~15 min
    python -m draftsmith.eval.bench.results_page              # + the Qwen2.5-Coder 1.5B/0.5B pair (if fetched):
                                                              # ~1.5-2 h on 2 cores
    ... --overwrite                                           # measure again over the last run in out_dir

On a shared machine wrap it in the CPU lock:
`flock /tmp/draftsmith_cpu.lock env OMP_NUM_THREADS=2 python -m draftsmith.eval.bench.results_page quick=true`.

Per target it runs `eval.bench` once over MT-Bench (both turns), GSM8K test (seeded sample) and HumanEval, greedy,
on the compiled engine, with: plain HF greedy and plain-compiled (the references every other method must reproduce
token by token), the training-free drafters (prompt lookup, Self-Draft, a layer-subset student of the target), the
bundled drafter alone and in the cascade with lookup, the decoder policies (LLMCad, Minions; full mode only), HF
assisted generation and the draft LM (for targets with a draft model), and of each trained kind found under
`drafters/` (the committed snapshots; `drafters_root=outputs` for a run's final/) the drafter trained on the most
tokens: Medusa heads (`draftsmith.medusa/1`), feature drafters (`draftsmith.dgf/1`), distilled students
(`draftsmith.distilled/1`) and DFlash block drafters (`draftsmith.dflash/1`). Untrained baselines (manifests whose
training ran 0 optimizer updates, e.g. lr 0) are skipped with quick=true. The page's block names the machine kind
it ran on: compare its numbers only with others of that kind.

Writes `<out_dir>/<run>/bench.json/.md/*.png` (eval.bench's outputs) and `<out_dir>/summary.json`, then
replaces the block between the `<!-- eval.results_page:begin -->` / `<!-- eval.results_page:end -->` markers
of the page (RESULTS.md; appended when the markers are missing) with the generated tables.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from draftsmith.config import command_parser, option, parse_command
from draftsmith.errors import exit_with
from draftsmith.eval.bench.run import BenchConfig, check_output_dir, run_benchmark, write_outputs
from draftsmith.eval.bench.methods import parse_method
from draftsmith.eval.bench.report import format_table
from draftsmith.eval.documents import machine_kind
from draftsmith.models.registry import is_fetched

BEGIN = "<!-- eval.results_page:begin -->"
END = "<!-- eval.results_page:end -->"
MANIFEST_KINDS = {"draftsmith.medusa/1": "medusa", "draftsmith.dgf/1": "dgf", "draftsmith.distilled/1": "student",
                  "draftsmith.dflash/1": "dflash"}


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
            methods=["plain", "ngram", "dgf", "cascade", "self-draft", "lm-chain:budget=4,every=3"],
            full_only_methods=["llmcad:every=3", "minions:drafters=[(lm-chain:every=2),(lm-chain:every=3),ngram]"]),
    RunPlan(name="qwen1.5b", target="qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct",
            title="Qwen2.5-Coder-1.5B-Instruct target, 0.5B draft (bfloat16)", dtype="bfloat16",
            methods=["plain", "hf-assisted", "lm-chain:budget=4", "lm-tree:depth=4,topk=2,budget=8",
                     "lm-tree:depth=5,topk=3,budget=16", "ngram"],
            full_only_methods=["minions:drafters=[lm-chain,(lm-chain:every=4),ngram]"], num_prompts=3),
]


@dataclass(frozen=True)
class FoundDrafter:
    kind: str
    path: Path
    loss_tokens: int  # what its snapshot.json says it was trained on (0 where it has none)


# Each kind's methods: its best setting on the drafter-family benches that needs nothing of one target (a draft
# vocabulary is per target) first, the only one with quick=true; then the others.
KIND_METHODS = {
    "medusa": ("medusa:{path},adapter=ignore",),
    "dgf": ("dgf:{path},depth=3,topk=1,budget=3", "dgf:{path},depth=6,topk=2,budget=8,stop_below=0.2"),
    "student": ("lm-chain:model={path},budget=3,precision=int8-weights", "lm-chain:model={path},budget=3"),
    "dflash": ("dflash:{path},budget=3", "dflash:{path}"),
}


def snapshot_tokens(directory: Path) -> int:
    try:
        return int(json.loads((directory / "snapshot.json").read_text()).get("loss_tokens_seen") or 0)
    except (OSError, ValueError, AttributeError):
        return 0


def discover_drafters(root: Path, target: str, quick: bool) -> list[FoundDrafter]:
    """Trained drafters under `root` (every folder whose manifest is of a known kind and names `target`): of each
    run (the folder holding its snapshots or final/) the one trained on the most loss tokens; most trained first."""
    best: dict[Path, FoundDrafter] = {}
    for manifest_file in sorted(root.glob("**/manifest.json")):
        try:
            manifest = json.loads(manifest_file.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        kind = MANIFEST_KINDS.get(manifest.get("format"))
        if kind is None or (manifest.get("target") or {}).get("name") != target:
            continue
        if quick and untrained(manifest):
            continue
        found = FoundDrafter(kind, manifest_file.parent, snapshot_tokens(manifest_file.parent))
        run = manifest_file.parent.parent
        if run not in best or found.loss_tokens > best[run].loss_tokens:
            best[run] = found
    return sorted(best.values(), key=lambda found: (-found.loss_tokens, str(found.path)))


def untrained(manifest: dict) -> bool:
    """A baseline that never learned: trained with learning rate 0 (the recipes' untrained reference)."""
    optim = ((manifest.get("training") or {}).get("optim") or {})
    return optim.get("lr") == 0 or (manifest.get("training") or {}).get("untrained") is True


def drafter_methods(found: list[FoundDrafter], quick: bool, per_kind: int) -> list[str]:
    """The methods of the `per_kind` most trained drafters of each kind."""
    methods, seen = [], {}
    for drafter in found:
        if seen.get(drafter.kind, 0) >= per_kind:
            continue
        seen[drafter.kind] = seen.get(drafter.kind, 0) + 1
        templates = KIND_METHODS[drafter.kind][:1] if quick else KIND_METHODS[drafter.kind]
        methods += [template.format(path=drafter.path) for template in templates]
    return methods


def plan_runs(args) -> list[tuple[RunPlan, list[str]]]:
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
    lines = [BEGIN, f"## Every drafter found, one run on {machine_kind()} (generated by "
             "`python -m draftsmith.eval.bench.results_page`)", "",
             f"Command: `{command}` (wall time {elapsed_s / 60:.1f} min, finished "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}). Everything between the `eval.results_page` "
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


@dataclass
class ResultsConfig:
    quick: bool = option(False, "SmolLM2 only, 3 prompts per suite, 64 new tokens")
    only: list[str] | None = option(None, f"run only these plans: {', '.join(plan.name for plan in PLANS)}")
    out_dir: str = option("results/current", "where each run's bench output and summary.json go")
    page: str = option("RESULTS.md", "the page whose generated block is replaced")
    drafters_root: str = option("drafters", "where trained drafters are searched (every folder with a manifest: "
                                            "the committed snapshots, or a run's final/)")
    per_kind: int = option(1, "trained drafters per kind (the most trained first)", ge=1)
    threads: int = option(2, "torch CPU threads", ge=0)
    suite: str = option("mt-bench,gsm8k,humaneval", "comma-separated suites")
    dry_run: bool = option(False, "print the planned runs and exit")
    wandb: bool = option(False, "log each run to W&B (offline without network)")


def main(argv: list[str]) -> list[dict]:
    parser = command_parser("python -m draftsmith.eval.bench.results_page", __doc__.split("\n\n")[0], ResultsConfig)
    parser.add_argument("--overwrite", action="store_true", help="measure again over an earlier run in out_dir")
    args, flags = parse_command(parser, ResultsConfig, argv)
    runs = plan_runs(args)
    for plan, methods in runs:
        print(f"{plan.name}: {plan.target} draft={plan.draft} {plan.num_prompts} prompts x {args.suite} "
              f"{plan.max_new_tokens} tokens; methods: {' '.join(methods)}", flush=True)
    if args.dry_run or not runs:
        return []
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m draftsmith.eval.bench.results_page", *argv])
    start = time.perf_counter()
    entries = []
    configs = [BenchConfig(target=plan.target, draft=plan.draft, methods=[parse_method(m) for m in methods],
                           suites=args.suite.split(","), num_prompts=plan.num_prompts,
                           max_new_tokens=plan.max_new_tokens, dtype=plan.dtype, threads=args.threads,
                           output_dir=str(out_dir / plan.name), wandb=args.wandb) for plan, methods in runs]
    for config in configs:  # a finished earlier run is never silently re-rendered as a new one
        check_output_dir(config, flags.overwrite)
    for (plan, _), config in zip(runs, configs):
        results = run_benchmark(config, overwrite=flags.overwrite)
        results["command"] = command
        written = write_outputs(results, config)
        print(format_table(results), flush=True)
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
    exit_with(main)
