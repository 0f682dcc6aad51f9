"""data/sources/: every loader on small files written here, plus the real bundled data."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from draftsmith.data.sources import (
    gsm8k_dir,
    Conversation,
    bundled_sharegpt_path,
    gsm8k_final_answer,
    iter_json_records,
    load_alpaca,
    load_conversations,
    load_gsm8k,
    load_hf_dataset,
    load_humaneval,
    load_jsonl_prompts,
    load_mt_bench,
    load_sharegpt,
    load_source,
    read_sharegpt,
    save_conversations,
    strip_gsm8k_calculator,
)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def turns(*pairs: tuple[str, str]) -> list[dict]:
    return [{"from": f, "value": v} for f, v in pairs]


SHAREGPT_ITEMS = [
    {"id": "ok", "conversations": turns(("human", "hi"), ("gpt", "hello"), ("human", "bye"), ("gpt", "ciao"))},
    {"id": "sys", "conversations": turns(("system", "be nice"), ("human", "q"), ("gpt", "a"))},
    {"id": "lead", "conversations": turns(("gpt", "I start"), ("human", "q"), ("gpt", "a"))},
    {"id": "openai", "messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]},
    {"id": "prompt-only", "conversations": turns(("human", "only a question"))},
    {"id": "empty", "conversations": turns(("human", "q"), ("gpt", "  "))},
    {"id": "role", "conversations": turns(("narrator", "q"), ("gpt", "a"))},
    {"id": "alt", "conversations": turns(("human", "q"), ("human", "q2"), ("gpt", "a"))},
    {"id": "none", "conversations": []},
    "not an object",
]
GOOD_IDS = ["ok", "sys", "lead", "openai", "prompt-only"]


def roles(c: Conversation) -> list[str]:
    return [m["role"] for m in c.messages]


# ---------------------------------------------------------------------------
# ShareGPT
# ---------------------------------------------------------------------------


def test_sharegpt_json_array(tmp_path):
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(SHAREGPT_ITEMS, indent=2), encoding="utf-8")
    convs, report = read_sharegpt(p)
    assert [c.id for c in convs] == GOOD_IDS
    assert report.kept == 5 and not report.truncated
    assert dict(report.skipped) == {
        "empty_message": 1,
        "unknown_role": 1,
        "not_alternating": 1,
        "no_turns": 1,
        "not_an_object": 1,
    }
    by_id = {c.id: c for c in convs}
    assert by_id["ok"].messages == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "bye"},
        {"role": "assistant", "content": "ciao"},
    ]
    assert roles(by_id["sys"]) == ["system", "user", "assistant"]
    assert roles(by_id["lead"]) == ["user", "assistant"]  # leading assistant turn dropped
    assert roles(by_id["openai"]) == ["user", "assistant"]
    assert not by_id["prompt-only"].has_response
    assert all(c.source == "sharegpt" for c in convs)


def test_sharegpt_truncated_file(tmp_path):
    text = json.dumps(SHAREGPT_ITEMS[:3], indent=2)
    cut = text.rfind('"value"')  # cut inside the last record
    p = tmp_path / "cut.json"
    p.write_text(text[:cut], encoding="utf-8")
    convs, report = read_sharegpt(p)
    assert [c.id for c in convs] == ["ok", "sys"]
    assert report.truncated


def test_sharegpt_jsonl_skips_bad_lines(tmp_path):
    p = tmp_path / "sg.jsonl"
    lines = [json.dumps(SHAREGPT_ITEMS[0]), "{this is not json", json.dumps(SHAREGPT_ITEMS[1])]
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    convs, report = read_sharegpt(p)
    assert [c.id for c in convs] == ["ok", "sys"]
    assert report.skipped["bad_json"] == 1


def test_sharegpt_limit(tmp_path):
    p = write_jsonl(tmp_path / "sg.jsonl", SHAREGPT_ITEMS)
    assert [c.id for c in load_sharegpt(p, limit=2)] == ["ok", "sys"]


def test_bundled_sharegpt_truncated_dump():
    t0 = time.perf_counter()
    convs, report = read_sharegpt(bundled_sharegpt_path())
    elapsed = time.perf_counter() - t0
    assert report.truncated
    assert len(convs) > 17000
    assert report.kept + report.n_skipped > 17500  # ~17.6k complete items survive the cut
    for c in convs:
        body = c.messages[1:] if c.messages[0]["role"] == "system" else c.messages
        assert [m["role"] for m in body] == ["user", "assistant"][: len(body)] * (len(body) // 2) + (
            ["user"] if len(body) % 2 else []
        )
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in c.messages)
    assert sum(c.has_response for c in convs) > 16000
    assert elapsed < 20, f"parsing the bundled ShareGPT took {elapsed:.1f}s"


# ---------------------------------------------------------------------------
# Alpaca, JSONL prompts, saved conversations
# ---------------------------------------------------------------------------


def test_alpaca(tmp_path):
    rows = [
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
        {"instruction": "Open question."},
        {"instruction": "", "output": "dropped"},
    ]
    p = tmp_path / "alpaca.json"
    p.write_text(json.dumps(rows), encoding="utf-8")
    convs = load_alpaca(p)
    assert len(convs) == 3
    assert convs[0].messages == [
        {"role": "user", "content": "Add the numbers.\n\n2 and 3"},
        {"role": "assistant", "content": "5"},
    ]
    assert convs[1].messages[0]["content"] == "Say hi."
    assert roles(convs[2]) == ["user"]
    assert load_alpaca(write_jsonl(tmp_path / "alpaca.jsonl", rows))[0].messages == convs[0].messages


def test_jsonl_prompts(tmp_path):
    p = write_jsonl(
        tmp_path / "p.jsonl",
        [{"prompt": "first", "id": "a"}, {"prompt": "second"}, "bare string prompt", {"other": "no prompt"}],
    )
    convs = load_jsonl_prompts(p)
    assert [c.messages[0]["content"] for c in convs] == ["first", "second", "bare string prompt"]
    assert convs[0].id == "a" and convs[1].id == "jsonl-1"
    q = write_jsonl(tmp_path / "q.jsonl", [{"text": "t", "sys": "s", "out": "o"}])
    (c,) = load_jsonl_prompts(q, field="text", response_field="out", system_field="sys")
    assert c.messages == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "t"},
        {"role": "assistant", "content": "o"},
    ]


def test_conversation_roundtrip_and_validation(tmp_path):
    c = Conversation(
        id="x",
        source="t",
        messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        reference="1",
        category="math",
        followups=["and?"],
        meta={"k": [1, 2]},
    )
    p = save_conversations(tmp_path / "out" / "c.jsonl", [c, c])
    assert load_conversations(p) == [c, c]
    assert load_source(f"conversations:{p}") == [c, c]
    assert c.prompt_messages() == [{"role": "user", "content": "q"}]
    with pytest.raises(ValueError, match="must end with a user message"):
        c.next_turn("a2")
    asked = Conversation(id="y", source="t", messages=c.prompt_messages(), followups=["and?"])
    nxt = asked.next_turn("a")
    assert nxt.messages == c.messages + [{"role": "user", "content": "and?"}] and nxt.followups == []
    assert asked.followups == ["and?"]  # not mutated
    with pytest.raises(ValueError, match="no follow-up"):
        nxt.next_turn("again")
    with pytest.raises(ValueError, match="role"):
        Conversation(id="bad", source="t", messages=[{"role": "human", "content": "q"}])
    with pytest.raises(ValueError, match="unknown Conversation field"):
        Conversation.from_dict({**c.to_dict(), "extra": 1})


# ---------------------------------------------------------------------------
# HF datasets (local files only: the hub is not reachable from tests)
# ---------------------------------------------------------------------------


def test_hf_dataset_local_file_and_columns(tmp_path):
    p = write_jsonl(
        tmp_path / "qa.jsonl",
        [{"question": "q1", "answer": "a1", "uid": 7}, {"question": "q2", "answer": "a2", "uid": 8}],
    )
    auto = load_hf_dataset(str(p))
    assert [c.messages for c in auto] == [
        [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}],
        [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}],
    ]
    mapped = load_hf_dataset(str(p), columns={"prompt": "question", "reference": "answer", "id": "uid"})
    assert [(c.id, roles(c), c.reference) for c in mapped] == [("7", ["user"], "a1"), ("8", ["user"], "a2")]
    assert load_source(f"hf:{p}")[0].messages == auto[0].messages
    with pytest.raises(ValueError, match="unknown column-mapping key"):
        load_hf_dataset(str(p), columns={"promt": "question"})
    with pytest.raises(ValueError, match="available columns"):
        load_hf_dataset(str(p), columns={"prompt": "nope"})


def test_hf_dataset_saved_to_disk_with_messages(tmp_path):
    import datasets

    msgs = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]]
    datasets.Dataset.from_dict({"messages": msgs, "category": ["chat"]}).save_to_disk(str(tmp_path / "ds"))
    (c,) = load_hf_dataset(str(tmp_path / "ds"))
    assert c.messages == msgs[0] and c.category == "chat"
    datasets.DatasetDict({"test": datasets.Dataset.from_dict({"prompt": ["p"]})}).save_to_disk(str(tmp_path / "dd"))
    (d,) = load_source(f"hf:{tmp_path / 'dd'},split=test")
    assert d.messages == [{"role": "user", "content": "p"}]


# ---------------------------------------------------------------------------
# Benchmarks
# ---------------------------------------------------------------------------


def test_mt_bench():
    convs = load_mt_bench()
    assert len(convs) == 80
    assert all(roles(c) == ["user"] and len(c.followups) == 1 for c in convs)
    assert len({c.category for c in convs}) == 8
    assert sum(c.reference is not None for c in convs) > 0
    two = convs[0].next_turn("first answer")
    assert roles(two) == ["user", "assistant", "user"]
    assert two.messages[2]["content"] == convs[0].followups[0]
    assert len(load_source("mt-bench")) == 80


@pytest.mark.skipif(not gsm8k_dir().is_dir(), reason=f"no local GSM8K copy at {gsm8k_dir()}")
def test_gsm8k_local():
    test = load_gsm8k("test")
    assert len(test) == 1319
    assert len(load_source("gsm8k:train")) == 7473
    raw = next(iter_json_records(gsm8k_dir() / "test.jsonl"))
    c = test[0]
    assert c.messages[0] == {"role": "user", "content": raw["question"]}
    assert c.reference == gsm8k_final_answer(raw["answer"]) == raw["answer"].rsplit("####", 1)[1].strip()
    assert all("<<" not in t.messages[1]["content"] for t in test)
    assert all(t.reference is not None for t in test)
    assert roles(load_gsm8k("test", with_answer=False, limit=1)[0]) == ["user"]


def test_gsm8k_explicit_path(tmp_path):
    write_jsonl(tmp_path / "test.jsonl", [{"question": "1+1?", "answer": "1+1 = <<1+1=2>>2\n#### 2"}])
    (c,) = load_gsm8k("test", path=tmp_path)
    assert c.messages[1]["content"] == "1+1 = 2\n#### 2" and c.reference == "2"
    with pytest.raises(FileNotFoundError, match="train.jsonl"):
        load_gsm8k("train", path=tmp_path)


def test_gsm8k_final_answer():
    assert gsm8k_final_answer("so 3 + 4 = 7\n#### 1,234") == "1234"
    assert gsm8k_final_answer("#### $18.50") == "18.5"
    assert gsm8k_final_answer("#### -3") == "-3"
    assert gsm8k_final_answer("The answer is \\boxed{42}.") == "42"
    assert gsm8k_final_answer("She has 3 apples, then 5, so 8 in total.") == "8"
    assert gsm8k_final_answer("It costs 72.00 dollars.") == "72"
    assert gsm8k_final_answer("between 3-4 hours") == "4"
    assert gsm8k_final_answer("no digits here") is None
    assert strip_gsm8k_calculator("48/2 = <<48/2=24>>24") == "48/2 = 24"


def test_humaneval():
    convs = load_humaneval()
    assert len(convs) == 164
    c = convs[0]
    assert c.id == "HumanEval/0" and c.meta["entry_point"] == "has_close_elements"
    assert c.meta["prompt"] in c.messages[0]["content"] and "def check" in c.meta["test"]
    assert load_humaneval(instruction=None, limit=1)[0].messages[0]["content"] == c.meta["prompt"]


# ---------------------------------------------------------------------------
# Dispatcher
# ---------------------------------------------------------------------------


def test_load_source_dispatch(tmp_path):
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps(SHAREGPT_ITEMS), encoding="utf-8")
    assert [c.id for c in load_source(f"sharegpt:{sg}")] == GOOD_IDS
    assert len(load_source({"kind": "sharegpt", "path": str(sg), "limit": 2})) == 2
    assert len(load_source(f"sharegpt:{sg}", limit=3)) == 3
    assert len(load_source("sharegpt", limit=5)) == 5  # bundled file, stops early
    p = write_jsonl(tmp_path / "p.jsonl", [{"text": "a"}, {"text": "b"}])
    assert [c.messages[0]["content"] for c in load_source({"kind": "jsonl", "path": str(p), "field": "text"})] == ["a", "b"]
    al = write_jsonl(tmp_path / "al.jsonl", [{"instruction": "i", "output": "o"}])
    assert roles(load_source(f"alpaca:{al}")[0]) == ["user", "assistant"]
    assert len(load_source("mt_bench", limit=4)) == 4  # alias
    assert load_source("humaneval", limit=1)[0].source == "humaneval"


def test_load_source_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown source kind 'sharegtp'.*valid kinds: sharegpt.*gsm8k.*mt-bench"):
        load_source("sharegtp:/x.json")
    with pytest.raises(FileNotFoundError, match=r"file not found: '/no/such/file.json'.*usage: sharegpt"):
        load_source("sharegpt:/no/such/file.json")
    with pytest.raises(FileNotFoundError, match="file not found"):
        load_source({"kind": "jsonl", "path": str(tmp_path / "missing.jsonl")})
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['splt'\]"):
        load_source({"kind": "gsm8k", "splt": "train"})
    with pytest.raises(ValueError, match="takes no argument"):
        load_source("mt-bench:extra")
    with pytest.raises(ValueError, match="needs a 'kind'"):
        load_source({"path": "x"})
    f = write_jsonl(tmp_path / "bare.jsonl", [{"prompt": "x"}])
    with pytest.raises(ValueError, match="looks like a path"):
        load_source(str(f))
    with pytest.raises(ValueError, match=r"unknown source kind 'missing.jsonl' \(nor a file: .* does not exist"):
        load_source("missing.jsonl")


def test_the_benchmarks_suites_are_refused_as_sources_and_their_neighbours_are_not():
    """Every suite the benches score (eval.prompts.SUITES) is one of data.sources.TEST_SUITE_SPECS: refused as a
    training source in any spelling (an option left out takes the loader's default: bare gsm8k is the train split)."""
    from draftsmith.data.sources import refuse_test_suite
    from draftsmith.errors import UserError
    from draftsmith.eval.prompts import SUITES

    for spec in [*SUITES.values(), "breadth:qa", {"kind": "gsm8k", "split": "test"}, "sharegpt + gsm8k:test"]:
        with pytest.raises(UserError, match="is a test suite the benchmarks score"):
            refuse_test_suite(spec)
    for spec in ["gsm8k", "gsm8k:train", {"kind": "gsm8k"}, "sharegpt + gsm8k:train", "leetcode"]:
        refuse_test_suite(spec)


def test_python_docstrings_are_the_same_in_every_process():
    """A resumed regeneration checks the items' digest: prompts must not carry per-process reprs (memory
    addresses of sentinel defaults such as configparser's `fallback=<object object at 0x...>`, or the
    environment that `cgi.parse(environ=os.environ)` prints, which differs under nohup)."""
    import os
    import subprocess
    import sys

    code = ("import hashlib; from draftsmith.data.sources import load_python_docstrings as load; "
            "print(hashlib.sha256(''.join(c.messages[0]['content'] for c in load()).encode()).hexdigest())")
    environments = [dict(os.environ), dict(os.environ, DRAFTSMITH_TEST_SHELL_LEVEL="7", SHLVL="0")]
    digests = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env=env).stdout for env in environments}
    assert len(digests) == 1 and len(next(iter(digests)).strip()) == 64


def test_python_docstring_signatures_spell_out_only_literal_defaults():
    from draftsmith.data.sources import load_python_docstrings

    prompts = {c.id: c.messages[0]["content"] for c in load_python_docstrings()}
    assert "environ=..." in prompts["pydoc-cgi.parse"] and "IS_SANDBOX" not in prompts["pydoc-cgi.parse"]
    assert not any(" at 0x" in text for text in prompts.values())


def test_python_source_answers_are_the_standard_librarys_own_code():
    """The human-written code source: each answer is the function's real source, which parses and defines
    the function asked for; the docstring prompts are the same as python-docstrings'."""
    import ast

    from draftsmith.data.sources import load_python_docstrings, load_source

    convs = load_source("python-source")
    assert len(convs) > 2000 and len({c.id for c in convs}) == len(convs)
    asked = {c.id.removeprefix("pydoc-"): c.messages[0]["content"] for c in load_python_docstrings()}
    for conv in convs[::50]:
        user, answer = conv.messages
        assert (user["role"], answer["role"]) == ("user", "assistant") and conv.source == "python-source"
        code = answer["content"].removeprefix("```python\n").removesuffix("\n```")
        name = conv.id.rpartition(".")[2]
        assert any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
                   for node in ast.walk(ast.parse(code)))
        key = conv.id.removeprefix("pysrc-")
        assert key not in asked or asked[key] == user["content"]
    assert [c.id for c in load_source("python-source:limit=2")] == [c.id for c in convs[:2]]


def test_leetcode_prompts_are_problem_statements_in_number_order():
    from draftsmith.data.sources import load_source

    convs = load_source("leetcode")
    assert len(convs) > 1000 and len({c.id for c in convs}) == len(convs)
    numbers = [c.meta["number"] for c in convs]
    assert numbers == sorted(numbers) and convs[0].id == "leetcode-1"
    first = convs[0].messages[0]["content"]
    assert "# Two Sum" in first and "Example 1:" in first and "Constraints:" in first
    assert all(c.source == "leetcode" and c.reference is None for c in convs)
    assert [c.id for c in load_source({"kind": "leetcode", "limit": 3})] == [c.id for c in convs[:3]]


def test_a_mixture_reports_its_mix(tmp_path):
    """Each part of `a + b` is counted: records and loss-bearing tokens after max_length (the mix a run reports)."""
    from draftsmith.data.records import load_records, write_records

    write_records(tmp_path / "a.jsonl", [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}] * 2)
    write_records(tmp_path / "b.jsonl", [{"input_ids": [5, 6, 7], "loss_mask": [0, 0, 1]}])
    stats = {}
    spec = f"records:{tmp_path / 'a.jsonl'} + records:{tmp_path / 'b.jsonl'}"
    records = load_records(spec, max_length=3, stats=stats)
    assert len(records) == 3 and stats["kept"] == 3
    assert stats["mix"] == {f"records:{tmp_path / 'a.jsonl'}": {"records": 2, "loss_tokens": 4},
                            f"records:{tmp_path / 'b.jsonl'}": {"records": 1, "loss_tokens": 1}}


def test_packed_records_round_trip_and_refuse_other_files(tmp_path):
    """records:<file>.npz reads back exactly what write_packed_records wrote (uint16 ids where they fit, int32
    beyond); a file that is not one is refused in one line."""
    from draftsmith.data.records import load_records, write_packed_records
    from draftsmith.errors import UserError

    small = [{"input_ids": [1, 2, 3, 65535], "loss_mask": [0, 1, 1, 1]}, {"input_ids": [7], "loss_mask": [1]}]
    large = [{"input_ids": [151665, 0, 9], "loss_mask": [0, 0, 1]}]
    for records in (small, large):
        path = write_packed_records(tmp_path / "r.npz", records)
        assert load_records(f"records:{path}") == records
    import numpy as np

    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(UserError, match="not a packed records file"):
        load_records(f"records:{tmp_path / 'other.npz'}")


def test_breadth_prompts_cover_four_kinds_on_disjoint_passages():
    """Translation, summarization, extraction and QA prompts over the standard library's
    Language Reference topics; each passage serves one kind only, and a wrong kind is one clear line."""
    from draftsmith.data.sources import load_source
    from draftsmith.errors import UserError

    every = load_source("breadth")
    kinds = {c.category for c in every}
    assert kinds == {"translation", "summarization", "extraction", "qa"} and len(every) >= 40
    topics = [c.meta["topic"] for c in every]
    assert len(topics) == len(set(topics))
    qa = load_source("breadth:qa")
    assert qa and all(c.category == "qa" and "Question:" in c.messages[0]["content"] for c in qa)
    with pytest.raises(UserError, match="valid kinds: translation, summarization, extraction, qa"):
        load_source("breadth:poetry")


def test_pack_refuses_an_existing_output_in_one_line(tmp_path, capsys):
    """`python -m draftsmith.data.records pack` never replaces a file without --overwrite."""
    from draftsmith.data.records import main
    from draftsmith.errors import run_main

    out = tmp_path / "r.npz"
    out.write_bytes(b"mine")
    for argv in (["pack", "gsm8k:train", str(out), "--target", "tiny:llama"],
                 ["command=pack", "spec=gsm8k:train", f"out={out}", "target=tiny:llama"]):  # flags or key=value
        assert run_main(main, argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and "--overwrite" in err
    assert out.read_bytes() == b"mine"
