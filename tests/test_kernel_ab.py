"""eval.kernel_ab: the kernels' sources at a git revision against the working tree's, in alternating processes."""

import json

import pytest
import torch

from draftsmith.errors import UserError
from draftsmith.eval import kernel_ab
from draftsmith.models import kernels

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 200}


def tiny_model(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(TINY))
    return tmp_path / "model"


def test_the_step_is_the_engines_linears_in_order(tmp_path):
    linears = kernel_ab.step_linears(str(tiny_model(tmp_path)), kernel_ab.StepPrecision.FLOAT32)
    shapes = [(linear.in_features, linear.out_features) for linear in linears]
    assert shapes[:4] == [(64, 64 + 2 * 32), (64, 64), (64, 192), (96, 64)]
    assert len(shapes) == 2 * 4 + 1 and shapes[-1] == (64, 200)


def test_both_sources_time_every_precision(tmp_path):
    tiny_model(tmp_path)
    out = tmp_path / "ab.json"
    document = kernel_ab.main([f"target={tmp_path / 'model'}", "baseline=HEAD", "precisions=[float32, w8a8]",
                               "widths=[1, 3]", "repeats=1", "rounds=1", f"output={out}"])
    cells = json.loads(out.read_text())["cells"]
    assert [(c["precision"], c["sources"]) for c in cells] == [("float32", "baseline"), ("float32", "candidate"),
                                                               ("w8a8", "baseline"), ("w8a8", "candidate")]
    assert all(c["ms"]["3"] > 0 and c["isa"] == kernels.kernel_isa() for c in cells)
    assert "| candidate |" in out.with_suffix(".md").read_text() and document["target"] == str(tmp_path / "model")


def test_the_attention_step_is_a_chain_over_the_context(tmp_path, monkeypatch):
    spec = {"model": str(tiny_model(tmp_path)), "precision": "float32", "widths": [1, 3], "context_tokens": 5,
            "capacity": 12}
    calls = []
    kernels.load_kernels()
    monkeypatch.setattr(torch.ops.draftsmith, "attention",
                        lambda q, k, v, mask, scaling: calls.append((q.shape, k.shape, mask)))
    kernel_ab.attention_step(spec)(3)
    assert len(calls) == TINY["num_hidden_layers"]
    q_shape, k_shape, mask = calls[0]
    assert tuple(q_shape) == (1, 4, 3, 16) and tuple(k_shape) == (1, 2, 12, 16)
    assert [int((row == 0).sum()) for row in mask[0, 0]] == [6, 7, 8]


def test_attention_is_timed_on_both_sources(tmp_path):
    tiny_model(tmp_path)
    document = kernel_ab.main([f"target={tmp_path / 'model'}", "parts=[attention]", "widths=[1, 2]", "repeats=1",
                               "rounds=1", "context_tokens=8", "capacity=16"])
    assert [(c["part"], c["sources"]) for c in document["cells"]] == [("attention", "baseline"),
                                                                      ("attention", "candidate")]
    with pytest.raises(UserError, match="exceed capacity=16"):
        kernel_ab.KernelABConfig(widths=[9], context_tokens=8, capacity=16)


def test_an_unknown_baseline_is_one_line(tmp_path):
    with pytest.raises(UserError, match="baseline=no-such-revision: git has no models/native/"):
        kernel_ab.baseline_sources("no-such-revision", tmp_path)


def test_sources_change_only_before_the_kernels_load():
    kernels.load_kernels()
    with pytest.raises(UserError, match="loaded the kernels already"):
        kernels.use_sources(kernels.SOURCE_DIRECTORY)
