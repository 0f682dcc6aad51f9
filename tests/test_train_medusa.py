"""Medusa recipe and train/common helpers on a tiny in-process target (seconds on a 2-core CPU)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.models.target import TargetModel
from draftsmith.train.checkpoints import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from draftsmith.config import ConfigError, load_config
from draftsmith.train.run_guards import MetricsFile
from draftsmith.models.tiny import TinyTokenizer, build_tiny_causal_lm
from draftsmith.data.records import batch_indices, load_records, read_records, split_heldout, write_records
from draftsmith.train.rng import rng_state, set_rng_state
from draftsmith.eval.decode.drafters.medusa import load_medusa_drafter
from draftsmith.train.medusa import MedusaRecipeConfig, cli, main

REPO = Path(__file__).resolve().parents[1]
TINY_YAML = REPO / "train" / "configs" / "medusa_tiny.yaml"


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_cfg(output_dir, *overrides) -> MedusaRecipeConfig:
    return load_config(MedusaRecipeConfig, TINY_YAML, [f"output_dir={output_dir}", *overrides])


def train_losses(output_dir) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in MetricsFile.read(Path(output_dir) / "metrics.jsonl")
            if "train/loss" in r}


# ---------------------------------------------------------------------------------------------
# config loading
# ---------------------------------------------------------------------------------------------


@dataclass
class _Inner:
    rate: float = 0.1
    names: list[str] = field(default_factory=list)
    depth: int | None = None


@dataclass
class _Outer:
    inner: _Inner = field(default_factory=_Inner)
    flag: bool = False


def test_config_rejects_unknown_keys_with_path(tmp_path):
    with pytest.raises(ConfigError, match=r"'train\.max_stepz'.*did you mean 'train\.max_steps'"):
        tiny_cfg(tmp_path, "train.max_stepz=3")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  sourse: gsm8k\n")
    with pytest.raises(ConfigError, match=r"'data\.sourse'"):
        load_config(MedusaRecipeConfig, bad)
    with pytest.raises(ConfigError, match=r"unknown config key 'inner\.nested\.x'|'inner\.nested'"):
        load_config(_Outer, None, ["inner.nested.x=1"])


def test_config_types_and_overrides(tmp_path):
    cfg = load_config(_Outer, None, ["inner.rate=1e-3", "inner.names=[a, b]", "flag=true", "inner.depth=null"])
    assert cfg.inner.rate == 1e-3 and cfg.inner.names == ["a", "b"] and cfg.flag is True and cfg.inner.depth is None
    with pytest.raises(ConfigError, match=r"inner\.depth: expected an integer"):
        load_config(_Outer, None, ["inner.depth=2.5"])
    with pytest.raises(ConfigError, match=r"inner\.names\[1\]: expected a string"):
        load_config(_Outer, None, ["inner.names=[a, 3]"])
    with pytest.raises(ConfigError, match=r"flag: expected true/false"):
        load_config(_Outer, None, ["flag=1"])
    with pytest.raises(ConfigError, match="heads.num_heads"):
        tiny_cfg(tmp_path, "loss.head_weights=[1.0]")
    with pytest.raises(ConfigError, match="logging.tracker.*not one of"):
        tiny_cfg(tmp_path, "logging.tracker=tensorboard")
    with pytest.raises(FileNotFoundError):
        load_config(_Outer, tmp_path / "missing.yaml")


@pytest.mark.parametrize("name", ["medusa_tiny.yaml", "medusa_smollm2.yaml"])
def test_shipped_configs_load_and_name_their_launch_command(name):
    path = REPO / "train" / "configs" / name
    first = path.read_text().splitlines()[0]
    assert first.startswith("# ") and f"train/medusa.py --config train/configs/{name}" in first
    load_config(MedusaRecipeConfig, path)


# ---------------------------------------------------------------------------------------------
# checkpoints, RNG, data order
# ---------------------------------------------------------------------------------------------


def test_checkpoint_roundtrip_atomic_and_keep_last(tmp_path):
    opt_like = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}},
                "param_groups": [{"params": [0], "betas": (0.9, 0.99), "lr": 0.1, "fused": None}]}
    state = {"optimizer": opt_like, "arr": np.arange(4, dtype=np.uint32), "nested": [{"x": torch.ones(2)}],
             "dotted.key": torch.zeros(1), "dotted": {"key": torch.ones(1)}}
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, state, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_4", "step_6"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    back = load_checkpoint(latest_checkpoint(tmp_path))
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert torch.equal(back["optimizer"]["state"][0]["exp_avg"], opt_like["state"][0]["exp_avg"])
    assert list(back["optimizer"]["state"]) == [0]
    assert back["arr"].dtype == np.uint32 and back["arr"].tolist() == [0, 1, 2, 3]
    assert torch.equal(back["dotted.key"], torch.zeros(1)) and torch.equal(back["dotted"]["key"], torch.ones(1))


def test_checkpoint_errors_name_the_file(tmp_path):
    path = save_checkpoint(tmp_path, 1, {"w": torch.randn(64, 64)})
    tensors = path / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="tensors.safetensors is corrupt"):
        load_checkpoint(path)
    (path / "state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="state.json is corrupt"):
        load_checkpoint(path)
    (path / "state.json").unlink()
    with pytest.raises(CheckpointError, match="state.json is missing"):
        load_checkpoint(path)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "step_99")


def test_rng_state_roundtrip_through_checkpoint(tmp_path):
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    save_checkpoint(tmp_path, 1, {"rng": rng_state()})
    draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    set_rng_state(load_checkpoint(tmp_path / "step_1")["rng"])
    assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == draws


def test_batch_order_is_a_function_of_samples_seen():
    stream = batch_indices(10, 0, 35, seed=3)
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:20]) == list(range(10))
    assert stream[10:20] != stream[:10]  # each epoch reshuffles
    assert batch_indices(10, 13, 9, seed=3) == stream[13:22]
    assert batch_indices(10, 0, 10, seed=4) != stream[:10]
    lengths = [(7 * i) % 11 for i in range(10)]
    grouped = batch_indices(10, 0, 20, seed=3, lengths=lengths, window=4)
    for start, stop in [(0, 4), (4, 8), (8, 10), (10, 14)]:  # each window: the same records, longest first
        assert sorted(grouped[start:stop]) == sorted(stream[start:stop])
        assert [lengths[i] for i in grouped[start:stop]] == sorted((lengths[i] for i in stream[start:stop]), reverse=True)
    assert batch_indices(10, 6, 9, seed=3, lengths=lengths, window=4) == grouped[6:15]
    records = [{"input_ids": [i], "loss_mask": [1]} for i in range(20)]
    train, held = split_heldout(records, 0.1, seed=0)
    assert len(held) == 2 and len(train) == 18 and split_heldout(records, 0.1, seed=0) == (train, held)


def test_tiny_target_is_deterministic():
    a, b = build_tiny_causal_lm("qwen2"), build_tiny_causal_lm("qwen2")
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    target = TargetModel.from_pretrained("tiny:llama")
    assert target.config.hidden_size == 48 and len(target.tokenizer.get_vocab()) == 96
    with pytest.raises(ValueError, match="unknown tiny model family"):
        TargetModel.from_pretrained("tiny:gpt9")


# ---------------------------------------------------------------------------------------------
# the recipe
# ---------------------------------------------------------------------------------------------


def test_resume_continues_exactly(tmp_path):
    """Interrupted right after the step-4 checkpoint and resumed == uninterrupted (8 steps), with
    gradient accumulation and self-distillation on."""
    extra = ["train.grad_accum_steps=2", "train.batch_size=2", "loss.distill_weight=0.5", "train.checkpoint_every=2"]
    main(tiny_cfg(tmp_path / "full", *extra))
    main(tiny_cfg(tmp_path / "cut", *extra, "train.stop_after_steps=4"))
    assert max(train_losses(tmp_path / "cut")) == 4
    assert not (tmp_path / "cut" / "final").exists()
    with pytest.raises(RuntimeError, match="already holds checkpoints"):
        main(tiny_cfg(tmp_path / "cut", *extra))
    main(tiny_cfg(tmp_path / "cut", *extra), resume="auto")
    full, cut = train_losses(tmp_path / "full"), train_losses(tmp_path / "cut")
    assert sorted(full) == sorted(cut) == list(range(1, 9))
    for step in range(5, 9):
        assert cut[step] == pytest.approx(full[step], abs=1e-6)
    from safetensors.torch import load_file

    a = load_file(str(tmp_path / "full" / "final" / "medusa_heads.safetensors"))
    b = load_file(str(tmp_path / "cut" / "final" / "medusa_heads.safetensors"))
    assert all(torch.allclose(a[name], b[name], atol=1e-6) for name in a)
    assert [p.name for p in list_checkpoints(tmp_path / "cut" / "checkpoints")] == ["step_6", "step_8"]


def test_skip_samples_starts_the_data_stream_further_in(tmp_path, monkeypatch):
    """data.skip_samples: a continuation (init_from) trains on the records after those its snapshot saw."""
    import draftsmith.train.runtime as runtime

    positions = []

    def recording(num_records, samples_seen, count, *args, **kwargs):
        positions.append(samples_seen)
        return batch_indices(num_records, samples_seen, count, *args, **kwargs)

    monkeypatch.setattr(runtime, "batch_indices", recording)
    main(tiny_cfg(tmp_path / "run", "train.max_steps=3", "train.batch_size=2", "data.skip_samples=6"))
    assert positions == [6, 8, 10]


def test_frozen_lm_heads_train_resblocks_only_and_resume(tmp_path):
    """heads.train_lm_head=false: the LM heads stay the target's, ResBlocks learn, resume is exact."""
    extra = ["heads.train_lm_head=false", "train.max_steps=4", "train.checkpoint_every=2", "optim.lr=0.05"]
    main(tiny_cfg(tmp_path / "full", *extra))
    main(tiny_cfg(tmp_path / "cut", *extra, "train.stop_after_steps=2"))
    main(tiny_cfg(tmp_path / "cut", *extra), resume="auto")
    from safetensors.torch import load_file

    full = load_file(str(tmp_path / "full" / "final" / "medusa_heads.safetensors"))
    cut = load_file(str(tmp_path / "cut" / "final" / "medusa_heads.safetensors"))
    lm_head = TargetModel.from_pretrained("tiny:llama").model.get_output_embeddings().weight
    for name, tensor in full.items():
        assert torch.allclose(tensor, cut[name], atol=1e-6), name
        if name.endswith(".1.weight"):  # medusa_head.{k}.{num_layers=1}.weight: the LM head
            assert torch.equal(tensor, lm_head.float())
        elif name.endswith("linear.weight"):
            assert tensor.abs().sum() > 0  # zero-initialised, so it moved
    saved = load_checkpoint(latest_checkpoint(tmp_path / "cut" / "checkpoints"))
    assert sorted(saved["trainable"]) == sorted(f"heads.medusa_head.{k}.0.linear.{w}"
                                                for k in range(3) for w in ("weight", "bias"))


def test_grad_accumulation_matches_large_batch(tmp_path):
    main(tiny_cfg(tmp_path / "big", "train.max_steps=3", "train.batch_size=4"))
    main(tiny_cfg(tmp_path / "acc", "train.max_steps=3", "train.batch_size=2", "train.grad_accum_steps=2"))
    big, acc = train_losses(tmp_path / "big"), train_losses(tmp_path / "acc")
    for step in (1, 2, 3):
        assert acc[step] == pytest.approx(big[step], rel=1e-5)


def test_medusa1_outputs_and_drafter(tmp_path):
    summary = main(tiny_cfg(tmp_path, "data.source=synthetic:96:0.3", "train.max_steps=12"))
    final = tmp_path / "final"
    assert {p.name for p in final.iterdir()} >= {"medusa_heads.safetensors", "config.json", "manifest.json",
                                                "head_accuracy.json", "train_config.yaml"}
    manifest = json.loads((final / "manifest.json").read_text())
    target = TargetModel.from_pretrained("tiny:llama")
    from draftsmith.models.target import vocab_fingerprint

    assert manifest["method"] == "medusa-1" and manifest["target_adapter"] is None
    assert manifest["target"]["hidden_size"] == 48 and manifest["target"]["hidden_layer"] == -1
    assert manifest["target"]["vocab_fingerprint"] == vocab_fingerprint(target.tokenizer)
    assert summary["lm_loss_before"] == summary["lm_loss_after"]  # Medusa-1 never touches the target
    evals = [r for r in MetricsFile.read(tmp_path / "metrics.jsonl") if "eval/loss" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 12
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    for key in ("eval/head1_top1", "eval/head3_top3"):
        assert 0.0 <= evals[-1][key] <= 1.0
    accuracy = json.loads((final / "head_accuracy.json").read_text())
    assert len(accuracy["rank_accuracy"]) == 3 and len(accuracy["rank_accuracy"][0]) == 5

    # The loaded drafter decodes exactly like plain greedy decoding.
    drafter = load_medusa_drafter(final, target, budget=6)
    assert drafter.parents.numel() == 6
    prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    config = DecodeConfig(max_new_tokens=16, stop_on_eos=False)
    plain = SpeculativeDecoder(target, None, config).generate(prompt).tokens
    assert SpeculativeDecoder(target, drafter, config).generate(prompt).tokens == plain


def test_drafter_refuses_another_target(tmp_path):
    main(tiny_cfg(tmp_path, "train.max_steps=1", "eval.every_steps=0"))
    wider = TargetModel(build_tiny_causal_lm("llama", hidden_size=64), TinyTokenizer(96), name="wider")
    with pytest.raises(ValueError, match=r"hidden_size: 48 in the manifest vs 64"):
        load_medusa_drafter(tmp_path / "final", wider)

    class Shuffled(TinyTokenizer):
        def get_vocab(self):
            return {f"<{(i + 1) % 96}>": i for i in range(96)}

    other_vocab = TargetModel(build_tiny_causal_lm("llama"), Shuffled(96), name="other-vocab")
    with pytest.raises(ValueError, match="vocab_fingerprint") as err:
        load_medusa_drafter(tmp_path / "final", other_vocab)
    assert "hidden_size" not in str(err.value)


def test_medusa2_smoke(tmp_path):
    summary = main(tiny_cfg(tmp_path, "medusa2.enabled=true", "medusa2.lora_lr=1e-2", "medusa2.heads_only_steps=2",
                            "train.max_steps=6"))
    manifest = json.loads((tmp_path / "final" / "manifest.json").read_text())
    assert manifest["method"] == "medusa-2" and manifest["target_adapter"] == "target_lora"
    assert (tmp_path / "final" / "target_lora" / "adapter_model.safetensors").is_file()
    before, after = manifest["eval"]["lm_loss_before"], manifest["eval"]["lm_loss_after"]
    assert before == summary["lm_loss_before"] and after == summary["lm_loss_after"] and after != before
    logged = [r for r in MetricsFile.read(tmp_path / "metrics.jsonl") if "train/loss" in r]
    assert logged[0]["train/lora_lr"] == 0.0 and logged[-1]["train/lora_lr"] > 0  # heads-only warm-up
    assert all("train/lm_loss" in r for r in logged)

    target = TargetModel.from_pretrained("tiny:llama")
    with pytest.raises(ValueError, match="target_adapter='merge'"):
        load_medusa_drafter(tmp_path / "final", target)
    drafter = load_medusa_drafter(tmp_path / "final", target, target_adapter="merge")
    assert drafter.heads.config.num_heads == 3
    prompt = torch.arange(5)[None]
    config = DecodeConfig(max_new_tokens=10, stop_on_eos=False)
    assert (SpeculativeDecoder(target, drafter, config).generate(prompt).tokens
            == SpeculativeDecoder(target, None, config).generate(prompt).tokens)


def test_records_source_and_wandb_offline(tmp_path, monkeypatch):
    """A JSONL of pre-tokenised records trains without any tokenizer; W&B writes an offline run."""
    gen = torch.Generator().manual_seed(0)
    records = [{"input_ids": torch.randint(0, 96, (20,), generator=gen).tolist(), "loss_mask": [0] * 5 + [1] * 15}
               for _ in range(16)]
    path = tmp_path / "records.jsonl"
    write_records(path, records)
    assert read_records(path) == records
    mixed = load_records(f"records:{path} + records:{path}", limit=3)  # a mixture concatenates its parts
    assert mixed == records[:3] + records[:3]
    monkeypatch.setenv("WANDB_MODE", "offline")
    main(tiny_cfg(tmp_path / "run", f"data.source=records:{path}", "train.max_steps=2", "eval.every_steps=0",
                  "logging.tracker=wandb"))
    assert (tmp_path / "run" / "final" / "manifest.json").is_file()
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))


def test_cli_rejects_unknown_key(tmp_path):
    with pytest.raises(ConfigError, match="train.max_stepz"):
        cli(["--config", str(TINY_YAML), f"output_dir={tmp_path}", "train.max_stepz=1", "--debug"])


def test_script_runs_as_plain_python(tmp_path):
    """`python train/medusa.py ...` works as a script (train/ is sys.path[0]) and prints its summary."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [sys.executable, "train/medusa.py", "--config", str(TINY_YAML), f"output_dir={tmp_path}",
           "train.max_steps=2", "train.checkpoint_every=1", "eval.every_steps=0"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["step"] == 2
    assert (tmp_path / "final" / "medusa_heads.safetensors").is_file()


@pytest.mark.slow
def test_accelerate_launch(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = ["accelerate", "launch", "--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "train/medusa.py", "--config", str(TINY_YAML), f"output_dir={tmp_path}",
           "train.max_steps=2"]
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "final" / "manifest.json").is_file()


def test_accelerate_launch_on_one_thread_says_how_to_use_the_cores(tmp_path, monkeypatch, caplog):
    """accelerate's launcher starts a CPU process on one thread: the run says so once, with the flag that fixes it."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with caplog.at_level("WARNING", logger="draftsmith"):
        main(tiny_cfg(tmp_path, "train.max_steps=1", "eval.every_steps=0"))
    said = [r.getMessage() for r in caplog.records if "num_cpu_threads_per_process" in r.getMessage()]
    assert said == ["each of the 1 process(es) computes on 1 thread of 2 cores (accelerate launch sets "
                    "OMP_NUM_THREADS=1): pass --cpu or --num_cpu_threads_per_process 2 to use them"]


def test_heads_start_from_a_finished_run(tmp_path):
    """heads.init_from: a run starts from another's final heads (its first held-out loss is the other's last); heads
    of another layout or a directory that is not a final/ are refused in one line."""
    main(tiny_cfg(tmp_path / "first", "train.max_steps=3", "optim.lr=0.05"))
    main(tiny_cfg(tmp_path / "second", "train.max_steps=1", f"heads.init_from={tmp_path / 'first' / 'final'}"))
    first = [r for r in MetricsFile.read(tmp_path / "first" / "metrics.jsonl") if "eval/loss" in r]
    second = [r for r in MetricsFile.read(tmp_path / "second" / "metrics.jsonl") if "eval/loss" in r]
    assert second[0]["step"] == 0 and second[0]["eval/loss"] == pytest.approx(first[-1]["eval/loss"], rel=1e-6)
    assert first[0]["eval/loss"] != pytest.approx(first[-1]["eval/loss"], rel=1e-3)
    differ = r"heads\.init_from=.*its heads differ from this config's: num_heads=3 \(this config: 2\)"
    with pytest.raises(ConfigError, match=differ):
        main(tiny_cfg(tmp_path / "third", "heads.num_heads=2", f"heads.init_from={tmp_path / 'first' / 'final'}"))
    with pytest.raises(ConfigError, match=r"heads\.init_from=.*not a train/medusa\.py final/ directory"):
        tiny_cfg(tmp_path / "fourth", f"heads.init_from={tmp_path}")


def test_medusa2_names_bad_lora_modules(tmp_path):
    with pytest.raises(ConfigError, match=r"medusa2\.lora_target_modules \['nope'\]"):
        main(tiny_cfg(tmp_path, "medusa2.enabled=true", "medusa2.lora_target_modules=[nope]"))


@pytest.mark.parametrize("head", ["own", "slice"])
def test_vocab_heads_train_resume_and_decode_losslessly(tmp_path, head):
    """heads.draft_vocab: the heads score 48 of the 96 tiny tokens; distillation on the draft vocabulary;
    exact resume; the saved heads decode losslessly through load_medusa_drafter."""
    from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
    from draftsmith.eval.decode.drafters.medusa import load_medusa_drafter
    from draftsmith.models.vocab import DraftVocab

    vocab_dir = tmp_path / "vocab"
    vocab_dir.mkdir()
    DraftVocab.from_ids(range(1, 96, 2), 96).save(vocab_dir)
    extra = [f"heads.draft_vocab={vocab_dir}", f"heads.head={head}", "train.max_steps=4", "train.checkpoint_every=2",
             "loss.distill_weight=0.5"]
    main(tiny_cfg(tmp_path / "full", *extra))
    main(tiny_cfg(tmp_path / "cut", *extra, "train.stop_after_steps=2"))
    main(tiny_cfg(tmp_path / "cut", *extra), resume="auto")
    full, cut = train_losses(tmp_path / "full"), train_losses(tmp_path / "cut")
    assert all(cut[s] == pytest.approx(full[s], abs=1e-6) for s in full)
    manifest = json.loads((tmp_path / "full" / "final" / "manifest.json").read_text())
    assert manifest["draft_vocab"]["size"] == 48 and manifest["heads"]["head"] == head
    target = TargetModel.from_pretrained("tiny:llama")
    drafter = load_medusa_drafter(tmp_path / "full" / "final", target)
    prompt = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(4))
    result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=16)).generate(prompt)
    reference = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                                      do_sample=False)[0, 8:].tolist()
    assert result.tokens == reference



def test_the_default_tree_is_the_declared_budget():
    from draftsmith.models.medusa import arca_paths
    from draftsmith.models.trees import MEDUSA_BUDGET

    accuracy = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.1]]
    assert len(arca_paths(accuracy, MEDUSA_BUDGET)) == MEDUSA_BUDGET == 3
