"""Multi-process runs through `accelerate launch` on CPU (gloo): real 2-process launches in subprocesses.

The launch command is the shipped `train/accelerate/ddp_cpu.yaml` (torchrun launcher; see the
comment in that file for why `--cpu --num_processes 2` alone starts one process).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.data.features import FeatureDataset, load_index
from draftsmith.data.sources import load_regenerated
from draftsmith.data.sources import Conversation, save_conversations
from draftsmith.train.run_guards import MetricsFile
from draftsmith.config import load_config
from draftsmith.train.medusa import MedusaRecipeConfig, main

from launch_utils import ACCELERATE_CONFIGS, REPO, TINY_YAML, accelerate_launch, run, save_tiny_model_dir, summaries


pytestmark = pytest.mark.usefixtures("one_thread")


SHIPPED = {"ddp_cpu.yaml": ("MULTI_GPU", 2, 1), "ddp_1gpu.yaml": ("NO", 1, 1), "ddp_8gpu.yaml": ("MULTI_GPU", 8, 1),
           "fsdp.yaml": ("FSDP", 8, 1), "deepspeed_zero2.yaml": ("DEEPSPEED", 8, 1),
           "deepspeed_zero3.yaml": ("DEEPSPEED", 8, 1), "multinode.yaml": ("MULTI_GPU", 16, 2)}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_accelerate_configs_load_and_validate(name):
    """Each YAML parses with accelerate's config loader and passes `accelerate launch`'s own validation."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path = ACCELERATE_CONFIGS / name
    kind, processes, machines = SHIPPED[name]
    config = load_config_from_file(str(path))
    assert config.distributed_type.value == kind and config.num_processes == processes
    assert config.num_machines == machines and not config.use_cpu
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(
        ["--config_file", str(path), "train/medusa.py"]))
    assert args.num_processes == processes
    if kind == "FSDP":
        assert config.fsdp_config["fsdp_version"] == 2 and args.use_fsdp
    if kind == "DEEPSPEED":
        assert config.deepspeed_config["zero_stage"] == int(name[-6]) and args.use_deepspeed
    assert sorted(p.name for p in ACCELERATE_CONFIGS.glob("*.yaml")) == sorted(SHIPPED)


def _metrics(output_dir: Path) -> list[dict]:
    return MetricsFile.read(output_dir / "metrics.jsonl")


def test_two_processes_equal_one_process_at_the_same_global_batch(tmp_path):
    """2 processes x batch 2 (gloo DDP) == 1 process x batch 4 == 1 process x batch 2 x 2 accumulation:
    same losses, held-out metrics and final heads; metrics and W&B are written once (main process)."""
    common = ["train.max_steps=4", "train.checkpoint_every=2", "loss.distill_weight=0.5", *RECIPES["medusa"]]
    done = run([*accelerate_launch(2), "train/medusa.py", "--config", str(TINY_YAML), f"output_dir={tmp_path / 'ddp'}",
                "train.batch_size=2", "logging.tracker=wandb", *common])
    finished = summaries(done.stdout)
    # both ranks ran to the end (the launch exits 0 only then); the summary is printed once, by the main process
    assert len(finished) == 1 and finished[0]["step"] == 4 and finished[0]["processes"] == 2
    main(load_config(MedusaRecipeConfig, TINY_YAML, [f"output_dir={tmp_path / 'big'}", "train.batch_size=4", *common]))
    main(load_config(MedusaRecipeConfig, TINY_YAML, [f"output_dir={tmp_path / 'accum'}", "train.batch_size=2",
                                                     "train.grad_accum_steps=2", *common]))
    ddp = _metrics(tmp_path / "ddp")
    steps = [(r["step"], "train/loss" in r) for r in ddp]
    assert len(steps) == len(set(steps))  # every metric row logged once, not once per process
    for other in ("big", "accum"):
        ref = _metrics(tmp_path / other)
        assert len(ref) == len(ddp)
        for a, b in zip(ddp, ref):
            assert a["step"] == b["step"]
            for key in ("train/loss", "train/samples_seen", "eval/loss", "eval/head1_top1", "eval/head3_top3"):
                if key in b:
                    assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), (other, a["step"], key)
        heads_a = load_file(str(tmp_path / "ddp" / "final" / "medusa_heads.safetensors"))
        heads_b = load_file(str(tmp_path / other / "final" / "medusa_heads.safetensors"))
        for name, tensor in heads_b.items():
            assert torch.allclose(heads_a[name], tensor, atol=1e-5), (other, name)
    assert len(list((tmp_path / "ddp" / "wandb").glob("offline-run-*"))) == 1
    manifest = json.loads((tmp_path / "ddp" / "final" / "manifest.json").read_text())
    assert manifest["training"]["command"].startswith("accelerate launch --num_processes 2 --mixed_precision no "
                                                      "train/medusa.py --config ")  # how a user retrains it
    # the checkpoint holds both processes' RNG states (exact resume under the same world size)
    state = json.loads((tmp_path / "ddp" / "checkpoints" / "step_4" / "state.json").read_text())
    assert len(state["state"]["rng"]) == 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smol_tokenizer):
    return save_tiny_model_dir(smol_tokenizer, tmp_path_factory.mktemp("tiny-model"))


def conversations(n: int) -> list[Conversation]:
    return [Conversation(id=f"c{i}", source="test", messages=[
        {"role": "user", "content": f"Question {i}: what is {i} plus {i}?"},
        {"role": "assistant", "content": f"It is {2 * i}. " * (1 + i % 3)}]) for i in range(n)]


@pytest.mark.slow  # ~1 min on 2 busy cores (4 process start-ups); the rank split itself is tested in-process
def test_regeneration_and_feature_cache_shard_across_two_processes(tmp_path, model_dir):
    """`accelerate launch -m draftsmith.data.regenerate / data.features`: each rank writes its own shards, the
    merged index covers every item once, and the readers see the whole data set."""
    source = save_conversations(tmp_path / "convs.jsonl", conversations(7))
    regen_dir, feat_dir = tmp_path / "regen", tmp_path / "features"
    run([*accelerate_launch(2), "-m", "draftsmith.data.regenerate", f"target={model_dir}",
         f"source=conversations:{source}", f"output_dir={regen_dir}", "max_new_tokens=4", "shard_size=2",
         "batch_size=2", "threads=1", "--no-progress"])
    index = json.loads((regen_dir / "index.json").read_text())
    assert {s["rank"] for s in index["shards"]} == {0, 1}
    assert {p.name for p in regen_dir.glob("shard_*.jsonl")} == {"shard_0_00000.jsonl", "shard_0_00001.jsonl",
                                                                "shard_1_00000.jsonl", "shard_1_00001.jsonl"}
    regenerated = load_regenerated(regen_dir, require_complete=True)
    assert [c.meta["regenerated"]["item"] for c in regenerated] == list(range(7))

    run([*accelerate_launch(2), "-m", "draftsmith.data.features", f"target={model_dir}",
         f"source=conversations:{regen_dir}", f"output_dir={feat_dir}", "hidden_layers=[-1]", "topk_logits=0",
         "shard_tokens=64", "batch_size=2", "threads=1", "--no-progress"])
    index = load_index(feat_dir)
    assert index["complete"] and {s["rank"] for s in index["shards"]} == {0, 1}
    items = sorted(int(x["item"]) for x in FeatureDataset(feat_dir))
    assert items == list(range(len(regenerated)))  # every regenerated conversation once, across both ranks


RECIPES = {  # recipe -> overrides giving an uneven number of held-out batches per rank (3 batches, 2 ranks)
    "medusa": ["eval.batch_size=5"],
    "dgf": ["eval.batch_size=5"],
    "distill": ["eval.batch_size=3"],
}
SKIP_KEYS = ("elapsed", "time", "per_s", "seconds")


def _assert_same_metrics(a_rows: list[dict], b_rows: list[dict], where: str) -> None:
    assert [r["step"] for r in a_rows] == [r["step"] for r in b_rows], where
    for a, b in zip(a_rows, b_rows):
        assert a.keys() == b.keys(), where
        for key, value in b.items():
            if isinstance(value, float) and not any(s in key for s in SKIP_KEYS):
                assert a[key] == pytest.approx(value, rel=1e-5, abs=1e-6), (where, a["step"], key)


@pytest.mark.parametrize("recipe", ["dgf", "distill"])
def test_every_recipe_two_processes_equal_one_process(tmp_path, recipe):
    """Each recipe under a real 2-process launch (batch 2 per rank) == 1 process with batch 4, with an
    evaluation whose batches do not split evenly over the ranks (a DDP forward is a collective)."""
    import importlib

    module = importlib.import_module(f"train.{recipe}")
    yaml_path = REPO / "train" / "configs" / f"{recipe}_tiny.yaml"
    common = ["train.max_steps=3", "train.checkpoint_every=3", "eval.every_steps=2", *RECIPES[recipe]]
    done = run([*accelerate_launch(2), f"train/{recipe}.py", "--config", str(yaml_path),
                f"output_dir={tmp_path / 'ddp'}", "train.batch_size=2", *common], timeout=240)
    finished = summaries(done.stdout)  # both ranks finished (exit 0); printed once, by the main process
    assert len(finished) == 1 and finished[0]["processes"] == 2
    config_cls = next(v for k, v in vars(module).items() if k.endswith("RecipeConfig"))
    module.main(load_config(config_cls, yaml_path, [f"output_dir={tmp_path / 'one'}", "train.batch_size=4", *common]))
    _assert_same_metrics(_metrics(tmp_path / "ddp"), _metrics(tmp_path / "one"), recipe)


def test_gather_trainable_state_keeps_only_trainable_weights():
    from accelerate import Accelerator

    from draftsmith.train.distributed import gather_trainable_state

    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    module[0].requires_grad_(False)  # "the frozen target"
    acc = Accelerator(cpu=True)
    prepared = acc.prepare(module)
    state = gather_trainable_state(acc, prepared)
    assert sorted(state) == ["1.bias", "1.weight"]
    assert torch.equal(state["1.weight"], module[1].weight.detach()) and state["1.weight"].device.type == "cpu"
