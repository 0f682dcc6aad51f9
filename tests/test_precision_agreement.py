"""eval/precision_agreement.py: how far the target in bf16, int8 and w8a8 strays from its float32 self."""

from __future__ import annotations

import json

import torch

from conftest import tiny_target_for
from draftsmith.errors import run_main
from draftsmith.eval.bench.methods import parse_method
from draftsmith.eval.bench.run import BenchConfig, run_benchmark
from draftsmith.eval.precision_agreement import agreement, main, measure, precisions_here
from draftsmith.models.target import TargetModel


def test_agreement_counts_top1_and_kl():
    reference = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1]]).log()
    same = agreement([reference], [reference])
    assert same == {"positions": 2, "top1_agreement": 1.0, "kl": 0.0}
    flipped = agreement([reference], [reference[:, [1, 0, 2]]])
    assert flipped["top1_agreement"] == 0.0 and flipped["kl"] > 0


def test_every_precision_per_suite_on_a_bench(smol_tokenizer, tmp_path):
    tiny = tiny_target_for(smol_tokenizer, seed=0)
    target = TargetModel(tiny.model, smol_tokenizer, name="tiny-target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": text}) + "\n"
                               for i, text in enumerate(["Count to ten.", "Name three colours."])))
    config = BenchConfig(methods=[parse_method("plain")], suites=[f"jsonl:{prompts}"], num_prompts=2,
                         max_new_tokens=8, backend="eager", plots=False)
    results = json.loads(json.dumps(run_benchmark(config, target=target, progress=False), default=str))
    before = {name: tensor.clone() for name, tensor in target.model.state_dict().items()}
    document = measure(results, target)
    assert list(document) == [label for label, _, _ in precisions_here()]
    for per_suite in document.values():
        entry = per_suite[f"jsonl:{prompts}"]
        assert entry["positions"] == 2 * 8 and 0.0 <= entry["top1_agreement"] <= 1.0 and entry["kl"] >= -1e-6
    assert all(torch.equal(before[name], tensor) for name, tensor in target.model.state_dict().items())


def test_a_missing_bench_file_is_one_line(tmp_path, capsys):
    assert run_main(main, [f"bench={tmp_path / 'none.json'}"]) == 2
    err = capsys.readouterr().err
    assert "none.json: no such file" in err and "Traceback" not in err
