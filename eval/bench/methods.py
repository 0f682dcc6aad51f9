"""The methods a benchmark compares: one explicit table, name -> (typed options, builder).

A method spec names a table entry and sets its options, parsed once by the strict config loader
(unknown options are refused with the valid ones listed, bad values are named):

    lm-tree:depth=4,topk=3,budget=16        compact form (command line)
    {lm-tree: {depth: 4, topk: 3}}          mapping form (YAML)
    medusa:outputs/run/final,budget=8       a first item without `=` is the entry's `path`
    pipeline:inner=(lm-chain:budget=4)      a nested method in parentheses
    minions:drafters=[(lm-chain:every=2),ngram]   a list of methods in brackets
    union:drafters=[(dgf:depth=3,topk=1,budget=3),(ngram:budget=6)]   two trees in one verify
    cascade:drafters=[(ngram:min_n=3,budget=8),dgf]   lookup on a repeat, else the trained drafter
    {method: <either form>, label: lookup, else DFlash}   a short label for the tables (YAML)

Composite methods (pipeline, dovetail, hcmp, minions, union, cascade) receive the drafters the table
built for their nested specs; ARCA profiles rebuild the profiled drafter at the chosen budget from its
parsed spec. Every drafter's node budget is called `budget` (`eval.decode.drafters.base.TREE_BUDGET`).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import yaml

from draftsmith.config import ConfigError, Parsable, config_from_dict, option
from draftsmith.data.ngram_prior import NgramPrior
from draftsmith.eval.bench.build_context import BuildContext, require_invariant_kernels
from draftsmith.eval.decode.decoder import DrafterMethod, Method
from draftsmith.eval.decode.drafters.base import CHAIN_BUDGET, TREE_BUDGET, Drafter
from draftsmith.eval.decode.drafters.dgf import DGF_DEPTH, DGF_TOPK, drafter_tree, load_dgf_drafter, same_weights
from draftsmith.eval.decode.drafters.llmcad import LLMCadConfig, LLMCadDrafter
from draftsmith.eval.decode.drafters.lm import LMDrafter
from draftsmith.eval.decode.drafters.dflash import load_dflash_drafter
from draftsmith.eval.decode.drafters.prior import PRIOR_WEIGHT, CandidatePrior
from draftsmith.eval.decode.drafters.medusa import TargetAdapter, load_medusa_drafter
from draftsmith.eval.decode.drafters.minions import MinionsConfig, MinionsDrafter
from draftsmith.eval.decode.drafters.ngram import NGRAM_BUDGET, NgramDrafter
from draftsmith.eval.decode.drafters.union import UnionDrafter
from draftsmith.eval.bench.hf_methods import HFGenerate
from draftsmith.eval.policies.arca import load_profile, profile_paths
from draftsmith.eval.policies.hcmp import LAYER_TYPES, HcmpConfig, HcmpPolicy
from draftsmith.eval.policies.pipeline import PipelinePolicy
from draftsmith.eval.policies.placement import DovetailPolicy
from draftsmith.eval.policies.selfdraft import SelfDraftConfig, SelfDraftPolicy
from draftsmith.models.bundled import bundled_drafter
from draftsmith.models.compiled import CompileSettings
from draftsmith.models.engine import Backend
from draftsmith.models.kernels import KernelIsa, WeightPrecision
from draftsmith.models.precision import DraftPrecision
from draftsmith.models.target import resolve_dtype
from draftsmith.models.trees import LM_TREE, MEDUSA_BUDGET
from draftsmith.specs import SpecError, check_spec_name, split_items, split_top

# ---------------------------------------------------------------------------------------------
# Method specs
# ---------------------------------------------------------------------------------------------


def unwrap(text: str) -> str:
    """`(lm-chain:budget=4)` -> `lm-chain:budget=4` (a nested method spec)."""
    return text[1:-1].strip() if text.startswith("(") and text.endswith(")") else text


def raw_value(text: str, annotation: Any) -> Any:
    """A compact-form value for a field: lists in brackets, strings kept as written, others as YAML."""
    if text.startswith("[") and text.endswith("]"):
        return [unwrap(item) for item in split_top(text[1:-1])]
    text = unwrap(text)
    if annotation is str or annotation == (str | None) or annotation is MethodSpec or annotation == (MethodSpec | None):
        return text
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_compact(text: str, options_cls: type) -> dict:
    """`depth=4,topk=3` (the part after `name:`) -> raw option values for `options_cls`."""
    hints = typing.get_type_hints(options_cls)
    names = [f.name for f in dataclasses.fields(options_cls)]
    try:
        first, options = split_items(text)
    except SpecError as err:
        raise ConfigError(f"{err} (options: {', '.join(names)})") from None
    raw: dict[str, Any] = {key: raw_value(value, hints.get(key, str)) for key, value in options.items()}
    if first is not None:
        if "path" not in names:
            raise ConfigError(f"option {first!r}: use key=value (options: {', '.join(names)})")
        raw["path"] = first
    return raw


def compact_text(name: str, raw: Any) -> str:
    """The compact form of a mapping-form spec: `{cascade: {drafters: [ngram, {dgf: {depth: 4}}]}}` ->
    `cascade:drafters=[(ngram), (dgf:depth=4)]`."""
    def value_text(value: Any) -> str:
        if isinstance(value, list):
            return "[" + ", ".join(f"({value_text(item)})" for item in value) + "]"
        if isinstance(value, Mapping) and len(value) == 1:
            (inner, options), = value.items()
            return compact_text(str(inner), options)
        if isinstance(value, Mapping) and "method" in value:
            return value_text(value["method"])
        return str(value)
    options = ",".join(f"{key}={value_text(value)}" for key, value in (raw or {}).items())
    return name + (":" + options if options else "")


LABEL_KEYS = {"method", "label"}
LABEL_REFUSED = ("|", "\n", "`")  # a label is one cell of a Markdown table


@dataclass(frozen=True)
class MethodSpec(Parsable):
    """A parsed method spec: the table entry's name, its typed options, and the label it is shown as
    (its spec text unless the config gave it a label; `text` then keeps the spec it reads back from)."""

    name: str
    options: Any
    label: str
    text: str | None = None

    @classmethod
    def entry(cls, name: str, path: str) -> "MethodEntry":
        """The table entry a name refers to (another engine's spec type looks names up in its own table)."""
        return lookup(name, path)

    @classmethod
    def from_config(cls, value: Any, path: str = "method") -> "MethodSpec":
        if isinstance(value, str):
            name, _, rest = value.strip().partition(":")
            try:
                check_spec_name(value, name)
            except SpecError as err:
                raise ConfigError(f"{path}: {err}") from None
            entry = cls.entry(name, path)
            try:
                raw = parse_compact(rest, entry.options)
            except ConfigError as err:
                raise ConfigError(f"{path}: method {value!r}: {err}") from None
            return cls._build(name, entry, raw, value.strip(), path)
        if isinstance(value, Mapping) and "method" in value:
            return cls.labelled(value, path)
        if isinstance(value, Mapping) and len(value) == 1:
            (name, raw), = value.items()
            entry = cls.entry(str(name), path)
            return cls._build(str(name), entry, raw or {}, compact_text(str(name), raw), path)
        raise ConfigError(f"{path}: a method is `name[:key=value,...]`, a one-key mapping or "
                          f"{{method: ..., label: ...}}, got {value!r}")

    @classmethod
    def labelled(cls, value: Mapping, path: str) -> "MethodSpec":
        """`{method: <spec>, label: <short text>}`: the spec shown in every table as its label."""
        unknown = sorted(set(map(str, value)) - LABEL_KEYS)
        if unknown:
            raise ConfigError(f"{path}: unknown key {unknown[0]!r} beside `method` (keys: label, method)")
        spec = cls.from_config(value["method"], f"{path}.method")
        label = value.get("label")
        if label is None:
            return spec
        label = str(label).strip()
        if not label or any(mark in label for mark in LABEL_REFUSED):
            raise ConfigError(f"{path}.label: {label!r}: give one line of text without |, ` or a line break")
        return cls(spec.name, spec.options, label, spec.text or spec.label)

    @classmethod
    def _build(cls, name: str, entry: "MethodEntry", raw: Any, label: str, path: str) -> "MethodSpec":
        try:
            options = config_from_dict(entry.options, raw, "", noun="option")
        except ConfigError as err:
            raise ConfigError(f"{path}: method {label!r}: {err}") from None
        return cls(name, options, label)

    def replace(self, **changes: Any) -> "MethodSpec":
        """The same method with some options changed (e.g. another budget); the label says so."""
        options = dataclasses.replace(self.options, **changes)
        extra = ",".join(f"{key}={value}" for key, value in changes.items())

        def extended(text: str) -> str:
            return text + ("," if ":" in text else ":") + extra
        return type(self)(self.name, options, extended(self.label), self.text and extended(self.text))

    def __str__(self) -> str:
        return self.label

    def to_config(self) -> Any:
        return {"method": self.text, "label": self.label} if self.text else self.label

    def __hash__(self) -> int:  # options are plain dataclasses: equal specs have equal names and labels
        return hash((self.name, self.label))

    def has_option(self, name: str) -> bool:
        """Whether this method's options declare `name` (e.g. a `budget` a sweep can set)."""
        return name in {f.name for f in dataclasses.fields(self.options)}

    def family(self) -> str:
        """The spec without its size options (budget, depth, topk, beam): what a budget sweep varies over."""
        sizes = {"budget", "depth", "topk", "beam", "branches"}
        kept = [(f.name, getattr(self.options, f.name)) for f in dataclasses.fields(self.options)
                if f.name not in sizes and getattr(self.options, f.name) != f.default
                and not isinstance(getattr(self.options, f.name), (list, MethodSpec))]
        text = ",".join(str(value) if name == "path" else f"{name}={value}" for name, value in kept)
        return self.name + (":" + text if text else "")


def check_labels(methods: list[MethodSpec]) -> None:
    """Every method is one row of each table and one key of the results: a label shown twice is refused."""
    seen: set[str] = set()
    for spec in methods:
        if spec.label in seen:
            raise ConfigError(f"methods names a method twice: {spec.label!r} is listed twice; drop one or give it "
                              "another `label` ({method: ..., label: ...} in the YAML config)")
        seen.add(spec.label)


def parse_method(value: Any, path: str = "method") -> MethodSpec:
    return MethodSpec.from_config(value, path)


def inner_drafter(method: Method, what: str) -> Drafter:
    """The drafter of a built nested method (composites take drafters, not policies)."""
    if not isinstance(method, DrafterMethod) or method.drafter is None:
        raise ConfigError(f"{what}: {method.name!r} is not a drafter method (lm-chain, lm-tree, ngram, medusa, "
                          "dflash, dgf, llmcad, minions, union, cascade)")
    return method.drafter


# ---------------------------------------------------------------------------------------------
# Options and builders, one per method
# ---------------------------------------------------------------------------------------------


@dataclass
class NoOptions:
    pass


@dataclass
class PlainCompiledOptions:
    kernel_isa: KernelIsa | None = option(None, "the batch-invariant kernels' instruction set (null: the run's, and "
                                          "this is the compiled methods' lossless reference); another set times a "
                                          "second plain baseline in the same run, its tokens compared, not required "
                                          "to agree (other arithmetic)")


@dataclass
class AssistedOptions:
    model: str | None = option(None, "assistant model (registry name / dir); null: the run's draft")
    tokens: int | None = option(None, "draft tokens per round at most (num_assistant_tokens, constant schedule); "
                                      "null: the assistant's generation config (transformers' default: 20)", ge=1)
    confidence: float | None = option(None, "stop drafting once the assistant's probability of its token falls "
                                            "below this (assistant_confidence_threshold; 0: never); null: the "
                                            "assistant's generation config (transformers' default: 0.4)",
                                      ge=0.0, lt=1.0)

    def assistant_settings(self) -> dict[str, Any]:
        settings = {}
        if self.tokens is not None:
            settings.update(num_assistant_tokens=self.tokens, num_assistant_tokens_schedule="constant")
        if self.confidence is not None:
            settings["assistant_confidence_threshold"] = self.confidence
        return settings


SHARED_WIDTH_HELP = ("the draft LM's compiled graphs: null as compile.shared_width; false: a static graph per "
                     "bucket (a small draft LM's weight copies are cheap, and its one-token forwards get a graph of "
                     "their own); compiled backend only")
LM_VOCAB_HELP = "a draft vocabulary (data.draft_vocab output dir): the draft LM's head is sliced to it at load time"
DRAFTER_DTYPE_HELP = ("the drafter's arithmetic (bfloat16 halves the weights a draft step streams; the target "
                      "verifies in its own dtype); null: the target's dtype")
DRAFTER_WEIGHTS_HELP = ("the drafter's stored weights on the compiled backend's batch-invariant kernels: model (in "
                        "its dtype) | int8 (weight-only, a scale per output row: a quarter of fp32's weight stream) | "
                        "w8a8 (int8 weights and inputs, float32 drafters); null: the run's compile.weights")
LM_WEIGHTS_HELP = ("the draft LM's stored weights on the compiled backend's batch-invariant kernels, its arithmetic "
                   "in `precision` (float32 or bfloat16): model | int8 (weight-only, a scale per output row: a quarter "
                   "of fp32's weight stream; under float32 activations where the CPU has no bf16 dot product) | w8a8 "
                   "(float32 draft LMs); null: as `precision` says")
PRECISION_HELP = ("the draft LM's arithmetic: float32 | bfloat16 | int8 (dynamic, eager) | int8-weights (weight-only "
                  "int8, bf16 activations: the batch-invariant kernels' int8 on the compiled backend); the target "
                  "verifies in its own dtype")


@dataclass
class LMChainOptions:
    budget: int = option(CHAIN_BUDGET, "draft tokens per round", ge=1)
    precision: DraftPrecision = option(DraftPrecision.FLOAT32, PRECISION_HELP)
    shared_width: bool | None = option(None, SHARED_WIDTH_HELP)
    weights: WeightPrecision | None = option(None, LM_WEIGHTS_HELP)
    model: str | None = option(None, "draft LM (registry name / dir); null: the run's draft")
    every: int | None = option(None, "use every N-th layer of the target as the draft LM instead", ge=1)
    vocab: str | None = option(None, LM_VOCAB_HELP)
    stop_below: float | None = option(None, "stop the chain once the draft LM's probability of the chain so far "
                                            "falls below this (null: always draft budget tokens)", gt=0, lt=1)


@dataclass
class LMParallelOptions:
    budget: int = option(CHAIN_BUDGET, "draft tokens per round, all from one forward (budget - 1 mask tokens)", ge=1)
    precision: DraftPrecision = option(DraftPrecision.FLOAT32, PRECISION_HELP)
    shared_width: bool | None = option(None, SHARED_WIDTH_HELP)
    weights: WeightPrecision | None = option(None, LM_WEIGHTS_HELP)
    model: str | None = option(None, "a parallel (PARD) draft LM, with config.pard_token; null: the run's draft")
    vocab: str | None = option(None, LM_VOCAB_HELP)


@dataclass
class LMTreeOptions:
    budget: int = option(TREE_BUDGET, "draft nodes per round (the best by cumulative log-probability)", ge=1)
    precision: DraftPrecision = option(DraftPrecision.FLOAT32, PRECISION_HELP)
    shared_width: bool | None = option(None, SHARED_WIDTH_HELP)
    weights: WeightPrecision | None = option(None, LM_WEIGHTS_HELP)
    depth: int = option(LM_TREE.depth, "tree depth", ge=1)
    topk: int = option(LM_TREE.topk, "children per expanded node", ge=1)
    beam: int | None = option(None, "nodes expanded per level (null: topk)", ge=1)
    model: str | None = option(None, "draft LM (registry name / dir); null: the run's draft")
    every: int | None = option(None, "use every N-th layer of the target as the draft LM instead", ge=1)
    vocab: str | None = option(None, LM_VOCAB_HELP)


@dataclass
class NgramOptions:
    n: int = option(3, "longest n-gram matched", ge=1)
    min_n: int = option(1, "shortest n-gram matched (2-3: propose only on a real repeat, e.g. before a "
                           "trained drafter in a cascade)", ge=1)
    budget: int = option(NGRAM_BUDGET, "tokens proposed per continuation", ge=1)
    branches: int = option(1, "distinct continuations merged into a trie", ge=1)


ROUND_COSTS_HELP = ("dynamic size (greedy): the cost of a round of 1, 2, ... draft nodes on this machine (any unit: "
                    "its draft and its verify of 2, 3, ... tokens, e.g. a bench's draft_ms_per_round plus its "
                    "verify_ms_by_width); each round keeps the count of its best nodes that commits the most tokens "
                    "per cost, counting a node's path probability as its chance (null: off)")
KEEP_ABOVE_HELP = ("dynamic size (greedy): of the tree's nodes verify only those whose path probability under the "
                   "drafter is above this (null: all of them)")


@dataclass
class MedusaOptions:
    path: str = option(help="a train/medusa.py final/ directory")
    budget: int | None = option(None, f"ARCA tree size from the saved head accuracies (null: {MEDUSA_BUDGET} nodes, "
                                      "the best measured on a 2-core CPU)", ge=1)
    adapter: TargetAdapter = option(TargetAdapter.REFUSE, "Medusa-2 heads: merge the LoRA adapter into the target, "
                                                          "or ignore it")
    keep_above: float | None = option(None, KEEP_ABOVE_HELP, gt=0, lt=1)
    weights: WeightPrecision | None = option(None, DRAFTER_WEIGHTS_HELP)


CONTEXT_WEIGHT_HELP = ("greedy: re-rank each node's candidates by the request's own pairs and triples after its token, "
                       "with this weight on log(1 + count) (0: off)")


@dataclass
class DFlashOptions:
    path: str = option(help="a train/dflash.py final/ (or snapshot) directory")
    budget: int | None = option(None, "draft tokens per round (null: the block's, block_size - 1)", ge=1)
    stop_below: float | None = option(None, "cut the chain where the drafter's probability of it falls below this "
                                            "(null: always the whole budget)", gt=0, lt=1)
    vocab: str | None = option(None, "a draft vocabulary (data.draft_vocab output dir): the drafter scores only that "
                                     "slice of the LM head (cheaper; null: the whole vocabulary, as exported)")
    topk: int = option(1, "candidates per block position: 1 a chain, k > 1 a tree of budget x k nodes (the top k "
                          "at each position under the previous position's first)", ge=1)
    nodes: int | None = option(None, "greedy, with topk > 1: the tree is every path of top-k candidates (each "
                                     "position's k under each of the previous position's k) cut to its `nodes` best "
                                     "by path probability (null: the tree topk describes)", ge=1)
    keep_above: float | None = option(None, KEEP_ABOVE_HELP, gt=0, lt=1)
    round_costs: list[float] | None = option(None, ROUND_COSTS_HELP, gt=0)
    dtype: Literal["float32", "bfloat16"] | None = option(None, DRAFTER_DTYPE_HELP)
    weights: WeightPrecision | None = option(None, DRAFTER_WEIGHTS_HELP)
    prior: str | None = option(None, "greedy: a data.ngram_prior output directory; each node's children are its "
                                     "position's top candidates re-ranked given the node's token and its parent's")
    prior_weight: float | None = option(None, f"the prior's weight on its log-probability (null: {PRIOR_WEIGHT})",
                                        gt=0)
    context_weight: float = option(0.0, CONTEXT_WEIGHT_HELP, ge=0)


@dataclass
class DGFOptions:
    path: str | None = option(None, "a train/dgf.py final/ directory; null: the drafter bundled for the target")
    depth: int | None = option(None, f"dynamic-tree depth; null: the export's tree, else {DGF_DEPTH}", ge=1)
    topk: int | None = option(None, f"children per expanded node; null: the export's tree, else {DGF_TOPK}", ge=1)
    budget: int | None = option(None, f"draft nodes per round (Dovetail's g); null: the export's tree, else "
                                      f"{TREE_BUDGET}", ge=1)
    stop_below: float | None = option(None, "dynamic depth: no deeper level once the drafter's probability of its "
                                            "best path falls below this (null: always the full depth)", gt=0, lt=1)
    keep_above: float | None = option(None, KEEP_ABOVE_HELP, gt=0, lt=1)
    round_costs: list[float] | None = option(None, ROUND_COSTS_HELP, gt=0)
    dtype: Literal["float32", "bfloat16"] | None = option(None, DRAFTER_DTYPE_HELP)
    weights: WeightPrecision | None = option(None, DRAFTER_WEIGHTS_HELP)
    context_weight: float = option(0.0, CONTEXT_WEIGHT_HELP, ge=0)


@dataclass
class LLMCadOptions(LLMCadConfig):
    model: str | None = option(None, "draft LM (registry name / dir); null: the run's draft, else every=3")
    every: int | None = option(None, "use every N-th layer of the target as the draft LM", ge=1)
    precision: DraftPrecision = option(DraftPrecision.FLOAT32, PRECISION_HELP)
    weights: WeightPrecision | None = option(None, LM_WEIGHTS_HELP)
    vocab: str | None = option(None, LM_VOCAB_HELP)


def default_minions_drafters() -> list:
    return [MethodSpec.from_config("lm-chain:every=2"), MethodSpec.from_config("lm-chain:every=3"),
            MethodSpec.from_config("ngram")]


def check_drafters(drafters: list | None) -> None:
    """A composite's drafters, when given, name at least one method."""
    if drafters is not None and not drafters:
        raise ConfigError("drafters=[]: give at least one drafter method, e.g. drafters=[(ngram:min_n=3),dgf]")


@dataclass
class MinionsOptions(MinionsConfig):
    drafters: list[MethodSpec] = option(factory=default_minions_drafters, help="sub-drafters (methods)")
    weights: list[float] | None = option(None, "initial weights, one per sub-drafter", gt=0)

    def __post_init__(self):
        super().__post_init__()
        check_drafters(self.drafters)


def default_union_drafters() -> list:
    return [MethodSpec.from_config("dgf"), MethodSpec.from_config("ngram")]


# The cascade's lookup: only on a repeated 3-gram, 8 tokens at a time (on 2-grams with 5 tokens before; on the AVX2
# EPYC the 3-gram, 8-token lookup was faster in front of each drafter it was tried with: 1.015-1.031x per prompt turn,
# results/drafter_families_epyc_avx2/lookup_bundled/).
CASCADE_LOOKUP = "ngram:min_n=3,budget=8"
# Its drafter in a greedy run on the batch-invariant kernels: the bundled drafter as an 8-node dynamic tree on int8
# weights, trimmed by path probability. After this lookup it led the export's chain in one interleaved run per kind:
# 1.93x against 1.77x on the Xeon, 1.70x against 1.59x on the AVX2 EPYC (results/drafter_families_*/lookup_bundled;
# on the Zen 4, after lookup on 2-grams, 2.03x against 1.85x: drafter_families_zen4). Elsewhere (eager, inductor,
# or sampling, where a tree is not trimmed) the bundled drafter as its export's chain on the run's weights.
CASCADE_TREE = "dgf:depth=6,topk=2,budget=8,stop_below=0.2,keep_above=0.1,weights=int8"
CASCADE_CHAIN = "dgf"


def default_cascade_drafters(ctx: BuildContext) -> list[MethodSpec]:
    """The bare cascade's drafters: lookup, else the bundled drafter (its int8 tree where it is measured fastest)."""
    tree = ctx.greedy and ctx.settings.runs_invariant_kernels(ctx.backend)
    return [MethodSpec.from_config(CASCADE_LOOKUP), MethodSpec.from_config(CASCADE_TREE if tree else CASCADE_CHAIN)]


@dataclass
class UnionOptions:
    drafters: list[MethodSpec] = option(factory=default_union_drafters,
                                        help="sub-drafters in priority order (default: the bundled dgf, then ngram)")
    budget: int = option(TREE_BUDGET, "most nodes of the merged tree", ge=1)

    def __post_init__(self):
        check_drafters(self.drafters)


@dataclass
class CascadeOptions:
    drafters: list[MethodSpec] | None = option(None, f"sub-drafters asked in order; null: prompt lookup "
                                               f"({CASCADE_LOOKUP}), else the bundled drafter: ({CASCADE_TREE}) "
                                               f"in a greedy run on the batch-invariant kernels, ({CASCADE_CHAIN}) "
                                               "elsewhere")

    def __post_init__(self):
        check_drafters(self.drafters)


@dataclass
class InnerOptions:
    inner: MethodSpec = option(help="the drafter method to wrap, e.g. (lm-chain:budget=4)")


@dataclass
class DovetailOptions(InnerOptions):
    device: str = option("auto", "the drafter's device (the target stays where it was loaded)")


@dataclass
class HcmpOptions:
    inner: MethodSpec | None = option(None, "a drafter method (null: plain decoding with the split target)")
    ratio: float | None = option(None, "share of every linear layer's columns on unit 0", ge=0, le=1)
    qkv: float | None = option(None, "q/k/v projections on unit 0", ge=0, le=1)
    o: float | None = option(None, "output projection on unit 0", ge=0, le=1)
    mlp: float | None = option(None, "MLP on unit 0", ge=0, le=1)
    attention: float | None = option(None, "share of the KV cache on unit 0", ge=0, le=1)
    device0: str = option("cpu", "unit 0 (the high-parallelism unit)")
    device1: str = option("cpu", "unit 1")
    threads: bool = option(False, "run the two units' shares in two threads")


@dataclass
class ArcaOptions:
    path: str = option(help="an eval.arca_profile profile JSON")
    budget: int | None = option(None, "another profiled budget than the ARCA pick", ge=0)


def build_plain(spec: MethodSpec, ctx: BuildContext) -> Method:
    return HFGenerate(spec.label)


def build_assisted(spec: MethodSpec, ctx: BuildContext) -> Method:
    return HFGenerate(spec.label, assistant=ctx.small_model(spec.options.model, None, spec.label).model,
                      assistant_settings=spec.options.assistant_settings())


def build_loop_plain(spec: MethodSpec, ctx: BuildContext) -> Method:
    return DrafterMethod(None, spec.label)


def build_plain_compiled(spec: MethodSpec, ctx: BuildContext) -> Method:
    if spec.options.kernel_isa is not None:
        require_invariant_kernels(spec.label, f"kernel_isa={spec.options.kernel_isa}", Backend.COMPILED, ctx.settings)
    return DrafterMethod(None, spec.label, backend=Backend.COMPILED, kernel_isa=spec.options.kernel_isa)


def build_lm_chain(spec: MethodSpec, ctx: BuildContext) -> Method:
    o = spec.options
    vocab = ctx.vocab(o.vocab)
    lm = ctx.small_model(o.model, o.every, spec.label, vocab, o.precision, o.shared_width, o.weights)
    drafter = LMDrafter(lm, mode="chain", budget=o.budget, name=spec.label, vocab=vocab, stop_below=o.stop_below)
    return DrafterMethod(drafter, spec.label)


def build_lm_parallel(spec: MethodSpec, ctx: BuildContext) -> Method:
    o = spec.options
    vocab = ctx.vocab(o.vocab)
    lm = ctx.small_model(o.model, None, spec.label, vocab, o.precision, o.shared_width, o.weights)
    return DrafterMethod(LMDrafter(lm, mode="parallel", budget=o.budget, name=spec.label, vocab=vocab), spec.label)


def build_lm_tree(spec: MethodSpec, ctx: BuildContext) -> Method:
    o = spec.options
    vocab = ctx.vocab(o.vocab)
    lm = ctx.small_model(o.model, o.every, spec.label, vocab, o.precision, o.shared_width, o.weights)
    drafter = LMDrafter(lm, mode="tree", budget=o.budget, depth=o.depth, topk=o.topk, beam=o.beam, name=spec.label,
                        vocab=vocab)
    return DrafterMethod(drafter, spec.label)


def build_ngram(spec: MethodSpec, ctx: BuildContext) -> Method:
    o = spec.options
    if o.min_n > o.n:
        raise ConfigError(f"{spec.label}: min_n={o.min_n} is larger than n={o.n}; need 1 <= min_n <= n")
    drafter = NgramDrafter(max_ngram=o.n, min_ngram=o.min_n, budget=o.budget, num_branches=o.branches,
                           name=spec.label)
    return DrafterMethod(drafter, spec.label)


def build_medusa(spec: MethodSpec, ctx: BuildContext) -> Method:
    o = spec.options
    drafter = load_medusa_drafter(o.path, ctx.target, budget=o.budget, target_adapter=o.adapter, name=spec.label,
                                  backend=ctx.backend, settings=drafter_settings(spec, ctx), keep_above=o.keep_above)
    return DrafterMethod(drafter, spec.label)


def drafter_settings(spec: MethodSpec, ctx: BuildContext) -> CompileSettings:
    """The compile settings of a feature, block or Medusa drafter: the run's, with the method's `weights` when given."""
    weights = spec.options.weights
    if weights is None:
        return ctx.settings
    require_invariant_kernels(spec.label, f"weights={weights.value}", ctx.backend, ctx.settings)
    return replace(ctx.settings, weights=weights)


def dflash_prior(o: DFlashOptions, label: str) -> CandidatePrior | None:
    """The options' candidate prior (None: the block's own ranking)."""
    if o.prior is None and o.prior_weight is not None:
        raise ConfigError(f"{label}: prior_weight={o.prior_weight} weighs a prior; give prior=<a data.ngram_prior "
                          "directory>")
    if o.prior is None and not o.context_weight:
        return None
    ngrams = None if o.prior is None else NgramPrior.load(o.prior)
    return CandidatePrior(ngrams, PRIOR_WEIGHT if o.prior_weight is None else o.prior_weight, o.context_weight)


def context_prior(context_weight: float) -> CandidatePrior | None:
    """A feature drafter's re-ranking by the request's own tokens only (no trained prior; None: its own ranking)."""
    return CandidatePrior(None, 0.0, context_weight) if context_weight else None


def build_dflash(spec: MethodSpec, ctx: BuildContext) -> Method:
    o = spec.options
    drafter = load_dflash_drafter(o.path, ctx.target, budget=o.budget, name=spec.label, stop_below=o.stop_below,
                                  vocab=ctx.vocab(o.vocab), backend=ctx.backend, settings=drafter_settings(spec, ctx),
                                  topk=o.topk, dtype=o.dtype and resolve_dtype(o.dtype), keep_above=o.keep_above,
                                  nodes=o.nodes, prior=dflash_prior(o, spec.label), round_costs=o.round_costs)
    ctx.drafter_engines.extend(drafter.engine.graphs)  # compiled: built before timing
    return DrafterMethod(drafter, spec.label)


def build_dgf(spec: MethodSpec, ctx: BuildContext) -> Method:
    o = spec.options
    path = o.path if o.path is not None else bundled_drafter(ctx.target.name)
    key = ("dgf", str(path), o.dtype, o.weights)
    if key in ctx.models:  # the same drafter in another tree shape: one model, one engine per run
        depth, topk, budget = drafter_tree(path, o.depth, o.topk, o.budget)
        return DrafterMethod(same_weights(ctx.models[key], depth, topk, budget, spec.label, o.stop_below,
                                          o.keep_above, context_prior(o.context_weight), o.round_costs), spec.label)
    drafter = ctx.models[key] = load_dgf_drafter(path, ctx.target, depth=o.depth, topk=o.topk, budget=o.budget,
                                                 name=spec.label, backend=ctx.backend,
                                                 settings=drafter_settings(spec, ctx), stop_below=o.stop_below,
                                                 dtype=o.dtype and resolve_dtype(o.dtype), keep_above=o.keep_above,
                                                 prior=context_prior(o.context_weight), round_costs=o.round_costs)
    ctx.drafter_engines.append(drafter.engine)
    return DrafterMethod(drafter, spec.label)


def build_llmcad(spec: MethodSpec, ctx: BuildContext) -> Method:
    o = spec.options
    every = o.every if (o.every is not None or o.model is not None or ctx.has_draft) else 3
    vocab = ctx.vocab(o.vocab)
    lm = ctx.small_model(o.model, every, spec.label, vocab, o.precision, weights=o.weights)
    config = LLMCadConfig(**{f.name: getattr(o, f.name) for f in dataclasses.fields(LLMCadConfig)})
    return DrafterMethod(LLMCadDrafter(lm, config=config, name=spec.label, vocab=vocab), spec.label)


def sub_drafters(spec: MethodSpec, subs: list[MethodSpec], ctx: BuildContext) -> list[Drafter]:
    """The drafters of a composite's nested specs (minions, union, cascade), built by the table."""
    return [inner_drafter(build_method(sub, ctx), spec.label) for sub in subs]


def build_minions(spec: MethodSpec, ctx: BuildContext) -> Method:
    o = spec.options
    if o.weights is not None and len(o.weights) != len(o.drafters):
        raise ConfigError(f"{spec.label}: {len(o.weights)} weights for {len(o.drafters)} drafters")
    drafters = sub_drafters(spec, o.drafters, ctx)
    config = MinionsConfig(**{f.name: getattr(o, f.name) for f in dataclasses.fields(MinionsConfig)})
    return DrafterMethod(MinionsDrafter(drafters, config, weights=o.weights, name=spec.label), spec.label)


def build_union(spec: MethodSpec, ctx: BuildContext) -> Method:
    drafters = sub_drafters(spec, spec.options.drafters, ctx)
    return DrafterMethod(UnionDrafter(drafters, "union", spec.options.budget, name=spec.label), spec.label)


def build_cascade(spec: MethodSpec, ctx: BuildContext) -> Method:
    subs = spec.options.drafters
    if subs is None:
        subs = default_cascade_drafters(ctx)
    drafters = sub_drafters(spec, subs, ctx)
    return DrafterMethod(UnionDrafter(drafters, "first", name=spec.label), spec.label)


def build_self_draft(spec: MethodSpec, ctx: BuildContext) -> Method:
    return SelfDraftPolicy(spec.options, tokenizer=ctx.target.tokenizer, name=spec.label)


def build_pipeline(spec: MethodSpec, ctx: BuildContext) -> Method:
    return PipelinePolicy(inner_drafter(build_method(spec.options.inner, ctx), spec.label), name=spec.label)


def build_dovetail(spec: MethodSpec, ctx: BuildContext) -> Method:
    drafter = inner_drafter(build_method(spec.options.inner, ctx), spec.label)
    return DovetailPolicy(drafter, spec.options.device, name=spec.label)


def build_hcmp(spec: MethodSpec, ctx: BuildContext) -> Method:
    o = spec.options
    ratios = {name: o.ratio for name in ("qkv", "o", "mlp")} if o.ratio is not None else {}
    ratios.update({name: getattr(o, name) for name in LAYER_TYPES if getattr(o, name) is not None})
    drafter = inner_drafter(build_method(o.inner, ctx), spec.label) if o.inner is not None else None
    config = HcmpConfig(device0=o.device0, device1=o.device1, ratios=ratios, threads=o.threads)
    return HcmpPolicy(drafter, config, name=spec.label)  # HCMP splits the eager module: backend eager


def arca_drafter(drafter_spec: MethodSpec, paths: list[list[int]], budget: int, ctx: BuildContext,
                 label: str) -> Drafter:
    """A profiled drafter at `budget` on ctx's engine: Medusa heads with ARCA's static tree `paths`, any other
    drafter with its own tree of that budget."""
    if isinstance(drafter_spec.options, MedusaOptions):
        o = drafter_spec.options
        return load_medusa_drafter(o.path, ctx.target, paths=paths, target_adapter=o.adapter, name=label,
                                   backend=ctx.backend, settings=drafter_settings(drafter_spec, ctx),
                                   keep_above=o.keep_above)
    return inner_drafter(build_method(drafter_spec.replace(budget=max(budget, 1)), ctx), label)


def build_arca(spec: MethodSpec, ctx: BuildContext) -> Method:
    """The profile's drafter at the ARCA pick (or the given budget), with its placement."""
    profile = load_profile(spec.options.path)
    budget = profile["best"]["budget"] if spec.options.budget is None else spec.options.budget
    paths = profile_paths(profile, budget)  # refuses a budget the profile did not measure
    if budget == 0:
        raise ConfigError(f"{spec.label}: budget 0 is plain decoding: use the plain or loop-plain method")
    drafter_spec = parse_method(profile["drafter"], f"{spec.options.path}: drafter")
    backend = Backend(profile["best"]["backend"])
    ctx = replace(ctx, backend=backend)  # an LM drafter runs on the engine the profile picked (models shared)
    drafter = arca_drafter(drafter_spec, paths, budget, ctx, spec.label)
    ratio = profile["best"].get("hcmp_ratio")
    if ratio is not None:
        config = HcmpConfig.uniform(ratio, threads=bool(profile["config"].get("hcmp_threads")))
        return HcmpPolicy(drafter, config, name=spec.label)
    return DrafterMethod(drafter, spec.label, backend=backend)


@dataclass(frozen=True)
class MethodEntry:
    options: type
    build: Callable[[MethodSpec, BuildContext], Method]
    help: str
    may_compile: bool = False  # may run on the compiled engine whatever the run's backend


METHODS: dict[str, MethodEntry] = {
    "plain": MethodEntry(NoOptions, build_plain, "HF generate of the target (the reference and baseline)"),
    "hf-assisted": MethodEntry(AssistedOptions, build_assisted, "HF assisted generation with a draft LM (the peer)"),
    "loop-plain": MethodEntry(NoOptions, build_loop_plain, "our decoder loop without a drafter, the run's backend"),
    "plain-compiled": MethodEntry(PlainCompiledOptions, build_plain_compiled, "our loop without a drafter on the "
                                  "compiled backend (the compiled plain baseline)",
                                  may_compile=True),
    "lm-chain": MethodEntry(LMChainOptions, build_lm_chain, "a small LM drafts a chain"),
    "lm-tree": MethodEntry(LMTreeOptions, build_lm_tree, "a small LM drafts an EAGLE-2-style dynamic tree"),
    "lm-parallel": MethodEntry(LMParallelOptions, build_lm_parallel, "a PARD draft LM: a chain from one forward"),
    "ngram": MethodEntry(NgramOptions, build_ngram, "prompt lookup (training-free)"),
    "medusa": MethodEntry(MedusaOptions, build_medusa, "trained Medusa heads, static tree"),
    "dflash": MethodEntry(DFlashOptions, build_dflash, "trained DFlash block drafter: a chain from one forward"),
    "dgf": MethodEntry(DGFOptions, build_dgf, "trained feature drafter (EAGLE / DGF), dynamic tree"),
    "llmcad": MethodEntry(LLMCadOptions, build_llmcad, "LLMCad: confidence-paced tree with fallback"),
    "minions": MethodEntry(MinionsOptions, build_minions, "Minions: weighted majority of several drafters"),
    "union": MethodEntry(UnionOptions, build_union, "several drafters' trees merged into one verified trie"),
    "cascade": MethodEntry(CascadeOptions, build_cascade, "the first of several drafters that proposes"),
    "self-draft": MethodEntry(SelfDraftConfig, build_self_draft, "Self-Draft: branches in the target's own forward"),
    "pipeline": MethodEntry(InnerOptions, build_pipeline, "pre-draft the next tree during verification"),
    "dovetail": MethodEntry(DovetailOptions, build_dovetail, "Dovetail placement: the drafter on another device"),
    "hcmp": MethodEntry(HcmpOptions, build_hcmp, "Ghidorah HCMP: the target split across two units"),
    "arca": MethodEntry(ArcaOptions, build_arca, "the drafter and budget an ARCA profile picked", may_compile=True),
}


def lookup(name: str, path: str = "method") -> MethodEntry:
    if name not in METHODS:
        close = difflib.get_close_matches(name, list(METHODS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{path}: unknown method {name!r}{hint}; methods: {', '.join(METHODS)}")
    return METHODS[name]


def build_method(spec: MethodSpec | str, ctx: BuildContext) -> Method:
    """Build a parsed spec (or parse a string first) with the run's models."""
    spec = spec if isinstance(spec, MethodSpec) else parse_method(spec)
    return METHODS[spec.name].build(spec, ctx)


def methods_help() -> str:
    """The table, for --help: each method with its options and their defaults."""
    lines = ["methods (name[:key=value,...]):"]
    for name, entry in METHODS.items():
        options = ", ".join(f"{f.name}={f.default}" if f.default is not dataclasses.MISSING else f.name
                            for f in dataclasses.fields(entry.options))
        lines.append(f"  {name:<12} {entry.help}" + (f"\n  {'':<12} options: {options}" if options else ""))
    return "\n".join(lines)


# The plain baselines of every bench: HF `generate`, and the decode loop without a drafter on the compiled engine
PLAIN, PLAIN_COMPILED = parse_method("plain"), parse_method("plain-compiled")
