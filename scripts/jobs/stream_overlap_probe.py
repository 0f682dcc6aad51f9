"""What this machine allows a float32 verify's linear layers: how much of F multiply-adds per weight line hides under
a weight stream (scripts/jobs/stream_overlap_probe.cpp, built here with g++ -O3 -march=native -fopenmp; AVX-512 or
AVX2: there F multiply-adds on each of a line's two vectors). For F = 0, 8, 16 (a verify of F rows) it times a 512 MB
stream on 2 threads, with each line requested ahead (into L1 at 96 / 192 / 384 / 768 lines, into L2 at 192) and
without, and the multiply-adds alone over data in cache; settings interleaved over 7 rounds, medians. T(F)/T(0)
within one setting is the floor a verify's linear layers can reach on this machine with this access pattern (one
load a line, F multiply-adds on it). Prints a table; writes JSON and the table beside it where an output path is
given (an existing one is refused).
    scripts/jobs/quiet.sh python scripts/jobs/stream_overlap_probe.py [output.json]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ab_arguments import probe_output

from draftsmith.eval.documents import cpu_model, write_document

SETTINGS = ((96, 0), (192, 0), (384, 0), (768, 0), (192, 1))  # (lines ahead, 0: into L1, 1: into L2)
ROUNDS = 7


def build(directory: Path) -> Path:
    binary = directory / "stream_overlap_probe"
    source = Path(__file__).with_suffix(".cpp")
    subprocess.run(["g++", "-O3", "-march=native", "-fopenmp", str(source), "-o", str(binary)], check=True)
    return binary


def main() -> None:
    output = probe_output(sys.argv)
    with tempfile.TemporaryDirectory() as directory:
        binary = build(Path(directory))
        runs: dict[tuple, list[dict]] = {setting: [] for setting in SETTINGS}
        for _ in range(ROUNDS):
            for distance, hint in SETTINGS:
                printed = subprocess.run([str(binary), str(distance), str(hint)], check=True, capture_output=True,
                                         text=True, env={**os.environ, "OMP_PROC_BIND": "close"}).stdout
                rows = map(json.loads, printed.splitlines())
                runs[distance, hint].append({row["fmas_per_line"]: row for row in rows})
    table = {}
    for (distance, hint), rounds in runs.items():
        label = f"{distance} lines ahead into {'L1' if hint == 0 else 'L2'}"
        table[label] = {f: {key: statistics.median(r[f][key] for r in rounds) for key in
                            ("stream_ms", "requested_ahead_ms", "compute_ms")} for f in (0, 8, 16)}
    lines = [f"{cpu_model()}, 2 threads: a 512 MB stream with F multiply-adds a line, medians of {ROUNDS} rounds, ms",
             "", "| requests | T(0) | T(8) | T(16) | T(8)/T(0) | T(16)/T(0) | compute alone F=8 / F=16 |",
             "|---|---|---|---|---|---|---|"]
    # no requests: every setting's own run without them, pooled
    none = {f: {"requested_ahead_ms": statistics.median(r[f]["stream_ms"] for rounds in runs.values() for r in rounds),
                "compute_ms": statistics.median(row[f]["compute_ms"] for row in table.values())} for f in (0, 8, 16)}
    for label, row in [("none", none)] + list(table.items()):
        t = {f: row[f]["requested_ahead_ms"] for f in (0, 8, 16)}
        lines.append(f"| {label} | {t[0]:.1f} | {t[8]:.1f} | {t[16]:.1f} | {t[8] / t[0]:.2f} | {t[16] / t[0]:.2f} | "
                     f"{row[8]['compute_ms']:.1f} / {row[16]['compute_ms']:.1f} |")
    write_document(output, {"cpu": cpu_model(), "rounds": ROUNDS, "ms": table}, "\n".join(lines))


if __name__ == "__main__":
    main()
