"""ARCA profiler (Ghidorah III-C) with the Dovetail cost model (eq. (1)/(6)).

    python -m draftsmith.eval.arca_profile target=smollm2-135m-instruct drafter=medusa:outputs/medusa_smollm2_cpu/final \\
        output=results/arca_profile_smollm2.json [placement=hcmp hcmp_ratios="0.5 0.75"] [bench_prompts=4]

Steps (everything measured on the machine and placement it runs on):
 1. Verification latency T(b) for budgets b in {0, 1, 2, 4, ..., 64}: a random tree of b draft nodes
    (plus the root: b + 1 tokens) verified over the KV cache of a real prompt (MT-Bench, chat
    template, padded by repeating it to `context_tokens`), through the decoder's own verification
    round (`eval.decode.decoder.Generation.verify`: mask, forward, verification, KV commit), repeated,
    median. T(0) is one plain decoding step of the target (T_T). With `placement=hcmp` T is
    measured for every split ratio in `hcmp_ratios` (and the unsplit target).
 2. Acceptance on a calibration set (MT-Bench prompts after the benchmark's, by default): the
    decoder runs the drafter with a wide tree (`calibration_budget` nodes); a recorder wrapped
    around the drafter reads, for every round, which rank (position among its siblings) the
    target's token took at each depth -> per-depth/per-rank conditional acceptance and the rank
    path of every round. For Medusa heads the saved held-out accuracies are the default table
    (`acceptance=saved`); `measured` uses the calibration table.
 3. Best tree per budget: `eval.policies.arca.arca_paths` (expected-acceptance maximisation), then refined
    by trying neighbours (swap a removable leaf for a free slot at any level) scored by the real
    acceptance of the recorded rank paths.
 3b. With `loop_prompts` > 0 (the default): each measured budget's tree decodes that many calibration prompts in
    the decoder's loop (the budgets in turn on each prompt), and the prediction takes a round's cost from there
    (its draft, and its verify with what the loop adds to step 1's: the head's rows on the accepted path, caches
    the drafter evicted, the loop's own work; T(0): a plain step in the same loop). A random tree's verify alone
    understated a real round's: on the AVX2 EPYC a verify of 9 tokens cost 1.14 steps there, 1.18-1.40 in the loop.
 4. Pick the budget (and split ratio) maximising predicted tokens/s = tau(b) / (T_draft + T(b)).
    The Dovetail cost model is printed beside it: eq. (1) T_avg = (T_draft + T_V(b)) / Omega, and
    eq. (6) T_avg / T_T = (T_draft / T_T + T_V(b) / T_T) / Omega, whose inverse is the predicted
    speedup.
 5. Write the profile JSON. The bench loads it as `arca:<profile.json>[,budget=N]`: the profile's
    drafter with the chosen (or the given) budget's tree and placement. `bench_prompts=N` runs that
    benchmark right away (plain vs the ARCA pick vs `compare_budgets`) and prints the prediction
    next to the measured speedup.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.config import (ConfigError, TextEnum, check_config, command_parser, config_to_dict, option,
                              parse_command, section)
from draftsmith.errors import UserError, exit_with
from draftsmith.fileio import refuse_overwrite
from draftsmith.eval.policies.arca import (RankRecorder, arca_paths, expected_accepted, interpolate_latency,
                                  load_rank_accuracy, refine_paths, replay_tau, save_profile, PROFILE_VERSION)
from draftsmith.eval.bench.run import BenchConfig, format_table, machine_info, run_benchmark
from draftsmith.eval.prompts import load_prompts
from draftsmith.eval.latency import context_ids
from draftsmith.eval.decode.decoder import BUDGET_LIMIT, DecodeConfig, DecodeStats, Generation, SpeculativeDecoder
from draftsmith.eval.decode.drafters.medusa import MedusaDrafter
from draftsmith.eval.policies.hcmp import HcmpConfig, hcmp_mode
from draftsmith.eval.bench.methods import (BuildContext, LMChainOptions, MedusaOptions, MethodSpec, NgramOptions,
                                          arca_drafter, build_method, inner_drafter, parse_method)
from draftsmith.eval.policies.placement import PlacedDrafter
from draftsmith.eval.decode.tree import DraftTree
from draftsmith.models.bundled import DEFAULT_TARGET
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend, sync
from draftsmith.models.target import TargetModel, dtype_name

DEFAULT_BUDGETS = [0, 1, 2, 4, 8, 16, 32, 64]


class Placement(TextEnum):
    PLAIN = "plain"
    HCMP = "hcmp"  # also HCMP's split ratios (eager)


class AcceptanceSource(TextEnum):
    """Where the acceptance table comes from."""

    AUTO = "auto"  # saved for Medusa heads, else measured
    SAVED = "saved"  # Medusa's held-out head accuracies
    MEASURED = "measured"  # the drafter's ranks accepted in calibration decoding


@dataclass
class ProfileConfig:
    target: str = option(DEFAULT_TARGET, "the target: registry name, model directory, hub id or tiny:<family>")
    draft: str | None = option(None, "the draft LM that lm-chain / lm-tree use by default")
    drafter: MethodSpec = option(parse_method("lm-tree:every=2,depth=5,topk=4"),
                                 "the drafter method (its budget is what the profile varies)")
    backends: list[Backend] = option(factory=lambda: list(Backend),
                                                           help="engines measured (the pick is one of them)")
    dtypes: list[str] = option(factory=lambda: ["float32"], help="dtypes measured (the first calibrates)")
    compile: CompileSettings = section(CompileSettings, "the compiled backend's buckets, KV capacity, autotuning")
    device: str = option("cpu", "cpu | cuda | auto")
    drafter_device: str | None = option(None, "Dovetail placement: put the drafter on this device")
    placement: Placement = option(Placement.PLAIN, "hcmp: also measure HCMP split ratios (eager)")
    hcmp_ratios: list[float] = option(factory=lambda: [0.5], help="HCMP ratios measured", ge=0, le=1)
    hcmp_threads: bool = option(False, "HCMP: two threads")
    budgets: list[int] = option(factory=lambda: list(DEFAULT_BUDGETS), help="budgets where T(b) is measured "
                                "(0 is added; compiled: its buckets' tops); the pick ranges over every budget "
                                "up to the largest", ge=0)
    repeats: int = option(15, "verification forwards measured per budget", ge=1)
    context_tokens: int = option(128, "KV-cache length the latency is measured over", ge=1)
    suite: str = option("mt-bench", "calibration (and benchmark) prompts")
    calibration_offset: int = option(40, "skip this many prompts (the ones a benchmark uses)", ge=0)
    calibration_prompts: int = option(8, "calibration prompts", ge=1)
    calibration_budget: int = option(BUDGET_LIMIT, "tree size while calibrating", ge=1)
    calibration_new_tokens: int = option(64, "new tokens per calibration prompt", ge=1)
    acceptance: AcceptanceSource = option(AcceptanceSource.AUTO, "acceptance table: saved (Medusa's head "
                                                                  "accuracies) or measured; auto picks")
    refine_iterations: int = option(8, "neighbour-search iterations per tree", ge=0)
    loop_prompts: int = option(4, "calibration prompts each measured budget's tree decodes in the loop (the budgets "
                                  "interleaved per prompt), whose round costs the prediction takes (0: step 1's "
                                  "random-tree T(b) alone)", ge=0)
    threads: int = option(0, "torch CPU threads (0: torch's default)", ge=0)
    seed: int = option(0, "seed of the random trees and prompt sample")
    bench_prompts: int = option(0, "> 0: benchmark the pick against compare_budgets right after", ge=0)
    bench_new_tokens: int = option(64, "new tokens per benchmark prompt", ge=1)
    bench_turns: int = option(1, "MT-Bench turns per prompt in the benchmark", ge=1)
    compare_budgets: list[int] = option(factory=lambda: [4, BUDGET_LIMIT], help="fixed budgets benchmarked beside the pick",
                                        ge=1)
    output: str | None = option(None, "profile JSON path (default outputs/arca_profile_<target>.json)")

    def __post_init__(self):
        check_config(self)
        self.budgets = sorted(set([0] + list(self.budgets)))  # T(0) = T_T, the plain decoding step
        if Backend.COMPILED in self.backends and self.calibration_budget + 1 > max(self.compile.buckets):
            raise ConfigError(f"calibration_budget: {self.calibration_budget} plus the root must fit the largest "
                              f"compiled bucket ({max(self.compile.buckets)})")


@dataclass(frozen=True)
class Setting:
    """One way to run the target that the profile measures: engine, dtype, optional HCMP split."""

    backend: Backend
    dtype: str
    hcmp_ratio: float | None = None
    padded: bool = False  # compiled with one graph per bucket: T(b) is flat inside a bucket

    @property
    def label(self) -> str:
        base = f"{self.backend}/{self.dtype}"
        return base if self.hcmp_ratio is None else f"hcmp:{self.hcmp_ratio:g}/{base}"

    @property
    def step(self) -> bool:
        """T(b) is flat inside a bucket (compiled, padded graphs), else it is interpolated."""
        return self.backend is Backend.COMPILED and self.padded


def settings_of(config: ProfileConfig) -> list[Setting]:
    padded = not config.compile.shared_width
    settings = [Setting(backend, dtype, padded=padded) for dtype in config.dtypes for backend in config.backends]
    if config.placement is Placement.HCMP:
        settings += [Setting(Backend.EAGER, config.dtypes[0], ratio) for ratio in config.hcmp_ratios]
    return settings


def measured_budgets(config: ProfileConfig, setting: Setting) -> list[int]:
    """Where T(b) is measured: the config's budgets (eager; shared-width graphs up to the largest bucket's top,
    b + 1 tokens), each bucket's top (padded compiled graphs)."""
    if setting.step:
        tops = [bucket - 1 for bucket in config.compile.buckets if bucket - 1 <= max(config.budgets)]
        return sorted(set([0] + tops))
    if setting.backend is not Backend.COMPILED:
        return config.budgets
    largest = max(config.compile.buckets) - 1  # a tree and its root fit the largest graph width
    kept = [budget for budget in config.budgets if budget <= largest]
    return sorted(set(kept + ([largest] if len(kept) < len(config.budgets) else [])))


# --------------------------------------------------------------------------------------------
# 1. verification latency
# --------------------------------------------------------------------------------------------


def random_tree(budget: int, vocab_size: int, generator: torch.Generator) -> DraftTree:
    """`budget` nodes, each attached to a uniformly chosen earlier node (or the root), random tokens."""
    if budget == 0:
        return DraftTree.empty()
    parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=generator)) if i else -1
                            for i in range(budget)])
    tokens = torch.randint(0, vocab_size, (budget,), generator=generator)
    return DraftTree.from_parents(tokens, parents)


@torch.inference_mode()
def measure_verify_latency(target: TargetModel, input_ids: torch.Tensor, budgets: list[int], repeats: int,
                           seed: int = 0, warmup: int = 2) -> dict[int, list[float]]:
    """Seconds per verification round of a random b-node tree over the cache of `input_ids` (1, T)."""
    device = target.device
    target.prepare(tuple(b + 1 for b in budgets))  # compiled graphs built or loaded before timing
    gen = Generation(target, DecodeConfig(max_new_tokens=1, budget_limit=max(budgets + [1])), input_ids)
    past = target.cache_length(gen.cache)
    generator = torch.Generator().manual_seed(seed)
    vocab = target.model.get_output_embeddings().weight.shape[0]
    times: dict[int, list[float]] = {b: [] for b in budgets}
    for rep in range(warmup + repeats):
        for budget in budgets:  # interleaved across budgets so load changes hit all of them alike
            tree = random_tree(budget, vocab, generator)
            tree = DraftTree(tree.tokens.to(device), tree.parents.to(device), tree.depths.to(device))
            sync(device)
            start = time.perf_counter()
            gen.verify(tree)
            sync(device)
            if rep >= warmup:
                times[budget].append(time.perf_counter() - start)
            target.truncate(gen.cache, past)
    return times


def latency_curves(config: ProfileConfig, targets: dict[str, TargetModel], input_ids: torch.Tensor,
                   say) -> dict[str, dict[int, list[float]]]:
    """{setting label: {budget: [seconds, ...]}} for every setting (backend x dtype, HCMP ratios)."""
    curves = {}
    for setting in settings_of(config):
        target = targets[setting.dtype].with_backend(setting.backend, config.compile)
        budgets = measured_budgets(config, setting)
        say(f"measuring T(b) [{setting.label}] at b = {budgets} over a {input_ids.shape[1]}-token context, "
            f"{config.repeats} repeats ...")
        if setting.hcmp_ratio is None:
            times = measure_verify_latency(target, input_ids, budgets, config.repeats, config.seed)
        else:
            with hcmp_mode(target.model, HcmpConfig.uniform(setting.hcmp_ratio, threads=config.hcmp_threads)):
                times = measure_verify_latency(target, input_ids, budgets, config.repeats, config.seed)
        curves[setting.label] = times
        say("  " + "  ".join(f"T({b})={1000 * statistics.median(t):.1f}ms" for b, t in times.items()))
    return curves


# --------------------------------------------------------------------------------------------
# 2. acceptance on the calibration set
# --------------------------------------------------------------------------------------------


def calibration_spec(spec: MethodSpec, budget: int) -> MethodSpec:
    """The drafter with the calibration tree size (chains and prompt lookup: at most 16 tokens)."""
    if isinstance(spec.options, (LMChainOptions, NgramOptions)):
        return spec.replace(budget=min(budget, 16))
    return spec.replace(budget=budget) if spec.has_option("budget") else spec


def medusa_rank_paths(drafter: MedusaDrafter) -> list[list[int]]:
    """Rank paths of a MedusaDrafter's static tree."""
    parents, ranks = drafter.parents.tolist(), drafter.ranks.tolist()
    paths = []
    for node in range(len(parents)):
        path, current = [], node
        while current >= 0:
            path.append(ranks[current])
            current = parents[current]
        paths.append(path[::-1])
    return paths


def calibrate(config: ProfileConfig, context: BuildContext, calibration: list[dict], say) -> dict:
    """Run the drafter with a wide tree over the calibration prompts, recording the ranks taken."""
    spec = calibration_spec(config.drafter, config.calibration_budget)
    inner = inner_drafter(build_method(spec, context), f"drafter={config.drafter}")
    allowed = {tuple(map(int, p)) for p in medusa_rank_paths(inner)} if isinstance(inner, MedusaDrafter) else None
    if config.drafter_device:
        inner = PlacedDrafter(inner, config.drafter_device, context.target.device)
    recorder = RankRecorder(inner)
    target = context.engine(context.target)
    decoder = SpeculativeDecoder(target, recorder, DecodeConfig(
        max_new_tokens=config.calibration_new_tokens, budget_limit=config.calibration_budget))
    say(f"calibrating {spec} [{context.backend}/{dtype_name(target.dtype)}] on {len(calibration)} {config.suite} "
        "prompts ...")
    target.prepare()
    draft_s, rounds = 0.0, 0
    for prompt in calibration:
        stats = decoder.generate(prompt["input_ids"]).stats
        draft_s, rounds = draft_s + stats.draft_s, rounds + stats.verify_forwards
    paths = recorder.rank_paths
    tau = 1 + sum(len([r for r in p if r >= 0]) for p in paths) / max(len(paths), 1)
    measured = recorder.rank_accuracy()
    say(f"  rounds {len(paths)}, calibration tau {tau:.2f}, draft {1000 * draft_s / max(rounds, 1):.1f} ms/round; "
        "per-depth acceptance (rank 0): " + " ".join(f"{row[0]:.2f}" for row in measured if row))
    return {"spec": str(spec), "recorder": recorder, "draft_per_round": draft_s / max(rounds, 1), "tau": tau,
            "measured": measured, "allowed": allowed, "prompts": len(calibration)}


def calibrate_settings(config: ProfileConfig, models: dict, prompts: list[dict], say) -> dict[str, dict]:
    """{backend/dtype label: calibration}: acceptance is read from the first, the drafter's time from each
    (drafters run on the target's engine and dtype)."""
    results = {}
    for setting in settings_of(config):
        if setting.hcmp_ratio is None:
            target, draft = models[setting.dtype]
            context = BuildContext(target, draft, setting.backend, config.compile)
            results[setting.label] = calibrate(config, context, prompts, say)
    return results


def calibration_of(calibrations: dict[str, dict], setting: Setting) -> dict:
    """A setting's calibration; an HCMP split uses its unsplit engine's (or the first one)."""
    unsplit = Setting(setting.backend, setting.dtype).label
    return calibrations.get(unsplit) or next(iter(calibrations.values()))


def acceptance_table(config: ProfileConfig, calibration: dict) -> tuple[str, list[list[float]]]:
    source = config.acceptance
    if source is AcceptanceSource.AUTO:
        medusa = isinstance(config.drafter.options, MedusaOptions)
        source = AcceptanceSource.SAVED if medusa else AcceptanceSource.MEASURED
    if source is AcceptanceSource.SAVED:
        if not isinstance(config.drafter.options, MedusaOptions):
            raise UserError("acceptance=saved needs a Medusa drafter (its head_accuracy.json)")
        return source, load_rank_accuracy(config.drafter.options.path)
    return source, calibration["measured"]


def round_costs(decoders: dict[int, SpeculativeDecoder], prompts: list[dict]) -> dict[int, dict[str, float]]:
    """{budget: seconds per round} of each decoder over `prompts`: its draft, and its verify with the loop's own
    work. Per prompt every decoder in turn (the order reversed every other prompt), so a slower minute of the
    machine falls on every budget alike."""
    for decoder in decoders.values():
        decoder.generate(prompts[0]["input_ids"][:, :8])  # warm-up: every package and graph width loaded
    totals = {budget: DecodeStats() for budget in decoders}
    for index, prompt in enumerate(prompts):
        for budget in list(decoders) if index % 2 == 0 else list(decoders)[::-1]:
            totals[budget].merge(decoders[budget].generate(prompt["input_ids"]).stats)
    return {budget: {"draft_s": t.draft_s / max(t.verify_forwards, 1),
                     "verify_s": (t.verify_s + t.other_s) / max(t.verify_forwards, 1), "rounds": t.verify_forwards}
            for budget, t in totals.items()}


def loop_costs(config: ProfileConfig, models: dict, trees: dict, prompts: list[dict], say) -> dict[str, dict]:
    """{setting label: {budget: round costs}}: each measured budget's tree (0: plain decoding) in the decode loop
    on `prompts`, per unsplit setting."""
    costs = {}
    for setting in settings_of(config):
        if setting.hcmp_ratio is not None:
            continue
        target, draft = models[setting.dtype]
        context = BuildContext(target, draft, setting.backend, config.compile)
        engine = context.engine(target)
        decoders = {}
        for budget in measured_budgets(config, setting):
            drafter = None if budget == 0 else arca_drafter(config.drafter, trees[budget][0], budget, context,
                                                             f"budget {budget}")
            decode = DecodeConfig(max_new_tokens=config.calibration_new_tokens, budget_limit=max(budget, 1))
            decoders[budget] = SpeculativeDecoder(engine, drafter, decode)
        curve = costs[setting.label] = round_costs(decoders, prompts)
        say(f"  in the loop [{setting.label}], ms a round (draft + verify): " + "  ".join(
            f"b={b}: {1000 * c['draft_s']:.1f} + {1000 * c['verify_s']:.1f}" for b, c in curve.items()))
    return costs


# --------------------------------------------------------------------------------------------
# 3-4. trees per budget, predictions, the pick
# --------------------------------------------------------------------------------------------


def budget_tree(config: ProfileConfig, accuracy, calibration: dict, budget: int) -> tuple[list, float, float]:
    """(tree paths, estimated tau, replayed tau) for one budget."""
    if budget == 0:
        return [], 1.0, 1.0
    rank_paths = calibration["recorder"].rank_paths
    chain = isinstance(config.drafter.options, LMChainOptions)  # a chain drafter has one candidate per depth
    paths = [[0] * d for d in range(1, budget + 1)] if chain else arca_paths(accuracy, budget)
    tau_estimate = 1 + expected_accepted(paths, accuracy)
    tau_replay = replay_tau(paths, rank_paths)
    if config.refine_iterations and not chain:
        refined, refined_tau = refine_paths(paths, rank_paths, calibration["allowed"], config.refine_iterations)
        if refined_tau > tau_replay:
            paths, tau_replay = refined, refined_tau
    return paths, tau_estimate, tau_replay


def all_trees(config: ProfileConfig, accuracy, calibration: dict, largest: int) -> dict[int, tuple]:
    """{budget: (paths, tau estimate, tau replayed)} for every budget 0..largest."""
    return {budget: budget_tree(config, accuracy, calibration, budget) for budget in range(largest + 1)}


def predict_row(config: ProfileConfig, tree: tuple, curve: dict, step: bool, draft_per_round: float | dict,
                base_tt: float, recorded: bool, budget: int) -> dict:
    """The cost model's prediction for one budget on one setting (Dovetail eq. (1) and (6)). `draft_per_round`:
    the calibration's (one value) or the loop's per budget (a curve like `curve`)."""
    paths, tau_est, tau_replay = tree
    tau = tau_replay if recorded and budget else tau_est
    nodes = len(paths) if budget else 0  # a tree can have fewer nodes than b (the table ran out)
    chain = isinstance(config.drafter.options, LMChainOptions)
    if budget == 0:
        t_draft = 0.0
    elif isinstance(draft_per_round, dict):
        t_draft = interpolate_latency(draft_per_round, nodes, step)
    else:
        per_token = draft_per_round / max(min(config.calibration_budget, 16), 1)
        t_draft = per_token * max(nodes, 1) if chain else draft_per_round
    t_verify = interpolate_latency(curve, nodes, step)
    step_s = t_draft + t_verify
    return {"tau_estimate": tau_est, "tau_replay": tau_replay, "tau": tau, "t_draft_s": t_draft,
            "t_verify_s": t_verify, "tokens_per_s": tau / step_s, "eq1_t_avg_s": step_s / tau,  # Dovetail eq. (1)
            "eq6_ratio": (t_draft / base_tt + t_verify / base_tt) / tau,  # eq. (6): T_avg / T_T
            "predicted_speedup": tau * base_tt / step_s, "tree_nodes": nodes,
            "tree_depth": max((len(p) for p in paths), default=0), "measured": budget in curve}


def predict(config: ProfileConfig, latency: dict, calibrations: dict, trees: dict, loop: dict | None = None) -> dict:
    """{setting label: {budget: prediction}} for every budget up to the largest measured on that setting.
    Speedups are against the fastest plain step measured (T_T: the smallest T(0) of any setting); with `loop`
    (loop_costs), a setting it measured takes its round costs and T_T is the loop's plain step."""
    loop = loop or {}
    verify_curves = {label: {b: c["verify_s"] for b, c in curve.items()} for label, curve in loop.items()}
    base_tt = min(curve[0] for curve in (verify_curves or latency).values())
    predicted = {}
    for setting in settings_of(config):
        curve = verify_curves.get(setting.label, latency[setting.label])
        calibration = calibration_of(calibrations, setting)
        draft = ({b: c["draft_s"] for b, c in loop[setting.label].items()} if setting.label in loop
                 else calibration["draft_per_round"])
        recorded = bool(calibration["recorder"].rank_paths)
        predicted[setting.label] = {
            budget: predict_row(config, trees[budget], curve, setting.step, draft, base_tt, recorded, budget)
            for budget in range(max(curve) + 1)}
    return predicted


def pick_best(config: ProfileConfig, predicted: dict, trees: dict) -> dict:
    """The setting and budget with the most predicted tokens/s."""
    settings = {setting.label: setting for setting in settings_of(config)}
    label, budget = max(((label, b) for label in predicted for b in predicted[label] if b > 0),
                        key=lambda lb: predicted[lb[0]][lb[1]]["tokens_per_s"])
    setting = settings[label]
    return {"budget": budget, "setting": label, "backend": setting.backend, "dtype": setting.dtype,
            "placement": "plain" if setting.hcmp_ratio is None else "hcmp", "hcmp_ratio": setting.hcmp_ratio,
            "paths": trees[budget][0], **predicted[label][budget]}


def load_models(config: ProfileConfig, target: TargetModel | None, draft: TargetModel | None) -> dict:
    """{dtype: (target, draft)}: the given models in the first dtype, the others loaded here."""
    models = {}
    for i, dtype in enumerate(config.dtypes):
        given = i == 0
        lm = target if given and target is not None else TargetModel.from_pretrained(config.target, dtype=dtype,
                                                                                      device=config.device)
        small = draft if given else None
        if small is None and config.draft:
            small = TargetModel.from_pretrained(config.draft, dtype=dtype, device=config.device)
        models[dtype] = (lm, small)
    return models


def run_profile(config: ProfileConfig, target: TargetModel | None = None, draft: TargetModel | None = None,
                progress: bool = True) -> dict:
    """Measure, calibrate, predict and pick (steps 1-4); returns the profile document."""
    if config.threads:
        torch.set_num_threads(config.threads)
    models = load_models(config, target, draft)
    first = models[config.dtypes[0]][0]

    def say(text: str) -> None:
        if progress:
            print(text, flush=True)

    prompts = load_prompts(config.suite, config.calibration_offset + config.calibration_prompts, config.seed,
                           first.tokenizer)
    input_ids = context_ids(prompts[0]["input_ids"], config.context_tokens)
    curves = latency_curves(config, {dtype: pair[0] for dtype, pair in models.items()}, input_ids, say)
    latency = {label: {b: statistics.median(t) for b, t in times.items()} for label, times in curves.items()}
    calibration_prompts = prompts[config.calibration_offset:] or prompts[-config.calibration_prompts:]
    calibrations = calibrate_settings(config, models, calibration_prompts, say)
    reference = next(iter(calibrations.values()))
    source, accuracy = acceptance_table(config, reference)
    trees = all_trees(config, accuracy, reference, max(max(curve) for curve in latency.values()))
    loop = (loop_costs(config, models, trees, calibration_prompts[:config.loop_prompts], say)
            if config.loop_prompts else {})
    predicted = predict(config, latency, calibrations, trees, loop)
    profile = {
        "version": PROFILE_VERSION, "config": config_to_dict(config), "drafter": str(config.drafter),
        "machine": machine_info(first), "context_tokens": int(input_ids.shape[1]), "budgets": config.budgets,
        "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "verify_latency_s": latency, "verify_latency_all_s": curves, "loop_round_s": loop,
        "draft_s_per_round": {label: c["draft_per_round"] for label, c in calibrations.items()},
        "calibration": {"spec": reference["spec"], "prompts": reference["prompts"],
                        "rounds": len(reference["recorder"].rank_paths), "tau": reference["tau"],
                        "rank_accuracy": reference["measured"]},
        "acceptance_source": source, "rank_accuracy": accuracy, "trees": {b: t[0] for b, t in trees.items()},
        "predicted": predicted, "best": pick_best(config, predicted, trees),
        "rank_paths": reference["recorder"].rank_paths}
    say(format_profile(profile))
    return profile


# --------------------------------------------------------------------------------------------
# Tables and the command line
# --------------------------------------------------------------------------------------------


def base_step(profile: dict) -> float:
    """T_T: the fastest plain step (T(0)) of any measured setting: in the decode loop where the profile timed it."""
    loop = profile.get("loop_round_s") or {}
    if loop:
        return min((curve["0"] if "0" in curve else curve[0])["verify_s"] for curve in loop.values())
    return min(curve["0"] if "0" in curve else curve[0] for curve in profile["verify_latency_s"].values())


def format_profile(profile: dict) -> str:
    """The measured budgets of every setting (and the pick) with the cost model's prediction."""
    lines = ["| setting | b | nodes | T(nodes) ms | T(b)/T_T | T_draft/T_T | tau est | tau replay | pred tok/s | "
             "eq.(6) T_avg/T_T | pred speedup |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    base_tt, best = base_step(profile), profile["best"]
    for label, rows in profile["predicted"].items():
        for budget, row in sorted(rows.items(), key=lambda item: int(item[0])):
            pick = label == best["setting"] and int(budget) == best["budget"]
            if not (row["measured"] or pick):
                continue
            lines.append(f"| {label} | {budget} | {row['tree_nodes']} | {1000 * row['t_verify_s']:.1f} | "
                         f"{row['t_verify_s'] / base_tt:.2f} | {row['t_draft_s'] / base_tt:.2f} | "
                         f"{row['tau_estimate']:.2f} | {row['tau_replay']:.2f} | {row['tokens_per_s']:.1f} | "
                         f"{row['eq6_ratio']:.3f} | {row['predicted_speedup']:.2f}x{' **<- ARCA**' if pick else ''} |")
    lines.append("")
    for label, curve in profile["verify_latency_s"].items():
        lines.append(f"Measured T(b) [{label}], median of {profile['config']['repeats']}, ms: " + ", ".join(
            f"b={b}: {1000 * t:.1f}" for b, t in sorted(curve.items(), key=lambda item: int(item[0]))))
    for label, curve in (profile.get("loop_round_s") or {}).items():
        lines.append(f"In the decode loop [{label}], {profile['config']['loop_prompts']} prompts, ms a round "
                     "(draft + verify; the table's T and T_draft): " + ", ".join(
                         f"b={b}: {1000 * c['draft_s']:.1f} + {1000 * c['verify_s']:.1f}"
                         for b, c in sorted(curve.items(), key=lambda item: int(item[0]))))
    lines.append("")
    lines.append(f"ARCA pick: budget {best['budget']} on {best['setting']}, predicted tau {best['tau']:.2f}, "
                 f"{best['tokens_per_s']:.1f} tok/s, speedup {best['predicted_speedup']:.2f}x over the fastest plain "
                 f"step measured (T_T = {1000 * base_tt:.1f} ms"
                 f"{', in the loop' if profile.get('loop_round_s') else ''}); every budget up to the largest measured was "
                 f"considered (T between measured budgets: interpolated, compiled: its bucket's). Drafter "
                 f"{profile['drafter']}, acceptance from {profile['acceptance_source']}, context "
                 f"{profile['context_tokens']} tokens.")
    return "\n".join(lines)


def compare_table(profile: dict, bench: dict, method_budgets: dict[str, int]) -> str:
    """Predicted (cost model) next to measured speedup for the benchmarked budgets."""
    predicted = profile["predicted"][profile["best"]["setting"]]
    rows = ["| method | budget | pred tau | measured tau | pred speedup (eq. 6) | measured speedup (95% CI) | "
            "lossless |", "|---|---|---|---|---|---|---|"]
    for method, budget in method_budgets.items():
        entry = bench["summary"][method]
        pred = predicted.get(budget) or predicted.get(str(budget))
        ci = entry.get("speedup_ci95", float("nan"))
        rows.append(f"| {method} | {budget} | {pred['tau']:.2f} | {entry['tau']:.2f} | "
                    f"{pred['predicted_speedup']:.2f}x | {entry['headline_speedup']:.2f}x (±{ci:.2f}) | "
                    f"{'yes' if not entry['mismatches'] else 'NO'} |")
    return "\n".join(rows)


def bench_the_pick(config: ProfileConfig, profile: dict, out: Path, target, draft) -> str:
    """Benchmark the ARCA pick against fixed budgets, in the picked dtype and backend; stores the summary
    in the profile."""
    best = profile["best"]
    method_budgets = {f"arca:{out}": best["budget"]}
    for budget in config.compare_budgets:
        if budget != best["budget"] and budget in profile["predicted"][best["setting"]]:
            method_budgets[f"arca:{out},budget={budget}"] = budget
    bench_config = BenchConfig(target=config.target, draft=config.draft,
                               methods=[parse_method("plain"), *map(parse_method, method_budgets)],
                               suites=[config.suite], num_prompts=config.bench_prompts,
                               max_new_tokens=config.bench_new_tokens, turns=config.bench_turns,
                               dtype=best["dtype"], backend=best["backend"], compile=config.compile,
                               device=config.device, threads=config.threads, seed=config.seed,
                               budget_limit=max(method_budgets.values()))
    same_dtype = best["dtype"] == config.dtypes[0]
    bench = run_benchmark(bench_config, target if same_dtype else None, draft if same_dtype else None)
    profile["bench"] = {"summary": bench["summary"], "machine": bench["machine"], "config": bench["config"],
                        "method_budgets": method_budgets}
    return format_table(bench) + "\n\n" + compare_table(profile, bench, method_budgets)


def main(argv: list[str]) -> dict:
    parser = command_parser("python -m draftsmith.eval.arca_profile", __doc__.split("\n\n")[0], ProfileConfig)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing profile file")
    config, flags = parse_command(parser, ProfileConfig, argv)
    out = Path(config.output or f"outputs/arca_profile_{Path(config.target).name}.json")
    refuse_overwrite(out, flags.overwrite)
    dtype = config.dtypes[0]
    target = TargetModel.from_pretrained(config.target, dtype=dtype, device=config.device)
    draft = TargetModel.from_pretrained(config.draft, dtype=dtype, device=config.device) if config.draft else None
    profile = run_profile(config, target, draft)
    save_profile(profile, out)
    print(f"wrote {out}")
    table = format_profile(profile)
    if config.bench_prompts > 0:
        comparison = bench_the_pick(config, profile, out, target, draft)
        print(comparison)
        save_profile(profile, out)
        table += "\n\n" + comparison
    out.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {out.with_suffix('.md')}")
    return profile


if __name__ == "__main__":
    exit_with(main)
