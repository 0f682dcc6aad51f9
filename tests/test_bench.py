"""eval.bench end to end on tiny in-process models (real SmolLM2 tokenizer + chat template, random
weights): JSON + markdown + PNG, two-turn MT-Bench prompt construction, several suites in one run,
temperature-1 mode, W&B offline logging."""

from __future__ import annotations

import json

import pytest
import torch

from draftsmith.config import ConfigError
from draftsmith.errors import UserError
from draftsmith.eval.bench import report
from draftsmith.eval.bench import run as bench
from draftsmith.eval.bench.run import BenchConfig, run_benchmark, turn_input_ids, write_outputs
from draftsmith.eval.bench.methods import parse_method
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.kernels import kernel_isa
from draftsmith.models.target import TargetModel
from tests.conftest import tiny_target_for

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# the compiled backend, cheap to build for tiny models (no GEMM autotuning, two buckets)
FAST_COMPILE = {"budget_limit": 15, "compile": CompileSettings(buckets=[1, 16], capacity=512, autotune=False)}


@pytest.fixture(scope="module")
def tiny_pair(smol_tokenizer):
    target = tiny_target_for(smol_tokenizer, seed=0)
    draft = tiny_target_for(smol_tokenizer, seed=1)
    return TargetModel(target.model, smol_tokenizer, name="tiny-target"), TargetModel(draft.model, smol_tokenizer, name="tiny-draft")


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [{"id": "p0", "prompt": "Count from one to ten."}, {"id": "p1", "prompt": "Name three colours."},
             {"id": "p2", "prompt": "What is two plus two?"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_two_turn_prompt_is_chat_template_over_q1_answer_q2(smol_tokenizer):
    from draftsmith.data.chat import prompt_ids
    from draftsmith.data.sources import Conversation

    conv = Conversation(id="c", source="mt-bench", messages=[{"role": "user", "content": "Q1?"}],
                        category="writing", followups=["Q2?"])
    first = turn_input_ids(smol_tokenizer, conv, [])
    second = turn_input_ids(smol_tokenizer, conv, ["A1."])
    expected = prompt_ids(smol_tokenizer, [{"role": "user", "content": "Q1?"}, {"role": "assistant", "content": "A1."},
                                           {"role": "user", "content": "Q2?"}])
    assert second[0].tolist() == expected
    text = smol_tokenizer.decode(second[0])
    assert text.index("Q1?") < text.index("A1.") < text.index("Q2?")
    assert first.shape[1] < second.shape[1]
    assert bench.num_turns(conv, 2) == 2 and bench.num_turns(conv, 1) == 1 and bench.num_turns(conv, 5) == 2


def test_hf_assisted_draft_length_and_confidence(tiny_pair, smol_tokenizer):
    """hf-assisted:tokens=,confidence= set the assistant's draft length and confidence stop for its own calls
    (HF reads them from the assistant's generation config, which other methods share) and restore them."""
    from draftsmith.eval.decode.decoder import DecodeConfig
    from draftsmith.eval.bench.methods import BuildContext, build_method

    target, draft = tiny_pair
    context = BuildContext(target, draft)
    settings = draft.model.generation_config
    before = (settings.num_assistant_tokens, settings.assistant_confidence_threshold)
    seen = []
    generate = target.model.generate

    def spy(*args, **kwargs):
        assistant = kwargs.get("assistant_model")
        if assistant is not None:
            config = assistant.generation_config
            seen.append((config.num_assistant_tokens, config.num_assistant_tokens_schedule,
                         config.assistant_confidence_threshold))
        return generate(*args, **kwargs)

    prompt = smol_tokenizer("Count from one to ten.", return_tensors="pt").input_ids
    config = DecodeConfig(max_new_tokens=12)
    plain = build_method(parse_method("plain"), context).make_decoder(target, config).generate(prompt).tokens
    target.model.generate = spy
    try:
        for spec in ("hf-assisted:tokens=3,confidence=0", "hf-assisted:confidence=0.6", "hf-assisted"):
            method = build_method(parse_method(spec), context)
            assert method.make_decoder(target, config).generate(prompt).tokens == plain, spec
            assert (settings.num_assistant_tokens, settings.assistant_confidence_threshold) == before
    finally:
        del target.model.generate
    assert seen == [(3, "constant", 0), (before[0], settings.num_assistant_tokens_schedule, 0.6), (*before[:1],
                    settings.num_assistant_tokens_schedule, before[1])]
    with pytest.raises(Exception, match="confidence"):
        parse_method("hf-assisted:confidence=1.5")


def test_bench_end_to_end_json_markdown_png(tiny_pair, prompts_file, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "run" / "bench.json"
    specs = ["plain", "hf-assisted", "lm-chain:budget=3", "lm-tree:depth=2,topk=2,budget=4",
             "lm-tree:depth=3,topk=2,budget=8", "ngram", "union:drafters=[(lm-chain:budget=2),ngram]"]
    config = BenchConfig(methods=[parse_method(m) for m in specs], suites=[f"jsonl:{prompts_file}", "mt-bench"],
                         num_prompts=2, turns=2, max_new_tokens=8, output_dir=str(out.parent), **FAST_COMPILE)
    results = run_benchmark(config, target=target, draft=draft, progress=False)
    written = write_outputs(results, config)

    summary = results["summary"]
    assert results["suites"] == [f"jsonl:{prompts_file}", "mt-bench"]
    for method in map(str, config.methods):
        assert summary[method]["mismatches"] == [], method  # greedy: every method == plain on every prompt/turn
        assert set(summary[method]["by_suite"]) == set(results["suites"])
        assert set(summary[method]["by_turn"]) == {"1", "2"}
    assert summary["lm-chain:budget=3"]["tau"] >= 1.0 and summary["lm-chain:budget=3"]["depth_acceptance"]
    # the compiled backend: both plain baselines run, every method has a speedup against both
    assert [str(m) for m in config.methods][:2] == ["plain", "plain-compiled"]
    assert summary["lm-chain:budget=3"]["backend"] == "compiled" and summary["hf-assisted"]["backend"] == "eager"
    for method in map(str, config.methods):
        assert summary[method]["speedup"] > 0 and summary[method]["speedup_compiled"] > 0
        assert summary[method]["headline_speedup"] == pytest.approx(min(summary[method]["speedup"],
                                                                        summary[method]["speedup_compiled"]))
    assert results["compile"] and all(entry["compile_s"] + entry["load_s"] > 0 for entry in results["compile"].values())
    assert results["machine"]["timed_loop_s"] > 0  # and, where Linux reports memory pressure, the stalls in it
    assert results["machine"]["kernel_isa"] == kernel_isa()  # the compiled engine ran on the invariant kernels
    assert results["machine"].get("memory_stall_s", 0.0) >= 0
    # 2 jsonl prompts (1 turn) + 2 MT-Bench questions x 2 turns
    rows = results["per_prompt"]
    assert [(r["suite"] == "mt-bench", r["turn"]) for r in rows] == [(False, 1), (False, 1), (True, 1), (True, 2),
                                                                      (True, 1), (True, 2)]
    # turn 2's history is the plain greedy answer of turn 1, and its prompt is built from it
    from draftsmith.data.sources import load_source

    first_q = load_source("mt-bench")[0]
    turn1, turn2 = rows[2], rows[3]
    assert turn2["id"] == turn1["id"] == first_q.id
    turn1_ids = turn_input_ids(target.tokenizer, first_q, [])
    assert turn1["prompt_tokens"] == turn1_ids.shape[1]
    greedy = target.model.generate(turn1_ids, attention_mask=torch.ones_like(turn1_ids), do_sample=False,
                                   max_new_tokens=8)[0, turn1_ids.shape[1]:]
    assert turn2["history"] == [target.tokenizer.decode(greedy, skip_special_tokens=True).strip()]
    assert turn2["prompt_tokens"] == turn_input_ids(target.tokenizer, first_q, turn2["history"]).shape[1]
    assert any(key.startswith("mt-bench/") for key in summary["plain"]["by_category"])

    saved = json.loads(out.read_text())
    assert saved["summary"]["plain"]["speedup"] == pytest.approx(1.0)
    markdown = out.with_suffix(".md").read_text()
    assert "| lm-chain:budget=3 |" in markdown and "Per suite" in markdown and "Per turn" in markdown
    assert "Tokens/s per category" in markdown
    union = results["policies"]["union:drafters=[(lm-chain:budget=2),ngram]"]  # who proposed the accepted tokens
    assert set(union["accepted_tokens"]) == {"lm-chain:budget=2", "ngram"}
    assert "- union:drafters=[(lm-chain:budget=2),ngram]: mode \"union\"; rounds_proposed {" in markdown
    names = {p.split("/")[-1] for p in written["plots"]}
    assert names == {"bench_acceptance.png", "bench_category_tps.png", "bench_speedup_budget.png"}
    for path in written["plots"]:
        assert open(path, "rb").read(8) == PNG_MAGIC


def test_bench_temperature_one_records_tau_without_token_comparison(tiny_pair, prompts_file, tmp_path):
    target, draft = tiny_pair
    config = BenchConfig(methods=[parse_method(m) for m in ("plain", "lm-chain:budget=3", "ngram")],
                         suites=[f"jsonl:{prompts_file}"], num_prompts=2, max_new_tokens=8, temperature=1.0,
                         output_dir=str(tmp_path / "t1"), backend="eager")
    results = run_benchmark(config, target=target, draft=draft, progress=False)
    write_outputs(results, config)
    chain = results["summary"]["lm-chain:budget=3"]
    assert chain["tau"] is not None and chain["tau"] >= 1.0 and chain["tokens_per_s"] > 0
    assert chain["mismatches"] == []  # never compared at T > 0
    parts = chain["prefill_s"] + chain["draft_s"] + chain["verify_s"] + chain["other_s"]  # where the time went
    assert chain["prefill_s"] > 0 and chain["verify_s"] > 0 and parts <= chain["seconds"] + 1e-6
    assert "speedup" in chain and chain["speedup"] > 0
    rounds, ms = chain["verify_rounds_by_width"], chain["verify_ms_by_width"]  # the loop's verify cost by width
    assert set(rounds) == set(ms) and all(int(w) >= 1 for w in rounds)
    assert sum(ms[w] * rounds[w] for w in rounds) / 1000 == pytest.approx(chain["verify_s"])
    markdown = (tmp_path / "t1" / "bench.md").read_text()
    assert "sampled (not compared)" in markdown and "Verify forwards in the decode loop by width" in markdown


def test_suite_errors(tiny_pair, tmp_path):
    target, _ = tiny_pair
    with pytest.raises(ValueError, match="names a suite twice"):
        bench.check_suites(["gsm8k", "gsm8k"])
    with pytest.raises(ValueError, match="space-separated"):
        bench.check_suites(["mt-bench", ""])
    with pytest.raises(FileNotFoundError):
        run_benchmark(BenchConfig(methods=[parse_method("plain")], suites=[f"jsonl:{tmp_path}/missing.jsonl"]),
                      target=target, progress=False)
    with pytest.raises(ValueError, match="temperature"):
        run_benchmark(BenchConfig(methods=[parse_method("plain")], temperature=-1), target=target, progress=False)


def test_mt_bench_prompts_cover_its_categories_before_repeating_one():
    """MT-Bench's first 10 records are all `writing`; 10 bench prompts take one of each of its 8 categories
    first. Suites without categories (HumanEval) keep their order."""
    mt_bench = bench.select_conversations("mt-bench", 10, seed=0)
    assert len({conversation.category for conversation in mt_bench[:8]}) == 8
    assert [conversation.id for conversation in mt_bench[::8]] == ["mt-bench-81", "mt-bench-82"]
    assert [c.id for c in bench.select_conversations("humaneval", 3, seed=0)] == ["HumanEval/0", "HumanEval/1",
                                                                                  "HumanEval/2"]


def test_cli_parses_new_flags():
    config, _ = bench.parse_config(["suites=mt-bench gsm8k", "temperature=1", "turns=1", "wandb=true",
                                    "plots=false"])
    assert config.suites == ["mt-bench", "gsm8k"] and config.temperature == 1.0 and config.turns == 1
    assert config.wandb and not config.plots


def test_printed_config_reads_back(tmp_path):
    import yaml

    from draftsmith.config import config_to_dict

    config, _ = bench.parse_config(["methods=lm-tree:depth=4,topk=3 medusa:/heads,budget=8", "compile.buckets=[1,8]",
                                    "budget_limit=7", "compile.autotune=false"])
    raw = config_to_dict(config)
    assert raw["methods"] == ["plain", "plain-compiled", "lm-tree:depth=4,topk=3", "medusa:/heads,budget=8"]
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(raw))
    again, _ = bench.parse_config(["--config", str(path)])
    assert config_to_dict(again) == raw and again.compile == CompileSettings(buckets=[1, 8], autotune=False)
    with pytest.raises(ValueError, match="budget_limit: 63 plus the root must fit the largest compiled bucket"):
        bench.parse_config(["compile.buckets=[1,8]"])
    with pytest.raises(ValueError, match="capacity: 8 must exceed the largest bucket 64"):
        bench.parse_config(["compile.capacity=8"])
    flagged, _ = bench.parse_config(["--backend", "compiled", "--compile.autotune=false", "--strict", "--num-prompts", "2"])
    assert (flagged.backend, flagged.compile.autotune, flagged.strict, flagged.num_prompts) == ("compiled", False, True, 2)


def test_budget_series_groups_sizes_of_one_kind():
    family = {spec: parse_method(spec).family() for spec in ("lm-tree:depth=2,budget=4", "lm-tree:depth=3,budget=8",
                                                              "ngram")}
    summary = {"plain": {"tree_tokens_per_round": None, "speedup": 1.0},
               "lm-tree:depth=2,budget=4": {"tree_tokens_per_round": 4.0, "speedup": 0.9,
                                            "family": family["lm-tree:depth=2,budget=4"]},
               "lm-tree:depth=3,budget=8": {"tree_tokens_per_round": 8.0, "speedup": 0.8,
                                            "family": family["lm-tree:depth=3,budget=8"]},
               "ngram": {"tree_tokens_per_round": 3.0, "speedup": 1.0, "family": family["ngram"]}}
    assert report.budget_series(summary) == {"lm-tree": [(4.0, 0.9, "lm-tree:depth=2,budget=4"),
                                                         (8.0, 0.8, "lm-tree:depth=3,budget=8")]}
    assert parse_method("lm-chain:budget=4,model=/s").family() == "lm-chain:model=/s"
    assert parse_method("medusa:/d,budget=8").family() == "medusa:/d"


def test_wandb_offline_logging(tiny_pair, prompts_file, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    target, draft = tiny_pair
    config = BenchConfig(methods=[parse_method("plain"), parse_method("lm-chain:budget=2")],
                         suites=[f"jsonl:{prompts_file}"], num_prompts=1, max_new_tokens=4,
                         output_dir=str(tmp_path / "w"), wandb=True, backend="eager")
    results = run_benchmark(config, target=target, draft=draft, progress=False)
    written = write_outputs(results, config)
    run_dirs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert run_dirs and written["wandb"]
    assert list(run_dirs[0].glob("*.wandb"))
    torch.set_num_threads(1)


def test_results_page_discovery_and_markers(tmp_path):
    from draftsmith.eval.bench import results_page

    root = tmp_path / "drafters"
    for folder, fmt, target, tokens in [
            ("medusa_a/loss_tokens_1000", "draftsmith.medusa/1", "t", 1000),
            ("medusa_a/loss_tokens_4000", "draftsmith.medusa/1", "t", 4000),  # the run's most trained snapshot
            ("medusa_b/loss_tokens_2000", "draftsmith.medusa/1", "t", 2000),
            ("medusa_untrained/final", "draftsmith.medusa/1", "t", None),
            ("dgf_x/final", "draftsmith.dgf/1", "t", None), ("other/final", "draftsmith.dgf/1", "u", None),
            ("stud/loss_tokens_5", "draftsmith.distilled/1", "t", 5),
            ("block/loss_tokens_7", "draftsmith.dflash/1", "t", 7), ("junk/final", "nope/1", "t", None)]:
        (root / folder).mkdir(parents=True)
        training = {"untrained": True} if "untrained" in folder else {}  # what the manifest says, not the path
        (root / folder / "manifest.json").write_text(json.dumps({"format": fmt, "target": {"name": target},
                                                                  "training": training}))
        if tokens is not None:
            (root / folder / "snapshot.json").write_text(json.dumps({"loss_tokens_seen": tokens}))
    found = results_page.discover_drafters(root, "t", quick=True)
    assert [(f.kind, f.path.relative_to(root).as_posix()) for f in found] == [
        ("medusa", "medusa_a/loss_tokens_4000"), ("medusa", "medusa_b/loss_tokens_2000"),
        ("dflash", "block/loss_tokens_7"), ("student", "stud/loss_tokens_5"), ("dgf", "dgf_x/final")]
    assert len(results_page.discover_drafters(root, "t", quick=False)) == 6
    methods = results_page.drafter_methods(found, quick=True, per_kind=1)
    assert methods == [f"medusa:{root}/medusa_a/loss_tokens_4000,adapter=ignore",
                       f"dflash:{root}/block/loss_tokens_7,budget=3",
                       f"lm-chain:model={root}/stud/loss_tokens_5,budget=3,precision=int8-weights",
                       f"dgf:{root}/dgf_x/final,depth=3,topk=1,budget=3"]
    assert len(results_page.drafter_methods(found, quick=False, per_kind=2)) == 8  # 2 medusa, 2 dflash, 2 student, 2 dgf
    page = tmp_path / "RESULTS.md"
    page.write_text("# Results\n\nintro\n")
    results_page.update_page(page, f"{results_page.BEGIN}\nfirst\n{results_page.END}")
    page.write_text(page.read_text() + "\n## someone else's section\n")
    results_page.update_page(page, f"{results_page.BEGIN}\nsecond\n{results_page.END}")
    text = page.read_text()
    assert "second" in text and "first" not in text and "intro" in text and "someone else's section" in text


def test_bench_writes_each_conversation_and_a_rerun_continues(tiny_pair, prompts_file, tmp_path, monkeypatch):
    """Fault: the process dies after the first conversation (and mid-write of the next line); the re-run
    restores the finished one and runs only the rest; another config is refused in one line."""
    target, draft = tiny_pair
    out = tmp_path / "run"
    config = BenchConfig(methods=[parse_method(m) for m in ("plain", "lm-chain:budget=3")],
                         suites=[f"jsonl:{prompts_file}"], num_prompts=3, max_new_tokens=6, output_dir=str(out),
                         backend="eager")
    full = run_benchmark(config, target=target, draft=draft, progress=False, overwrite=True)
    lines = (out / "progress.jsonl").read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[1])["key"].endswith("/p0")
    # keep the header + one conversation and half a line: what a kill -9 mid-append leaves
    (out / "progress.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][:40])
    ran = []
    original = bench.run_conversation
    monkeypatch.setattr(bench, "run_conversation", lambda state, suite, conv, bar: (ran.append(conv.id),
                                                                                      original(state, suite, conv, bar)))
    resumed = run_benchmark(config, target=target, draft=draft, progress=False)
    assert ran == ["p1", "p2"] and resumed["resumed_conversations"] == 1
    assert [row["plain"]["tokens"] for row in resumed["per_prompt"]] == [row["plain"]["tokens"]
                                                                          for row in full["per_prompt"]]
    assert resumed["summary"]["lm-chain:budget=3"]["mismatches"] == []
    assert resumed["summary"]["plain"]["prompts"] == 3
    other = BenchConfig(**{**config.__dict__, "max_new_tokens": 7})
    with pytest.raises(ValueError, match="another config"):
        run_benchmark(other, target=target, draft=draft, progress=False)
    header, *records = (out / "progress.jsonl").read_text().splitlines()
    moved = json.loads(header) | {"machine": "Some Other CPU @ 2.0GHz"}  # the run goes on after a change of machine
    (out / "progress.jsonl").write_text("\n".join([json.dumps(moved), *records]) + "\n")
    with pytest.raises(ValueError, match="started on another CPU"):
        run_benchmark(config, target=target, draft=draft, progress=False)
    same_name = json.loads(header) | {"isa": "another ISA"}  # one model name, another generation (AMD EPYC)
    (out / "progress.jsonl").write_text("\n".join([json.dumps(same_name), *records]) + "\n")
    with pytest.raises(ValueError, match="started on another CPU"):
        run_benchmark(config, target=target, draft=draft, progress=False)


def test_a_labelled_method_is_one_row_under_its_label(tiny_pair, prompts_file, tmp_path):
    """A config's label names the method's row, its JSON key and its state; bench.md gives the spec behind it."""
    target, draft = tiny_pair
    cascade = "cascade:drafters=[(ngram:min_n=2), (lm-chain:budget=3)]"
    config = BenchConfig(methods=[parse_method("plain"), parse_method({"method": cascade, "label": "lookup, else LM"})],
                         suites=[f"jsonl:{prompts_file}"], num_prompts=2, max_new_tokens=8,
                         output_dir=str(tmp_path / "run"), backend="eager")
    results = run_benchmark(config, target=target, draft=draft, progress=False)
    write_outputs(results, config)
    entry = results["summary"]["lookup, else LM"]
    assert entry["mismatches"] == [] and entry["tau"] >= 1.0 and "lookup, else LM" in results["policies"]
    assert results["config"]["methods"][1] == {"method": cascade, "label": "lookup, else LM"}
    markdown = (tmp_path / "run" / "bench.md").read_text()
    assert "| lookup, else LM | eager |" in markdown and f"- **lookup, else LM**: `{cascade}`" in markdown


def test_a_plain_baseline_on_other_kernels_in_the_same_run(tiny_pair, prompts_file, tmp_path):
    """kernel_isa: the run's methods on one instruction set, `plain-compiled:kernel_isa=<set>` a second plain baseline
    on another, interleaved: the lossless check stays against the run's own plain-compiled, the baseline's tokens
    are compared but not required to agree, and the headline is against the fastest plain."""
    target, draft = tiny_pair
    default = kernel_isa()
    baseline = f"plain-compiled:kernel_isa={default}"
    config = BenchConfig(methods=[parse_method(spec) for spec in [baseline, "lm-chain:budget=3"]], kernel_isa="scalar",
                         suites=[f"jsonl:{prompts_file}"], num_prompts=2, max_new_tokens=8,
                         output_dir=str(tmp_path / "run"), **FAST_COMPILE)
    results = run_benchmark(config, target=target, draft=draft, progress=False)
    write_outputs(results, config)
    summary = results["summary"]
    assert results["machine"]["kernel_isa"] == "scalar" and kernel_isa() == default  # the run's set, then back
    assert summary["lm-chain:budget=3"]["mismatches"] == [] and summary[baseline]["mismatches"] == []
    assert summary[baseline]["kernel_isa"] == default and isinstance(summary[baseline]["other_kernels_differ"], list)
    rates = {label: summary[label]["tokens_per_s"] for label in ("plain", "plain-compiled", baseline)}
    assert summary["lm-chain:budget=3"]["headline_baseline"] == max(rates, key=rates.get)
    assert f"| {baseline} | compiled |" in (tmp_path / "run" / "bench.md").read_text()
    with pytest.raises(ConfigError, match="kernel_isa='scalar' is not read here"):
        BenchConfig(methods=[parse_method("plain")], backend="eager", kernel_isa="scalar")
    only_kernels = "kernel_isa: scalar is read by the compiled backend's batch-invariant kernels only"
    with pytest.raises(ConfigError, match=only_kernels):
        BenchConfig(kernel_isa="scalar", compile=CompileSettings(kernels="inductor"))


def test_a_refused_bench_does_not_block_the_corrected_rerun(tiny_pair, prompts_file, tmp_path):
    """A run refused at its input (no conversation finished: the header alone) leaves nothing to keep, so the
    corrected command starts afresh instead of being told to pass --overwrite."""
    target, draft = tiny_pair
    out = tmp_path / "run"
    config = BenchConfig(methods=[parse_method("plain")], suites=[f"jsonl:{prompts_file}"], num_prompts=1,
                         max_new_tokens=4, output_dir=str(out), backend="eager")
    with pytest.raises(ValueError, match="no method reads it"):
        run_benchmark(config, target=target, draft=draft, progress=False)
    assert len((out / "progress.jsonl").read_text().splitlines()) == 1
    corrected = run_benchmark(config, target=target, draft=None, progress=False)
    assert corrected["summary"]["plain"]["prompts"] == 1


def test_report_says_how_busy_the_machine_was_while_packages_were_autotuned():
    from draftsmith.eval.bench.report import build_line

    quiet = {"built": "2026-11-24T21:00:00", "cpu_count": 2, "load_average_1min": 2.1, "available_memory_gb": 9.5}
    assert build_line(quiet) == " Built 2026-11-24T21:00:00 at load average 2.1 (2 cores), 9.5 GB available."
    assert "built on a busy machine" in build_line(quiet | {"available_memory_gb": 0.2})
    assert "built on a busy machine" in build_line(quiet | {"load_average_1min": 4.0})
    assert build_line(None) == ""


def test_report_shows_each_speedup_without_the_shared_prefill(tmp_path):
    from draftsmith.eval.bench import report

    summary = {"plain-compiled": {"seconds": 100.0, "prefill_s": 10.0, "reused_tokens": 1200},
               "dgf": {"seconds": 55.0, "prefill_s": 10.0, "reused_tokens": 1200},
               "plain": {"seconds": 300.0, "prefill_s": 0.0}}
    results = {"config": {"temperature": 0.0}, "summary": summary, "per_prompt": [{"prompt_tokens": 3000}]}
    lines = report.prefill_lines(results)
    assert "3,000 in all" in lines[1]
    assert lines[-2] == "| plain-compiled | 10.0 | 1,200 | 10% | 1.00x |"
    assert lines[-1] == "| dgf | 10.0 | 1,200 | 18% | 2.00x |"
    assert report.prefill_lines(results | {"config": {"temperature": 1.0}}) == []
    assert report.prefill_lines({"config": {}, "summary": {"plain": summary["plain"]}}) == []
    bad = tmp_path / "bench.json"
    bad.write_text("{}")
    with pytest.raises(UserError, match="not an eval.bench result"):
        report.main([str(bad)])


def test_reduced_precision_bench_says_its_lossless_check_can_flag_near_ties():
    """Only where the kernels are not batch-invariant (the eager backend, compile.kernels=inductor) can a reduced
    precision flip a near-tie; the invariant kernels make bf16 lossless, and the note says nothing there."""
    from draftsmith.eval.bench.run import BenchConfig, precision_note
    from draftsmith.models.compiled import CompileSettings
    from draftsmith.models.engine import Backend
    from draftsmith.models.kernels import Kernels

    invariant = BenchConfig()
    assert precision_note(torch.float32, invariant) is None
    assert precision_note(torch.bfloat16, invariant) is None
    stock = BenchConfig(compile=CompileSettings(kernels=Kernels.INDUCTOR))
    note = precision_note(torch.bfloat16, stock)
    assert "bfloat16" in note and "MISMATCH" in note and "invariant" in note
    assert precision_note(torch.bfloat16, BenchConfig(backend=Backend.EAGER)) is not None


def test_the_main_job_path_prints_no_warning(tiny_pair, prompts_file, tmp_path):
    """The bench's default methods (plain, plain-compiled, ngram, the cascade of lookup and a drafter) on both
    backends must not warn: a deprecation from a dependency is fixed where we call it (transformers' cache
    keyword, models.engine.CACHE_KEYWORD), never filtered. (Autotuned compiles are off here; torch 2.13's
    inductor itself calls the deprecated TypedStorage API while autotuning, which we cannot fix from here.)"""
    import warnings

    target, draft = tiny_pair
    specs = ["plain", "ngram", "lm-chain:budget=2", "cascade:drafters=[(ngram:min_n=2),(lm-chain:budget=2)]"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for backend, extra in (("eager", {}), ("compiled", FAST_COMPILE)):
            extra = {key: value for key, value in extra.items() if key != "backend"}
            config = BenchConfig(methods=[parse_method(m) for m in specs], suites=[f"jsonl:{prompts_file}"],
                                 num_prompts=1, max_new_tokens=6, output_dir=str(tmp_path / backend), backend=backend,
                                 **extra)
            results = run_benchmark(config, target=target, draft=draft, progress=False)
            write_outputs(results, config)
    assert [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught] == []
    # the compiled run's verify forwards by width, each over plain-compiled's one-token step in the loop
    assert results["summary"]["plain-compiled"]["verify_step_ratio_by_width"] == {"1": 1.0}
    chain = results["summary"]["lm-chain:budget=2"]["verify_step_ratio_by_width"]
    assert chain and all(ratio > 0 for ratio in chain.values())


TORCH_WITHOUT_TYPED_STORAGE_CALL = (2, 14, 1)  # torch 2.13's inductor autotuner calls tensor.storage(); fixed here


def torch_version() -> tuple[int, ...]:
    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:3])


@pytest.mark.skipif(torch_version() < TORCH_WITHOUT_TYPED_STORAGE_CALL,
                    reason="torch < 2.14.1: inductor's autotuner itself warns (TypedStorage); install.sh installs "
                           "2.14.1+cpu where the PyTorch index is reachable")
def test_an_autotuned_compile_prints_no_warning(tiny_pair, prompts_file, tmp_path, caplog, monkeypatch):
    """The main job compiles with autotuning: no Python warning and no warning logged by torch
    or transformers, on a torch whose autotuner no longer calls the deprecated storage API."""
    import logging
    import warnings

    target, _ = tiny_pair
    config = BenchConfig(methods=[parse_method("ngram")], suites=[f"jsonl:{prompts_file}"], num_prompts=1,
                         max_new_tokens=4, output_dir=str(tmp_path), backend="compiled", budget_limit=15,
                         compile=CompileSettings(buckets=[1, 16], capacity=512, autotune=True))
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "cache"))  # a first run: the graphs are compiled here
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        write_outputs(run_benchmark(config, target=target, progress=False), config)
    logged = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.name.split(".")[0] in ("torch", "transformers")]
    assert [f"{w.category.__name__}: {w.message}" for w in caught] == [] and logged == []


def test_parallel_drafting_in_the_bench(tiny_pair, prompts_file, monkeypatch):
    """lm-parallel (PARD: k tokens from one forward over mask tokens) is lossless on both backends; a draft model
    without a mask token is refused in one line."""
    target, draft = tiny_pair
    specs = ["plain", "lm-parallel:budget=3"]
    config = BenchConfig(methods=[parse_method(m) for m in specs], suites=[f"jsonl:{prompts_file}"], num_prompts=1,
                         max_new_tokens=8, plots=False, backend="eager")
    with pytest.raises(UserError, match="no parallel-drafting mask token"):
        run_benchmark(config, target=target, draft=draft, progress=False)
    monkeypatch.setattr(draft.model.config, "pard_token", 95, raising=False)
    for backend, extra in (("eager", {}), ("compiled", FAST_COMPILE)):
        extra = {key: value for key, value in extra.items() if key != "backend"}
        config = BenchConfig(methods=[parse_method(m) for m in specs], suites=[f"jsonl:{prompts_file}"], num_prompts=1,
                             max_new_tokens=8, plots=False, backend=backend, **extra)
        results = run_benchmark(config, target=target, draft=draft, progress=False)
        assert all(entry["mismatches"] == [] for entry in results["summary"].values())


@pytest.mark.parametrize("precision", ["bfloat16", "int8", "int8-weights"])
def test_a_cheaper_draft_lm_stays_lossless(tiny_pair, prompts_file, precision):
    """The draft LM in bf16, dynamic int8 or weight-only int8: its proposals change, the
    output does not (the target verifies in float32)."""
    target, draft = tiny_pair
    specs = ["plain", "lm-chain:budget=3", f"lm-chain:budget=3,precision={precision}",
             f"lm-tree:depth=2,topk=2,budget=4,precision={precision}"]
    config = BenchConfig(methods=[parse_method(m) for m in specs], suites=[f"jsonl:{prompts_file}"], num_prompts=2,
                         max_new_tokens=10, plots=False, backend="eager")
    results = run_benchmark(config, target=target, draft=draft, progress=False)
    assert all(entry["mismatches"] == [] for entry in results["summary"].values())


def test_an_int8_weight_draft_lm_compiles_and_stays_lossless(tiny_pair, prompts_file):
    """Weight-only int8 runs on the compiled backend (AOTInductor has torch's int8 kernel), lossless; drafting with
    the target's own layers (every=1) in int8 proposes what the target would, so most drafts are accepted."""
    target, _ = tiny_pair
    specs = ["plain", "lm-chain:budget=3,every=1,precision=int8-weights",
             "lm-chain:budget=3,every=1,precision=int8-weights,shared_width=false"]
    config = BenchConfig(methods=[parse_method(m) for m in specs], suites=[f"jsonl:{prompts_file}"], num_prompts=2,
                         max_new_tokens=10, plots=False, backend="compiled", **FAST_COMPILE)
    results = run_benchmark(config, target=target, progress=False)
    assert all(entry["mismatches"] == [] for entry in results["summary"].values())
    assert results["summary"]["lm-chain:budget=3,every=1,precision=int8-weights"]["tau"] > 2.5
    assert results["summary"]["lm-chain:budget=3,every=1,precision=int8-weights,shared_width=false"]["tau"] > 2.5


@pytest.mark.parametrize("backend, spec", [("eager", "lm-chain:budget=3,shared_width=false"),
                                           ("compiled", "lm-chain:budget=3,precision=int8,shared_width=false")])
def test_a_draft_graph_option_on_an_eager_draft_lm_is_refused(tiny_pair, prompts_file, backend, spec):
    target, draft = tiny_pair
    extra = FAST_COMPILE if backend == "compiled" else {}
    config = BenchConfig(methods=[parse_method(spec)], suites=[f"jsonl:{prompts_file}"], num_prompts=1,
                         max_new_tokens=4, plots=False, backend=backend, **extra)
    with pytest.raises(ConfigError, match="shared_width is read by the compiled backend only"):
        run_benchmark(config, target=target, draft=draft, progress=False)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 11, 13])
def test_each_method_follows_each_other_equally_often(count):
    """What ran just before a method changes its speed (a compiled forward right after HF eager's generate is
    ~15% slower), so the bench's order changes per prompt turn: over 2 x count turns every method runs once per
    turn and right after each other method exactly twice."""
    from collections import Counter

    from draftsmith.eval.bench.run import carryover_balanced

    follows = Counter()
    for turn in range(2 * count):
        order = carryover_balanced(count, turn)
        assert sorted(order) == list(range(count))
        follows.update(zip(order, order[1:]))
    assert len(follows) == count * (count - 1) and set(follows.values()) <= {2}


def test_results_page_refuses_to_rerender_a_finished_run(tmp_path, monkeypatch):
    """A rerun over the page's last run measures again only with --overwrite; without it, one line and no work (a
    finished run re-rendered as if new would show old numbers)."""
    from draftsmith.eval.bench import results_page

    plan = results_page.RunPlan(name="tiny", target="tiny:llama", title="tiny")
    monkeypatch.setattr(results_page, "plan_runs", lambda args: [(plan, ["plain"])])
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "bench.json").write_text("{}")
    with pytest.raises(UserError, match="--overwrite"):
        results_page.main([f"out_dir={tmp_path}", f"page={tmp_path / 'RESULTS.md'}"])
    assert not (tmp_path / "RESULTS.md").exists()
