"""The roofline probe runs end to end on a tiny target: the machine's roofs, T(w) beside its bound with the split by
part, and Medusa heads on the same kernels (their loading stubbed); the JSON and the table are written. (What it measures on a real model
is a benchmark's job: results/roofline/.)"""

from __future__ import annotations

import json

from draftsmith.eval import roofline
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.target import TargetModel


def test_roofline_of_a_tiny_target_and_medusa_heads(tmp_path, monkeypatch):
    target = TargetModel.from_pretrained("tiny:llama")
    heads = MedusaHeads(MedusaConfig(hidden_size=target.config.hidden_size, vocab_size=target.config.vocab_size,
                                     num_heads=2))
    monkeypatch.setattr(roofline, "load_medusa_heads", lambda path, device, target: (heads.eval(), {}))
    monkeypatch.setattr(roofline, "machine_roofs", lambda: {
        "stream_gbs": 10.0, "reduction_gbs": 10.0, "float32_gflops": 50.0, "bfloat16_gflops": 100.0,
        "int8_gops": 200.0, "kernel_float32_gflops": 50.0, "kernel_int8_gops": 150.0})
    monkeypatch.setattr(roofline, "stream_roofs", lambda: {"stream_gbs": 20.0, "reduction_gbs": 30.0})
    out = tmp_path / "roofline.json"
    document = roofline.main(["target=tiny:llama", "widths=[1,2]", "repeats=1", "context_tokens=8", "drafter=null",
                              f"medusa={tmp_path / 'heads'}", "compile.autotune=false", "compile.buckets=[1,2]",
                              "compile.capacity=64", f"output={out}"])
    written = json.loads(out.read_text())
    assert set(written["widths"]) == {"1", "2"} and written["widths"]["1"]["bound_ms"] > 0
    assert {"linear", "head", "attention", "rest"} <= set(written["widths"]["1"]["parts_ms"])
    # a float32 target's greedy decoding reads the greedy head: its forwards beside the bound of its copy's bytes
    greedy = written["greedy_head_widths"]
    assert set(greedy) == {"1", "2"} and 0 < greedy["1"]["bound_ms"] < written["widths"]["1"]["bound_ms"]
    assert "The forwards greedy decoding runs" in out.with_suffix(".md").read_text()
    assert list(written["drafters"]) == ["Medusa heads"] and document["drafters"]["Medusa heads"]["widths"][2]["ms"] > 0
    assert "Medusa heads" in out.with_suffix(".md").read_text()
    # the stream moves with the VM: read again after the timings, the bound on the mean of both readings
    assert written["roofs"]["stream_gbs"] == 15.0 and written["roofs"]["stream_gbs_after"] == 20.0
    assert "the mean of 10.0 before and 20.0 after the timings" in out.with_suffix(".md").read_text()
