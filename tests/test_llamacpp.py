"""llama.cpp as a real part: the pinned build is found, our exports load and decode in it, and its speculative
output (n-gram, draft model, EAGLE-3) equals its own plain greedy output; regeneration through its server.

The end-to-end tests need the build (`python -m draftsmith.models.engines.llamacpp build`, ~15-25 min on 2 cores). CI
builds it first and sets DRAFTSMITH_REQUIRE_LLAMACPP=1, so there a missing build fails instead of skipping.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from draftsmith.errors import run_main
from draftsmith.models.engines import llamacpp
from draftsmith.models.artifacts import save_dflash, save_dgf, target_block
from draftsmith.models.dflash import DFlashConfig, DFlashModel
from draftsmith.models.dgf import DGFConfig, DGFModel
from draftsmith.models.export_dflash import export_dflash
from draftsmith.models.exports import export_dgf
from draftsmith.models.target import TargetModel
from draftsmith.models.tiny import build_tiny_causal_lm
from draftsmith.scripts import export as export_cli
from tests.conftest import make_adapter


def require_build() -> None:
    if llamacpp.is_built():
        return
    if os.environ.get("DRAFTSMITH_REQUIRE_LLAMACPP", "") not in ("", "0"):
        pytest.fail("DRAFTSMITH_REQUIRE_LLAMACPP is set but llama.cpp is not built")
    pytest.skip("llama.cpp is not built (python -m draftsmith.models.engines.llamacpp build)")


def test_not_built_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path))
    assert run_main(llamacpp.main, ["where"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: llama.cpp b11434 is not built") and err.count("\n") == 1
    with pytest.raises(llamacpp.NotBuiltError):
        llamacpp.tool("llama-server")
    assert run_main(llamacpp.main, ["bild"]) == 2


def test_native_build_turns_amx_off_where_the_cpu_lists_it():
    assert "-mno-amx-tile" in " ".join(llamacpp.cmake_arguments(amx_off=True))
    assert "amx" not in " ".join(llamacpp.cmake_arguments(amx_off=False))
    assert "-DGGML_NATIVE=ON" in llamacpp.cmake_arguments(amx_off=False)


@pytest.fixture(scope="module")
def tiny_pair(smol_tokenizer, tmp_path_factory):
    """A tiny random Llama target with SmolLM2's tokenizer, its GGUF, a tiny draft model and a tiny EAGLE-3
    drafter exported in the speculators layout."""
    require_build()
    root = tmp_path_factory.mktemp("llamacpp")
    dirs = {}
    for name, seed in (("target", 1), ("draft", 2)):
        model = build_tiny_causal_lm("llama", seed=seed, vocab_size=len(smol_tokenizer), hidden_size=64, num_layers=4)
        model.config.bos_token_id, model.config.eos_token_id = smol_tokenizer.bos_token_id, smol_tokenizer.eos_token_id
        model.save_pretrained(root / name)
        smol_tokenizer.save_pretrained(root / name)
        dirs[name] = (root / name, model)
    target_dir, target_model = dirs["target"]
    target = TargetModel(target_model, smol_tokenizer, name=str(target_dir))
    torch.manual_seed(0)
    config = DGFConfig.for_target(target_model.config, fusion="eagle3", feature_layers=[1, 2, 3], num_blocks=1)
    drafter = DGFModel(config).attach_target(target_model).eval()
    save_dgf(drafter, root / "final", target_block(target, target.name, [1, 2, 3]))
    export_dgf(root / "final", root / "eagle3", target=target, layout="speculators")
    block = DFlashConfig.from_target(target_model.config, num_layers=1, block_size=4, target_layer_ids=[0, 2],
                                     mask_token_id=16)
    dflash = DFlashModel(block).attach_target(target_model).eval()
    save_dflash(dflash, root / "dflash_final", target_block(target, target.name, block.hidden_layers))
    export_dflash(root / "dflash_final", root / "dflash", target_model=target)
    return {"root": root, "target": target_dir, "draft": dirs["draft"][0], "eagle3": root / "eagle3",
            "dflash": root / "dflash", "target_model": target}


def export(argv: list[str], capsys) -> dict:
    code = run_main(export_cli.main, argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out[: out.rindex("}") + 1])


def test_the_dflash_export_drafts_in_llamacpp_and_speculation_is_lossless(tiny_pair, capsys):
    """z-lab's layout through llama.cpp's own converter (DFlashModel, the target's tokenizer) and its draft-dflash
    speculation: the target's layers 0 and 2 injected into the drafter's cache, blocks of 4 drafted, the output
    equal to the target's plain output."""
    root = tiny_pair["root"]
    out = export(["gguf", str(tiny_pair["dflash"]), str(root / "dflash.gguf"), "--target", str(tiny_pair["target"])],
                 capsys)
    assert out["kind"] == "dflash" and out["check"]["identical_to_plain"] and out["check"]["drafted"] > 0


def test_gguf_exports_decode_in_llamacpp_and_speculation_is_lossless(tiny_pair, capsys):
    root = tiny_pair["root"]
    target = export(["gguf", str(tiny_pair["target"]), str(root / "target.gguf")], capsys)
    assert target["kind"] == "causal-lm" and target["check"]["plain_tokens"] > 0
    export(["gguf", str(tiny_pair["draft"]), str(root / "draft-q8_0.gguf"), "--type", "q8_0"], capsys)
    eagle = export(["gguf", str(tiny_pair["eagle3"]), str(root / "eagle3.gguf"), "--target", str(tiny_pair["target"])],
                   capsys)
    assert eagle["kind"] == "eagle3" and eagle["check"]["identical_to_plain"] and eagle["check"]["drafted"] > 0
    prompt = llamacpp.check_prompt_ids(tiny_pair["target"])
    simple = ("--spec-type", "draft-simple")
    for speculative in (("--spec-type", "ngram-simple"), ("-md", str(root / "draft-q8_0.gguf"), *simple),
                        ("-md", str(root / "eagle3.gguf"), "--spec-type", "draft-eagle3")):
        check = llamacpp.decode_check(root / "target.gguf", prompt, speculative)
        assert check["identical_to_plain"], speculative
    self_draft = llamacpp.decode_check(root / "target.gguf", prompt, ("-md", str(root / "target.gguf"), *simple))
    assert self_draft["accepted"] == self_draft["drafted"] > 0  # the target drafting for itself: all accepted
    # the bench's memory plan: float weights are shared through the page cache, quantized ones repacked per server
    assert not llamacpp.repacked_per_server(root / "target.gguf")
    assert llamacpp.repacked_per_server(root / "draft-q8_0.gguf")


def test_a_merged_pard_adapter_runs_as_a_llamacpp_draft_model(tiny_pair, capsys):
    """A LoRA adapter as train/distill.py writes it (PARD mask token in its sidecar) -> `export
    student` merges it -> `export gguf` -> llama.cpp drafts with it (draft-simple) and its output equals plain."""
    from transformers import AutoModelForCausalLM

    root = tiny_pair["root"]
    draft = AutoModelForCausalLM.from_pretrained(tiny_pair["draft"])
    make_adapter(draft, root / "pard_adapter", base=str(tiny_pair["draft"]),
                 pard_token=len(draft.get_input_embeddings().weight) - 1)
    export(["student", str(root / "pard_adapter"), str(root / "pard")], capsys)
    exported = export(["gguf", str(root / "pard"), str(root / "pard-q8_0.gguf"), "--type", "q8_0"], capsys)
    assert exported["kind"] == "causal-lm" and exported["check"]["plain_tokens"] > 0
    prompt = llamacpp.check_prompt_ids(tiny_pair["target"])
    check = llamacpp.decode_check(llamacpp.cached_gguf(tiny_pair["target"], "tiny-target"), prompt,
                                  ("-md", str(root / "pard-q8_0.gguf"), "--spec-type", "draft-simple"))
    assert check["identical_to_plain"] and check["drafted"] > 0


def test_llamacpp_plain_greedy_equals_ours_in_float32(tiny_pair):
    target = tiny_pair["target_model"]
    gguf = llamacpp.cached_gguf(tiny_pair["target"], "tiny-target")
    prompt = llamacpp.check_prompt_ids(tiny_pair["target"])
    settings = llamacpp.ServerSettings(model=gguf, slots=1, context_per_slot=256)
    with llamacpp.LlamaServer(settings, log_path=tiny_pair["root"] / "plain.log") as server:
        theirs = server.complete(prompt, 16)["tokens"]
    with torch.inference_mode():
        ours = target.model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
    ours = ours.tolist()
    if theirs != ours:  # only a near-tie may round differently in another engine's kernels (another CPU's SIMD)
        first = next(i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b)
        with torch.inference_mode():
            logits = target.model(torch.tensor([prompt + ours[:first]])).logits[0, -1].float()
        margin = float(logits[ours[first]] - logits[theirs[first]])
        assert margin < 1e-3 * max(1.0, float(logits.abs().max())), (first, margin)


def test_gguf_export_refusals_are_one_line(tiny_pair, tmp_path, capsys):
    existing = tmp_path / "x.gguf"
    existing.write_bytes(b"")
    cases = [(["gguf", str(tiny_pair["target"]), str(existing)], "exists"),
             (["gguf", str(tiny_pair["target"]), str(tmp_path / "x.bin")], "ending in .gguf"),
             (["gguf", str(tiny_pair["eagle3"]), str(tmp_path / "e.gguf")], "give its target"),
             (["gguf", str(tiny_pair["target"]), str(tmp_path / "t.gguf"), "--target", str(tiny_pair["target"])],
              "only for EAGLE-3")]
    for argv, words in cases:
        assert run_main(export_cli.main, argv) == 2
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err


def test_regeneration_through_the_llamacpp_server_resumes(tiny_pair, tmp_path):
    from draftsmith.data.regenerate import RegenerateConfig, regenerate
    from draftsmith.data.sources import load_regenerated

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Say something about {w}."}) + "\n"
                               for w in ("rain", "bread", "maps", "owls", "glass")))
    config = dict(target=str(tiny_pair["target"]), source=f"jsonl:{prompts}", output_dir=str(tmp_path / "regen"),
                  engine="llamacpp", batch_size=3, shard_size=2, max_new_tokens=12, compress=True, progress=False)
    first = regenerate(RegenerateConfig(**config, max_shards=1))
    assert first.shards_written == 1 and first.stopped_early
    rest = regenerate(RegenerateConfig(**config))
    assert (rest.shards_skipped, rest.shards_written) == (1, 2)
    convs = load_regenerated(tmp_path / "regen")
    assert len(convs) == 5 and all(c.meta["regenerated"]["engine"] == "llamacpp" for c in convs)
    assert sorted(p.name for p in (tmp_path / "regen").glob("shard_*"))[0] == "shard_0_00000.jsonl.gz"


@pytest.mark.parametrize("options,words", [({"dtype": "q4_k_m"}, "converts the target to one of"),
                                           ({"device": "cuda"}, "runs on the CPU"),
                                           ({"world_size": 2}, "one server")])
def test_regeneration_engine_options_are_checked(options, words):
    from draftsmith.data.regenerate import RegenerateConfig
    from draftsmith.errors import UserError

    with pytest.raises(UserError, match=words):
        RegenerateConfig(target="tiny:llama", source="gsm8k", output_dir="x", engine="llamacpp", **options)
    with pytest.raises(UserError, match="GGUF type"):
        RegenerateConfig(target="tiny:llama", source="gsm8k", output_dir="x", dtype="q8_0")


def test_llamacpp_bench_table_on_tiny_models(tiny_pair, tmp_path, capsys):
    """The llama.cpp bench: plain, an n-gram mode, a draft model and the EAGLE-3 export on the same prompt ids,
    every speculative output compared with llama.cpp's plain one."""
    from draftsmith.eval.engines import llamacpp_bench

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Count to five.", "Name a colour.")))
    out = tmp_path / "llamacpp.json"
    document = llamacpp_bench.main([f"target={tiny_pair['target']}", f"suites=[jsonl:{prompts}]", "num_prompts=2",
                                    "max_new_tokens=12", "pytorch_baselines=false", f"output={out}",
                                    f"methods=ngram draft:{tiny_pair['target']} eagle3:{tiny_pair['eagle3']} "
                                    f"eagle3:{tiny_pair['eagle3']},type=bfloat16 "
                                    f"eagle3:{tiny_pair['eagle3']},ngram=ngram-simple"])
    summary = document["summary"]
    assert list(summary) == ["plain", "ngram", f"draft:{tiny_pair['target']}", f"eagle3:{tiny_pair['eagle3']}",
                             f"eagle3:{tiny_pair['eagle3']},type=bfloat16",  # a cheaper drafter, the same output
                             f"eagle3:{tiny_pair['eagle3']},ngram=ngram-simple"]  # llama.cpp's own cascade
    assert all(entry["differs_from_plain"] == [] for entry in summary.values())
    assert summary[f"draft:{tiny_pair['target']}"]["acceptance"] == 1.0  # the target drafting for itself
    assert out.is_file() and out.with_suffix(".md").read_text().startswith("llama.cpp b11434")
    assert "| plain |" in capsys.readouterr().out


@pytest.mark.parametrize("argv,words", [(["methods=ngram:kind=ngram-mod,n=4"], "read only by kind=ngram-simple"),
                                        (["methods=lookahead"], "unknown llama.cpp method"),
                                        (["target_type=q3"], "target_type"),
                                        (["methods=eagle3:x,type=q4"], "type"),
                                        (["methods=eagle3:x.gguf,type=q8_0"], "type is not read for a .gguf file"),
                                        (["methods=draft:x.gguf,type=q8_0"], "type is not read for a .gguf file"),
                                        (["methods=draft:x,p_min=1"], "p_min"),
                                        (["methods=eagle3:x,n_max=3,n_min=4"], "n_min=4 is above n_max=3"),
                                        (["methods=ngram ngram"], "names a method twice")])
def test_llamacpp_bench_refusals(argv, words, capsys):
    from draftsmith.eval.engines import llamacpp_bench

    if "kind=ngram-mod" in argv[0] or ".gguf," in argv[0]:  # refused where the method's arguments are built
        require_build()
    assert run_main(llamacpp_bench.main, argv + ["pytorch_baselines=false", "num_prompts=1"]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1, err


def test_draft_length_options_reach_llamacpp():
    """n_max and p_min (llama.cpp's per-token confidence stop) go to the server for draft models and EAGLE-3."""
    from draftsmith.eval.engines.llamacpp_bench import LlamaCppMethodSpec, draft_length_arguments

    spec = LlamaCppMethodSpec.from_config("draft:x,n_max=8,p_min=0.6")
    assert draft_length_arguments(spec.options) == ("--spec-draft-n-max", "8", "--spec-draft-p-min", "0.6",
                                                    "--spec-draft-n-min", "0")
    spec = LlamaCppMethodSpec.from_config("eagle3:x")
    assert draft_length_arguments(spec.options) == ("--spec-draft-n-max", "16", "--spec-draft-p-min", "0.0",
                                                    "--spec-draft-n-min", "0")


def test_the_eagle3_cascade_asks_llamacpp_for_both_types():
    """eagle3:<dir>,ngram=<mode> is llama.cpp's own cascade: one --spec-type list, the n-gram mode's settings kept."""
    from draftsmith.eval.engines.llamacpp_bench import LlamaCppMethodSpec, cascade_type_arguments

    spec = LlamaCppMethodSpec.from_config("eagle3:x,ngram=ngram-simple,n_max=3")
    assert cascade_type_arguments(spec.options.ngram, "draft-eagle3", None) == (
        "--spec-type", "ngram-simple,draft-eagle3", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "5")
    assert cascade_type_arguments("none", "draft-eagle3", None) == ("--spec-type", "draft-eagle3")
    with pytest.raises(Exception, match="ngram"):
        LlamaCppMethodSpec.from_config("eagle3:x,ngram=lookup")


def test_a_divergence_is_located_and_its_logit_gap_measured(tmp_path):
    """Where llama.cpp's speculative output parts from its plain output, the export check records the position and
    the target's float32 logit gap there (a near-tie is llama.cpp's batched arithmetic; a wide gap is refused)."""
    model = build_tiny_causal_lm("llama", seed=2)
    model.save_pretrained(tmp_path)
    prompt, plain, speculative = [5, 6, 7], [10, 11, 12], [10, 13]
    out = llamacpp.first_divergence(prompt, plain, speculative, tmp_path)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + [10]])).logits[0, -1]
    assert out["position"] == 1 and out["plain"] == [11] and out["speculative"] == [13]
    assert abs(out["logit_gap"] - abs(float(logits[11] - logits[13]))) < 1e-5
    assert llamacpp.first_divergence(prompt, plain, plain[:2], None) == {"position": 2, "plain": [12],
                                                                         "speculative": []}


def test_the_json_records_every_method_as_its_spec():
    """A PyTorch method whose options hold an enum (lm-chain's precision) is written as its spec text: the bench's
    JSON once failed on it after the whole run."""
    from draftsmith.config import load_config
    from draftsmith.eval.engines.common import document_config
    from draftsmith.eval.engines.llamacpp_bench import LlamaCppBenchConfig

    config = load_config(LlamaCppBenchConfig, None,
                         ["methods=[ngram]", "pytorch_methods=['lm-chain:every=2,precision=int8-weights']"])
    recorded = json.loads(json.dumps(document_config(config)))
    assert recorded["methods"] == ["plain", "ngram"]
    assert recorded["pytorch_methods"] == ["lm-chain:every=2,precision=int8-weights"]


def test_engine_benches_report_speedups_per_suite():
    """The engine benches' JSON and table give each method's speedup per suite, as the PyTorch bench does."""
    from draftsmith.eval.engines.common import suite_table, summarize

    def run(seconds):
        return {"seconds": seconds, "new_tokens": 10, "drafted": 0, "accepted": 0, "tokens": [1]}

    rows = [{"suite": "gsm8k", "id": 0, "turn": 1, "runs": {"plain": run(2.0), "ngram": run(1.0)}},
            {"suite": "gsm8k", "id": 1, "turn": 1, "runs": {"plain": run(2.0), "ngram": run(2.0)}},
            {"suite": "humaneval", "id": 0, "turn": 1, "runs": {"plain": run(3.0), "ngram": run(1.0)}}]
    summary = summarize(rows, ["plain", "ngram"])
    assert summary["ngram"]["speedup_per_suite"] == {"gsm8k": 4.0 / 3.0, "humaneval": 3.0}
    table = "\n".join(suite_table(summary, "llama.cpp"))
    assert "| method | gsm8k | humaneval |" in table and "| ngram | 1.33x | 3.00x |" in table


def test_the_toolkit_plain_runs_beside_llamacpp_plain_on_each_turn(tiny_pair, tmp_path):
    """With pytorch_baselines, the toolkit's compiled plain decoding answers on every prompt turn beside llama.cpp's
    plain decoding (the same minutes), with a speedup against it and, in float32, the same tokens."""
    from draftsmith.eval.engines import llamacpp_bench

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Count to five."}) + "\n")
    document = llamacpp_bench.main([f"target={tiny_pair['target']}", f"suites=[jsonl:{prompts}]", "num_prompts=1",
                                    "max_new_tokens=10", "methods=[]", f"output={tmp_path / 'out.json'}"])
    label = "toolkit plain-compiled (float32)"
    assert list(document["summary"]) == ["plain", label]
    row = document["rows"][0]["runs"][label]
    assert row["new_tokens"] == len(row["tokens"]) > 0 and row["seconds"] > 0
    assert document["summary"][label]["differs_from_plain"] == []
    assert f"| {label} |" in (tmp_path / "out.md").read_text()
