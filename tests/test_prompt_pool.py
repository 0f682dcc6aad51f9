"""scripts/jobs/prompt_pool.py: the prompt pool a GPU regeneration job answers (first turns, test suites out)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from draftsmith.data.sources import Conversation, load_source

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "jobs" / "prompt_pool.py"


def _module():
    spec = importlib.util.spec_from_file_location("prompt_pool", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cut_keeps_what_precedes_the_first_reply():
    pool = _module()
    conv = Conversation(id="a", source="x", messages=[
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}])
    assert [m["content"] for m in pool.first_prompt(conv).messages] == ["be brief", "hi"]
    lone = Conversation(id="b", source="x", messages=[{"role": "assistant", "content": "orphan"}])
    assert pool.first_prompt(lone) is None


def test_test_suite_prompts_never_enter_the_pool(tmp_path):
    pool = _module()
    mt_bench, breadth = load_source("mt-bench")[0], load_source("breadth")[0]
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "  " + mt_bench.messages[0]["content"].upper() + " "},  # normalised: still a test prompt
             {"prompt": mt_bench.followups[0]},  # MT-Bench's second turn
             {"prompt": breadth.messages[-1]["content"]},
             {"prompt": "Write a haiku about rivers."}, {"prompt": "Sum 2 and 3."}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "pool.jsonl.gz"
    assert pool.main([str(out), "--sources", f"jsonl:{prompts}"]) == 0
    with gzip.open(out, "rt") as f:
        kept = [json.loads(line)["messages"][-1]["content"] for line in f]
    assert sorted(kept) == ["Sum 2 and 3.", "Write a haiku about rivers."]
    assert [c.messages[-1]["content"] for c in load_source(f"conversations:{out}")] == kept
