"""Run eval.bench on several suites in one process and record the policies' internal state.

    python scripts/bench_policies.py --suites mt-bench gsm8k --out results/policies_smollm2 \
        --target smollm2-135m-instruct --num-prompts 3 --max-new-tokens 64 --threads 2 \
        --methods plain lm-chain:k=4,student=every3 minions:models=every2+every3+ngram self-draft

Every other flag is eval.bench's. Per suite it writes `<out>_<suite>.json/.md` (the bench's JSON
plus a "policies" entry: Minions weights / votes / speculation-length decisions, LLMCad's alpha,
the pipeline's pre-draft hit rate; these include the warm-up prompt).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import draftsmith.eval.bench as bench


def policy_state(method) -> dict:
    from draftsmith.eval.drafters.llmcad import LLMCadDrafter
    from draftsmith.eval.drafters.minions import MinionsDrafter
    from draftsmith.eval.pipeline import PipelinePolicy

    if isinstance(method, MinionsDrafter):
        return method.summary()
    if isinstance(method, LLMCadDrafter):
        history = method.alpha_history
        return {"alpha_final": method.alpha, "alpha_min_seen": min(history, default=None),
                "alpha_max_seen": max(history, default=None), "rounds": len(history)}
    if isinstance(method, PipelinePolicy):
        return {"predraft_hits": method.hits, "rounds": method.rounds,
                "hit_rate": method.hits / method.rounds if method.rounds else None}
    return {}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suites", nargs="+", required=True)
    parser.add_argument("--out", required=True, help="path prefix: <out>_<suite>.json/.md")
    args, rest = parser.parse_known_args(argv)
    config = bench.parse_args(rest)
    if "plain" not in config.methods:
        config.methods.insert(0, "plain")
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    target = bench.TargetModel.from_pretrained(config.target, dtype=config.dtype, device=config.device)
    draft = (bench.TargetModel.from_pretrained(config.draft, dtype=config.dtype, device=config.device)
             if config.draft else None)
    original_build = bench.build_drafter
    for suite in args.suites:
        built = {}

        def capture(spec, target_model, draft_model):
            built[spec] = original_build(spec, target_model, draft_model)
            return built[spec]

        bench.build_drafter = capture
        try:
            config.suite = suite
            results = bench.run_benchmark(config, target=target, draft=draft)
        finally:
            bench.build_drafter = original_build
        results["policies"] = {spec: policy_state(obj) for spec, obj in built.items() if policy_state(obj)}
        results["command"] = " ".join([os.path.basename(sys.executable), *sys.argv])
        if hasattr(os, "getloadavg"):
            results["machine"]["load_average_at_end"] = os.getloadavg()
        table = bench.format_table(results)
        print(table)
        print(json.dumps(results["policies"], indent=1, default=str))
        out = Path(f"{args.out}_{suite}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, default=str))
        out.with_suffix(".md").write_text(table + "\n")
        print(f"wrote {out} and {out.with_suffix('.md')}", flush=True)


if __name__ == "__main__":
    main()
