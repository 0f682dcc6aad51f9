"""data/regenerate.py: turn-by-turn regeneration with a tiny random Llama on the SmolLM2 tokenizer.

The tokenizer (for the chat template) comes from the registry cache; the model is a random 2-layer Llama
whose vocab matches the tokenizer, so generated ids decode to real text pieces.
"""

from __future__ import annotations

import json

import pytest
import torch

import draftsmith.data.regenerate as regen
from draftsmith.config import config_from_dict, load_config
from draftsmith.data.chat import prompt_ids
from draftsmith.data.regenerate import RegenerateConfig, context_chunks, regenerate
from draftsmith.data.shards import PlanMismatch
from draftsmith.data.sources import Conversation, check_gsm8k, load_regenerated

from conftest import tiny_target_for

MAX_NEW = 5


@pytest.fixture(scope="module")
def tokenizer(smol_tokenizer):
    return smol_tokenizer


@pytest.fixture(scope="module")
def target(tokenizer):
    return tiny_target_for(tokenizer, seed=0)


def single_turn(n: int, source: str = "test") -> list[Conversation]:
    return [Conversation(id=f"q{i}", source=source,
                         messages=[{"role": "user", "content": f"Question number {i}: what is {i} + {i}?"},
                                   {"role": "assistant", "content": f"The answer is {2 * i}."}],
                         reference=str(2 * i))
            for i in range(n)]


def cfg_for(tmp_path, **kw) -> RegenerateConfig:
    base = dict(target="tiny-llama", source=None, output_dir=str(tmp_path), max_new_tokens=MAX_NEW,
                batch_size=2, shard_size=2, rank=0, world_size=1, progress=False)
    base.update(kw)
    return RegenerateConfig(**base)


def shard_texts(d) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(d.glob("shard_*.jsonl"))}


def test_writes_shards_index_and_rerun_is_noop(tmp_path, target):
    convs = single_turn(5)
    res = regenerate(cfg_for(tmp_path), target=target, records=convs)
    assert (res.shards_written, res.shards_skipped, res.items_written) == (3, 0, 5)
    assert sorted(shard_texts(tmp_path)) == ["shard_0_00000.jsonl", "shard_0_00001.jsonl", "shard_0_00002.jsonl"]
    assert not list(tmp_path.glob("*.tmp"))
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["complete"] and index["n_items"] == 5 and index["model"] == "tiny-llama"
    assert [(s["file"], s["n_items"], s["n_written"]) for s in index["shards"]] == [
        ("shard_0_00000.jsonl", 2, 2), ("shard_0_00001.jsonl", 2, 2), ("shard_0_00002.jsonl", 1, 1)]

    out = load_regenerated(tmp_path)
    assert [c.id for c in out] == [c.id for c in convs]
    for old, new in zip(convs, out):
        assert new.messages[0] == old.messages[0]  # user turn kept
        assert [m["role"] for m in new.messages] == ["user", "assistant"]
        assert new.messages[1]["content"] != old.messages[1]["content"]
        mark = new.meta["regenerated"]
        assert mark["model"] == "tiny-llama" and mark["original_id"] == old.id and mark["turns"] == 1
        # Greedy replies equal a direct batch-1 generate from the prompt ids.
        ids = torch.tensor([prompt_ids(target.tokenizer, old.prompt_messages())])
        ref = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                    do_sample=False, eos_token_id=[target.tokenizer.eos_token_id],
                                    pad_token_id=target.tokenizer.eos_token_id)[0, ids.shape[1]:].tolist()
        if target.tokenizer.eos_token_id in ref:
            ref = ref[: ref.index(target.tokenizer.eos_token_id)]
        assert new.messages[1]["content"] == target.tokenizer.decode(ref, skip_special_tokens=True).strip()

    before = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("shard_*")}
    again = regenerate(cfg_for(tmp_path), target=target, records=convs)
    assert (again.shards_written, again.shards_skipped) == (0, 3)
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("shard_*")} == before


def test_crash_then_rerun_resumes_without_duplicates(tmp_path, target, monkeypatch):
    convs = single_turn(6)
    ref_dir, crash_dir = tmp_path / "ref", tmp_path / "crash"
    regenerate(cfg_for(ref_dir, temperature=0.8, top_p=0.9, seed=3, batch_size=1), target=target, records=convs)

    real = regen.generate_replies
    calls = {"n": 0}

    def dying(*args, **kwargs):  # batch 1: dies in the second batch of the second shard
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt("simulated kill")
        return real(*args, **kwargs)

    cfg = cfg_for(crash_dir, temperature=0.8, top_p=0.9, seed=3, batch_size=1)
    monkeypatch.setattr(regen, "generate_replies", dying)
    with pytest.raises(KeyboardInterrupt):
        regenerate(cfg, target=target, records=convs)
    monkeypatch.setattr(regen, "generate_replies", real)
    assert sorted(shard_texts(crash_dir)) == ["shard_0_00000.jsonl"]
    assert not json.loads((crash_dir / "index.json").read_text())["complete"]
    (crash_dir / "shard_0_00001.jsonl.999.tmp").write_text("half a shard")  # a kill -9 leftover

    partial = load_regenerated(crash_dir)
    assert [c.id for c in partial] == ["q0", "q1"]
    with pytest.raises(RuntimeError, match="incomplete"):
        load_regenerated(crash_dir, require_complete=True)

    res = regenerate(cfg, target=target, records=convs)
    assert (res.shards_written, res.shards_skipped) == (2, 1)
    assert not list(crash_dir.glob("*.tmp"))  # the killed run's leftovers are cleaned up
    # Same shards, same (sampled) text as the uninterrupted run; every item exactly once.
    assert shard_texts(crash_dir) == shard_texts(ref_dir)
    assert [c.id for c in load_regenerated(crash_dir, require_complete=True)] == [c.id for c in convs]


def test_max_shards_stops_and_rerun_continues(tmp_path, target):
    convs = single_turn(5)
    first = regenerate(cfg_for(tmp_path, max_shards=1), target=target, records=convs)
    assert first.stopped_early and first.shards_written == 1
    second = regenerate(cfg_for(tmp_path), target=target, records=convs)
    assert (second.shards_written, second.shards_skipped) == (2, 1)
    assert len(load_regenerated(tmp_path, require_complete=True)) == 5


def test_multi_turn_replay_keeps_user_turns(tmp_path, target):
    tok = target.tokenizer
    convs = [
        Conversation(id="mt", source="test", messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."},
            {"role": "user", "content": "Another one?"}, {"role": "assistant", "content": "Blue."}]),
        Conversation(id="fu", source="test", messages=[{"role": "user", "content": "Say hi."}],
                     followups=["Now say bye."]),
        Conversation(id="one", source="test", messages=[{"role": "user", "content": "Count to three."}]),
    ]
    assert context_chunks(convs[0]) == [convs[0].messages[:2], [convs[0].messages[3]]]
    regenerate(cfg_for(tmp_path, batch_size=3, shard_size=8), target=target, records=convs)
    out = {c.id: c for c in load_regenerated(tmp_path)}

    def reference(chunks):  # sequential batch-1 replay with the regenerated history
        msgs = []
        for chunk in chunks:
            msgs = msgs + chunk
            ids = torch.tensor([prompt_ids(tok, msgs)])
            new = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                        do_sample=False, eos_token_id=[tok.eos_token_id],
                                        pad_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
            if tok.eos_token_id in new:
                new = new[: new.index(tok.eos_token_id)]
            msgs = msgs + [{"role": "assistant", "content": tok.decode(new, skip_special_tokens=True).strip()}]
        return msgs

    mt = out["mt"]
    assert [m["role"] for m in mt.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert [mt.messages[i] for i in (0, 1, 3)] == [convs[0].messages[i] for i in (0, 1, 3)]
    assert mt.messages[2]["content"] != "Red." and mt.meta["regenerated"]["turns"] == 2
    assert mt.messages == reference(context_chunks(convs[0]))
    fu = out["fu"]
    assert [m["content"] for m in fu.messages if m["role"] == "user"] == ["Say hi.", "Now say bye."]
    assert fu.followups == [] and fu.messages == reference(context_chunks(convs[1]))
    assert out["one"].messages == reference(context_chunks(convs[2]))


def test_world_size_two_covers_every_item_once(tmp_path, target):
    convs = single_turn(7)
    r0 = regenerate(cfg_for(tmp_path, rank=0, world_size=2), target=target, records=convs)
    assert sorted(shard_texts(tmp_path)) == ["shard_0_00000.jsonl", "shard_0_00001.jsonl"]  # items 0 2 | 4 6
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["ranks_done"] == [0] and not index["complete"]
    r1 = regenerate(cfg_for(tmp_path, rank=1, world_size=2), target=target, records=convs)
    assert r0.items_written + r1.items_written == 7
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["complete"] and index["ranks_done"] == [0, 1]
    assert {s["file"] for s in index["shards"]} == set(shard_texts(tmp_path))
    items = [c.meta["regenerated"]["item"] for c in load_regenerated(tmp_path, require_complete=True)]
    assert items == list(range(7))
    with open(tmp_path / "shard_1_00000.jsonl") as f:
        assert [json.loads(line)["meta"]["regenerated"]["item"] for line in f] == [1, 3]


def test_rank_from_environment_and_plan_mismatch(tmp_path, target, monkeypatch):
    convs = single_turn(3)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    res = regenerate(cfg_for(tmp_path, rank=None, world_size=None), target=target, records=convs)
    assert (res.rank, res.world_size, res.items_written) == (1, 3, 1)
    with pytest.raises(PlanMismatch, match="max_new_tokens"):
        regenerate(cfg_for(tmp_path, rank=None, world_size=None, max_new_tokens=7), target=target, records=convs)
    with pytest.raises(PlanMismatch, match="items_sha256"):
        regenerate(cfg_for(tmp_path, rank=None, world_size=None), target=target, records=single_turn(4))


def test_checker_marks_or_drops(tmp_path, target):
    convs = single_turn(4, source="odd-is-wrong")
    checkers = {"odd-is-wrong": lambda c: int(c.id[1:]) % 2 == 0}
    regenerate(cfg_for(tmp_path / "mark"), target=target, records=convs, checkers=checkers)
    marks = [c.meta["regenerated"]["correct"] for c in load_regenerated(tmp_path / "mark")]
    assert marks == [True, False, True, False]
    res = regenerate(cfg_for(tmp_path / "drop", filter_wrong=True), target=target, records=convs, checkers=checkers)
    assert res.dropped == {"wrong_answer": 2} and res.items_written == 2
    assert [c.id for c in load_regenerated(tmp_path / "drop")] == ["q0", "q2"]
    index = json.loads((tmp_path / "drop" / "index.json").read_text())
    assert sum(s["dropped"].get("wrong_answer", 0) for s in index["shards"]) == 2


def test_check_gsm8k():
    def conv(reply, ref="72"):
        return Conversation(id="g", source="gsm8k", reference=ref, messages=[
            {"role": "user", "content": "q"}, {"role": "assistant", "content": reply}])

    assert check_gsm8k(conv("48 + 24 = 72 clips.\n#### 72")) is True
    assert check_gsm8k(conv("So she sold $72.00 in total.")) is True
    assert check_gsm8k(conv("The answer is 71.")) is False
    assert check_gsm8k(conv("no idea")) is False
    assert check_gsm8k(conv("72", ref=None)) is None


def test_config_rejects_unknown_keys_and_bad_values():
    with pytest.raises(ValueError, match="max_new_tokenz"):
        config_from_dict(RegenerateConfig, {"target": "m", "source": "gsm8k", "output_dir": "x", "max_new_tokenz": 3})
    with pytest.raises(ValueError, match="temperature"):
        RegenerateConfig(target="m", source="gsm8k", output_dir="x", temperature=-1)
    args = load_config(RegenerateConfig, None, ["target=m", "source=gsm8k:train", "limit=64", "output_dir=o",
                                                "filter_wrong=true"])
    assert args.limit == 64 and args.filter_wrong and args.temperature == 0.0


def test_unanswerable_records_are_dropped_and_counted(tmp_path, target):
    convs = single_turn(2) + [Conversation(id="sys-only", source="test",
                                           messages=[{"role": "system", "content": "Nothing to answer."}])]
    res = regenerate(cfg_for(tmp_path / "a", shard_size=4), target=target, records=convs)
    assert res.dropped == {"no_user_turn": 1} and res.items_written == 2
    res = regenerate(cfg_for(tmp_path / "b", shard_size=4, max_prompt_tokens=5), target=target, records=convs)
    assert res.dropped == {"prompt_too_long": 2, "no_user_turn": 1} and res.items_written == 0
    assert load_regenerated(tmp_path / "b") == []


def test_batches_group_prompts_of_similar_length(target, monkeypatch):
    """Left padding makes a batch as long as its longest prompt: replay batches by length, and every
    conversation still gets its own reply."""
    convs = [Conversation(id=f"c{i}", source="test", messages=[{"role": "user", "content": "word " * n}])
             for i, n in enumerate([200, 3, 150, 5, 180, 4])]
    seen = []

    def fake_generate(backend, prompts, cfg):
        seen.append(sorted(len(p) for p in prompts))
        return [(f"reply to {len(p)}", True) for p in prompts]

    monkeypatch.setattr(regen, "generate_replies", fake_generate)
    backend = regen.GenerationBackend(target.model, target.tokenizer, stop_ids=[], pad_id=0)
    cfg = RegenerateConfig(target="tiny-llama", source=None, output_dir="unused", batch_size=3, max_new_tokens=2)
    results = regen.replay_batch(backend, convs, cfg, None)
    assert max(seen[0]) < min(seen[1])  # the three short prompts together, then the three long ones
    for conv, (out, _) in zip(convs, results):
        prompt_length = len(prompt_ids(target.tokenizer, conv.messages))
        assert out.id == conv.id and out.messages[-1]["content"] == f"reply to {prompt_length}"


def test_regen_report_counts_conversations_tokens_and_rates(tmp_path, target, tokenizer):
    from draftsmith.errors import UserError
    from draftsmith.scripts import regen_report

    regenerate(cfg_for(tmp_path / "part"), target=target, records=single_turn(5))
    part = regen_report.part_report(tmp_path / "part", tokenizer)
    replies = [c.messages[1]["content"] for c in load_regenerated(tmp_path / "part")]
    assert (part["conversations"], part["planned"], part["shards_done"]) == (5, 5, 3)
    assert part["answer_tokens"] == sum(len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in replies)
    assert part["seconds"] > 0 and part["tokens_per_s"] == pytest.approx(part["answer_tokens"] / part["seconds"])
    assert "| **all** | 5 |" in regen_report.markdown([part])
    with pytest.raises(FileNotFoundError, match="neither progress_rank"):
        regen_report.part_report(tmp_path, tokenizer)
    (tmp_path / "report.md").write_text("an earlier report")
    with pytest.raises(UserError, match="report.md exists: pass --overwrite"):  # before any model is loaded
        regen_report.main([str(tmp_path / "part"), "--out", str(tmp_path / "report")])
    assert (tmp_path / "report.md").read_text() == "an earlier report"


def test_skip_continues_past_an_earlier_limit(tmp_path, target):
    convs = single_turn(7)
    regenerate(cfg_for(tmp_path / "first", limit=4), target=target, records=convs)
    regenerate(cfg_for(tmp_path / "rest", skip=4, limit=2), target=target, records=convs)
    assert [c.id for c in load_regenerated(tmp_path / "first")] == ["q0", "q1", "q2", "q3"]
    assert [c.id for c in load_regenerated(tmp_path / "rest")] == ["q4", "q5"]
    assert json.loads((tmp_path / "rest" / "progress_rank0.json").read_text())["plan"]["skip"] == 4
    assert "skip" not in json.loads((tmp_path / "first" / "progress_rank0.json").read_text())["plan"]
