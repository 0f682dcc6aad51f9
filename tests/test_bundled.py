"""Bundled drafters: the explicit table, the `dgf` method without a path, the bench's default methods,
the bfloat16 dgf export they are made with, and the shipped SmolLM2 drafter's files."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import build_spec, tiny_model
from draftsmith.errors import UserError
from draftsmith.eval.bench import run as bench
from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.models import bundled
from draftsmith.models import exports as export
from draftsmith.models.artifacts import save_dgf, target_block
from draftsmith.models.dgf import DGFConfig, DGFModel
from draftsmith.models.target import TargetModel
from draftsmith.models.tiny import TinyTokenizer


@pytest.fixture
def tiny_bundle(tmp_path, monkeypatch):
    """A tiny target named `tiny-bundled` and a DGF drafter bundled for it (exported in bfloat16)."""
    model = tiny_model("llama", seed=2)
    target = TargetModel(model, TinyTokenizer(96), name="tiny-bundled")
    torch.manual_seed(0)
    drafter = DGFModel(DGFConfig.for_target(model.config, num_blocks=1)).attach_target(model).eval()
    save_dgf(drafter, tmp_path / "final", target_block(target, target.name, [-1]))
    result = export.export_dgf(tmp_path / "final", tmp_path / "bundled" / "tiny-dgf", target=target, layout="dgf",
                               dtype="bfloat16")
    monkeypatch.setattr(bundled, "BUNDLED_DIR", tmp_path / "bundled")
    monkeypatch.setattr(bundled, "BUNDLED_DRAFTERS", {"tiny-bundled": "tiny-dgf"})
    return target, tmp_path, result


def test_bfloat16_dgf_export_halves_the_file_and_reloads_exactly(tiny_bundle):
    _, root, result = tiny_bundle
    assert result.max_abs_diff == 0.0  # parity against the rounded drafter
    stored = root / "bundled" / "tiny-dgf" / "dgf.safetensors"
    with safe_open(str(stored), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert stored.stat().st_size < 0.6 * (root / "final" / "dgf.safetensors").stat().st_size
    manifest = json.loads((root / "bundled" / "tiny-dgf" / "manifest.json").read_text())
    assert manifest["drafter"]["dtype"] == "bfloat16"
    with pytest.raises(UserError, match="only the dgf layout"):
        export.export_dgf(root / "final", root / "eagle", layout="eagle", dtype="bfloat16")


def test_dgf_without_a_path_is_the_bundled_drafter_and_lossless(tiny_bundle):
    target, _, _ = tiny_bundle
    drafter = build_spec("dgf:depth=3,topk=2,budget=6", target)
    prompt = torch.tensor([[3, 5, 7, 9, 11, 13]])
    config = DecodeConfig(max_new_tokens=16, budget_limit=6)
    plain = SpeculativeDecoder(target, None, config).generate(prompt).tokens
    assert SpeculativeDecoder(target, drafter, config).generate(prompt).tokens == plain


def test_export_records_the_measured_tree_and_dgf_decodes_with_it(tiny_bundle, tmp_path):
    from draftsmith.eval.decode.drafters.dgf import DGF_DEPTH, DGF_TOPK, drafter_tree
    from draftsmith.scripts.export import measured_tree

    target, root, _ = tiny_bundle
    source = root / "final"
    assert drafter_tree(source) == (DGF_DEPTH, DGF_TOPK, 16)  # a training final/: Dovetail's tree
    tree = measured_tree(str(source), f"dgf:path={source},depth=3,topk=1,budget=3")
    assert tree == {"depth": 3, "topk": 1, "budget": 3} and measured_tree(str(source), "ngram") is None
    export.export_dgf(source, tmp_path / "chain", target=target, layout="dgf", tree=tree)
    drafter = build_spec(f"dgf:path={tmp_path / 'chain'}", target)
    assert (drafter.depth, drafter.topk, drafter.budget) == (3, 1, 3)
    assert build_spec(f"dgf:path={tmp_path / 'chain'},budget=2", target).budget == 2  # given wins


def test_bench_defaults_add_the_bundled_drafter_alone_and_in_the_cascade(tiny_bundle):
    target, _, _ = tiny_bundle
    assert [m.label for m in bench.default_methods("tiny-bundled")] == ["plain", "ngram", "dgf", "cascade"]
    assert [m.label for m in bench.default_methods("tiny:llama")] == ["plain", "ngram"]
    cascade = build_spec("cascade", target)  # lookup on a repeated 3-gram, 8 tokens, else the bundled drafter
    assert [type(d).__name__ for d in cascade.drafters] == ["NgramDrafter", "DGFDrafter"]
    assert (cascade.drafters[0].min_ngram, cascade.drafters[0].budget) == (3, 8)
    prompt = torch.tensor([[3, 5, 7, 9, 3, 5, 7, 9, 3, 5]])
    config = DecodeConfig(max_new_tokens=16, budget_limit=16)
    plain = SpeculativeDecoder(target, None, config).generate(prompt).tokens
    assert SpeculativeDecoder(target, cascade, config).generate(prompt).tokens == plain


def test_the_bare_cascade_drafts_with_the_int8_tree_where_the_invariant_kernels_run(tiny_bundle):
    """On the compiled engine's batch-invariant kernels the bare cascade's drafter is the bundled drafter as an 8-node
    tree on int8 weights (elsewhere, and when sampling, its export's chain); its output is still plain's."""
    from draftsmith.eval.bench.methods import BuildContext, build_method
    from draftsmith.models.kernels import WeightPrecision
    from draftsmith.models.engine import Backend

    target, _, _ = tiny_bundle
    cascade = build_method("cascade", BuildContext(target, backend=Backend.COMPILED)).drafter
    lookup, tree = cascade.drafters
    assert (lookup.min_ngram, lookup.budget) == (3, 8)
    assert (tree.depth, tree.topk, tree.budget, tree.stop_below, tree.cut.keep_above) == (6, 2, 8, 0.2, 0.1)
    assert any(getattr(m, "precision", None) is WeightPrecision.INT8 for m in tree.engine.runs.modules())
    sampled = build_method("cascade", BuildContext(target, backend=Backend.COMPILED, greedy=False)).drafter
    chain = sampled.drafters[1]  # sampling keeps every drawn node: the export's tree, untrimmed, on the run's weights
    assert chain.cut.keep_above is None and not any(getattr(m, "precision", None) is WeightPrecision.INT8
                                                    for m in chain.engine.runs.modules())
    compiled = target.with_backend(Backend.COMPILED)
    prompt = torch.tensor([[3, 5, 7, 9, 3, 5, 7, 9, 3, 5]])
    config = DecodeConfig(max_new_tokens=16, budget_limit=16)
    plain = SpeculativeDecoder(compiled, None, config).generate(prompt).tokens
    assert SpeculativeDecoder(compiled, cascade, config).generate(prompt).tokens == plain


def test_no_bundled_drafter_is_one_clear_line(tiny_bundle, monkeypatch):
    target, root, _ = tiny_bundle
    with pytest.raises(UserError, match="no drafter is bundled for target 'other'; bundled drafters: tiny-bundled"):
        bundled.bundled_drafter("other")
    monkeypatch.setattr(bundled, "BUNDLED_DRAFTERS", {"tiny-bundled": "gone"})
    with pytest.raises(UserError, match="is missing from"):
        bundled.bundled_drafter("tiny-bundled")


def test_the_shipped_drafters_are_small_and_name_their_target():
    """Every bundled drafter on disk: a few MB of bfloat16 weights, a manifest for its table key, a model
    card with the command that trained it."""
    for target_name, directory in bundled.BUNDLED_DRAFTERS.items():
        path = bundled.BUNDLED_DIR / directory
        if not (path / "manifest.json").is_file():
            pytest.skip(f"{path} is not shipped yet")
        manifest = json.loads((path / "manifest.json").read_text())
        assert manifest["target"]["name"] == target_name and manifest["drafter"]["dtype"] == "bfloat16"
        assert sum(f.stat().st_size for f in path.iterdir()) < 16 * 2**20
        card = (path / "README.md").read_text()
        assert "accelerate launch" in card and "weights: safetensors, bfloat16" in card
