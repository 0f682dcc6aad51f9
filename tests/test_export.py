"""scripts/export.py / models.exports round trips: HF students (assistant_model generate parity), Medusa
heads in the FasterDecoding layout (names + parity), DGF/EAGLE drafters, manifests, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.errors import UserError
from transformers import AutoModelForCausalLM

from conftest import tiny_model, tiny_target_for
from draftsmith.models import export_medusa
from draftsmith.models import exports as export
from draftsmith.models.medusa import MedusaConfig, MedusaHeads
from draftsmith.models.target import TargetModel, vocab_fingerprint
from draftsmith.errors import run_main
from tests.conftest import make_adapter, write_medusa_final
from draftsmith.scripts.export import main as export_main
from draftsmith.models.tiny import TinyTokenizer


# -- students --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def student_setup(smol_tokenizer, tmp_path_factory):
    """(target TargetModel, a student HF dir, a distill-style final/ dir) sharing the SmolLM2 tokenizer."""
    root = tmp_path_factory.mktemp("students")
    target = tiny_target_for(smol_tokenizer, seed=0)
    target = TargetModel(target.model, smol_tokenizer, name="tiny-target")
    student = tiny_target_for(smol_tokenizer, seed=1).model
    plain_dir = root / "plain"
    student.save_pretrained(str(plain_dir))
    smol_tokenizer.save_pretrained(str(plain_dir))
    final = root / "run" / "final"
    student.save_pretrained(str(final))
    smol_tokenizer.save_pretrained(str(final))
    (final / "manifest.json").write_text(json.dumps({
        "format": "draftsmith.distilled/1", "method": "distilled-student",
        "target": {"name": "tiny-target", "vocab_fingerprint": vocab_fingerprint(smol_tokenizer)},
        "training": {"steps": 3}}))
    return target, student, plain_dir, final


def test_student_export_round_trip_with_assisted_generate(student_setup, tmp_path):
    target, student, _, final = student_setup
    result = export.export_student(final, tmp_path / "out", target=target)
    out = tmp_path / "out"
    assert result.max_abs_diff == 0.0 and not (tmp_path / "out.tmp").exists()
    manifest = export.read_export_manifest(out)
    assert manifest["layout"] == "hf" and manifest["target"]["name"] == "tiny-target"
    assert manifest["target"]["vocab_fingerprint"] == vocab_fingerprint(target.tokenizer)
    assert manifest["target"]["hidden_layers"] == [] and manifest["fusion"] is None and manifest["tree"]
    assert manifest["student"]["distillation"] == {"steps": 3}
    assert "assisted_generate" in manifest["parity"]
    loaded = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    prompt = torch.tensor([target.tokenizer("Hello there, how are you")["input_ids"]])
    common = dict(attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=10)
    assert torch.equal(target.model.generate(prompt, assistant_model=loaded, **common),
                       target.model.generate(prompt, **common))
    with torch.inference_mode():
        torch.testing.assert_close(loaded(prompt).logits, student(prompt).logits, rtol=0, atol=0)


def test_student_export_plain_dir_without_target(student_setup, tmp_path):
    _, _, plain_dir, _ = student_setup
    result = export.export_student(plain_dir, tmp_path / "o")
    assert result.manifest["target"]["name"] is None and "assisted_generate" not in result.manifest["parity"]
    card = (tmp_path / "o" / "README.md").read_text()  # an off-the-shelf model: the card does not claim training
    assert "not trained by draftsmith: `plain` exported as it is" in card and "training command" not in card


def test_the_card_names_the_command_that_made_the_export(student_setup, tmp_path):
    _, _, _, final = student_setup
    assert export_cli(["student", str(final), str(tmp_path / "o"), "--dtype", "bfloat16"]) == 0
    card = (tmp_path / "o" / "README.md").read_text()
    assert f"- export command: `python scripts/export.py student {final} {tmp_path / 'o'} --dtype bfloat16`" in card
    assert "trained by draftsmith" in card and "training command" in card


def test_student_export_bad_input(student_setup, tmp_path):
    target, _, plain_dir, _ = student_setup
    with pytest.raises(FileNotFoundError, match="config.json"):
        export.export_student(tmp_path, tmp_path / "o")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        export.export_student(plain_dir, tmp_path / "busy")
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in plain_dir.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00garbage")
    with pytest.raises(ValueError, match="corrupt"):
        export.export_student(broken, tmp_path / "o2")
    other = TargetModel(tiny_model("llama", vocab_size=96), TinyTokenizer(96))
    with pytest.raises(ValueError):
        export.export_student(plain_dir, tmp_path / "o3", target=other)


def test_a_lora_adapter_exports_merged_into_its_base(student_setup, tmp_path):
    """An adapter directory (a distill run's final/adapter, or a committed one) -> the merged standalone model,
    with the PARD mask token from the sidecar; the card says what was merged into what."""
    target, student, plain_dir, _ = student_setup
    peft_model = make_adapter(student, tmp_path / "adapter", base=str(plain_dir))
    assert export_cli(["student", str(tmp_path / "adapter"), str(tmp_path / "out"), "--target", str(plain_dir)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    merged = peft_model.merge_and_unload()
    for name, weight in exported.state_dict().items():
        assert torch.allclose(merged.state_dict()[name], weight, atol=1e-6), name
    assert exported.config.pard_token == 5
    manifest = export.read_export_manifest(tmp_path / "out")
    assert manifest["student"]["adapter_merge"]["base"] == str(plain_dir)
    assert manifest["student"]["pard_token"] == 5 and "assisted_generate" in manifest["parity"]
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"the LoRA adapter `{tmp_path / 'adapter'}` merged into `{plain_dir}`" in card and "mask token 5" in card
    # in bf16 the reloaded export computes the same logits (exact parity): only weights are rounded
    assert export_cli(["student", str(tmp_path / "adapter"), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0


def test_an_adapter_export_refuses_what_does_not_fit_in_one_line(student_setup, tmp_path, capsys):
    _, student, plain_dir, final = student_setup
    make_adapter(student, tmp_path / "adapter", base=str(plain_dir), pard_token=None)
    other = tmp_path / "other"  # a model of another width: the adapter's matrices do not fit it
    tiny_model("llama", vocab_size=student.config.vocab_size, hidden_size=48).save_pretrained(str(other))
    student_setup[0].tokenizer.save_pretrained(str(other))
    cases = [(["student", str(tmp_path / "adapter"), str(tmp_path / "o1"), "--base", str(other)],
              "the adapter does not fit the base"),
             (["student", str(final), str(tmp_path / "o2"), "--base", str(plain_dir)],
              "read only when the source is a LoRA adapter directory"),
             (["student", str(tmp_path / "pruned"), str(tmp_path / "o3")], "export the run's final/")]
    make_adapter(student, tmp_path / "pruned", base=None)  # a pruned student's adapter: no base to merge into
    for argv, words in cases:
        assert export_cli(argv) == 2
        err = capsys.readouterr().err  # above the error line: transformers' loading progress bars
        assert words in err.strip().splitlines()[-1] and "Traceback" not in err
        assert not any(tmp_path.glob(argv[2].rsplit("/", 1)[-1] + "*"))


# -- Medusa ------------------------------------------------------------------------------------


def make_medusa_final(path, num_heads=3, num_layers=1, hidden=16, vocab=40, adapter=None):
    """A train/medusa.py-style final/ dir with random (nonzero) heads."""
    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig(hidden_size=hidden, vocab_size=vocab, num_heads=num_heads, num_layers=num_layers))
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return write_medusa_final(path, heads, adapter)


def test_medusa_fasterdecoding_layout_and_parity(tmp_path):
    from safetensors import safe_open

    heads = make_medusa_final(tmp_path / "final", num_heads=3, num_layers=1)
    result = export_medusa.export_medusa(tmp_path / "final", tmp_path / "fd", base_model="org/base")
    out = tmp_path / "fd"
    assert result.max_abs_diff == 0.0
    with safe_open(str(out / "medusa_lm_head.safetensors"), "pt") as f:
        names = set(f.keys())
    expected = {f"{k}.0.linear.{p}" for k in range(3) for p in ("weight", "bias")}
    expected |= {f"{k}.1.weight" for k in range(3)}
    assert names == expected
    config = json.loads((out / "config.json").read_text())
    assert config["medusa_num_heads"] == 3 and config["medusa_num_layers"] == 1
    assert (out / "README.md").is_file()
    assert config["base_model_name_or_path"] == "org/base"
    manifest = export.read_export_manifest(out)
    assert manifest["layout"] == "fasterdecoding-medusa" and manifest["target"]["hidden_layers"] == [-1]
    assert manifest["target"]["vocab_fingerprint"] == "abc" and manifest["tree"]["medusa_choices"]
    reloaded, _ = export_medusa.load_fasterdecoding_medusa(out)
    hidden = torch.randn(2, 5, 16)
    torch.testing.assert_close(reloaded(hidden), heads(hidden), rtol=0, atol=0)


def test_medusa_export_refuses_what_fasterdecoding_cannot_hold(tmp_path):
    make_medusa_final(tmp_path / "final", num_layers=2)
    with pytest.raises(UserError, match="ONE ResBlock"):
        export_medusa.export_medusa(tmp_path / "final", tmp_path / "fd")
    assert not (tmp_path / "fd").exists() and not (tmp_path / "fd.tmp").exists()


def test_medusa_loader_accepts_model_prefixed_names(tmp_path):
    from safetensors.torch import load_file, save_file

    heads = make_medusa_final(tmp_path / "final")
    export_medusa.export_medusa(tmp_path / "final", tmp_path / "fd")
    file = tmp_path / "fd" / "medusa_lm_head.safetensors"
    save_file({f"medusa_head.{k}": v for k, v in load_file(str(file)).items()}, str(file))
    reloaded, config = export_medusa.load_fasterdecoding_medusa(tmp_path / "fd")
    assert config["base_model_name_or_path"] == "tiny-target"
    hidden = torch.randn(1, 3, 16)
    torch.testing.assert_close(reloaded(hidden), heads(hidden), rtol=0, atol=0)


def test_medusa_export_errors(tmp_path, monkeypatch):
    make_medusa_final(tmp_path / "final")
    export_medusa.export_medusa(tmp_path / "final", tmp_path / "fd")
    (tmp_path / "fd" / "medusa_lm_head.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        export_medusa.load_fasterdecoding_medusa(tmp_path / "fd")
    (tmp_path / "fd" / "medusa_lm_head.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="medusa_lm_head.safetensors is missing"):
        export_medusa.load_fasterdecoding_medusa(tmp_path / "fd")
    with pytest.raises(FileNotFoundError, match="manifest.json"):
        export_medusa.export_medusa(tmp_path / "nothing", tmp_path / "o")
    make_medusa_final(tmp_path / "m2", adapter="target_lora")
    with pytest.raises(ValueError, match="LoRA adapter"):
        export_medusa.export_medusa(tmp_path / "m2", tmp_path / "o")
    # a reload that does not reproduce the logits fails the export and leaves no output directory
    real = export_medusa.load_fasterdecoding_medusa

    def perturbed(path):
        heads, config = real(path)
        with torch.no_grad():
            heads.medusa_head[0][-1].weight.add_(1e-3)
        return heads, config

    monkeypatch.setattr(export_medusa, "load_fasterdecoding_medusa", perturbed)
    with pytest.raises(export.ParityError, match="differs"):
        export_medusa.export_medusa(tmp_path / "final", tmp_path / "bad")
    assert not (tmp_path / "bad").exists() and not (tmp_path / "bad.tmp").exists()
    # any exception mid-export (here: the tokenizer copy) leaves no half-written `<out>.tmp` either

    def broken(name, out):
        raise OSError("disk full")

    monkeypatch.setattr(export_medusa, "_save_tokenizer", broken)
    with pytest.raises(OSError, match="disk full"):
        export_medusa.export_medusa(tmp_path / "final", tmp_path / "half")
    assert not (tmp_path / "half").exists() and not (tmp_path / "half.tmp").exists()


def export_cli(argv):
    return run_main(export_main, argv)


def test_cli_medusa_and_failure_exit_code(tmp_path, capsys):
    make_medusa_final(tmp_path / "final")
    assert export_cli(["medusa", str(tmp_path / "final"), str(tmp_path / "cli")]) == 0
    assert "parity" in capsys.readouterr().out
    assert export_cli(["medusa", str(tmp_path / "missing"), str(tmp_path / "cli2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    # an existing export is never replaced; a bad tolerance is one line too
    assert export_cli(["medusa", str(tmp_path / "final"), str(tmp_path / "cli")]) == 2
    assert "exists" in capsys.readouterr().err
    assert export_cli(["medusa", str(tmp_path / "final"), str(tmp_path / "cli3"), "--tolerance", "-1"]) == 2
    assert "tolerance: must be >= 0" in capsys.readouterr().err
    # key=value is the documented spelling; both name the same keys
    assert export_cli(["medusa", str(tmp_path / "final"), str(tmp_path / "cli4"), "tolerance=0.5"]) == 0
    assert export_cli(["medusa", f"source={tmp_path / 'final'}", f"out={tmp_path / 'cli5'}"]) == 0
    assert export_cli(["medusa", str(tmp_path / "final"), str(tmp_path / "cli6"), "bench=x.json"]) == 2
    assert "bench_method" in capsys.readouterr().err


def test_push_to_hub_unreachable_is_one_line_and_keeps_the_export(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_medusa_final(tmp_path / "final")
    code = export_cli(["medusa", str(tmp_path / "final"), str(tmp_path / "fd"), "--push-to-hub", "me/heads"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: push_to_hub=me/heads") and err.count("\n") == 1
    assert (tmp_path / "fd" / "medusa_lm_head.safetensors").is_file()


# -- DGF / EAGLE -------------------------------------------------------------------------------


@pytest.mark.parametrize("fusion,layout", [("linear", "eagle"), ("dgf", "draftsmith.dgf")])
def test_dgf_export_round_trip(tmp_path, fusion, layout):
    from draftsmith.models.artifacts import save_dgf, target_block
    from draftsmith.models.dgf import DGFConfig, DGFModel

    model = tiny_model("llama")
    target = TargetModel(model, TinyTokenizer(96), name="tiny-llama")
    torch.manual_seed(0)
    drafter = DGFModel(DGFConfig.for_target(model.config, fusion=fusion, num_blocks=2)).attach_target(model).eval()
    save_dgf(drafter, tmp_path / "final", target_block(target, target.name, [-1]))
    result = export.export_dgf(tmp_path / "final", tmp_path / "out", target=target)
    manifest = result.manifest
    assert manifest["layout"] == layout and manifest["fusion"] == fusion and result.max_abs_diff == 0.0
    assert manifest["target"]["hidden_layers"] == [-1] and manifest["target"]["name"] == "tiny-llama"
    assert manifest["tree"] == {"depth": 7, "topk": 10, "budget": 16} and manifest["parity"]["embedding_and_head"] == "target"
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert ("model.safetensors" in names) if fusion == "linear" else ("dgf.safetensors" in names)
    # without a target the parity check runs through a seeded stand-in embedding / head
    stand_in = export.export_dgf(tmp_path / "final", tmp_path / "out2")
    assert stand_in.manifest["parity"]["embedding_and_head"].startswith("seeded stand-in")
    if fusion == "dgf":
        with pytest.raises(ValueError, match="EAGLE-1/2's layout"):
            export.export_dgf(tmp_path / "final", tmp_path / "out3", layout="eagle")


def test_model_card_and_metadata_carry_target_training_and_measurements(tmp_path, capsys):
    from safetensors import safe_open

    make_medusa_final(tmp_path / "final")
    bench_file = tmp_path / "bench.json"
    bench_file.write_text(json.dumps({"machine": {"device": "cpu", "processor": "test cpu", "cpu_count": 2,
                                                     "torch_threads": 2}, "summary": {
        "medusa:x": {"tau": 2.5, "headline_speedup": 1.6, "headline_baseline": "plain-compiled"}}}))
    assert export_cli(["medusa", str(tmp_path / "final"), str(tmp_path / "fd"), "--bench", str(bench_file),
                       "--bench-method", "medusa:x"]) == 0
    card = (tmp_path / "fd" / "README.md").read_text()
    assert card.startswith("---\nbase_model: tiny-target\nlibrary_name: medusa\ntags:\n")
    assert "training command:" in card and "tau 2.50, speedup 1.60x vs plain-compiled" in card
    assert "on cpu (test cpu, 2 cores), 2 threads" in card and "weights: safetensors, float32" in card
    assert "another engine decodes them its own way" in card  # the speedup is our decoder's, with its settings
    with safe_open(str(tmp_path / "fd" / "medusa_lm_head.safetensors"), "pt") as f:
        metadata = f.metadata()
    assert metadata["target_vocab_fingerprint"] == "abc" and metadata["producer"] == "draftsmith"
    assert export_cli(["medusa", str(tmp_path / "final"), str(tmp_path / "fd2"), "--bench", str(bench_file),
                       "--bench-method", "nope"]) == 2
    assert "medusa:x" in capsys.readouterr().err and not (tmp_path / "fd2").exists()
