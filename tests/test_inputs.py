"""Every input checked at the door: invalid option values of every command end in one short line and
exit status 2, malformed token tensors given to the decoder's API end in an InputError (a ValueError) naming the
value, and hardware that is not there is one line, never an assertion from inside torch. Values are drawn by
hypothesis."""

from __future__ import annotations

import dataclasses
import enum
import typing

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from draftsmith.config import option  # noqa: F401  (the configs below are built with it)
from draftsmith.data.features import FeatureCacheConfig
from draftsmith.data.regenerate import RegenerateConfig
from draftsmith.errors import UserError, run_main
from draftsmith.data import draft_vocab
from draftsmith.eval import arca_profile, drafter_top1, forward_profile, latency
from draftsmith.eval.bench import results_page
from draftsmith.eval.bench import run as bench
from draftsmith.eval.engines import llamacpp_bench
from draftsmith.eval.bench.run import BenchConfig
from draftsmith.eval.decode.decoder import DecodeConfig, InputError, SpeculativeDecoder
from draftsmith.eval.decode.drafters.ngram import NgramDrafter
from draftsmith.eval.latency import LatencyConfig
from draftsmith.eval.engines.llamacpp_bench import LlamaCppBenchConfig
from draftsmith.models.target import TargetModel, resolve_device
from draftsmith.train import dgf, distill, medusa

# ---------------------------------------------------------------------------------------------
# Commands: every typed option of every command's config, drawn invalid
# ---------------------------------------------------------------------------------------------

COMMANDS = [(bench.main, BenchConfig), (latency.main, LatencyConfig), (llamacpp_bench.main, LlamaCppBenchConfig),
            (draft_vocab.main, draft_vocab.DraftVocabConfig), (drafter_top1.main, drafter_top1.DrafterTop1Config),
            (forward_profile.main, forward_profile.ForwardProfileConfig),
            (arca_profile.main, arca_profile.ProfileConfig),
            (results_page.main, results_page.ResultsConfig)]
JOB_CONFIGS = [RegenerateConfig, FeatureCacheConfig]  # parsed by data.shards.parse_job_command
TRAIN_COMMANDS = [(dgf.cli, dgf.DGFRecipeConfig), (medusa.cli, medusa.MedusaRecipeConfig),
                  (distill.cli, distill.DistillRecipeConfig)]


def scalar_type(annotation):
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if typing.get_origin(annotation) in (typing.Union, getattr(__import__("types"), "UnionType"))\
        and len(args) == 1 else annotation


def invalid_values(annotation, bounds: dict) -> st.SearchStrategy | None:
    """Values the annotation (and its declared bounds) refuse; None for free text."""
    tp = scalar_type(annotation)
    words = st.text(alphabet="abcxyz", min_size=1, max_size=6).map(lambda w: "q" + w)
    if tp is bool:
        return st.sampled_from(["maybe", "2", "yes please"])
    if tp is int:
        low = bounds.get("ge", bounds.get("gt"))
        below = st.integers(max_value=int(low) - (0 if "ge" in bounds else 1) - 1).filter(lambda v: v < low) \
            if low is not None else st.nothing()
        return st.one_of(words, st.sampled_from(["1.5", "[1]"]), below.map(str))
    if tp is float:
        return st.one_of(words, st.sampled_from(["nan", "inf", "[0.1]"]))
    if isinstance(tp, type) and issubclass(tp, enum.Enum) or typing.get_origin(tp) is typing.Literal:
        return words
    return None


def option_cases(config_cls, prefix: str = "") -> list[tuple[str, st.SearchStrategy]]:
    """(dotted option name, invalid values) for every typed option, sections included."""
    hints = typing.get_type_hints(config_cls)
    cases = []
    for f in dataclasses.fields(config_cls):
        if dataclasses.is_dataclass(hints[f.name]):
            cases += option_cases(hints[f.name], f"{prefix}{f.name}.")
            continue
        strategy = invalid_values(hints[f.name], f.metadata.get("bounds", {}))
        if strategy is not None:
            cases.append((prefix + f.name, strategy))
    return cases


def assert_one_line(code: int, err: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert len(err) < 400, err  # the line that matters, not the usage text


CASES = [(main, name, strategy) for main, cls in COMMANDS for name, strategy in option_cases(cls)]
TRAIN_CASES = [(cli, name, strategy) for cli, cls in TRAIN_COMMANDS for name, strategy in option_cases(cls)]


@pytest.mark.parametrize("main,name,strategy", CASES, ids=[f"{m.__module__.split('.')[-1]}.{n}" for m, n, _ in CASES])
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_invalid_option_is_one_line_and_exit_2(main, name, strategy, data, capsys):
    value = data.draw(strategy)
    code = run_main(main, [f"{name}={value}"])
    assert_one_line(code, capsys.readouterr().err)


@pytest.mark.parametrize("cli,name,strategy", TRAIN_CASES,
                         ids=[f"{c.__module__.split('.')[-1]}.{n}" for c, n, _ in TRAIN_CASES])
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_invalid_training_option_is_one_line_and_exit_2(cli, name, strategy, data, capsys, tmp_path):
    """The train commands (`python train/<recipe>.py`), every typed option of every section: refused before
    anything loads."""
    value = data.draw(strategy)
    code = cli([f"output_dir={tmp_path / 'run'}", f"{name}={value}"])
    assert_one_line(code, capsys.readouterr().err)


REQUIRED = {"target": "tiny:llama", "source": "gsm8k:train", "output_dir": "x"}
JOB_CASES = [(cls, name, strategy) for cls in JOB_CONFIGS for name, strategy in option_cases(cls)]


@pytest.mark.parametrize("config_cls,name,strategy", JOB_CASES, ids=[f"{c.__name__}.{n}" for c, n, _ in JOB_CASES])
@settings(max_examples=6, deadline=None)
@given(data=st.data())
def test_job_configs_refuse_invalid_options_by_name(config_cls, name, strategy, data):
    from draftsmith.config import config_from_dict

    value = data.draw(strategy)
    fields = {f.name for f in dataclasses.fields(config_cls)}
    raw = {key: val for key, val in REQUIRED.items() if key in fields} | {name: value}
    with pytest.raises(UserError) as err:
        config_from_dict(config_cls, raw)
    assert name in str(err.value) and "\n" not in str(err.value)


def test_unknown_and_misspelled_options_are_one_line(capsys):
    assert_one_line(run_main(bench.main, ["num_promts=3"]), capsys.readouterr().err)
    assert_one_line(run_main(bench.main, ["--no-such-flag"]), capsys.readouterr().err)


# ---------------------------------------------------------------------------------------------
# Hardware that is not there
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:3", "mps"])
def test_a_device_that_is_not_there_is_one_line(device):
    with pytest.raises(UserError) as err:
        resolve_device(device)
    assert device in str(err.value) and "use device=cpu" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_the_bench_command_refuses_a_missing_gpu_in_one_line(capsys):
    assert_one_line(run_main(bench.main, ["target=tiny:llama", "device=cuda", "num_prompts=1"]),
                    capsys.readouterr().err)


# ---------------------------------------------------------------------------------------------
# The Python API: malformed token tensors
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder():
    target = TargetModel.from_pretrained("tiny:llama")
    return SpeculativeDecoder(target, NgramDrafter(), DecodeConfig(max_new_tokens=4))


VOCAB = 96  # models.tiny's vocabulary
MALFORMED = st.one_of(
    st.integers(0, VOCAB - 1).map(lambda n: torch.tensor([[n]], dtype=torch.float32)),  # not integer ids
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8).map(torch.tensor),  # (T,), not (1, T)
    st.integers(2, 3).map(lambda b: torch.zeros(b, 4, dtype=torch.long)),  # a batch
    st.just(torch.zeros(1, 0, dtype=torch.long)),  # empty
    st.integers(VOCAB, 10 ** 6).map(lambda n: torch.tensor([[1, n]])),  # past the vocabulary
    st.integers(-10 ** 6, -1).map(lambda n: torch.tensor([[n, 1]])),  # negative
    st.just(torch.ones(1, 1030, dtype=torch.long)),  # more than the target's 1024 positions
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4))  # a list, not a tensor


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=MALFORMED)
def test_malformed_token_tensors_raise_input_error(decoder, ids):
    with pytest.raises(InputError) as err:
        decoder.generate(ids)
    assert isinstance(err.value, ValueError) and "\n" not in str(err.value)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
def test_well_formed_prompts_decode(decoder, ids):
    result = decoder.generate(torch.tensor([ids]))
    assert 1 <= len(result.tokens) <= 4


def test_an_option_the_chosen_mode_does_not_read_is_refused_by_name(capsys):
    """compile.* is read only by the compiled backend: set on an eager run, it is refused, not ignored."""
    assert_one_line(run_main(bench.main, ["backend=eager", "methods=plain ngram", "compile.capacity=4096"]),
                    capsys.readouterr().err)
    BenchConfig(backend="eager", methods=None, target="tiny:llama")  # the defaults pass


@pytest.mark.parametrize("recipe,overrides,words", [
    ("dgf", ["data.feature_cache=somewhere"], "data.feature_cache='somewhere' is not read here: read by data.mode=offline"),
    ("dgf", ["loss.unroll_decay=0.5", "loss.unroll_steps=1"], "read when loss.unroll_steps > 1"),
    ("dgf", ["drafter.layer_fusion=gated"], "read when the drafter fuses several target layers"),
    ("dgf", ["optim.schedule=constant", "optim.min_lr_ratio=0.1"], "read by optim.schedule=linear|cosine"),
    ("dgf", ["logging.tracker=none", "logging.run_name=x"], "read by logging.tracker=wandb"),
    ("medusa", ["medusa2.lora_r=4"], "read by medusa2.enabled=true"),
    ("medusa", ["loss.distill_temperature=2"], "read when loss.distill_weight > 0"),
    ("distill", ["student.num_layers=3"], "read by student.init=shallow"),
    ("distill", ["loss.beta=0.3"], "read by loss.kind=jsd"),
    ("distill", ["on_policy.temperature=0.5"], "read when on_policy.fraction > 0"),
    ("distill", ["lora.enabled=true", "lora.adapter_samples_seen=240"], "read with lora.adapter"),
])
def test_train_options_the_chosen_mode_does_not_read_are_refused(recipe, overrides, words):
    """A recipe option that the configuration as given never reads is refused by name, with what reads it."""
    from draftsmith.config import ConfigError, load_config
    from draftsmith.train.dgf import DGFRecipeConfig
    from draftsmith.train.distill import DistillRecipeConfig
    from draftsmith.train.medusa import MedusaRecipeConfig

    cls = {"dgf": DGFRecipeConfig, "medusa": MedusaRecipeConfig, "distill": DistillRecipeConfig}[recipe]
    with pytest.raises(ConfigError) as err:
        load_config(cls, f"train/configs/{recipe}_tiny.yaml", overrides)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_a_draft_model_no_method_reads_is_refused(tmp_path):
    """`draft=` with only methods that never draft with it: refused by name before anything is timed."""
    from draftsmith.config import ConfigError
    from draftsmith.eval.bench.run import run_benchmark
    from draftsmith.eval.bench.methods import parse_method

    target, draft = TargetModel.from_pretrained("tiny:llama"), TargetModel.from_pretrained("tiny:llama,seed=1")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "p0", "prompt": "Count."}\n')
    config = BenchConfig(methods=[parse_method("plain"), parse_method("ngram")], suites=[f"jsonl:{prompts}"],
                         num_prompts=1, max_new_tokens=4, plots=False)
    with pytest.raises(ConfigError, match="no method reads it"):
        run_benchmark(config, target=target, draft=draft, progress=False)


# ---------------------------------------------------------------------------------------------
# The drafters' and the bench's Python API
# ---------------------------------------------------------------------------------------------


def _drafters(target):
    from draftsmith.eval.decode.drafters.lm import LMDrafter

    return {"NgramDrafter.budget": lambda v: NgramDrafter(budget=v),
            "NgramDrafter.max_ngram": lambda v: NgramDrafter(max_ngram=v),
            "NgramDrafter.num_branches": lambda v: NgramDrafter(num_branches=v),
            "LMDrafter.budget": lambda v: LMDrafter(target, budget=v),
            "LMDrafter.depth": lambda v: LMDrafter(target, mode="tree", depth=v),
            "LMDrafter.topk": lambda v: LMDrafter(target, mode="tree", topk=v)}


BAD_SIZES = st.one_of(st.integers(max_value=0), st.floats(allow_nan=True), st.booleans(), st.text(max_size=3),
                      st.none().map(lambda _: [1]))


@pytest.mark.parametrize("which", list(_drafters(None)))
@settings(max_examples=8, deadline=None)
@given(value=BAD_SIZES)
def test_drafter_sizes_are_checked_where_they_enter(which, value):
    from draftsmith.eval.decode.drafters.base import InputError as DrafterInputError

    target = TargetModel.from_pretrained("tiny:llama")
    with pytest.raises(DrafterInputError) as err:
        _drafters(target)[which](value)
    assert which.split(".")[1] in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("part,value", [("target", "smollm2-135m-instruct"), ("drafter", "ngram"),
                                        ("config", {"max_new_tokens": 4}), ("drafter", 3)])
def test_decoder_parts_of_the_wrong_type_are_named(part, value):
    target = TargetModel.from_pretrained("tiny:llama")
    parts = {"target": target, "drafter": NgramDrafter(), "config": DecodeConfig(max_new_tokens=4)} | {part: value}
    with pytest.raises(InputError, match=f"^{part}: expected"):
        SpeculativeDecoder(parts["target"], parts["drafter"], parts["config"])


@pytest.mark.parametrize("part", ["config", "target", "draft"])
def test_run_benchmark_arguments_of_the_wrong_type_are_named(part):
    from draftsmith.eval.bench.run import run_benchmark
    from draftsmith.eval.bench.methods import parse_method

    config = BenchConfig(methods=[parse_method("plain")], suites=["gsm8k"], num_prompts=1, plots=False)
    kwargs = {"config": config, "target": None, "draft": None} | {part: {"target": "tiny:llama"}}
    with pytest.raises(InputError, match=f"run_benchmark: {part}: expected"):
        run_benchmark(kwargs.pop("config"), progress=False, **kwargs)


@pytest.mark.parametrize("argv,words", [
    (["backends=eager", "release=true"], "release=True is not read here"),
    (["backends=eager", "compile.autotune=false"], "compile.autotune=False is not read here"),
])
def test_latency_options_the_eager_backend_does_not_read_are_refused(argv, words, capsys):
    assert_one_line(run_main(latency.main, argv), err := capsys.readouterr().err)
    assert words in err
