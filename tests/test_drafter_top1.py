"""eval/drafter_top1.py: teacher-forced top-1 of a feature drafter on a bench's own greedy outputs."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_target_for
from draftsmith.errors import run_main
from draftsmith.eval.bench.run import BenchConfig, run_benchmark
from draftsmith.eval.drafter_top1 import decoder_acceptance, hit_rates, main, measure_top1, pair_hits
from draftsmith.eval.bench.methods import parse_method
from draftsmith.models.artifacts import load_dgf, save_dgf, target_block
from draftsmith.models.dgf import DGFConfig, DGFModel
from draftsmith.models.target import TargetModel


def test_pair_t_is_checked_against_the_target_token_after_x_t_plus_1():
    # prompt of 3 tokens, 3 generated: pairs t = 2, 3 draft positions 4, 5 (greedy[3], greedy[4])
    greedy = torch.tensor([10, 11, 12, 13, 14, 15])
    guess = torch.tensor([0, 0, 13, 99, 0])  # pair 2 right, pair 3 wrong; pairs 0-1 (prompt) and 4 are not counted
    assert pair_hits(guess, greedy, prompt_length=3).tolist() == [True, False]


def test_hit_rates_split_by_the_previous_pair():
    hits = [torch.tensor([True, True, False, True]), torch.tensor([False, False])]
    rates = hit_rates(hits)
    assert rates["positions"] == 6 and rates["top1"] == 0.5
    assert rates["top1_after_hit"] == 0.5  # pairs after a hit: True, False
    assert rates["top1_after_miss"] == 0.5  # pairs after a miss: True (first list), False (second)


def test_top1_per_suite_beside_the_decoder_acceptance(smol_tokenizer, tmp_path):
    tiny = tiny_target_for(smol_tokenizer, seed=0)
    target = TargetModel(tiny.model, smol_tokenizer, name="tiny-target")
    torch.manual_seed(0)
    drafter = DGFModel(DGFConfig.for_target(tiny.model.config, num_blocks=1)).attach_target(tiny.model).eval()
    save_dgf(drafter, tmp_path / "final", target_block(target, target.name, [-1]))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": text}) + "\n"
                               for i, text in enumerate(["Count to ten.", "Name three colours."])))
    path = str(tmp_path / "final")
    config = BenchConfig(methods=[parse_method(m) for m in ["plain", f"dgf:path={path},depth=2,topk=1,budget=2"]],
                         suites=[f"jsonl:{prompts}"], num_prompts=2, max_new_tokens=8, backend="eager", plots=False)
    results = json.loads(json.dumps(run_benchmark(config, target=target, progress=False), default=str))
    loaded, _ = load_dgf(path, target=target)
    suites = measure_top1(results, loaded, target)
    assert suites[f"jsonl:{prompts}"]["positions"] == 2 * (8 - 1)  # every generated token but the last
    assert 0.0 <= suites[f"jsonl:{prompts}"]["top1"] <= 1.0
    assert list(decoder_acceptance(results, path)) == [f"dgf:path={path},depth=2,topk=1,budget=2"]


def test_a_missing_bench_file_is_one_line(tmp_path, capsys):
    assert run_main(main, [f"bench={tmp_path / 'none.json'}"]) == 2
    err = capsys.readouterr().err
    assert "none.json: no such file" in err and "Traceback" not in err


def test_a_missing_drafter_is_refused_before_the_target_loads(tmp_path, capsys, monkeypatch):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"config": {"target": "tiny:llama", "dtype": "float32"}}))
    monkeypatch.setattr(TargetModel, "from_pretrained", lambda *args, **kwargs: pytest.fail("the target loaded"))
    assert run_main(main, [f"bench={bench}", f"drafter={tmp_path / 'none'}"]) == 2
    err = capsys.readouterr().err
    assert "no manifest.json in" in err and "Traceback" not in err
