"""ARCA profiler (Ghidorah III-C) with the Dovetail cost model (eq. (1)/(6)).

    python -m draftsmith.eval.profile --target smollm2-135m-instruct --drafter medusa:outputs/medusa_smollm2_cpu/final \
        --out results/arca_profile_smollm2.json [--placement hcmp --hcmp-ratios 0.5,0.75] [--bench-prompts 4]

Steps (everything measured on the machine and placement it runs on):
 1. Verification latency T(w) for widths w in {0, 1, 2, 4, ..., 64}: a random tree of w draft
    nodes (plus the root: w + 1 tokens) verified over the KV cache of a real prompt (MT-Bench,
    chat template, padded by repeating it to `--context-tokens`), through the decoder's own
    `_verify` (mask building, forward, verification, KV commit), repeated, median. T(0) is one
    plain decoding step of the target (T_T). With `--placement hcmp` T is measured for every
    split ratio in `--hcmp-ratios` (and the unsplit target).
 2. Acceptance on a calibration set (MT-Bench prompts after the benchmark's, by default): the
    decoder runs the drafter with a wide tree (`--calibration-width` nodes); a recorder wrapped
    around the drafter reads, for every round, which rank (position among its siblings) the
    target's token took at each depth -> per-depth/per-rank conditional acceptance and the
    rank path of every round. For Medusa heads the saved held-out accuracies are the default
    table (`--acceptance saved`); `measured` uses the calibration table.
 3. Best tree per width: `eval.arca.arca_paths` (expected-acceptance maximisation), then
    refined by trying neighbours (swap a removable leaf for a free slot at any level) scored by
    the real acceptance of the recorded rank paths (exact for drafters whose candidates at a
    node depend only on the path: Medusa heads, LM drafters; trees are kept inside the
    calibration tree so every score is an exact replay).
 4. Pick the width (and split ratio) maximising predicted tokens/s = tau(w) / (T_draft + T(w)).
    The Dovetail cost model is printed beside it: eq. (1) T_avg = (T_draft + T_V(w)) / Omega
    (our T_draft is the measured drafting time of a round, Dovetail's gamma * T_D), and eq. (6)
    T_avg / T_T = (T_draft / T_T + T_V(w) / T_T) / Omega, whose inverse is the predicted speedup.
 5. Write the profile JSON. The bench loads it as `arca:<profile.json>[,width=N]`: the profile's
    drafter with the chosen (or the given) width's tree and placement. `--bench-prompts N` runs
    that benchmark right away (plain vs the ARCA pick vs fixed widths, `--compare-widths`) and
    prints the prediction next to the measured speedup.

Width w counts draft nodes, as in `eval.arca` and `DecodeConfig.max_tree_tokens`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from draftsmith.eval.arca import arca_paths, expected_accepted, load_rank_accuracy
from draftsmith.eval.decoder import DecodeConfig, SpeculativeDecoder
from draftsmith.eval.drafters.base import Drafter
from draftsmith.eval.tree import DraftTree, tree_from_paths
from draftsmith.models.target import TargetModel, crop_cache

PROFILE_VERSION = 1
DEFAULT_WIDTHS = [0, 1, 2, 4, 8, 16, 32, 64]
WIDTH_OPTION = {"lm-tree": "budget", "lm-chain": "k", "ngram": "k"}  # bench option a width maps to


@dataclass
class ProfileConfig:
    target: str = "smollm2-135m-instruct"
    draft: str | None = None
    drafter: str = "lm-tree:student=every2,depth=5,topk=4"  # a bench method spec without its width option
    dtype: str = "float32"
    device: str = "cpu"
    drafter_device: str | None = None  # dovetail: put the drafter there
    placement: str = "plain"  # plain | hcmp
    hcmp_ratios: list[float] = field(default_factory=lambda: [0.5])
    hcmp_threads: bool = False
    widths: list[int] = field(default_factory=lambda: list(DEFAULT_WIDTHS))
    repeats: int = 15
    context_tokens: int = 128
    suite: str = "mt-bench"
    calibration_offset: int = 40  # skip the prompts the benchmark uses
    calibration_prompts: int = 8
    calibration_width: int = 64
    calibration_new_tokens: int = 64
    acceptance: str = "auto"  # auto (saved for Medusa, else measured) | saved | measured
    refine_iterations: int = 8
    threads: int = 0
    seed: int = 0
    bench_prompts: int = 0  # > 0: benchmark the pick against --compare-widths right after
    bench_new_tokens: int = 64
    bench_turns: int = 1  # MT-Bench turns per prompt in the benchmark (the bench's own default is 2)
    compare_widths: list[int] = field(default_factory=lambda: [4, 64])
    out: str | None = None

    def __post_init__(self):
        if self.placement not in ("plain", "hcmp"):
            raise ValueError(f"placement must be plain or hcmp, got {self.placement!r}")
        if self.acceptance not in ("auto", "saved", "measured"):
            raise ValueError(f"acceptance must be auto, saved or measured, got {self.acceptance!r}")
        if any(w < 0 for w in self.widths):
            raise ValueError(f"widths must be >= 0, got {self.widths}")
        if 0 not in self.widths:
            self.widths = [0] + list(self.widths)  # T(0) = T_T, the plain decoding step
        self.widths = sorted(set(self.widths))


# --------------------------------------------------------------------------------------------
# 1. verification latency
# --------------------------------------------------------------------------------------------

def random_tree(width: int, vocab_size: int, generator: torch.Generator) -> DraftTree:
    """w nodes, each attached to a uniformly chosen earlier node (or the root), random tokens."""
    if width == 0:
        return DraftTree.empty()
    parents = torch.tensor([int(torch.randint(-1, i, (1,), generator=generator)) if i else -1 for i in range(width)])
    tokens = torch.randint(0, vocab_size, (width,), generator=generator)
    return DraftTree.from_parents(tokens, parents)


def context_ids(prompt: torch.Tensor, length: int) -> torch.Tensor:
    """(1, T) prompt repeated/cut to `length` tokens (at least the prompt itself when length <= 0)."""
    if length <= 0:
        return prompt
    reps = -(-length // prompt.shape[1])
    return prompt.repeat(1, reps)[:, :length]


@torch.inference_mode()
def measure_verify_latency(target: TargetModel, input_ids: torch.Tensor, widths: list[int], repeats: int,
                           seed: int = 0, warmup: int = 2) -> dict[int, list[float]]:
    """Seconds per verification forward of a random w-node tree over the cache of `input_ids` (1, T)."""
    device = target.device
    cache = target.new_cache()
    out = target.forward(input_ids.to(device), cache)
    root = int(out.logits[0, -1].argmax())
    past = cache.get_seq_length()
    decoder = SpeculativeDecoder(target, None, DecodeConfig(max_tree_tokens=max(widths + [1])))
    generator = torch.Generator().manual_seed(seed)
    vocab = target.model.get_output_embeddings().weight.shape[0]
    times: dict[int, list[float]] = {w: [] for w in widths}
    for rep in range(warmup + repeats):
        for width in widths:  # interleaved across widths so load changes hit all of them alike
            tree = random_tree(width, vocab, generator)
            tree = DraftTree(tree.tokens.to(device), tree.parents.to(device), tree.depths.to(device))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            decoder._verify(tree, root, cache, (), None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rep >= warmup:
                times[width].append(time.perf_counter() - start)
            crop_cache(cache, past)
    return times


# --------------------------------------------------------------------------------------------
# 2. acceptance recording (any drafter)
# --------------------------------------------------------------------------------------------

class RankRecorder(Drafter):
    """Wraps a drafter; per round, the rank path the target took through the proposed tree.

    A node's rank is its position among its siblings in the tree (drafters list children best
    first). After a round, the tokens appended to the context (accepted + bonus) are walked down
    the tree: at depth k the target's token is found among the children of the depth k-1 path
    node (rank r, counted in hits[k][r]) or not (a miss, the round's end). Depths whose path node
    has no children in the tree are not attempts. The last round of each request, whose bonus
    token is never seen, is dropped.
    """

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.name, self.hidden_layers, self.tokenizer = inner.name, inner.hidden_layers, inner.tokenizer
        self.hits: dict[int, dict[int, int]] = {}  # depth -> rank -> rounds where the target took it
        self.attempts: dict[int, int] = {}  # depth -> rounds whose path node at depth - 1 had children
        self.rank_paths: list[list[int]] = []  # per round: ranks taken, then -1 if it ended on a miss
        self._pending: tuple[DraftTree, int] | None = None  # (tree, context length when proposed)

    def begin(self, prompt_ids):
        self._pending = None
        self.inner.begin(prompt_ids)

    def observe(self, tokens, hidden):
        self.inner.observe(tokens, hidden)

    def propose(self, root, context, sampling, generator):
        if self._pending is not None:
            tree, known = self._pending
            self._record(tree, context[known:].tolist())
        tree = self.inner.propose(root, context, sampling, generator)
        self._pending = (tree, context.numel())
        return tree

    def _record(self, tree: DraftTree, appended: list[int]) -> None:
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        children: dict[int, list[int]] = {}
        for node, parent in enumerate(parents):
            children.setdefault(parent, []).append(node)
        node, path = -1, []
        for depth, token in enumerate(appended, start=1):
            kids = children.get(node, [])
            if not kids:
                break
            self.attempts[depth] = self.attempts.get(depth, 0) + 1
            ranks = [i for i, kid in enumerate(kids) if tokens[kid] == token]
            if not ranks:
                path.append(-1)
                break
            rank = ranks[0]
            self.hits.setdefault(depth, {})
            self.hits[depth][rank] = self.hits[depth].get(rank, 0) + 1
            path.append(rank)
            node = kids[rank]
        self.rank_paths.append(path)

    def rank_accuracy(self, max_rank: int | None = None) -> list[list[float]]:
        """(depth, rank) conditional acceptance: hits / attempts at that depth."""
        table = []
        for depth in sorted(self.attempts):
            attempts = self.attempts[depth]
            hits = self.hits.get(depth, {})
            ranks = (max(hits) + 1) if hits else 1
            if max_rank is not None:
                ranks = min(ranks, max_rank)
            table.append([hits.get(r, 0) / attempts for r in range(ranks)])
        return table


def replay_tau(paths: list[list[int]], rank_paths: list[list[int]]) -> float:
    """Mean accepted length (bonus included) of the static rank tree `paths` over recorded rounds."""
    if not rank_paths:
        return float("nan")
    tree = {tuple(p) for p in paths}
    total = 0
    for ranks in rank_paths:
        accepted = 0
        for depth in range(1, len(ranks) + 1):
            if ranks[depth - 1] < 0 or tuple(ranks[:depth]) not in tree:
                break
            accepted = depth
        total += accepted + 1
    return total / len(rank_paths)


def _closed(tree: set[tuple[int, ...]]) -> bool:
    for path in tree:
        if len(path) > 1 and path[:-1] not in tree:
            return False
        if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in tree:
            return False
    return True


def refine_paths(paths: list[list[int]], rank_paths: list[list[int]], allowed: set[tuple[int, ...]] | None,
                 iterations: int = 8) -> tuple[list[list[int]], float]:
    """Neighbour search (Ghidorah: leaves and same-level nodes): swap one removable leaf for one
    free slot (the next rank under a tree node, or a first child) while the replayed tau improves.
    `allowed`: the nodes the replay can score exactly (the calibration tree); None = any."""
    tree = {tuple(p) for p in paths}
    best = replay_tau([list(p) for p in tree], rank_paths)
    for _ in range(iterations):
        leaves = [p for p in tree if not any(q[:-1] == p for q in tree if len(q) == len(p) + 1)
                  and p[:-1] + (p[-1] + 1,) not in tree]
        slots = set()
        for p in list(tree) + [()]:
            count = sum(1 for q in tree if len(q) == len(p) + 1 and q[:-1] == p)
            slots.add(p + (count,))
        slots -= tree
        if allowed is not None:
            slots &= allowed
        improved, candidate_best = False, None
        for leaf in leaves:
            for slot in slots:
                if slot[:-1] == leaf:
                    continue
                candidate = (tree - {leaf}) | {slot}
                if not _closed(candidate):
                    continue
                score = replay_tau([list(p) for p in candidate], rank_paths)
                if score > best + 1e-12:
                    best, candidate_best, improved = score, candidate, True
        if not improved:
            break
        tree = candidate_best
    return sorted([list(p) for p in tree], key=lambda p: (len(p), p)), best


# --------------------------------------------------------------------------------------------
# profile document
# --------------------------------------------------------------------------------------------

def save_profile(profile: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(path)
    return path


def load_profile(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ARCA profile not found: {path}")
    doc = json.loads(path.read_text())
    for key in ("version", "drafter", "best", "trees", "widths"):
        if key not in doc:
            raise ValueError(f"{path}: not an ARCA profile (missing {key!r})")
    if doc["version"] != PROFILE_VERSION:
        raise ValueError(f"{path}: profile version {doc['version']}, this code reads {PROFILE_VERSION}")
    doc["trees"] = {int(w): paths for w, paths in doc["trees"].items()}
    return doc


def profile_paths(profile: dict, width: int | None = None) -> list[list[int]]:
    """The tree ARCA chose for `width` (default: the picked width)."""
    width = profile["best"]["width"] if width is None else width
    if width not in profile["trees"]:
        raise ValueError(f"profile has no tree for width {width}; widths: {sorted(profile['trees'])}")
    return profile["trees"][width]


def drafter_spec_for_width(profile: dict, width: int) -> str:
    """The bench method spec of the profile's drafter at `width` (not for Medusa: it takes paths)."""
    spec = profile["drafter"]
    kind = spec.partition(":")[0]
    if kind not in WIDTH_OPTION:
        raise ValueError(f"no width option known for {kind!r} (known: {sorted(WIDTH_OPTION)}, or medusa)")
    return spec + ("," if ":" in spec else ":") + f"{WIDTH_OPTION[kind]}={max(width, 1)}"


def build_drafter_from_profile(profile: dict, target, draft, width: int | None = None, name: str | None = None):
    """The drafter (or HCMP policy) the profile describes, at its chosen width or `width`."""
    from draftsmith.eval.bench import build_drafter, parse_method

    width = profile["best"]["width"] if width is None else width
    profile_paths(profile, width)  # refuses a width the profile did not measure
    kind, options = parse_method(profile["drafter"])
    if width == 0:
        drafter = None
    elif kind == "medusa":
        from draftsmith.eval.drafters.medusa import load_medusa_drafter

        drafter = load_medusa_drafter(options.pop("path"), target, paths=profile_paths(profile, width),
                                      target_adapter=options.pop("adapter", "refuse"),
                                      name=name or f"arca-medusa[w={width}]")
    else:
        drafter = build_drafter(drafter_spec_for_width(profile, width), target, draft)
    ratio = profile["best"].get("hcmp_ratio")
    if ratio is not None:
        from draftsmith.eval.hcmp import HcmpConfig, HcmpPolicy

        config = HcmpConfig.uniform(ratio, threads=bool(profile["config"].get("hcmp_threads")))
        return HcmpPolicy(drafter, config, name=name or f"arca-hcmp[w={width}]")
    if drafter is None:
        raise ValueError("width 0 is plain decoding: use the 'plain' or 'loop-plain' method")
    return drafter


def build_from_spec(options: dict, target, draft, name: str):
    """Bench method `arca:<profile.json>[,width=N]`."""
    profile = load_profile(options.pop("path"))
    width = options.pop("width", None)
    return build_drafter_from_profile(profile, target, draft, int(width) if width else None, name=name)


# --------------------------------------------------------------------------------------------
# the profiler
# --------------------------------------------------------------------------------------------

def _width_tree(kind: str, accuracy, width: int) -> list[list[int]]:
    if kind == "lm-chain":  # a chain drafter has one candidate per depth
        return [[0] * d for d in range(1, width + 1)]
    return arca_paths(accuracy, width)


def _calibration_spec(spec: str, width: int) -> str:
    kind = spec.partition(":")[0]
    if kind == "medusa":
        return spec + f",width={width}"
    option = WIDTH_OPTION.get(kind)
    if option is None:
        return spec
    value = min(width, 16) if kind in ("lm-chain", "ngram") else width
    return spec + ("," if ":" in spec else ":") + f"{option}={value}"


def run_profile(config: ProfileConfig, target: TargetModel | None = None, draft: TargetModel | None = None,
                progress: bool = True) -> dict:
    from draftsmith.eval.bench import build_drafter, load_prompts, machine_info, BenchConfig, parse_method

    if config.threads:
        torch.set_num_threads(config.threads)
    target = target or TargetModel.from_pretrained(config.target, dtype=config.dtype, device=config.device)
    if draft is None and config.draft:
        draft = TargetModel.from_pretrained(config.draft, dtype=config.dtype, device=config.device)
    say = print if progress else (lambda *a, **k: None)
    prompts = load_prompts(config.suite, config.calibration_offset + config.calibration_prompts, config.seed,
                           target.tokenizer)
    calibration = prompts[config.calibration_offset:] or prompts[-config.calibration_prompts:]
    kind, _ = parse_method(config.drafter)

    # 1. T(w), per placement
    placements: list[float | None] = [None]
    if config.placement == "hcmp":
        placements += list(config.hcmp_ratios)
    latency: dict[str, dict[int, float]] = {}
    latency_all: dict[str, dict[int, list[float]]] = {}
    input_ids = context_ids(prompts[0]["input_ids"], config.context_tokens)
    for ratio in placements:
        label = "plain" if ratio is None else f"hcmp:{ratio:g}"
        say(f"measuring T(w) [{label}] over a {input_ids.shape[1]}-token context, {config.repeats} repeats ...",
            flush=True)
        if ratio is None:
            times = measure_verify_latency(target, input_ids, config.widths, config.repeats, config.seed)
        else:
            from draftsmith.eval.hcmp import HcmpConfig, hcmp_mode

            with hcmp_mode(target.model, HcmpConfig.uniform(ratio, threads=config.hcmp_threads)):
                times = measure_verify_latency(target, input_ids, config.widths, config.repeats, config.seed)
        latency_all[label] = {w: t for w, t in times.items()}
        latency[label] = {w: statistics.median(t) for w, t in times.items()}
        say("  " + "  ".join(f"T({w})={1000 * s:.1f}ms" for w, s in latency[label].items()), flush=True)

    # 2. acceptance on the calibration set, with a wide tree
    calib_spec = _calibration_spec(config.drafter, config.calibration_width)
    inner = build_drafter(calib_spec, target, draft)
    if inner is None or hasattr(inner, "make_decoder"):
        raise ValueError(f"--drafter {config.drafter!r} must be a drafter method (medusa, lm-tree, lm-chain, ngram ...)")
    if config.drafter_device:
        from draftsmith.eval.placement import PlacedDrafter

        inner = PlacedDrafter(inner, config.drafter_device, target.device)
    recorder = RankRecorder(inner)
    decoder = SpeculativeDecoder(target, recorder, DecodeConfig(max_new_tokens=config.calibration_new_tokens,
                                                                max_tree_tokens=max(config.calibration_width, 1)))
    say(f"calibrating {calib_spec} on {len(calibration)} {config.suite} prompts ...", flush=True)
    draft_s, rounds, calib_tree = 0.0, 0, None
    for prompt in calibration:
        result = decoder.generate(prompt["input_ids"])
        draft_s += result.stats.draft_s
        rounds += result.stats.verify_forwards
    measured_accuracy = recorder.rank_accuracy()
    draft_per_round = draft_s / max(rounds, 1)
    calibration_tau = 1 + sum(len([r for r in p if r >= 0]) for p in recorder.rank_paths) / max(len(recorder.rank_paths), 1)
    allowed = None
    if kind == "medusa":
        calib_tree = {tuple(map(int, p)) for p in _medusa_paths(inner)}
        allowed = calib_tree
    source = config.acceptance
    if source == "auto":
        source = "saved" if kind == "medusa" else "measured"
    if source == "saved":
        if kind != "medusa":
            raise ValueError("--acceptance saved needs a Medusa drafter (head_accuracy.json)")
        accuracy = load_rank_accuracy(parse_method(config.drafter)[1]["path"])
    else:
        accuracy = measured_accuracy
    say(f"  rounds {len(recorder.rank_paths)}, calibration tau {calibration_tau:.2f}, draft {1000 * draft_per_round:.1f} "
        f"ms/round; per-depth acceptance (rank 0): " + " ".join(f"{row[0]:.2f}" for row in measured_accuracy if row),
        flush=True)

    # 3. trees per width, refined against the recorded rounds
    trees, predicted = {}, {}
    base_tt = latency["plain"][0]
    chain_draft_per_token = draft_per_round / max(min(config.calibration_width, 16), 1)
    for width in config.widths:
        if width == 0:
            paths, tau_est, tau_replay = [], 1.0, 1.0
        else:
            paths = _width_tree(kind, accuracy, width)
            tau_est = 1 + expected_accepted(paths, accuracy)
            tau_replay = replay_tau(paths, recorder.rank_paths)
            if config.refine_iterations and kind != "lm-chain":
                refined, refined_tau = refine_paths(paths, recorder.rank_paths, allowed, config.refine_iterations)
                if refined_tau > tau_replay:
                    paths, tau_replay = refined, refined_tau
        trees[width] = paths
        tau = tau_replay if recorder.rank_paths and width else tau_est
        if width == 0:
            t_draft = 0.0
        elif kind == "lm-chain":
            t_draft = chain_draft_per_token * max(len(paths), 1)
        else:
            t_draft = draft_per_round
        nodes = len(paths) if width else 0  # a tree can have fewer nodes than w (the table ran out)
        for label, curve in latency.items():
            t_verify = interpolate_latency(curve, nodes)
            step = t_draft + t_verify
            predicted.setdefault(label, {})[width] = {
                "tau_estimate": tau_est, "tau_replay": tau_replay if width else 1.0, "tau": tau,
                "t_draft_s": t_draft, "t_verify_s": t_verify,
                "tokens_per_s": tau / step,
                "eq1_t_avg_s": step / tau,  # Dovetail eq. (1)
                "eq6_ratio": (t_draft / base_tt + t_verify / base_tt) / tau,  # eq. (6): T_avg / T_T
                "predicted_speedup": tau * base_tt / step,
                "tree_nodes": nodes, "tree_depth": max((len(p) for p in paths), default=0)}

    best_label, best_width = max(((label, w) for label in predicted for w in predicted[label] if w > 0),
                                 key=lambda lw: predicted[lw[0]][lw[1]]["tokens_per_s"])
    best = {"width": best_width, "placement": "plain" if best_label == "plain" else "hcmp",
            "hcmp_ratio": None if best_label == "plain" else float(best_label.split(":")[1]),
            "paths": trees[best_width], **predicted[best_label][best_width]}
    profile = {
        "version": PROFILE_VERSION, "config": asdict(config), "drafter": config.drafter,
        "machine": machine_info(target, BenchConfig()),
        "load_average_at_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "context_tokens": int(input_ids.shape[1]), "widths": config.widths,
        "verify_latency_s": latency, "verify_latency_all_s": latency_all,
        "draft_s_per_round": draft_per_round, "calibration": {
            "spec": calib_spec, "prompts": len(calibration), "rounds": len(recorder.rank_paths),
            "tau": calibration_tau, "rank_accuracy": measured_accuracy},
        "acceptance_source": source, "rank_accuracy": accuracy,
        "trees": trees, "predicted": predicted, "best": best,
        "rank_paths": recorder.rank_paths,
    }
    say(format_profile(profile), flush=True)
    return profile


def interpolate_latency(curve: dict[int, float], nodes: int) -> float:
    """T at `nodes` draft nodes, linear between the measured widths (clamped at the ends)."""
    widths = sorted(int(w) for w in curve)
    values = {int(w): t for w, t in curve.items()}
    if nodes <= widths[0]:
        return values[widths[0]]
    for low, high in zip(widths, widths[1:]):
        if nodes <= high:
            return values[low] + (values[high] - values[low]) * (nodes - low) / (high - low)
    return values[widths[-1]]


def _medusa_paths(drafter) -> list[list[int]]:
    """Rank paths of a MedusaDrafter's static tree (through a PlacedDrafter wrapper too)."""
    drafter = getattr(drafter, "inner", drafter)
    parents, ranks = drafter.parents.tolist(), drafter.ranks.tolist()
    paths = []
    for node in range(len(parents)):
        path, current = [], node
        while current >= 0:
            path.append(ranks[current])
            current = parents[current]
        paths.append(path[::-1])
    return paths


def format_profile(profile: dict) -> str:
    lines = ["| placement | w | nodes | T(nodes) ms | T(w)/T_T | T_draft/T_T | tau est | tau replay | pred tok/s | "
             "eq.(6) T_avg/T_T | pred speedup |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    base_tt = profile["verify_latency_s"]["plain"]["0"] if "0" in profile["verify_latency_s"]["plain"] \
        else profile["verify_latency_s"]["plain"][0]
    for label, rows in profile["predicted"].items():
        for width, row in sorted(rows.items(), key=lambda item: int(item[0])):
            mark = " **<- ARCA**" if (int(width) == profile["best"]["width"] and
                                      (label == "plain") == (profile["best"]["placement"] == "plain") and
                                      (label == "plain" or float(label.split(":")[1]) == profile["best"]["hcmp_ratio"])) else ""
            lines.append(f"| {label} | {width} | {row['tree_nodes']} | {1000 * row['t_verify_s']:.1f} | {row['t_verify_s'] / base_tt:.2f} | "
                         f"{row['t_draft_s'] / base_tt:.2f} | {row['tau_estimate']:.2f} | {row['tau_replay']:.2f} | "
                         f"{row['tokens_per_s']:.1f} | {row['eq6_ratio']:.3f} | {row['predicted_speedup']:.2f}x{mark} |")
    best = profile["best"]
    lines.append("")
    for label, curve in profile["verify_latency_s"].items():
        lines.append(f"Measured T(w) [{label}], median of {profile['config']['repeats']}, ms: " + ", ".join(
            f"w={w}: {1000 * t:.1f}" for w, t in sorted(curve.items(), key=lambda item: int(item[0]))))
    lines.append("")
    lines.append(f"ARCA pick: width {best['width']} ({best['placement']}"
                 + (f", ratio {best['hcmp_ratio']:g}" if best["hcmp_ratio"] is not None else "")
                 + f"), predicted tau {best['tau']:.2f}, {best['tokens_per_s']:.1f} tok/s, speedup "
                 f"{best['predicted_speedup']:.2f}x over our plain step (T_T = {1000 * base_tt:.1f} ms). "
                 f"Drafter {profile['drafter']}, acceptance from {profile['acceptance_source']}, "
                 f"context {profile['context_tokens']} tokens.")
    return "\n".join(lines)


def compare_table(profile: dict, bench: dict, method_widths: dict[str, int]) -> str:
    """Predicted (cost model) next to measured speedup for benchmarked widths."""
    label = "plain" if profile["best"]["placement"] == "plain" else f"hcmp:{profile['best']['hcmp_ratio']:g}"
    rows = ["| method | width | pred tau | measured tau | pred speedup (eq. 6) | measured speedup (95% CI) | lossless |",
            "|---|---|---|---|---|---|---|"]
    for method, width in method_widths.items():
        entry = bench["summary"][method]
        pred = profile["predicted"][label].get(width) or profile["predicted"][label].get(str(width))
        ci = entry.get("speedup_ci95", float("nan"))
        rows.append(f"| {method} | {width} | {pred['tau']:.2f} | {entry['tau']:.2f} | {pred['predicted_speedup']:.2f}x | "
                    f"{entry['speedup']:.2f}x (±{ci:.2f}) | {'yes' if not entry['mismatches'] else 'NO'} |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> ProfileConfig:
    defaults = ProfileConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=defaults.target)
    p.add_argument("--draft", default=defaults.draft)
    p.add_argument("--drafter", default=defaults.drafter, help="bench method spec without its width option")
    p.add_argument("--dtype", default=defaults.dtype)
    p.add_argument("--device", default=defaults.device)
    p.add_argument("--drafter-device", default=defaults.drafter_device, help="dovetail placement of the drafter")
    p.add_argument("--placement", default=defaults.placement, choices=["plain", "hcmp"])
    p.add_argument("--hcmp-ratios", default=",".join(map(str, defaults.hcmp_ratios)))
    p.add_argument("--hcmp-threads", action="store_true")
    p.add_argument("--widths", default=",".join(map(str, defaults.widths)))
    p.add_argument("--repeats", type=int, default=defaults.repeats)
    p.add_argument("--context-tokens", type=int, default=defaults.context_tokens)
    p.add_argument("--suite", default=defaults.suite)
    p.add_argument("--calibration-offset", type=int, default=defaults.calibration_offset)
    p.add_argument("--calibration-prompts", type=int, default=defaults.calibration_prompts)
    p.add_argument("--calibration-width", type=int, default=defaults.calibration_width)
    p.add_argument("--calibration-new-tokens", type=int, default=defaults.calibration_new_tokens)
    p.add_argument("--acceptance", default=defaults.acceptance, choices=["auto", "saved", "measured"])
    p.add_argument("--refine-iterations", type=int, default=defaults.refine_iterations)
    p.add_argument("--threads", type=int, default=defaults.threads)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--bench-prompts", type=int, default=defaults.bench_prompts)
    p.add_argument("--bench-new-tokens", type=int, default=defaults.bench_new_tokens)
    p.add_argument("--bench-turns", type=int, default=defaults.bench_turns)
    p.add_argument("--compare-widths", default=",".join(map(str, defaults.compare_widths)))
    p.add_argument("--out", default=defaults.out)
    a = p.parse_args(argv)
    ints = lambda text: [int(x) for x in text.split(",") if x.strip()]  # noqa: E731
    return ProfileConfig(
        target=a.target, draft=a.draft, drafter=a.drafter, dtype=a.dtype, device=a.device,
        drafter_device=a.drafter_device, placement=a.placement,
        hcmp_ratios=[float(x) for x in a.hcmp_ratios.split(",") if x.strip()], hcmp_threads=a.hcmp_threads,
        widths=ints(a.widths), repeats=a.repeats, context_tokens=a.context_tokens, suite=a.suite,
        calibration_offset=a.calibration_offset, calibration_prompts=a.calibration_prompts,
        calibration_width=a.calibration_width, calibration_new_tokens=a.calibration_new_tokens,
        acceptance=a.acceptance, refine_iterations=a.refine_iterations, threads=a.threads, seed=a.seed,
        bench_prompts=a.bench_prompts, bench_new_tokens=a.bench_new_tokens, bench_turns=a.bench_turns, compare_widths=ints(a.compare_widths),
        out=a.out)


def main(argv: list[str] | None = None) -> dict:
    from draftsmith.eval.bench import BenchConfig, format_table, run_benchmark

    config = parse_args(argv)
    target = TargetModel.from_pretrained(config.target, dtype=config.dtype, device=config.device)
    draft = TargetModel.from_pretrained(config.draft, dtype=config.dtype, device=config.device) if config.draft else None
    profile = run_profile(config, target, draft)
    out = Path(config.out or f"outputs/arca_profile_{Path(config.target).name}.json")
    save_profile(profile, out)
    print(f"wrote {out}")
    table = format_profile(profile)
    if config.bench_prompts > 0:
        best = profile["best"]["width"]
        method_widths = {f"arca:{out}": best}
        for width in config.compare_widths:
            if width != best and width in profile["trees"]:
                method_widths[f"arca:{out},width={width}"] = width
        bench_config = BenchConfig(target=config.target, draft=config.draft, methods=["plain", *method_widths],
                                   suite=config.suite, num_prompts=config.bench_prompts,
                                   max_new_tokens=config.bench_new_tokens, turns=config.bench_turns, dtype=config.dtype, device=config.device,
                                   threads=config.threads, seed=config.seed,
                                   max_tree_tokens=max(max(profile["trees"]), 1))
        bench = run_benchmark(bench_config, target, draft)
        bench_table = format_table(bench)
        comparison = compare_table(profile, bench, method_widths)
        print(bench_table)
        print()
        print(comparison)
        profile["bench"] = {"summary": bench["summary"], "machine": bench["machine"], "config": bench["config"],
                            "method_widths": method_widths}
        save_profile(profile, out)
        table += "\n\n" + bench_table + "\n\n" + comparison
    out.with_suffix(".md").write_text(table + "\n")
    print(f"wrote {out.with_suffix('.md')}")
    return profile


if __name__ == "__main__":
    main()
