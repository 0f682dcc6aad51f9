"""The table of scripts/jobs/llamacpp_verify_cost.sh: per llama-bench JSON file (one target type, one flash-attention
setting), the ms a batch of n tokens takes and its cost in single steps (n = 1)."""
import json
import statistics
import sys
from pathlib import Path

from draftsmith.eval.documents import cpu_isa, cpu_model


def row(path: Path) -> str:
    tests = json.loads(path.read_text())
    ms = {test["n_prompt"]: statistics.median(test["samples_ns"]) / 1e6 for test in tests}
    label = path.stem.split("_", 1)[1]  # <type>_fa-<on|off>, as the job script names the file
    cells = " | ".join(f"{ms[n]:.1f} ({ms[n] / ms[1]:.2f})" for n in sorted(ms))
    return f"| {label} | {tests[0]['model_size'] / 2**20:.0f} MiB | {cells} |"


def main() -> None:
    paths = [Path(p) for p in sys.argv[1:]]
    tests = sorted(json.loads(paths[0].read_text()), key=lambda test: test["n_prompt"])
    print(f"# llama.cpp: what a batch of n tokens costs against one step ({cpu_model()}, {cpu_isa()}, "
          f"{tests[0]['n_threads']} threads, build {tests[0]['build_commit']})\n")
    print("ms per batch (in single steps), llama-bench `-p n -n 0`, median of its repetitions (a busy moment spikes "
          "single ones).\n")
    print("| target GGUF, flash attention | weights | " + " | ".join(f"n = {test['n_prompt']}" for test in tests) + " |")
    print("|---|---|" + "---|" * len(tests))
    for path in paths:
        print(row(path))


if __name__ == "__main__":
    main()
