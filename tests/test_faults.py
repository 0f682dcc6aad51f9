"""Faults and bad input: kill -9 and rerun (real subprocesses), corrupt checkpoints, NaN losses,
drafters for the wrong target, no pickle anywhere."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import draftsmith.train.medusa as medusa_recipe
from draftsmith.data.features import FeatureCacheConfig, build_feature_cache, load_index
from draftsmith.data.regenerate import RegenerateConfig, regenerate
from draftsmith.data.sources import Conversation, save_conversations
from draftsmith.train.checkpoints import CheckpointError, latest_checkpoint, list_checkpoints, load_checkpoint, load_latest_checkpoint, recover_checkpoints, save_checkpoint
from draftsmith.train.run_guards import MetricsFile, NonFiniteLossError, check_finite
from draftsmith.config import load_config
from draftsmith.train.medusa import MedusaRecipeConfig, main

from launch_utils import REPO, TINY_YAML, kill_when, ledger_shards, run, save_tiny_model_dir


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_cfg(output_dir, *overrides) -> MedusaRecipeConfig:
    return load_config(MedusaRecipeConfig, TINY_YAML, [f"output_dir={output_dir}", *overrides])


def last_losses(output_dir: Path) -> dict[int, float]:
    """Step -> training loss; a step logged twice (before a kill and after the resume) keeps the last."""
    return {r["step"]: r["train/loss"] for r in MetricsFile.read(output_dir / "metrics.jsonl") if "train/loss" in r}


def assert_same_heads(a: Path, b: Path, atol: float = 1e-6) -> None:
    ha, hb = load_file(str(a / "final" / "medusa_heads.safetensors")), load_file(str(b / "final" / "medusa_heads.safetensors"))
    assert ha.keys() == hb.keys()
    for name in ha:
        assert torch.allclose(ha[name], hb[name], atol=atol), name


# ---------------------------------------------------------------------------------------------
# kill -9, then rerun the same command
# ---------------------------------------------------------------------------------------------


def test_kill9_training_then_rerun_continues_from_last_checkpoint(tmp_path):
    every = 5
    overrides = ["train.max_steps=120", f"train.checkpoint_every={every}", "eval.every_steps=0", "train.batch_size=2"]
    out = tmp_path / "killed"
    cmd = [sys.executable, "train/medusa.py", "--config", str(TINY_YAML), "--resume", f"output_dir={out}", *overrides]
    kill_when(cmd, lambda: (out / "checkpoints" / f"step_{2 * every}").is_dir(), tmp_path / "killed.log")
    assert not (out / "final").exists()
    reached = max(last_losses(out))  # the last step logged before the kill
    done = run(cmd)  # the very same command
    resumed = re.search(r"resumed from \S+ at step (\d+)", done.stderr)
    assert resumed, done.stderr[-2000:]
    assert 0 <= reached - int(resumed.group(1)) <= every  # at most one checkpoint interval is redone
    assert not list((out / "checkpoints").glob(".tmp_*"))
    main(tiny_cfg(tmp_path / "straight", *overrides))
    full, cut = last_losses(tmp_path / "straight"), last_losses(out)
    assert sorted(full) == sorted(cut) == list(range(1, 121))
    rows = [(row["step"], tuple(sorted(row))) for row in MetricsFile.read(out / "metrics.jsonl")]
    assert len(rows) == len(set(rows))  # the redone steps are not logged twice
    for step in full:
        assert cut[step] == pytest.approx(full[step], abs=1e-6), step
    assert_same_heads(out, tmp_path / "straight")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smol_tokenizer):
    return save_tiny_model_dir(smol_tokenizer, tmp_path_factory.mktemp("tiny-model"))


def conversations(n: int) -> list[Conversation]:
    return [Conversation(id=f"c{i}", source="test", messages=[
        {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
        {"role": "assistant", "content": f"It is {2 * i}. " * (1 + i % 3)}]) for i in range(n)]


def shard_files(d: Path, pattern: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.glob(pattern))}


@pytest.mark.slow  # ~25 s (2 start-ups); the in-process crash/resume tests of data/ run by default
def test_kill9_regeneration_then_rerun_loses_at_most_one_shard(tmp_path, model_dir):
    source = save_conversations(tmp_path / "convs.jsonl", conversations(40))
    out = tmp_path / "killed"
    args = dict(max_new_tokens=6, shard_size=1, batch_size=1, threads=1)
    cmd = [sys.executable, "-m", "draftsmith.data.regenerate", f"target={model_dir}", f"source=conversations:{source}",
           f"output_dir={out}", "--no-progress", *[f"{k}={v}" for k, v in args.items()]]
    kill_when(cmd, lambda: ledger_shards(out) >= 3, tmp_path / "killed.log")
    recorded = ledger_shards(out)
    assert 3 <= recorded < 40
    done = run(cmd)
    skipped = int(re.search(r"skipped (\d+) complete shard", done.stdout).group(1))
    assert skipped >= recorded  # everything the ledger recorded before the kill is kept
    reference = tmp_path / "straight"
    regenerate(RegenerateConfig(target=str(model_dir), source=f"conversations:{source}", output_dir=str(reference),
                                progress=False, rank=0, world_size=1, **args))
    assert shard_files(out, "shard_*.jsonl") == shard_files(reference, "shard_*.jsonl")
    assert not list(out.glob("*.tmp"))


@pytest.mark.slow  # ~25 s (2 start-ups); the in-process crash/resume tests of data/ run by default
def test_kill9_feature_caching_then_rerun_loses_at_most_one_shard(tmp_path, model_dir):
    source = save_conversations(tmp_path / "convs.jsonl", conversations(60))
    out = tmp_path / "killed"
    args = dict(shard_tokens=40, batch_size=1, threads=1)
    cmd = [sys.executable, "-m", "draftsmith.data.features", f"target={model_dir}", f"source=conversations:{source}",
           f"output_dir={out}", "hidden_layers=[-1, 0]", "topk_logits=4", "--no-progress",
           *[f"{k}={v}" for k, v in args.items()]]
    kill_when(cmd, lambda: ledger_shards(out) >= 2, tmp_path / "killed.log")
    recorded = ledger_shards(out)
    done = run(cmd)
    assert "bytes/token" in done.stdout  # the disk estimate is printed before caching
    skipped = int(re.search(r"skipped (\d+) complete shard", done.stdout).group(1))
    assert 2 <= recorded <= skipped
    reference = tmp_path / "straight"
    build_feature_cache(FeatureCacheConfig(target=str(model_dir), source=f"conversations:{source}",
                                           output_dir=str(reference), hidden_layers=(-1, 0), topk_logits=4,
                                           progress=False, rank=0, world_size=1, **args))
    resumed, straight = shard_files(out, "shard_*.safetensors"), shard_files(reference, "shard_*.safetensors")
    assert resumed.keys() == straight.keys() and len(resumed) > skipped
    for name in straight:
        a, b = load_file(str(out / name)), load_file(str(reference / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert load_index(out)["complete"]


# ---------------------------------------------------------------------------------------------
# corrupt checkpoints
# ---------------------------------------------------------------------------------------------


def test_truncated_newest_checkpoint_resume_falls_back_with_a_warning(tmp_path, capsys):
    """Policy: `--resume` warns (naming the file), sets the bad step aside as step_<N>.corrupt and
    continues from the previous checkpoint; `--resume-from <bad>` is an error naming the file."""
    overrides = ["train.checkpoint_every=2", "train.keep_checkpoints=3"]
    main(tiny_cfg(tmp_path / "straight", *overrides))
    out = tmp_path / "cut"
    main(tiny_cfg(out, *overrides, "train.stop_after_steps=6"))
    newest = out / "checkpoints" / "step_6"
    tensors = newest / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[: tensors.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"step_6: tensors.safetensors is corrupt or truncated"):
        main(tiny_cfg(out, *overrides), resume=str(newest))
    capsys.readouterr()
    main(tiny_cfg(out, *overrides), resume="auto")
    err = capsys.readouterr().err
    assert re.search(r"warning: checkpoint \S+step_6: tensors.safetensors is corrupt or truncated .*falling back", err)
    assert (out / "checkpoints" / "step_6.corrupt").is_dir()
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_4", "step_6", "step_8"]
    full, cut = last_losses(tmp_path / "straight"), last_losses(out)
    for step in range(5, 9):
        assert cut[step] == pytest.approx(full[step], abs=1e-6)
    assert_same_heads(out, tmp_path / "straight")


def test_no_loadable_checkpoint_is_an_error_naming_each_file(tmp_path):
    for step in (1, 2):
        path = save_checkpoint(tmp_path, step, {"w": torch.ones(3)})
        (path / "state.json").write_text("{broken")
    with pytest.raises(CheckpointError, match=r"no usable checkpoint .*step_2: state.json is corrupt.*step_1: state"):
        load_latest_checkpoint(tmp_path, quarantine=False)
    assert load_latest_checkpoint(tmp_path / "empty") is None


def test_recover_after_a_kill_inside_save_checkpoint(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    save_checkpoint(tmp_path, 2, {"w": torch.ones(2)})
    # killed while writing step 4, and while swapping a re-saved step 2 (old copy moved out, new not in)
    (tmp_path / f".tmp_step_4_{dead.pid}").mkdir()
    (tmp_path / "step_2").rename(tmp_path / f".old_step_2_{dead.pid}")
    assert latest_checkpoint(tmp_path) is None
    recover_checkpoints(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]
    assert torch.equal(load_checkpoint(tmp_path / "step_2")["w"], torch.ones(2))


# ---------------------------------------------------------------------------------------------
# NaN / inf
# ---------------------------------------------------------------------------------------------


def test_check_finite():
    check_finite(torch.tensor([1.0, 2.0]), step=1)
    check_finite(3.5, step=1)
    with pytest.raises(NonFiniteLossError, match="loss is NaN at step 7: stopping the run; no checkpoint"):
        check_finite(torch.tensor(float("nan")), step=7)
    with pytest.raises(NonFiniteLossError, match="gradient norm is inf at step 2"):
        check_finite(float("inf"), step=2, what="gradient norm")


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    real, calls = medusa_recipe.medusa_loss, {"train": 0}

    def poisoned(*args, **kwargs):  # the 5th training micro-batch (= step 5) turns NaN
        out = real(*args, **kwargs)
        if torch.is_grad_enabled():
            calls["train"] += 1
            if calls["train"] == 5:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(medusa_recipe, "medusa_loss", poisoned)
    out = tmp_path / "run"
    with pytest.raises(NonFiniteLossError, match=r"training loss is NaN at step 5: stopping the run; the last good "
                                                 r"checkpoint is \S+step_4"):
        main(tiny_cfg(out, "train.checkpoint_every=2", "eval.every_steps=0"))
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step_2", "step_4"]
    state = load_checkpoint(out / "checkpoints" / "step_4")
    assert all(torch.isfinite(t).all() for t in state["trainable"].values())
    assert not (out / "final").exists() and max(last_losses(out)) == 4
    monkeypatch.setattr(medusa_recipe, "medusa_loss", real)
    main(tiny_cfg(out, "train.checkpoint_every=2", "eval.every_steps=0"), resume="auto")  # the resume works
    assert (out / "final" / "manifest.json").is_file()


# ---------------------------------------------------------------------------------------------
# wrong target, pickle audit
# ---------------------------------------------------------------------------------------------


def test_manifest_check_names_every_difference():
    from draftsmith.models.artifacts import check_target
    from draftsmith.models.target import TargetModel, vocab_fingerprint

    def check_manifest_target(manifest, target, where="checkpoint"):  # a Medusa drafter feeds the final state
        check_target(manifest, target, where, hidden_layers=[-1])

    target = TargetModel.from_pretrained("tiny:llama")
    good = {"name": "tiny:llama", "hidden_size": 48, "vocab_size": 96, "hidden_layer": -1,
            "vocab_fingerprint": vocab_fingerprint(target.tokenizer)}
    check_manifest_target({"target": good}, target)
    check_manifest_target({"target": {**good, "num_hidden_layers": 2}}, target)
    bad = {**good, "hidden_size": 64, "hidden_layer": -2, "vocab_fingerprint": "0" * 16, "num_hidden_layers": 3}
    with pytest.raises(ValueError) as err:
        check_manifest_target({"target": bad}, target, where="heads dir")
    message = str(err.value)
    assert message.startswith("heads dir was trained for target 'tiny:llama'")
    for part in ("hidden_size: 64 in the manifest vs 48", "vocab_fingerprint", "hidden_layer",
                 "num_hidden_layers: 3 in the manifest vs 2"):
        assert part in message
    assert "vocab_size" not in message  # only what differs is listed


def test_nothing_is_unpickled():
    """Checkpoints and caches are safetensors + JSON: no pickle import, no torch.load without weights_only=True."""
    offenders = []
    for path in REPO.rglob("*.py"):
        if any(part in {"outputs", ".git", "build", ".venv"} for part in path.relative_to(REPO).parts):
            continue
        for no, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            code = line.split("#", 1)[0]
            if re.search(r"\bimport pickle\b|\bpickle\.loads?\(|\bcloudpickle\b|\bdill\b", code) or (
                    "torch.load(" in code and "weights_only=True" not in code):
                offenders.append(f"{path.relative_to(REPO)}:{no}: {line.strip()}")
    offenders = [o for o in offenders if not o.startswith("tests/test_faults.py")]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("recipe", ["dgf", "distill"])
def test_other_recipes_resume_past_a_truncated_newest_checkpoint(tmp_path, capsys, recipe):
    import importlib

    module = importlib.import_module(f"train.{recipe}")
    config_cls = next(v for k, v in vars(module).items() if k.endswith("RecipeConfig"))
    yaml_path = REPO / "train" / "configs" / f"{recipe}_tiny.yaml"
    cfg = lambda *extra: load_config(config_cls, yaml_path, [f"output_dir={tmp_path}", "train.max_steps=4",
                                                             "train.checkpoint_every=1", "eval.every_steps=0", *extra])
    module.main(cfg("train.stop_after_steps=3"))
    tensors = tmp_path / "checkpoints" / "step_3" / "tensors.safetensors"
    tensors.write_bytes(tensors.read_bytes()[:1000])
    capsys.readouterr()
    summary = module.main(cfg(), resume="auto")
    assert "step_3: tensors.safetensors is corrupt or truncated" in capsys.readouterr().err
    assert summary["step"] == 4 and (tmp_path / "checkpoints" / "step_3.corrupt").is_dir()


def overwrite_middle(file: Path, size: int = 4096) -> None:
    """Same length, 4 KB of garbage in the middle: only a digest can tell."""
    data = bytearray(file.read_bytes())
    start = len(data) // 2
    data[start:start + size] = bytes((i * 37 + 11) % 256 for i in range(min(size, len(data) - start)))
    file.write_bytes(bytes(data))


def test_same_size_garbage_in_a_checkpoint_is_caught_and_the_previous_one_used(tmp_path, capsys):
    save_checkpoint(tmp_path, 2, {"w": torch.ones(8192)})
    save_checkpoint(tmp_path, 4, {"w": torch.full((8192,), 2.0)})
    overwrite_middle(tmp_path / "step_4" / "tensors.safetensors")
    path, state = load_latest_checkpoint(tmp_path)
    assert path.name == "step_2" and torch.equal(state["w"], torch.ones(8192))
    assert "step_4" in capsys.readouterr().err and (tmp_path / "step_4.corrupt").is_dir()


def test_same_size_garbage_in_a_regenerated_shard_is_redone(tmp_path, model_dir, capsys):
    source = save_conversations(tmp_path / "convs.jsonl", conversations(4))
    cfg = RegenerateConfig(target=str(model_dir), source=f"conversations:{source}", output_dir=str(tmp_path / "regen"),
                           shard_size=2, max_new_tokens=4, batch_size=2, progress=False, rank=0, world_size=1)
    regenerate(cfg)
    shard = sorted((tmp_path / "regen").glob("shard_*.jsonl"))[0]
    good = shard.read_bytes()
    overwrite_middle(shard, 8)
    result = regenerate(cfg)
    assert result.shards_written == 1 and "redoing that shard" in capsys.readouterr().err
    assert shard.read_bytes() == good  # greedy: the redone shard is the same shard
