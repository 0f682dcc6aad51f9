"""Distillation recipe (train/distill.py) on tiny in-process models (seconds on a 2-core CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from draftsmith.config import ConfigError, load_config
from draftsmith.errors import UserError
from draftsmith.train.run_guards import MetricsFile
from draftsmith.models.tiny import TinyTokenizer, build_tiny_causal_lm
from draftsmith.data.records import load_records, synthetic_records
from draftsmith.eval.bench.methods import parse_method
from draftsmith.models.artifacts import read_adapter_sidecar
from draftsmith.models.target import TargetModel
from draftsmith.train.distill import DistillRecipeConfig, build_student, load_cache_records, main, read_manifest

REPO = Path(__file__).resolve().parents[1]
TINY_YAML = REPO / "train" / "configs" / "distill_tiny.yaml"


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_cfg(output_dir, *overrides) -> DistillRecipeConfig:
    return load_config(DistillRecipeConfig, TINY_YAML, [f"output_dir={output_dir}", *overrides])


def train_metrics(output_dir) -> dict[int, dict]:
    return {r["step"]: r for r in MetricsFile.read(Path(output_dir) / "metrics.jsonl") if "train/loss" in r}


def test_config_rejects_unknown_and_inconsistent_keys(tmp_path):
    with pytest.raises(ConfigError, match=r"'loss\.knd'.*did you mean 'loss\.kind'"):
        tiny_cfg(tmp_path, "loss.knd=fkl")
    with pytest.raises(ConfigError, match=r"loss\.kind: 'kl' is not one of"):
        tiny_cfg(tmp_path, "loss.kind=kl")
    with pytest.raises(ConfigError, match="feature_cache holds the target's logits"):
        tiny_cfg(tmp_path, "loss.kind=ce", "data.feature_cache=/x")
    with pytest.raises(ConfigError, match="on_policy needs a divergence"):
        tiny_cfg(tmp_path, "loss.kind=ce", "on_policy.fraction=0.5")
    with pytest.raises(ConfigError, match="bucket needs loss.temperature 1"):
        tiny_cfg(tmp_path, "loss.temperature=2.0", "data.feature_cache=/x")


def test_choices_are_members_and_saved_as_text(tmp_path):
    """A choice option holds its enum member (code dispatches on it) and is written back as its text."""
    from draftsmith.config import config_to_dict
    from draftsmith.train.distill import DistillLoss, StudentInit
    from draftsmith.train.losses import TopkTail

    cfg = tiny_cfg(tmp_path, "loss.kind=jsd")
    assert cfg.loss.kind is DistillLoss.JSD and cfg.loss.topk_tail is TopkTail.BUCKET
    assert isinstance(cfg.student.init, StudentInit)
    saved = config_to_dict(cfg)
    assert saved["loss"]["kind"] == "jsd" and type(saved["loss"]["kind"]) is str
    assert saved["loss"]["topk_tail"] == "bucket" and saved["student"]["init"] == str(cfg.student.init)


@pytest.mark.parametrize("kind", ["ce", "fkl", "rkl", "jsd", "tvd"])
def test_each_loss_trains(tmp_path, kind):
    summary = main(tiny_cfg(tmp_path, f"loss.kind={kind}", "train.max_steps=4", "eval.every_steps=0",
                            "train.checkpoint_every=100"))
    losses = [m["train/loss"] for m in train_metrics(tmp_path).values()]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    before, after = summary["eval_before"], summary["eval_after"]
    assert after[f"eval/{kind}"] < before[f"eval/{kind}"], (before, after)
    assert read_manifest(tmp_path / "final")["training"]["loss"]["kind"] == kind


def test_resume_equals_uninterrupted_run(tmp_path):
    """Interrupted at step 3 (on-policy batches + LoRA dropout use the RNG), resumed: same losses."""
    common = ["train.max_steps=6", "train.checkpoint_every=3", "eval.every_steps=0", "on_policy.fraction=0.5",
              "on_policy.max_new_tokens=8",
              "lora.enabled=true", "lora.dropout=0.1", "lora.target_modules=[q_proj, v_proj]", "optim.lr=0.05"]
    main(tiny_cfg(tmp_path / "full", *common))
    main(tiny_cfg(tmp_path / "cut", *common, "train.stop_after_steps=3"))
    assert not (tmp_path / "cut" / "final").exists()
    main(tiny_cfg(tmp_path / "cut", *common), resume="auto")
    full, cut = train_metrics(tmp_path / "full"), train_metrics(tmp_path / "cut")
    assert sorted(cut) == list(range(1, 7))
    assert {m["train/on_policy"] for m in full.values()} == {0, 1}  # both kinds of batch were exercised
    for step in range(1, 7):
        assert cut[step]["train/loss"] == pytest.approx(full[step]["train/loss"], rel=1e-5, abs=1e-7), step
        assert cut[step]["train/on_policy"] == full[step]["train/on_policy"]


def test_lora_export_is_merged_and_generates_like_the_target(tmp_path):
    from transformers import AutoModelForCausalLM

    main(tiny_cfg(tmp_path, "lora.enabled=true", "lora.r=4", "train.max_steps=3", "eval.every_steps=0",
                  "optim.lr=0.05"))
    final = tmp_path / "final"
    manifest = read_manifest(final)
    assert manifest["student"]["lora_merged"] and manifest["target"]["name"] == "tiny:llama"
    student = AutoModelForCausalLM.from_pretrained(final).eval()
    assert not any("lora" in name for name, _ in student.named_parameters())
    init = build_tiny_causal_lm("llama", seed=1)
    trained = dict(student.named_parameters())
    assert any(not torch.equal(p, trained[name]) for name, p in init.named_parameters())  # adapters merged in
    target = build_tiny_causal_lm("llama", seed=0)  # the tiny:llama target
    ids = torch.tensor([[5, 17, 3, 42, 8, 9]])
    plain = target.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assisted = target.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0, assistant_model=student)
    assert torch.equal(plain, assisted)


def test_a_run_continues_from_a_saved_adapter_where_its_data_stopped(tmp_path):
    """final/adapter is PEFT's format (merging it gives final/), and lora.adapter + adapter_samples_seen continue
    a LoRA run without its checkpoint: the continued run's first step sees the data, and the weights, of the
    uninterrupted run's third step."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    common = ["lora.enabled=true", "lora.r=4", "eval.every_steps=0", "optim.lr=0.05", "train.checkpoint_every=100"]
    main(tiny_cfg(tmp_path / "whole", *common, "train.max_steps=3"))
    main(tiny_cfg(tmp_path / "first", *common, "train.max_steps=2"))
    adapter = tmp_path / "first" / "final" / "adapter"
    assert read_adapter_sidecar(adapter) == {"format": "draftsmith.adapter/1", "base": "tiny:llama,seed=1",
                                             "pard_token": None}  # what scripts/export.py merges it into
    merged = PeftModel.from_pretrained(build_tiny_causal_lm("llama", seed=1), adapter).merge_and_unload()
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "first" / "final")
    for name, weight in exported.state_dict().items():
        assert torch.allclose(merged.state_dict()[name], weight, atol=1e-6), name
    seen = train_metrics(tmp_path / "first")[2]["train/samples_seen"]
    main(tiny_cfg(tmp_path / "next", *common, "train.max_steps=1", f"lora.adapter={adapter}",
                  f"lora.adapter_samples_seen={seen}"))
    whole, continued = train_metrics(tmp_path / "whole")[3], train_metrics(tmp_path / "next")[1]
    assert continued["train/loss"] == pytest.approx(whole["train/loss"], rel=1e-5)
    assert continued["train/tokens"] == whole["train/tokens"]


@pytest.mark.parametrize("overrides,words", [
    (["lora.adapter={missing}"], "no adapter_config.json there"),
    (["lora.adapter={adapter}", "lora.r=8"], "has r 4 (lora.r: 8)"),
    (["lora.adapter={adapter}", "lora.target_modules=[q_proj]"], "'v_proj'] (lora.target_modules: ['q_proj'])"),
])
def test_an_adapter_of_another_shape_is_refused_in_one_line(tmp_path, overrides, words):
    main(tiny_cfg(tmp_path / "first", "lora.enabled=true", "lora.r=4", "train.max_steps=1", "eval.every_steps=0"))
    paths = {"missing": tmp_path / "nowhere", "adapter": tmp_path / "first" / "final" / "adapter"}
    with pytest.raises(ConfigError) as err:
        main(tiny_cfg(tmp_path / "next", "lora.enabled=true", "lora.r=4", "train.max_steps=1",
                      *[o.format(**paths) for o in overrides]))
    assert words in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "next" / "final").exists()


def test_on_policy_mode(tmp_path):
    summary = main(tiny_cfg(tmp_path, "on_policy.fraction=1.0", "loss.kind=rkl", "train.max_steps=3",
                            "eval.every_steps=0", "train.checkpoint_every=100"))
    metrics = train_metrics(tmp_path)
    assert all(m["train/on_policy"] == 1 and m["train/tokens"] > 0 for m in metrics.values())
    assert summary["eval_after"]["eval/rkl"] < summary["eval_before"]["eval/rkl"]


def test_topk_feature_cache_mode(tmp_path):
    from types import SimpleNamespace

    from draftsmith.data.features import FeatureCacheConfig, build_feature_cache

    target = build_tiny_causal_lm("llama", seed=0)
    records = synthetic_records(target, 40, 24, seed=0, temperature=0.3)
    build_feature_cache(FeatureCacheConfig(target="tiny:llama", source=None, output_dir=str(tmp_path / "cache"),
                                           topk_logits=8, progress=False, rank=0, world_size=1),
                        target=SimpleNamespace(model=target, tokenizer=TinyTokenizer(96)), records=records)
    summary = main(tiny_cfg(tmp_path / "run", f"data.feature_cache={tmp_path / 'cache'}", "train.max_steps=4",
                            "eval.every_steps=0", "train.checkpoint_every=100"))
    assert summary["eval_after"]["eval/fkl"] < summary["eval_before"]["eval/fkl"]
    manifest = read_manifest(tmp_path / "run" / "final")
    assert manifest["training"]["data"]["feature_cache"] == str(tmp_path / "cache")
    assert manifest["training"]["data"]["train_records"] + manifest["training"]["data"]["heldout_records"] == 40
    for part, chunk in (("a", records[:25]), ("b", records[25:])):  # one cache per data source, joined by " + "
        build_feature_cache(FeatureCacheConfig(target="tiny:llama", source=None, output_dir=str(tmp_path / part),
                                               topk_logits=8, progress=False, rank=0, world_size=1),
                            target=SimpleNamespace(model=target, tokenizer=TinyTokenizer(96)), records=chunk)
    both = load_cache_records(f"{tmp_path / 'a'} + {tmp_path / 'b'}", None, None, 64)
    assert [r["input_ids"] for r in both] == [r["input_ids"] for r in load_cache_records(str(tmp_path / "cache"),
                                                                                          None, None, 64)]
    assert len(load_cache_records(f"{tmp_path / 'a'} + {tmp_path / 'b'}", None, 30, 64)) == 30


def test_layer_and_shallow_students(tmp_path):
    main(tiny_cfg(tmp_path / "layers", "student.init=layers", "student.layer_ids=[1]", "train.max_steps=2",
                  "eval.every_steps=0"))
    info = read_manifest(tmp_path / "layers" / "final")["student"]
    assert info["num_layers"] == 1 and info["layer_ids"] == [1]
    assert info["trainable_parameters"] < info["parameters"]  # embeddings + LM head frozen
    main(tiny_cfg(tmp_path / "shallow", "student.init=shallow", "student.num_layers=1",
                  "student.intermediate_size=16", "train.max_steps=2", "eval.every_steps=0"))
    info = read_manifest(tmp_path / "shallow" / "final")["student"]
    assert info["num_layers"] == 1


def test_lean_student_holds_only_its_layers_and_loads_as_the_whole_student(tmp_path):
    """export.lean writes the trained layers and final norm; the student rebuilt from the target at load equals
    the whole student written by save_pretrained (same run, same seed)."""
    common = ["student.init=layers", "student.layer_ids=[1]", "train.max_steps=2", "eval.every_steps=0"]
    main(tiny_cfg(tmp_path / "whole", *common))
    main(tiny_cfg(tmp_path / "lean", *common, "export.lean=true"))
    lean_files = {p.name for p in (tmp_path / "lean" / "final").iterdir()}
    assert "student_layers.safetensors" in lean_files and "model.safetensors" not in lean_files
    whole = AutoModelForCausalLM.from_pretrained(str(tmp_path / "whole" / "final")).eval()
    lean = TargetModel.from_pretrained(str(tmp_path / "lean" / "final"))
    ids = torch.tensor([[3, 5, 7, 11, 13]])
    with torch.no_grad():
        assert torch.equal(whole(ids).logits, lean.model(ids).logits)
    assert read_manifest(tmp_path / "lean" / "final")["student"]["layer_ids"] == [1]
    with pytest.raises(ConfigError, match="export.lean needs student.init=layers"):
        tiny_cfg(tmp_path / "bad", "export.lean=true")


def test_student_continues_a_finished_lean_student(tmp_path):
    """student.init_from: a run starts from a finished lean student's weights (e.g. continued on other data); another
    target's or another layer subset's student is refused in one line naming what differs."""
    common = ["student.init=layers", "student.layer_ids=[1]", "eval.every_steps=0", "export.lean=true"]
    main(tiny_cfg(tmp_path / "first", *common, "train.max_steps=2"))
    first = tmp_path / "first" / "final"
    cfg = tiny_cfg(tmp_path / "second", *common, "train.max_steps=1", f"student.init_from={first}")
    target = TargetModel.from_pretrained(cfg.target)
    student, info = build_student(cfg, target, target.tokenizer)
    ids = torch.tensor([[3, 5, 7, 11, 13]])
    with torch.no_grad():
        assert torch.equal(student(ids).logits, TargetModel.from_pretrained(str(first)).model(ids).logits)
    main(cfg)
    assert read_manifest(tmp_path / "second" / "final")["student"]["init_from"] == str(first)
    with pytest.raises(ConfigError, match=r"student.init_from=.*its student differs from this config's: "
                                          r"layer_ids=\[1\] \(this config: \[0\]\)"):
        main(tiny_cfg(tmp_path / "bad", *common, "student.layer_ids=[0]", f"student.init_from={first}"))
    with pytest.raises(ConfigError, match="student.init_from=.*not a lean student directory"):
        main(tiny_cfg(tmp_path / "bad2", *common, f"student.init_from={tmp_path}"))
    with pytest.raises(ConfigError, match="student.init_from.*read by student.init=layers"):
        tiny_cfg(tmp_path, f"student.init_from={first}")


def test_pruned_student_keeps_layers_of_the_pretrained_model(tmp_path):
    """student.init=pruned: a layer subset of student.model (a layer-pruned 0.5B), not of the target."""
    main(tiny_cfg(tmp_path / "pruned", "student.init=pruned", "student.layer_ids=[0]", "train.max_steps=2",
                  "eval.every_steps=0", "train.log_every=1"))
    seen = [train_metrics(tmp_path / "pruned")[step]["train/loss_tokens_seen"] for step in (1, 2)]
    assert 0 < seen[0] < seen[1]  # the data curve's x: loss-bearing tokens trained on
    info = read_manifest(tmp_path / "pruned" / "final")["student"]
    assert info["init"] == "pruned" and info["num_layers"] == 1 and info["layer_ids"] == [0]
    assert info["model"] == tiny_cfg(tmp_path).student.model
    assert info["trainable_parameters"] < info["parameters"]
    with pytest.raises(UserError, match=r"layer_ids must be a non-empty subset of 0\.\.1 .*got \[9\]"):
        main(tiny_cfg(tmp_path / "bad", "student.init=pruned", "student.layer_ids=[9]"))  # one line, no traceback
    with pytest.raises(ConfigError, match="student.layer_ids.*read by student.init=layers\\|pruned"):
        tiny_cfg(tmp_path, "student.init=pretrained", "student.layer_ids=[0]")


def test_filter_wrong_gsm8k_answers(tmp_path, smol_tokenizer):
    from draftsmith.data.sources import Conversation, save_conversations

    def conv(i, answer):
        return Conversation(id=f"g{i}", source="gsm8k", reference="42",
                            messages=[{"role": "user", "content": "What is 6 * 7?"},
                                      {"role": "assistant", "content": f"6 * 7 = {answer}. #### {answer}"}])

    path = save_conversations(tmp_path / "c.jsonl", [conv(0, 42), conv(1, 41), conv(2, 42)])
    stats = {}
    records = load_records(f"conversations:{path}", smol_tokenizer, 128, None, filter_wrong=True, stats=stats)
    assert len(records) == 2 and stats.pop("mix") and stats == {"kept": 2, "wrong_answer": 1}
    records = load_records(f"conversations:{path}", smol_tokenizer, 128, None, filter_wrong=False)
    assert len(records) == 3


def test_refuses_student_with_other_tokenizer(tmp_path, monkeypatch):
    import draftsmith.train.distill as distill

    def other_vocab(spec, dtype):
        return build_tiny_causal_lm("llama", seed=1, vocab_size=64), TinyTokenizer(64)

    monkeypatch.setattr(distill, "load_pretrained_student", other_vocab)
    with pytest.raises(ValueError, match="student's tokenizer differs"):
        main(tiny_cfg(tmp_path, "train.max_steps=1"))


@pytest.mark.slow
def test_smollm2_layer_student_exports_as_draft(tmp_path):
    """Real model: a SmolLM2 every-2-layers student, exported, loads as a bench --draft and decodes losslessly."""
    from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
    from draftsmith.eval.decode.drafters.lm import LMDrafter
    from draftsmith.models.target import TargetModel
    from draftsmith.models.registry import is_fetched

    if not is_fetched("smollm2-135m-instruct"):
        pytest.skip("smollm2-135m-instruct not converted")
    main(tiny_cfg(tmp_path, "target=smollm2-135m-instruct", "student.init=layers", "student.layer_stride=2",
                  "data.source=gsm8k:train", "data.limit=12", "data.max_length=96", "train.max_steps=2",
                  "train.batch_size=2", "eval.every_steps=0", "optim.lr=1e-4", "export.dtype=float32"))
    target = TargetModel.from_pretrained("smollm2-135m-instruct")
    draft = TargetModel.from_pretrained(str(tmp_path / "final"))  # what eval.bench --draft <dir> does
    assert read_manifest(tmp_path / "final")["target"]["vocab_fingerprint"]
    ids = target.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colors."}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    plain = target.model.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1]:].tolist()
    drafter = LMDrafter(draft.model, draft.tokenizer, mode="chain", budget=3)
    result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=24, temperature=0.0)).generate(ids)
    assert result.tokens[:len(plain)] == plain[:len(result.tokens)]
    assisted = target.model.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft.model)
    assert assisted[0, ids.shape[1]:].tolist() == plain
    from draftsmith.eval.bench.run import BenchConfig, run_benchmark  # a second draft named in the method spec

    spec = f"lm-chain:model={tmp_path / 'final'}"
    report = run_benchmark(BenchConfig(target="smollm2-135m-instruct", methods=[parse_method("plain"), parse_method(spec)],
                                       num_prompts=1, max_new_tokens=8, backend="eager"), target=target,
                           progress=False)
    entry = report["summary"][spec]
    assert entry["mismatches"] == [] and entry["tau"] >= 1.0


def test_parallel_student_trains_and_drafts_losslessly(tmp_path):
    """PARD (parallel.copies=3): every mask copy is trained, the mask token is saved as config.pard_token, and the
    exported student drafts 3 tokens per forward in the decoder with the target's exact greedy output."""
    from transformers import AutoModelForCausalLM

    from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
    from draftsmith.eval.decode.drafters.lm import LMDrafter
    from draftsmith.models.target import TargetModel

    summary = main(tiny_cfg(tmp_path, "parallel.copies=3", "parallel.mask_token=95", "train.max_steps=6",
                            "eval.every_steps=0", "train.checkpoint_every=100"))
    metrics = train_metrics(tmp_path)
    main(tiny_cfg(tmp_path / "single", "train.max_steps=1", "eval.every_steps=0"))
    assert metrics[1]["train/tokens"] > train_metrics(tmp_path / "single")[1]["train/tokens"]  # the mask copies
    assert summary["eval_after"]["eval/fkl"] < summary["eval_before"]["eval/fkl"]
    assert {f"eval/agreement_copy{copy}" for copy in range(3)} <= summary["eval_after"].keys()
    student = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert student.config.pard_token == 95
    target = build_tiny_causal_lm("llama", seed=0)
    prompt = torch.tensor([[5, 9, 14, 5, 9, 14, 30]])
    result = SpeculativeDecoder(TargetModel(target, None), LMDrafter(student, mode="parallel", budget=3),
                                DecodeConfig(max_new_tokens=12)).generate(prompt)
    reference = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False)
    assert result.tokens == reference[0, prompt.shape[1]:].tolist()


def test_parallel_mask_token_must_be_a_free_row(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer uses every row"):
        main(tiny_cfg(tmp_path, "parallel.copies=2", "train.max_steps=1"))
    with pytest.raises(ConfigError, match=r"parallel\.mask_token.*read when parallel\.copies > 1"):
        tiny_cfg(tmp_path, "parallel.mask_token=3")


def test_an_adapter_for_another_model_is_refused_in_one_line():
    """The committed PARD adapter (for the 0.5B) on a tiny student: the first size mismatch, in one line."""
    from draftsmith.train.student_parts import load_adapter

    cfg = load_config(DistillRecipeConfig, REPO / "train" / "configs" / "pard_qwen_cpu.yaml",
                      [f"lora.adapter={REPO / 'drafters' / 'pard_qwen_cpu'}", "lora.adapter_samples_seen=240"])
    with pytest.raises(ConfigError) as err:
        load_adapter(cfg.lora, build_tiny_causal_lm("llama", seed=1))
    assert "does not fit student.model: size mismatch for" in str(err.value) and "\n" not in str(err.value)
