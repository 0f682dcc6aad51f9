"""The table of scripts/jobs/llamacpp_verify_cost.sh: per llama-bench JSON file (one target type, one flash-attention
setting), the ms a batch of n tokens takes and its cost in single steps (n = 1)."""
import json
import statistics
import sys
from pathlib import Path

from draftsmith.eval.latency import cpu_isa, cpu_model


def rows(path: Path) -> list[str]:
    tests = json.loads(path.read_text())
    ms = {test["n_prompt"]: statistics.median(test["samples_ns"]) / 1e6 for test in tests}
    first = tests[0]
    label = path.stem.split("_", 1)[1]  # <type>_fa-<on|off>, as the job script names the file
    one = ms[1]
    cells = " | ".join(f"{ms[n]:.1f} ({ms[n] / one:.2f})" for n in sorted(ms))
    return [f"| {label} | {first['model_size'] / 2**20:.0f} MiB | {cells} |"]


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]]
    sizes = sorted(json.loads(paths[0].read_text()), key=lambda t: t["n_prompt"])
    print(f"# llama.cpp: what a batch of n tokens costs against one step ({cpu_model()}, {cpu_isa()}, "
          f"{sizes[0]['n_threads']} threads, build {sizes[0]['build_commit']})\n")
    print("ms per batch (in single steps), llama-bench `-p n -n 0`, median of its repetitions (a busy moment spikes single ones).\n")
    print("| target GGUF, flash attention | weights | " + " | ".join(f"n = {t['n_prompt']}" for t in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    for path in paths:
        print(*rows(path), sep="\n")


if __name__ == "__main__":
    main()
