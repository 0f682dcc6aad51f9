"""ARCA / Medusa trees from per-head accuracies: greedy == brute-force optimum, rank closure."""

from __future__ import annotations

import itertools
import json

import pytest

from draftsmith.eval.policies.arca import (arca_paths, expected_accepted, load_rank_accuracy, path_value, rank_accuracy_from_topk)
from draftsmith.eval.decode.drafters.medusa import MedusaDrafter
from draftsmith.eval.decode.tree import tree_from_paths
from draftsmith.models.medusa import MedusaConfig, MedusaHeads

ACC = [[0.6, 0.2, 0.1], [0.5, 0.2], [0.4, 0.1]]


def _closed(paths) -> bool:
    """Every prefix present and every node's children use ranks 0..k-1."""
    found = {tuple(p) for p in paths}
    for p in found:
        if len(p) > 1 and p[:-1] not in found:
            return False
        if p[-1] > 0 and p[:-1] + (p[-1] - 1,) not in found:
            return False
    return True


def _all_nodes(acc, max_depth):
    nodes = []
    for depth in range(1, max_depth + 1):
        nodes += list(itertools.product(*[range(len(acc[d])) for d in range(depth)]))
    return nodes


def test_small_example_by_hand():
    paths = arca_paths(ACC, 4)
    # values: [0]=.6, [0,0]=.3, [1]=.2, [0,1]=.12, [0,0,0]=.12 (tie -> shallower first)
    assert paths == [[0], [0, 0], [1], [0, 1]]
    assert expected_accepted(paths, ACC) == pytest.approx(0.6 + 0.3 + 0.2 + 0.12)
    assert path_value([0, 0, 0], ACC) == pytest.approx(0.12)


@pytest.mark.parametrize("width", range(1, 8))
def test_greedy_is_optimal_for_decreasing_accuracies(width):
    nodes = _all_nodes(ACC, 3)
    best = max(expected_accepted(subset, ACC)
               for subset in itertools.combinations(nodes, width) if _closed(subset))
    paths = arca_paths(ACC, width)
    assert len(paths) == width and _closed(paths)
    assert expected_accepted(paths, ACC) == pytest.approx(best)


def test_prefix_property_and_depth_limit():
    big = arca_paths(ACC, 10)
    for n in range(11):
        assert arca_paths(ACC, n) == big[:n]
    assert all(len(p) <= 1 for p in arca_paths(ACC, 10, max_depth=1))
    assert arca_paths(ACC, 10, max_depth=1) == [[0], [1], [2]]


def test_ranks_are_closed_even_when_accuracy_rises_with_rank():
    acc = [[0.1, 0.5, 0.3], [0.2, 0.6]]
    paths = arca_paths(acc, 5)
    assert _closed(paths)
    assert paths[0] == [0]  # rank 1 (0.5) only becomes available once rank 0 is in the tree


def test_runs_out_of_nodes_and_skips_zero_value():
    acc = [[0.5, 0.0], [0.5]]
    assert arca_paths(acc, 100) == [[0], [0, 0]]
    assert arca_paths(acc, 0) == []


def test_validation():
    with pytest.raises(ValueError, match="cumulative"):
        arca_paths([[0.6, 0.8]], 2)
    with pytest.raises(ValueError, match="probability"):
        arca_paths([[1.5]], 1)
    with pytest.raises(ValueError, match="budget"):
        arca_paths(ACC, -1)
    assert rank_accuracy_from_topk([[0.6, 0.8, 0.9]])[0] == pytest.approx([0.6, 0.2, 0.1])


def test_paths_feed_medusa_drafter(tmp_path):
    paths = arca_paths(ACC, 7)
    parents, depths, ranks = tree_from_paths(paths)
    assert int(depths.max()) <= 3
    drafter = MedusaDrafter(MedusaHeads(MedusaConfig(hidden_size=8, vocab_size=16, num_heads=3)), paths)
    assert drafter.parents.numel() == 7
    (tmp_path / "head_accuracy.json").write_text(json.dumps({"rank_accuracy": ACC}))
    assert load_rank_accuracy(tmp_path) == ACC
    with pytest.raises(FileNotFoundError):
        load_rank_accuracy(tmp_path / "missing")
