"""eval.latency (T(w) curves) and eval.forward_profile (where a forward's time goes) on tiny models."""

from __future__ import annotations

import json

import pytest

from draftsmith.eval import forward_profile, latency
from draftsmith.models.compiled import CompileSettings


def test_latency_curves_cli_writes_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "curves" / "tiny.json"
    argv = ["target=tiny:llama", "widths=1 2 4", "repeats=2", "warmup=1", "context_tokens=24",
            "compile.buckets=[1,2,4]", "compile.capacity=64", "compile.autotune=false", f"output={out}"]
    document = latency.main(argv)
    assert set(document["curves"]) == {"eager/float32", "compiled/float32"}
    for curve in document["curves"].values():
        assert set(curve["ms"]) == {1, 2, 4} and curve["ratio"][1] == pytest.approx(1.0)
        assert all(len(times) == 2 for times in curve["all_s"].values())
    saved = json.loads(out.read_text())
    assert saved["format"] == "draftsmith.latency/1" and saved["machine"]
    assert "| compiled/float32 |" in out.with_suffix(".md").read_text()
    with pytest.raises(ValueError, match="exists: pass --overwrite"):
        latency.main(argv)
    with pytest.raises(ValueError, match="widths: 8 exceeds the largest compiled bucket 4"):
        latency.main(["target=tiny:llama", "widths=1 8", "compile.buckets=[1,2,4]"])


def test_release_measures_one_graph_at_a_time():
    config = latency.LatencyConfig(target="tiny:qwen2", backends=["compiled"], widths=[1, 2], repeats=1, warmup=0,
                                   context_tokens=8, release=True,
                                   compile=CompileSettings(buckets=[1, 2], capacity=32, autotune=False))
    document = latency.run_latency(config, progress=False)
    assert set(document["curves"]["compiled/float32"]["ms"]) == {1, 2}


def test_forward_profile_splits_the_wall_time(tmp_path):
    out = tmp_path / "profile.json"
    document = forward_profile.main(["target=tiny:llama", "backends=eager", "width=4", "context_tokens=16",
                                     "repeats=2", f"output={out}"])
    ms = document["backends"]["eager"]["ms"]
    assert set(forward_profile.CATEGORIES) <= set(ms)
    assert sum(ms[c] for c in forward_profile.CATEGORIES) == pytest.approx(ms["wall"], rel=0.05)
    assert ms["gemm"] > 0 and ms["lm_head"] > 0 and ms["attention"] > 0
    assert "| eager |" in out.with_suffix(".md").read_text()


def test_classify_names_the_lm_head_and_attention():
    assert forward_profile.classify("aten::mm", [[8, 48], [48, 96]], 96) == "lm_head"
    assert forward_profile.classify("aten::addmm", [[48], [8, 48], [48, 48]], 96) == "gemm"
    assert forward_profile.classify("graph_0_gemm_m8n96k48_cpp_fused", [], 96) == "lm_head"
    assert forward_profile.classify("aten::_scaled_dot_product_flash_attention_for_cpu", [], 96) == "attention"
    assert forward_profile.classify("draftsmith::greedy_head", [[1, 8, 576]], 96) == "lm_head"  # greedy decoding's head
    assert forward_profile.classify("graph_0_cpp_fused_add_mean_mul_pow_rsqrt", [], 96) == "other_kernels"
    # the batch-invariant kernels: weights packed (panels, K, 48); the head's panels cover the vocabulary
    assert forward_profile.classify("draftsmith::linear", [[1, 1, 48], [2, 48, 48], [], [], []], 96) == "lm_head"
    assert forward_profile.classify("draftsmith::linear", [[1, 1, 48], [1, 48, 48], [], [], []], 96) == "gemm"
    # bf16 weights packed in pairs (panels, K / 2, 48, 2)
    assert forward_profile.classify("draftsmith::linear", [[1, 1, 48], [2, 24, 48, 2], [], [], []], 96) == "lm_head"
    assert forward_profile.classify("draftsmith::linear", [[1, 1, 48], [1, 24, 48, 2], [], [], []], 96) == "gemm"


def test_the_machine_kind_names_its_vector_arithmetic():
    """Results name the CPU's widest vector arithmetic beside its model name: two AMD EPYC machines here differ in it
    (AVX2 only, or AVX-512 with BF16), and OpenVINO computes in bf16 by default where the CPU has it."""
    from draftsmith.eval.documents import cpu_isa, isa_name

    assert isa_name(["fpu", "avx2", "avx512f", "avx512_bf16"]) == "AVX-512 with BF16"
    assert isa_name(["avx2", "avx512f", "amx_tile"]) == "AVX-512+AMX"
    assert isa_name(["sse4_2", "avx2"]) == "AVX2" and isa_name([]) == "other"
    assert cpu_isa() in {"AVX-512 with BF16", "AVX-512", "AVX2", "other"} or cpu_isa().endswith("+AMX")


def test_results_are_kept_per_machine_kind():
    """The three kinds of 2-core machine the project runs on, and a name for any other CPU."""
    from draftsmith.eval.documents import machine_kind

    assert machine_kind("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "AVX-512 with BF16+AMX") == "intel_xeon"
    assert machine_kind("AMD EPYC", "AVX-512 with BF16") == "amd_epyc_zen4"
    assert machine_kind("AMD EPYC 7B12", "AVX2") == "amd_epyc_avx2"
    assert machine_kind("Apple M2", "other") == "apple_m2_other"
    assert machine_kind()


def test_a_bench_that_outgrew_the_ram_says_so(tmp_path):
    """A 1.5B bench with too many models in one process paged its compiled weights in and out: the
    bench records the machine's memory stalls during its timed loop (Linux PSI) and the table flags a large share."""
    from draftsmith.eval.documents import memory_stall_seconds
    from draftsmith.eval.bench.report import memory_line

    pressure = tmp_path / "memory"
    pressure.write_text("some avg10=0.00 avg60=0.06 avg300=8.54 total=997805802\n"
                        "full avg10=0.00 avg60=0.06 avg300=8.25 total=960958472\n")
    assert memory_stall_seconds(pressure) == pytest.approx(997.805802)
    assert memory_stall_seconds(tmp_path / "missing") is None
    pressure.write_text("garbled\n")
    assert memory_stall_seconds(pressure) is None
    assert memory_line({}) == "" and memory_line({"timed_loop_s": 100.0}) == ""
    assert memory_line({"memory_stall_s": 0.5, "timed_loop_s": 100.0}) == "; memory stalls 0.5 s of the 100 s timed loop"
    assert "outgrew the RAM" in memory_line({"memory_stall_s": 30.0, "timed_loop_s": 100.0})
