"""Every method spec the project writes or shows parses: the specs exports record, the bench's defaults, the
commands in README.md and RESULTS.md, and the trees in the bundled drafters' manifests (the student export once
wrote `lm-chain:k=4`, which the parser had stopped accepting)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from draftsmith.eval.bench import default_methods
from draftsmith.eval.methods import parse_method
from draftsmith.models.trees import DGF_TREE, LM_CHAIN_SPEC, LM_TREE_SPEC, TreeShape

ROOT = Path(__file__).resolve().parents[1]


def documented_specs() -> list[str]:
    specs = []
    for doc in ("README.md", "RESULTS.md"):
        for match in re.finditer(r'methods=("[^"]*"|\S+)', (ROOT / doc).read_text()):
            specs += shlex.split(match.group(1).strip("\"'"))
    return specs


@pytest.mark.parametrize("spec", [LM_CHAIN_SPEC, LM_TREE_SPEC, *documented_specs()])
def test_every_written_spec_parses(spec):
    assert str(parse_method(spec)) == spec


def test_bench_defaults_parse_back():
    for spec in default_methods("smollm2-135m-instruct"):
        assert str(parse_method(str(spec))) == str(spec)


def test_bundled_manifest_trees_read_with_either_budget_key():
    for manifest in (ROOT / "models" / "bundled").glob("*/export_manifest.json"):
        tree = json.loads(manifest.read_text())["tree"]
        shape = TreeShape.from_manifest(tree, DGF_TREE)
        assert shape.budget == tree.get("budget", tree.get("g"))
    assert TreeShape.from_manifest({"depth": 2, "g": 5}, DGF_TREE) == TreeShape(2, DGF_TREE.topk, 5)
    assert TreeShape.from_manifest(DGF_TREE.to_manifest(), DGF_TREE) == DGF_TREE
