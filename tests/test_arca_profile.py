"""ARCA profiler: latency measurement, rank recording, replay/refinement, profile JSON round trip."""

import json

import pytest
import torch

from conftest import build_spec, tiny_model, tiny_target_for
from draftsmith.eval.policies.arca import RankRecorder, load_profile, refine_paths, replay_tau, save_profile
from draftsmith.eval.decode.decoder import DecodeConfig
from draftsmith.eval.decode.drafters.base import Drafter
from draftsmith.eval.policies.hcmp import HcmpPolicy
from draftsmith.eval.bench.methods import BuildContext, build_method, parse_method
from draftsmith.eval.arca_profile import (ProfileConfig, measure_verify_latency, measured_budgets, pick_best, predict,
                                          random_tree, run_profile, settings_of)
from draftsmith.eval.decode.tree import DraftTree
from draftsmith.models.engine import Backend
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.target import TargetModel


def test_random_tree_is_topological():
    gen = torch.Generator().manual_seed(0)
    for width in (0, 1, 7, 64):
        tree = random_tree(width, 50, gen)
        tree.validate()
        assert tree.size == width


def test_measure_verify_latency_restores_cache():
    target = TargetModel(tiny_model("llama"), tokenizer=None)
    times = measure_verify_latency(target, torch.randint(0, 96, (1, 12)), [0, 1, 4], repeats=2, warmup=1)
    assert set(times) == {0, 1, 4} and all(len(t) == 2 and min(t) > 0 for t in times.values())


class _FixedTree(Drafter):
    """Root children [5, 6], under 5: [7, 8]; under 7: [9]."""

    def propose(self, root, context, sampling, generator):
        return DraftTree.from_parents(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 0, 2]))


def test_rank_recorder_reads_rank_paths():
    recorder = RankRecorder(_FixedTree())
    recorder.begin(torch.tensor([1, 2]))
    context = torch.tensor([1, 2, 3])
    recorder.propose(3, context, None, None)
    context = torch.cat([context, torch.tensor([5, 8, 4])])  # accepted 5 (rank 0), 8 (rank 1), bonus 4
    recorder.propose(4, context, None, None)
    context = torch.cat([context, torch.tensor([6, 1])])  # rank 1 at depth 1, then a miss (6 has no children)
    recorder.propose(1, context, None, None)
    context = torch.cat([context, torch.tensor([2])])  # a miss at depth 1
    recorder.propose(2, context, None, None)
    assert recorder.rank_paths == [[0, 1], [1], [-1]]  # depth 3 under node 8: no children, not an attempt
    assert recorder.attempts == {1: 3, 2: 1}
    accuracy = recorder.rank_accuracy()
    assert accuracy[0] == pytest.approx([1 / 3, 1 / 3]) and accuracy[1] == pytest.approx([0.0, 1.0])


def test_replay_and_refine():
    rounds = [[0, 1], [0, 1], [1], [0, 0, -1], [-1]]
    assert replay_tau([[0]], rounds) == pytest.approx((2 + 2 + 1 + 2 + 1) / 5)
    assert replay_tau([[0], [0, 0], [0, 1]], rounds) == pytest.approx((3 + 3 + 1 + 3 + 1) / 5)
    start = [[0], [1], [0, 0]]  # the estimate; the recorded rounds prefer [0, 1] over [0, 0]... with [0, 0] first
    refined, tau = refine_paths(start, rounds, allowed=None)
    assert tau >= replay_tau(start, rounds)
    assert len(refined) == len(start)
    found = {tuple(p) for p in refined}
    assert all(p[:-1] in found or len(p) == 1 for p in found)


@pytest.mark.parametrize("placement", ["plain", "hcmp"])
def test_profile_round_trip_and_decoding(tmp_path, smol_tokenizer, placement):
    tiny = tiny_target_for(smol_tokenizer, seed=0)
    target = TargetModel(tiny.model, smol_tokenizer)
    config = ProfileConfig(drafter=parse_method("lm-tree:every=2,depth=3,topk=2"), budgets=[1, 2, 4], repeats=1,
                           context_tokens=16, calibration_offset=0, calibration_prompts=2,
                           calibration_budget=7, calibration_new_tokens=12, placement=placement,
                           hcmp_ratios=[0.5], refine_iterations=2,
                           compile=CompileSettings(buckets=[1, 2, 4, 8], capacity=256, autotune=False))
    profile = run_profile(config, target, progress=False)
    assert profile["budgets"] == [0, 1, 2, 4]
    labels = ["eager/float32", "compiled/float32"] + (["hcmp:0.5/eager/float32"] if placement == "hcmp" else [])
    assert list(profile["verify_latency_s"]) == labels
    assert sorted(profile["verify_latency_s"]["compiled/float32"]) == [0, 1, 2, 4]  # shared width: every budget
    assert sorted(profile["predicted"]["eager/float32"]) == [0, 1, 2, 3, 4]  # every budget, not only measured ones
    loop = profile["loop_round_s"]  # each unsplit setting's measured budgets, timed in the decode loop
    assert list(loop) == labels[:2] and sorted(loop["compiled/float32"]) == [0, 1, 2, 4]
    assert all(c["rounds"] > 0 and c["verify_s"] > 0 for c in loop["eager/float32"].values())
    assert profile["predicted"]["eager/float32"][2]["t_verify_s"] == loop["eager/float32"][2]["verify_s"]
    assert profile["predicted"]["eager/float32"][2]["t_draft_s"] == loop["eager/float32"][2]["draft_s"]
    best = profile["best"]
    assert best["setting"] in labels and best["budget"] in profile["predicted"][best["setting"]]
    assert (best["backend"], best["dtype"]) == tuple(best["setting"].removeprefix("hcmp:0.5/").split("/"))
    row = profile["predicted"][best["setting"]][best["budget"]]
    assert row["tokens_per_s"] == max(r["tokens_per_s"] for rows in profile["predicted"].values()
                                      for b, r in rows.items() if b > 0)
    path = save_profile(profile, tmp_path / "profile.json")
    loaded = load_profile(path)
    assert loaded["trees"] == {w: p for w, p in profile["trees"].items()}
    assert loaded["best"] == json.loads(json.dumps(profile["best"]))
    context = BuildContext(target, None, Backend.EAGER, config.compile)
    method = build_method(parse_method(f"arca:{path},budget=4"), context)
    assert method.backend == loaded["best"]["backend"]  # the engine the profile picked
    assert isinstance(method, HcmpPolicy) == (loaded["best"]["placement"] == "hcmp")
    decoder = method.make_decoder(context.target_for(method), DecodeConfig(max_new_tokens=12))
    prompt = torch.tensor([smol_tokenizer.encode("Hello there, how are you")])
    reference = tiny.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                    do_sample=False)[0, prompt.shape[1]:].tolist()
    assert decoder.generate(prompt).tokens == reference
    with pytest.raises(ValueError, match="no tree for budget"):
        build_spec(f"arca:{path},budget=9", target, None)


def test_the_loop_round_costs_decide_the_pick():
    """Where the loop times a budget's rounds, the prediction takes them (and T_T is the loop's plain step):
    a tree whose random-tree verify looked cheap but whose rounds cost more in the loop loses the pick."""
    config = ProfileConfig(drafter=parse_method("lm-tree:depth=3,topk=2"), budgets=[1, 4], backends=[Backend.EAGER],
                           calibration_budget=7)
    recorder = type("Recorder", (), {"rank_paths": [[0, 0, 0]]})()
    calibrations = {"eager/float32": {"recorder": recorder, "draft_per_round": 0.001}}
    trees = {0: ([], 1.0, 1.0), 1: ([[0]], 1.8, 1.8), 2: ([[0], [0, 0]], 2.0, 2.0), 3: ([[0], [0, 0], [1]], 2.1, 2.1),
             4: ([[0], [0, 0], [1], [0, 0, 0]], 2.6, 2.6)}
    latency = {"eager/float32": {0: 0.010, 1: 0.010, 4: 0.011}}
    assert pick_best(config, predict(config, latency, calibrations, trees), trees)["budget"] == 4
    loop = {"eager/float32": {0: {"draft_s": 0.0, "verify_s": 0.012}, 1: {"draft_s": 0.001, "verify_s": 0.013},
                              4: {"draft_s": 0.002, "verify_s": 0.025}}}
    predicted = predict(config, latency, calibrations, trees, loop)
    assert pick_best(config, predicted, trees)["budget"] == 1
    assert predicted["eager/float32"][1]["predicted_speedup"] == pytest.approx(1.8 * 0.012 / 0.014)


def test_load_profile_refuses_other_files(tmp_path):
    (tmp_path / "x.json").write_text(json.dumps({"version": 1}))
    with pytest.raises(ValueError, match="not an ARCA profile"):
        load_profile(tmp_path / "x.json")
    with pytest.raises(FileNotFoundError):
        load_profile(tmp_path / "missing.json")


def test_compiled_settings_measure_where_latency_changes():
    """Padded graphs (one per bucket) are flat inside a bucket: measured at each bucket's top; the
    shared-width graph runs every width exactly: measured at the config's budgets, interpolated."""
    for shared, expected in ((False, [0, 1, 3]), (True, [0, 1, 2, 4, 6])):
        config = ProfileConfig(drafter=parse_method("lm-tree:depth=3,topk=2"), budgets=[1, 2, 4, 6], calibration_budget=7,
                               compile=CompileSettings(buckets=[1, 2, 4, 8], autotune=False, shared_width=shared))
        compiled = [s for s in settings_of(config) if s.backend == "compiled"][0]
        assert compiled.step == (not shared) and measured_budgets(config, compiled) == expected
