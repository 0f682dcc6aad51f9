"""data/features.py: offline feature cache on a tiny random Llama with the SmolLM2 tokenizer."""

from __future__ import annotations

import json
import shutil
from collections import namedtuple
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

import draftsmith.data.features as features
from draftsmith.config import config_from_dict, load_config
from draftsmith.data.chat import render_and_mask
from draftsmith.data.features import (
    FeatureCacheConfig,
    FeatureCacheMismatch,
    FeatureDataset,
    InsufficientDiskSpace,
    PlanMismatch,
    build_feature_cache,
    load_index,
)
from draftsmith.data.sources import Conversation

from conftest import tiny_target_for

TOPK = 5


@pytest.fixture(scope="module")
def tokenizer(smol_tokenizer):
    return smol_tokenizer


@pytest.fixture(scope="module")
def target(tokenizer):
    return tiny_target_for(tokenizer, seed=1)


def records() -> list:
    convs = [Conversation(id=f"c{i}", source="test", messages=[
        {"role": "user", "content": f"Tell me fact number {i}."},
        {"role": "assistant", "content": "Here is a fact: " + "the sky is blue. " * (1 + i % 3)}])
        for i in range(6)]
    convs.insert(2, Conversation(id="prompt-only", source="test", messages=[{"role": "user", "content": "Hi?"}]))
    convs.append({"id": "pretok", "input_ids": list(range(100, 130)), "loss_mask": [0] * 10 + [1] * 20})
    return convs  # 8 records; "prompt-only" (item 2) has nothing to learn from


KEPT_ITEMS = [0, 1, 3, 4, 5, 6, 7]


def cfg_for(out, **kw) -> FeatureCacheConfig:
    base = dict(target="tiny-llama", source=None, output_dir=str(out), hidden_layers=(-1, 0), topk_logits=TOPK,
                shard_tokens=100, batch_size=2, rank=0, world_size=1, progress=False)
    base.update(kw)
    return FeatureCacheConfig(**base)


def tokenised(tokenizer, rec) -> dict:
    if isinstance(rec, Conversation):
        return render_and_mask(tokenizer, rec.messages, max_length=2048)
    return {"input_ids": rec["input_ids"], "loss_mask": rec["loss_mask"]}


@pytest.fixture(scope="module")
def cache(tmp_path_factory, target):
    out = tmp_path_factory.mktemp("features")
    res = build_feature_cache(cfg_for(out), target=target, records=records())
    return SimpleNamespace(dir=out, result=res)


def shard_tensors(d: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {p.name: load_file(str(p)) for p in sorted(d.glob("shard_*.safetensors"))}


def test_cache_equals_direct_forward(cache, target, tokenizer):
    index = json.loads((cache.dir / "index.json").read_text())
    assert index["complete"] and index["hidden_size"] == 32 and index["num_layers"] == 2
    assert index["hidden_layers"] == [-1, 0] and index["hidden_layers_abs"] == [2, 0]
    assert index["dtype"] == "bfloat16" and index["topk_logits"] == TOPK
    assert len(index["shards"]) >= 2 and sum(s["n_sequences"] for s in index["shards"]) == 7
    assert cache.result.skipped == {"no_assistant_turn": 1}
    assert not list(cache.dir.glob("*.tmp"))

    recs = records()
    seen = []
    for name, t in shard_tensors(cache.dir).items():
        assert t["hidden.2"].dtype == torch.bfloat16 and t["topk_indices"].dtype == torch.int32
        offsets = t["offsets"].tolist()
        assert offsets[-1] == t["input_ids"].numel() == t["hidden.2"].shape[0]
        for j, item in enumerate(t["items"].tolist()):
            seen.append(item)
            a, b = offsets[j], offsets[j + 1]
            ref = tokenised(tokenizer, recs[item])
            assert t["input_ids"][a:b].tolist() == ref["input_ids"]
            assert t["loss_mask"][a:b].tolist() == ref["loss_mask"]
            with torch.no_grad():
                out = target.model(torch.tensor([ref["input_ids"]]), output_hidden_states=True)
            for layer in (2, 0):
                torch.testing.assert_close(t[f"hidden.{layer}"][a:b].float(), out.hidden_states[layer][0],
                                           rtol=1e-2, atol=1e-2)
            logits = out.logits[0].float()
            top = logits.topk(TOPK, dim=-1)
            torch.testing.assert_close(t["topk_values"][a:b].float(), top.values, rtol=1e-2, atol=1e-2)
            torch.testing.assert_close(logits.gather(-1, t["topk_indices"][a:b].long()), top.values,
                                       rtol=1e-4, atol=1e-4)  # the stored ids are the top-k ids
            torch.testing.assert_close(t["logsumexp"][a:b], torch.logsumexp(logits, -1), rtol=1e-4, atol=1e-4)
    assert seen == KEPT_ITEMS


def test_prints_size_per_token(tmp_path, target, capsys):
    res = build_feature_cache(cfg_for(tmp_path, hidden_layers=(-2,), topk_logits=0), target=target,
                              records=records()[:2])
    printed = capsys.readouterr().out
    assert res.bytes_per_token == 32 * 2 + 5  # one bf16 layer + int32 id + uint8 mask
    assert f"{res.bytes_per_token} bytes/token" in printed and "estimate" in printed and "free" in printed
    t = load_file(str(tmp_path / "shard_0_00000.safetensors"))
    assert set(t) == {"input_ids", "loss_mask", "offsets", "items", "hidden.1"}


def test_dataset_streams_every_sequence(cache):
    ds = FeatureDataset(cache.dir)
    assert ds.num_sequences == 7
    recs = list(ds)
    assert [int(r["item"]) for r in recs] == KEPT_ITEMS
    r = recs[0]
    T = r["input_ids"].shape[0]
    assert r["hidden_states"].shape == (2, T, 32) and r["hidden_states"].dtype == torch.bfloat16
    assert r["topk_values"].shape == (T, TOPK) and r["topk_indices"].dtype == torch.int64
    assert r["loss_mask"].shape == (T,) and r["logsumexp"].shape == (T,)
    only_final = next(iter(FeatureDataset(cache.dir, hidden_layers=[2], with_logits=False)))
    torch.testing.assert_close(only_final["hidden_states"][0], r["hidden_states"][0], rtol=0, atol=0)
    assert "topk_values" not in only_final

    # Ranks x DataLoader workers: disjoint, together exactly once.
    got = []
    for rank in range(2):
        loader = DataLoader(FeatureDataset(cache.dir, rank=rank, world_size=2), batch_size=None, num_workers=2)
        got += [int(x["item"]) for x in loader]
    assert sorted(got) == KEPT_ITEMS

    # Shuffling: same set, a seeded order that changes with the epoch.
    a = [int(x["item"]) for x in FeatureDataset(cache.dir, shuffle=True, seed=1)]
    b = [int(x["item"]) for x in FeatureDataset(cache.dir, shuffle=True, seed=1)]
    ds = FeatureDataset(cache.dir, shuffle=True, seed=1)
    ds.set_epoch(1)
    c = [int(x["item"]) for x in ds]
    assert a == b and sorted(a) == sorted(c) == KEPT_ITEMS
    assert a != KEPT_ITEMS or c != KEPT_ITEMS
    assert a != c


def test_resume_after_partial_run(tmp_path, target, cache, monkeypatch):
    out = tmp_path / "resumed"
    first = build_feature_cache(cfg_for(out, max_shards=1), target=target, records=records())
    assert first.stopped_early and first.shards_written == 1
    with pytest.raises(RuntimeError, match="incomplete"):
        load_index(out)

    real = features.forward_features
    calls = {"n": 0}

    def dying(*args, **kwargs):  # a kill in the middle of the next shard
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("simulated kill")
        return real(*args, **kwargs)

    monkeypatch.setattr(features, "forward_features", dying)
    with pytest.raises(KeyboardInterrupt):
        build_feature_cache(cfg_for(out), target=target, records=records())
    monkeypatch.setattr(features, "forward_features", real)
    recorded = {s["file"] for s in json.loads((out / "index.json").read_text())["shards"]}
    assert {p.name for p in out.glob("shard_*")} == recorded and not list(out.glob("*.tmp"))
    n_total = len(shard_tensors(cache.dir))
    assert 2 <= len(recorded) < n_total

    final = build_feature_cache(cfg_for(out), target=target, records=records())
    assert final.shards_skipped == len(recorded) and final.shards_written == n_total - len(recorded)
    resumed, reference = shard_tensors(out), shard_tensors(cache.dir)
    assert resumed.keys() == reference.keys()
    for name in reference:
        for key, tensor in reference[name].items():
            assert torch.equal(resumed[name][key], tensor), (name, key)
    assert load_index(out)["complete"]
    again = build_feature_cache(cfg_for(out), target=target, records=records())
    assert again.shards_written == 0 and again.estimate_bytes == 0
    with pytest.raises(PlanMismatch, match="topk_logits"):
        build_feature_cache(cfg_for(out, topk_logits=3), target=target, records=records())


def test_world_size_two(tmp_path, target):
    for rank in (0, 1):
        build_feature_cache(cfg_for(tmp_path, rank=rank, world_size=2, topk_logits=0), target=target,
                            records=records())
    index = load_index(tmp_path)
    assert index["complete"] and {s["rank"] for s in index["shards"]} == {0, 1}
    assert sorted(int(x["item"]) for x in FeatureDataset(tmp_path)) == KEPT_ITEMS
    copy = tmp_path / "copy"  # shards + index.json only (no ledgers): still readable
    copy.mkdir()
    for p in [*tmp_path.glob("shard_*"), tmp_path / "index.json"]:
        shutil.copy(p, copy / p.name)
    assert sorted(int(x["item"]) for x in FeatureDataset(copy)) == KEPT_ITEMS


def test_load_index_refuses_mismatched_target(cache, target, tokenizer):
    assert load_index(cache.dir, target, hidden_layers=[-1], topk_logits=TOPK)["model"] == "tiny-llama"
    wider = SimpleNamespace(tokenizer=tokenizer, config=SimpleNamespace(hidden_size=48, num_hidden_layers=3))
    with pytest.raises(FeatureCacheMismatch, match=r"hidden size: cache 32 != target 48.*number of layers"):
        load_index(cache.dir, wider)
    class OtherTokenizer:
        def get_vocab(self):
            return {"a": 0, "b": 1}

        def __len__(self):
            return 2

    with pytest.raises(FeatureCacheMismatch, match="vocab fingerprint differs"):
        load_index(cache.dir, SimpleNamespace(model=target.model, tokenizer=OtherTokenizer()))
    with pytest.raises(FeatureCacheMismatch, match=r"hidden layers \[-2\] not cached"):
        load_index(cache.dir, target, hidden_layers=[-1, -2])
    with pytest.raises(FeatureCacheMismatch, match="top-k logits: need 8, cache has 5"):
        load_index(cache.dir, topk_logits=8)
    with pytest.raises(FeatureCacheMismatch, match="hidden size"):
        FeatureDataset(cache.dir, target=wider)


def test_refuses_when_disk_is_too_small(tmp_path, target, monkeypatch, capsys):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**6, 10**6 - 1000, 1000))
    out = tmp_path / "cache"
    with pytest.raises(InsufficientDiskSpace, match="only 1000 B is free"):
        build_feature_cache(cfg_for(out), target=target, records=records())
    assert "bytes/token" in capsys.readouterr().out  # the estimate is printed before refusing
    assert not list(out.glob("shard_*")) and not (out / "index.json").exists()


def test_config_validation():
    with pytest.raises(ValueError, match="hidden_layerz"):
        config_from_dict(FeatureCacheConfig, {"target": "m", "source": "s", "output_dir": "o", "hidden_layerz": [1]})
    with pytest.raises(ValueError, match="duplicates"):
        FeatureCacheConfig(target="m", source="s", output_dir="o", hidden_layers=(-1, -1))
    args = load_config(FeatureCacheConfig, None, ["target=m", "source=gsm8k:train", "output_dir=o",
                                                  "hidden_layers=[-1, -3]", "topk_logits=8"])
    assert list(args.hidden_layers) == [-1, -3] and args.topk_logits == 8
