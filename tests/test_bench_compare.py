"""The paired comparison of two methods of one bench run (eval.bench.compare)."""

from __future__ import annotations

import json

import pytest

from draftsmith.errors import UserError
from draftsmith.eval.bench import compare


def run_with(first: list[float], second: list[float]) -> dict:
    rows = [{"A": {"seconds": a}, "B": {"seconds": b}} for a, b in zip(first, second)]
    return {"per_prompt": rows, "summary": {"A": {}, "B": {}}}


def test_a_constant_ratio_is_its_own_mean_and_interval():
    paired = compare.compare_run(run_with([1.0, 2.0, 4.0], [1.1, 2.2, 4.4]), "A", "B")
    assert paired.mean == pytest.approx(1.1) and paired.low == pytest.approx(1.1) and paired.high == pytest.approx(1.1)
    assert (paired.wins, paired.turns) == (3, 3)


def test_the_interval_holds_the_mean_and_the_order_of_methods_inverts_it():
    first, second = [1.0, 1.2, 0.9, 1.1, 1.0, 1.3], [1.1, 1.1, 1.0, 1.3, 0.95, 1.4]
    paired = compare.compare_run(run_with(first, second), "A", "B")
    assert paired.low < paired.mean < paired.high and paired.wins == 4
    inverse = compare.compare_run(run_with(first, second), "B", "A")
    assert inverse.mean == pytest.approx(1 / paired.mean) and inverse.wins == 2


def test_the_command_names_an_unknown_method_and_a_file_that_is_no_run(tmp_path, capsys):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(run_with([1.0, 2.0], [2.0, 4.0])))
    assert compare.main([str(path), "A", "B"]).startswith("A over B: 2.000x per prompt turn")
    with pytest.raises(UserError, match="no method 'C' in this run; its methods: A; B"):
        compare.main([str(path), "C", "B"])
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(UserError, match="not an eval.bench result"):
        compare.main([str(tmp_path / "other.json"), "A", "B"])
