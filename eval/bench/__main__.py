"""`python -m draftsmith.eval.bench`: the benchmark (eval/bench/run.py)."""

from draftsmith.errors import exit_with
from draftsmith.eval.bench.run import main

exit_with(main)
