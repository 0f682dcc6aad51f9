"""Two methods of one finished bench run, prompt turn by prompt turn: how much faster one is than the other.

    python -m draftsmith.eval.bench.compare <run>/bench.json "<method A>" "<method B>"

Every method of a run decodes every prompt turn, interleaved, so the two times of one turn share the machine's
state (its hour, its stream, what ran before). The ratio of B's time to A's, turn by turn, is the paired speedup of
A over B: its geometric mean, a 95% bootstrap interval over the turns, and in how many turns A was faster. A method
is named by its label in the run's tables (its spec, or the label the config gave it).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from draftsmith.errors import UserError, exit_with

RESAMPLES = 5000
SEED = 0


@dataclass(frozen=True)
class PairedSpeedup:
    """A over B: geometric mean of B's time / A's time per prompt turn, its 95% interval, A's wins."""

    mean: float
    low: float
    high: float
    wins: int
    turns: int

    def line(self, first: str, second: str) -> str:
        return (f"{first} over {second}: {self.mean:.3f}x per prompt turn (95% interval {self.low:.3f}-"
                f"{self.high:.3f}; faster in {self.wins} of {self.turns})")


def paired_speedup(first_seconds: list[float], second_seconds: list[float], resamples: int = RESAMPLES,
                   seed: int = SEED) -> PairedSpeedup:
    """The paired speedup of the first over the second from their times on the same turns."""
    if len(first_seconds) != len(second_seconds) or not first_seconds:
        raise ValueError("need the two methods' times on the same, non-empty list of prompt turns")
    logs = [math.log(b / a) for a, b in zip(first_seconds, second_seconds)]
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(logs, k=len(logs))) / len(logs) for _ in range(resamples))
    low, high = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    return PairedSpeedup(math.exp(sum(logs) / len(logs)), math.exp(low), math.exp(high),
                         sum(value > 0 for value in logs), len(logs))


def compare_run(results: dict, first: str, second: str) -> PairedSpeedup:
    """The paired speedup of method `first` over `second` in a bench result (bench.json's contents)."""
    rows = results["per_prompt"]
    known = list(results["summary"])
    for name in (first, second):
        if name not in known:
            raise UserError(f"no method {name!r} in this run; its methods: " + "; ".join(known))
    return paired_speedup([row[first]["seconds"] for row in rows], [row[second]["seconds"] for row in rows])


def main(argv: list[str]) -> str:
    if len(argv) != 3:
        raise UserError('usage: python -m draftsmith.eval.bench.compare <bench.json> "<method A>" "<method B>"')
    path = Path(argv[0])
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise UserError(f"{path}: not an eval.bench result ({type(error).__name__}: {error})") from None
    if not isinstance(results, dict) or not {"per_prompt", "summary"} <= results.keys():
        raise UserError(f"{path}: not an eval.bench result (no per_prompt and summary)")
    line = compare_run(results, argv[1], argv[2]).line(argv[1], argv[2])
    print(line)
    return line


if __name__ == "__main__":
    exit_with(main)
