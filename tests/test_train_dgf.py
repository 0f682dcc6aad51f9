"""DGF recipe smoke tests on tiny in-process targets: train, checkpoint, exact resume, offline mode
from a feature cache, the unrolled mask, the new losses vs reference formulas, lossless decoding
with the trained drafter."""

import json

import pytest
import torch
import torch.nn.functional as F

from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.decode.drafters.dgf import load_dgf_drafter
from draftsmith.config import ConfigError, load_config
from draftsmith.train.run_guards import MetricsFile
from draftsmith.models.target import TargetModel
from draftsmith.train.dgf import DGFRecipeConfig, main, pair_targets, unrolled_mask
from draftsmith.train.losses import (IGNORE_INDEX, feature_regression_loss, hard_cross_entropy, soft_cross_entropy,
                          topk_soft_cross_entropy, unrolled_step_weights)

CONFIG = "train/configs/dgf_tiny.yaml"


def tiny_cfg(tmp_path, *overrides):
    return load_config(DGFRecipeConfig, CONFIG, [f"output_dir={tmp_path}", "train.max_steps=4",
                                                 "train.checkpoint_every=2", "eval.every_steps=0", *overrides])


def train_losses(path) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in MetricsFile.read(path / "metrics.jsonl") if "train/loss" in r}


def test_losses_match_reference_formulas():
    torch.manual_seed(0)
    pred, target = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    diff = (pred - target).abs()
    ref = torch.where(diff < 1, 0.5 * diff ** 2, diff - 0.5).mean(-1)
    torch.testing.assert_close(feature_regression_loss(pred, target, mask), (ref * mask).sum() / 4)
    torch.testing.assert_close(feature_regression_loss(pred, target, mask, normalizer=8.0), (ref * mask).sum() / 8)
    logits, teacher = torch.randn(2, 3, 11), torch.randn(2, 3, 11)
    p = teacher.softmax(-1)
    ref = -(p * logits.log_softmax(-1)).sum(-1)
    torch.testing.assert_close(soft_cross_entropy(logits, teacher.log_softmax(-1), mask), (ref * mask).sum() / 4)
    top = teacher.topk(4, dim=-1)
    ref = -(top.values.softmax(-1) * logits.log_softmax(-1).gather(-1, top.indices)).sum(-1)
    torch.testing.assert_close(topk_soft_cross_entropy(logits, top.indices, top.values, mask), (ref * mask).sum() / 4)
    labels = torch.tensor([[1, 2, IGNORE_INDEX], [IGNORE_INDEX, 4, 5]])
    ref = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=IGNORE_INDEX)
    torch.testing.assert_close(hard_cross_entropy(logits, labels), ref)
    torch.testing.assert_close(unrolled_step_weights(3, 0.5), torch.tensor([1.0, 0.5, 0.25]))


def test_pair_targets_and_unrolled_mask():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    labels = pair_targets(ids, torch.tensor([[0, 0, 1, 0, 1]]), torch.ones(1, 5, dtype=torch.long))
    assert labels.tolist() == [[7, IGNORE_INDEX, 9, IGNORE_INDEX]]  # pair t predicts x_{t+2}
    step0 = unrolled_mask(4, 0)
    assert torch.equal(step0, torch.ones(4, 4, dtype=torch.bool).tril())
    step2 = unrolled_mask(4, 2).int()  # query t: step-0 keys <= t-2, step-1 key t-1, step-2 key t
    assert step2[3].tolist() == [1, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1]
    assert step2[0].tolist() == [0] * 8 + [1, 0, 0, 0]


def test_unknown_key_and_bad_values_rejected(tmp_path):
    with pytest.raises(ConfigError, match="drafter.num_blockz"):
        tiny_cfg(tmp_path, "drafter.num_blockz=2")
    with pytest.raises(ConfigError, match="fusion"):
        tiny_cfg(tmp_path, "drafter.fusion=sum")
    with pytest.raises(ConfigError, match="feature_cache"):
        tiny_cfg(tmp_path, "data.mode=offline")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_train_resume_and_lossless_decode(tmp_path, family):
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    overrides = [f"target=tiny:{family}", "loss.input_noise=0.05"]
    summary = main(tiny_cfg(full_dir, *overrides))
    assert summary["final"] and (full_dir / "final" / "manifest.json").is_file()
    main(tiny_cfg(part_dir, *overrides, "train.stop_after_steps=2"))
    assert not (part_dir / "final").exists()
    main(tiny_cfg(part_dir, *overrides), resume="auto")
    full, part = train_losses(full_dir), train_losses(part_dir)
    assert sorted(full) == [1, 2, 3, 4] and all(abs(full[s] - part[s]) < 1e-6 for s in full), (full, part)
    from safetensors.torch import load_file

    a, b = load_file(str(full_dir / "final/dgf.safetensors")), load_file(str(part_dir / "final/dgf.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    manifest = json.loads((full_dir / "final/manifest.json").read_text())
    assert manifest["target"]["name"] == f"tiny:{family}" and manifest["drafter"]["num_blocks"] == 2

    target = TargetModel.from_pretrained(f"tiny:{family}")
    drafter = load_dgf_drafter(full_dir / "final", target, depth=4, topk=3, budget=8)
    prompt = torch.randint(0, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=20)).generate(prompt)
    reference = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=20,
                                      do_sample=False)[0, 6:].tolist()
    assert result.tokens == reference


def test_offline_mode_from_feature_cache(tmp_path):
    from draftsmith.data.features import FeatureCacheConfig, build_feature_cache
    from draftsmith.data.records import load_records

    target = TargetModel.from_pretrained("tiny:llama")
    records = load_records("synthetic:24:0.3", max_length=20, model=target.model)
    cache = tmp_path / "cache"
    build_feature_cache(FeatureCacheConfig(target="tiny:llama", source=None, output_dir=str(cache), hidden_layers=(-1,),
                                           topk_logits=0, progress=False), target=target, records=records)
    summary = main(tiny_cfg(tmp_path / "run", "data.mode=offline", f"data.feature_cache={cache}",
                            "loss.unroll_steps=1", "eval.unroll_steps=2"))
    assert summary["final"]
    metrics = MetricsFile.read(tmp_path / "run" / "metrics.jsonl")
    assert any("eval/step1_top1" in m for m in metrics)
    # Online on the same records gives the same first loss (features cached in bf16: loose tolerance).
    online = tiny_cfg(tmp_path / "online", "loss.unroll_steps=1", "train.max_steps=1", "data.source=synthetic:24:0.3",
                      "data.max_length=20")
    main(online)
    first_offline = train_losses(tmp_path / "run")[1]
    first_online = train_losses(tmp_path / "online")[1]
    assert abs(first_offline - first_online) < 0.05 * abs(first_online)


def test_offline_caches_with_and_without_topk_logits_train_together(tmp_path):
    """A cache with top-k logits beside one without: the final state is the soft target of both, so the
    top-k fields are not loaded and the batches mix (they crashed with a KeyError in collate)."""
    from draftsmith.data.features import FeatureCacheConfig, build_feature_cache
    from draftsmith.data.records import load_records

    target = TargetModel.from_pretrained("tiny:llama")
    for name, topk in (("plain", 0), ("topk", 4)):
        records = load_records("synthetic:12:0.3", max_length=20, model=target.model, seed=topk)
        build_feature_cache(FeatureCacheConfig(target="tiny:llama", source=None, output_dir=str(tmp_path / name),
                                               hidden_layers=(-1,), topk_logits=topk, progress=False),
                            target=target, records=records)
    summary = main(tiny_cfg(tmp_path / "run", "data.mode=offline", "loss.token_loss=soft",
                            f"data.feature_cache={tmp_path / 'plain'} + {tmp_path / 'topk'}", "train.max_steps=2"))
    assert summary["final"]


@pytest.fixture
def tiny_vocab(tmp_path):
    from draftsmith.models.vocab import DraftVocab

    path = tmp_path / "vocab"
    path.mkdir()
    DraftVocab.from_ids(range(0, 96, 2), 96).save(path)
    return path


@pytest.mark.parametrize("head,fusion,token_fusion", [("slice", "linear", "dgf"), ("own", "gated", "dgf"),
                                                     ("own", "linear", "eagle3")])
def test_multi_layer_vocab_drafter_trains_resumes_and_decodes_losslessly(tmp_path, tiny_vocab, head, fusion,
                                                                         token_fusion):
    overrides = ["drafter.multi_layer=true", f"drafter.layer_fusion={fusion}", f"drafter.draft_vocab={tiny_vocab}",
                 f"drafter.head={head}", "loss.feature_weight=0", "loss.token_weight=1",
                 f"drafter.fusion={token_fusion}"]
    full_dir, part_dir = tmp_path / "full", tmp_path / "part"
    main(tiny_cfg(full_dir, *overrides))
    main(tiny_cfg(part_dir, *overrides, "train.stop_after_steps=2"))
    main(tiny_cfg(part_dir, *overrides), resume="auto")
    full, part = train_losses(full_dir), train_losses(part_dir)
    assert all(abs(full[s] - part[s]) < 1e-6 for s in full), (full, part)  # exact resume
    manifest = json.loads((full_dir / "final/manifest.json").read_text())
    assert manifest["drafter"]["feature_layers"] == [1, 2]  # EAGLE-3's low/mid/high, of a 2-layer target
    assert manifest["draft_vocab"]["size"] == 48 and manifest["target"]["hidden_layers"] == [1, 2]
    target = TargetModel.from_pretrained("tiny:llama")
    drafter = load_dgf_drafter(full_dir / "final", target, depth=3, topk=3, budget=6)
    assert drafter.vocab.size == 48 and drafter.hidden_layers == (1, 2)
    prompt = torch.randint(0, 96, (1, 8), generator=torch.Generator().manual_seed(2))
    result = SpeculativeDecoder(target, drafter, DecodeConfig(max_new_tokens=16)).generate(prompt)
    reference = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=16,
                                      do_sample=False)[0, 8:].tolist()
    assert result.tokens == reference


def test_init_from_continues_a_finished_run_and_refuses_another_architecture(tmp_path, tiny_vocab):
    overrides = [f"drafter.draft_vocab={tiny_vocab}", "drafter.head=slice"]
    main(tiny_cfg(tmp_path / "first", *overrides))
    first = json.loads((tmp_path / "first/final/manifest.json").read_text())["eval"]["after"]
    main(tiny_cfg(tmp_path / "longer", *overrides, f"drafter.init_from={tmp_path / 'first/final'}"))
    longer = json.loads((tmp_path / "longer/final/manifest.json").read_text())["eval"]["before"]
    assert longer["eval/top1"] == first["eval/top1"]
    assert abs(longer["eval/step0_token_loss"] - first["eval/step0_token_loss"]) < 1e-6
    with pytest.raises(ConfigError, match=r"num_blocks=2 \(this config: 1\)"):
        main(tiny_cfg(tmp_path / "other", *overrides, "drafter.num_blocks=1",
                      f"drafter.init_from={tmp_path / 'first/final'}"))
    with pytest.raises(ConfigError, match="drafter.init_from=.*nowhere: not a train/dgf.py final/ directory"):
        tiny_cfg(tmp_path / "other", *overrides, f"drafter.init_from={tmp_path / 'nowhere'}")


def test_multi_layer_and_vocab_options_are_checked(tmp_path, tiny_vocab):
    with pytest.raises(ConfigError, match="drafter predicts no target feature"):
        tiny_cfg(tmp_path, "drafter.multi_layer=true")
    with pytest.raises(ConfigError, match="drafter.head: with drafter.draft_vocab choose slice or own"):
        tiny_cfg(tmp_path, f"drafter.draft_vocab={tiny_vocab}")
    with pytest.raises(ConfigError, match="drafter.head"):
        tiny_cfg(tmp_path, "drafter.head=own")


def test_multi_layer_offline_cache_reads_every_layer(tmp_path):
    from draftsmith.data.features import FeatureCacheConfig, build_feature_cache
    from draftsmith.data.records import load_records

    target = TargetModel.from_pretrained("tiny:llama")
    records = load_records("synthetic:16:0.3", max_length=20, model=target.model)
    cache = tmp_path / "cache"
    build_feature_cache(FeatureCacheConfig(target="tiny:llama", source=None, output_dir=str(cache),
                                           hidden_layers=(1, 2, -1), topk_logits=0, progress=False),
                        target=target, records=records)
    summary = main(tiny_cfg(tmp_path / "run", "data.mode=offline", f"data.feature_cache={cache}",
                            "drafter.feature_layers=[1,2]", "loss.feature_weight=0", "loss.unroll_steps=2"))
    assert summary["final"]


def test_loss_token_snapshots_and_a_lean_checkpoint_resume_on_another_machine(tmp_path):
    """One run gives a data curve: snapshots/loss_tokens_<N>/ hold the drafter at the first step whose
    loss-bearing tokens seen reach N (final/'s layout, loadable). A lean checkpoint (no optimizer state, what a
    long run commits) resumes in a fresh output directory at the same step, data position and token count."""
    from draftsmith.train.checkpoints import load_checkpoint, write_lean_checkpoint

    full = tmp_path / "full"
    main(tiny_cfg(full, "train.snapshots_at_loss_tokens=[1,100000000]"))
    seen = [r["train/loss_tokens_seen"] for r in MetricsFile.read(full / "metrics.jsonl") if "train/loss" in r]
    assert seen == sorted(seen) and seen[0] > 0
    snapshot = full / "snapshots" / "loss_tokens_1"
    info = json.loads((snapshot / "snapshot.json").read_text())
    assert info["step"] == 1 and info["loss_tokens_seen"] == seen[0] and "eval/step0_top1" in info["held_out"]
    assert not (full / "snapshots" / "loss_tokens_100000000").exists()
    load_dgf_drafter(snapshot, TargetModel.from_pretrained("tiny:llama"), depth=2, topk=1, budget=2)

    lean = write_lean_checkpoint(full / "checkpoints" / "step_2", tmp_path / "resume")
    state = load_checkpoint(lean)
    assert "optimizer" not in state and state["step"] == 2 and state["loss_tokens_seen"] == seen[1]
    moved = tmp_path / "elsewhere"
    main(tiny_cfg(moved, "train.snapshots_at_loss_tokens=[1,100000000]"), resume=str(lean))
    assert not (moved / "snapshots").exists()  # the milestone passed before the checkpoint is not written again
    after = [r for r in MetricsFile.read(moved / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in after] == [3, 4] and after[-1]["train/loss_tokens_seen"] == seen[-1]
    assert (moved / "final" / "manifest.json").is_file()

    rounded = load_checkpoint(write_lean_checkpoint(full / "checkpoints" / "step_2", tmp_path / "resume_bf16",
                                                    torch.bfloat16))  # half the bytes, for a transfer
    assert all(t.dtype == torch.bfloat16 for t in rounded["trainable"].values() if t.is_floating_point())
    assert rounded["step"] == 2 and rounded["samples_seen"] == state["samples_seen"]


def test_a_curve_run_stops_at_its_last_snapshot(tmp_path):
    """With every milestone written the run saves a checkpoint and stops before max_steps (no final/)."""
    run = tmp_path / "run"
    main(tiny_cfg(run, "train.snapshots_at_loss_tokens=[1]", "train.max_steps=50"))
    steps = [r["step"] for r in MetricsFile.read(run / "metrics.jsonl") if "train/loss" in r]
    assert steps == [1] and (run / "snapshots" / "loss_tokens_1").is_dir()
    assert (run / "checkpoints" / "step_1").is_dir() and not (run / "final").exists()


def test_medusa_writes_curve_snapshots(tmp_path):
    """Medusa heads count their loss-bearing tokens (head 1's labels), so an acceptance-vs-data curve of heads
    snapshots them like the feature drafter's: a loadable final/ layout per milestone, then the run stops."""
    from draftsmith.train.medusa import MedusaRecipeConfig, main as medusa_main

    cfg = load_config(MedusaRecipeConfig, "train/configs/medusa_tiny.yaml",
                      [f"output_dir={tmp_path}", "train.max_steps=5", "train.snapshots_at_loss_tokens=[1]"])
    medusa_main(cfg)
    snapshot = tmp_path / "snapshots" / "loss_tokens_1"
    record = json.loads((snapshot / "snapshot.json").read_text())
    assert record["loss_tokens_seen"] >= 1 and record["step"] == 1
    assert (snapshot / "medusa_heads.safetensors").is_file()
