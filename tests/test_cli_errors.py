"""Every command x every class of bad input: one line `error: ...` naming the bad value (and what is
valid), exit status 2, no traceback, nothing written over. In-process through run_main, the
entry point every command's `__main__` uses."""

from __future__ import annotations

import pytest

from draftsmith.data import draft_vocab, features, regenerate
from draftsmith.errors import run_main
from draftsmith.eval import arca_profile, drafter_top1, latency, roofline
from draftsmith.eval.bench import run as bench
from draftsmith.scripts import export, fetch_models
from draftsmith.train import dgf, distill, medusa

CONFIGS = "train/configs/{}_tiny.yaml"
RECIPES = {"medusa": medusa.cli, "dgf": dgf.cli, "distill": distill.cli}
COMMANDS = {"regenerate": regenerate.main, "features": features.main, "draft_vocab": draft_vocab.main,
            "bench": bench.main, "profile": arca_profile.main, "latency": latency.main, "roofline": roofline.main,
            "top1": drafter_top1.main}

# (command, arguments, words the one line must contain)
CASES = [
    *[(name, ["--config", "/nonexistent.yaml"], ["/nonexistent.yaml"]) for name in RECIPES],
    *[(name, ["--config", CONFIGS.format(name), "optim.lr=-0.01"], ["optim.lr", "> 0"]) for name in RECIPES],
    *[(name, ["--config", CONFIGS.format(name), "train.max_steps=0"], ["train.max_steps", ">= 1"]) for name in RECIPES],
    *[(name, ["--config", CONFIGS.format(name), "train.keep_checkpoints=-1"], ["keep_checkpoints"]) for name in RECIPES],
    *[(name, ["--config", CONFIGS.format(name), "data.heldout_fraction=0"], ["heldout_fraction"]) for name in RECIPES],
    *[(name, ["--config", CONFIGS.format(name), "optim.lrr=1"], ["lrr", "optim.lr"]) for name in RECIPES],
    *[(name, ["--config", CONFIGS.format(name), "target=smolm2-135m-instruct"], ["smolm2", "smollm2-135m-instruct"])
      for name in RECIPES],
    ("regenerate", ["target=tiny:llama", "source=nosuch", "output_dir=OUT"], ["nosuch", "valid kinds"]),
    ("features", ["target=tiny:llama", "source=nosuch", "output_dir=OUT"], ["nosuch", "valid kinds"]),
    ("draft_vocab", ["target=tiny:llama", "sources=nosuch", "size=8", "output=OUT"], ["nosuch"]),
    ("regenerate", ["target=smolm2", "source=gsm8k:train", "output_dir=OUT"], ["smolm2"]),
    ("regenerate", ["target=tiny:llama", "source=mt-bench", "output_dir=OUT"], ["'mt-bench' is a test suite"]),
    ("regenerate", ["target=tiny:llama", "source=gsm8k:train + gsm8k:test", "output_dir=OUT"],
     ["'gsm8k:test' is a test suite"]),
    ("features", ["target=tiny:llama", "source=humaneval", "output_dir=OUT"], ["'humaneval' is a test suite"]),
    *[(name, ["--config", CONFIGS.format(name), "data.source=breadth:qa"], ["'breadth:qa' is a test suite"])
      for name in RECIPES],
    ("bench", ["target=tiny:llama", "methods=lm-tree:depth=abc"], ["depth", "integer", "abc"]),
    ("bench", ["target=tiny:llama", "methods=lm-chain:k=0"], ["'k'", "budget"]),
    ("bench", ["target=tiny:llama", "num_prompts=0"], ["num_prompts", ">= 1"]),
    ("bench", ["target=tiny:llama", "temperature=-1"], ["temperature", ">= 0"]),
    ("bench", ["target=tiny:llama", "methods=lm-chain:budget=0"], ["budget"]),
    ("bench", ["target=tiny:llama", "methods=cascade:drafters=[]"], ["drafters=[]", "at least one drafter"]),
    ("bench", ["--config", "/nonexistent.yaml"], ["/nonexistent.yaml"]),
    ("profile", ["target=tiny:llama", "budgets=0"], ["budgets"]),
    ("latency", ["target=tiny:llama", "widths=[0]"], ["widths"]),
    ("roofline", ["target=tiny:llama", "dtype=int4"], ["int4", "float32"]),  # before the machine's roofs are timed
    ("roofline", ["target=tiny:llama", "dtype=float16"], ["float16", "float32 or bfloat16"]),
    ("top1", ["drafter=/nonexistent"], ["/nonexistent", "manifest.json"]),  # before the bench's target loads
    ("export", ["dgf", "/nonexistent", "OUT"], ["/nonexistent"]),
    ("export", ["medusa", "/nonexistent", "OUT", "tolerance=-1"], ["tolerance"]),
    ("export", ["medusa", "/nonexistent", "OUT", "--tolerance", "-1"], ["tolerance"]),
    ("export", ["blocks", "/nonexistent", "OUT"], ["not an export kind"]),
    ("fetch", ["nosuch-model"], ["nosuch-model", "smollm2-135m-instruct"]),
    ("bench", ["target=no-such-org/no-such-model"], ["no-such-org/no-such-model", "could not be loaded"]),
    ("bench", ["target=tiny:llama", "dtype=float16"], ["float16", "float32 or bfloat16", "compile.kernels=inductor"]),
    ("bench", ["target=tiny:llama", "draft=no-such-org/no-such-draft", "methods=[ngram]"],  # refused unloaded
     ["draft=no-such-org/no-such-draft", "no method reads it"]),
]
MAINS = {**COMMANDS, "export": export.main, "fetch": fetch_models.main}
# Lines a user meets often enough that they must stay short: under SHORT characters, naming the value and the valid
# ones (the full list is in --help). A size beyond the target is refused before any work starts.
SHORT = 200
SHORT_CASES = [
    ("bench", ["target=tiny:llama", "suites=[jsonl:/no/such/prompts.jsonl]"], ["/no/such/prompts.jsonl", "usage"]),
    ("regenerate", ["target=tiny:llama", "source=jsonl:/no/such/prompts.jsonl", "output_dir=OUT"],
     ["/no/such/prompts.jsonl", "usage"]),
    ("bench", ["target=tiny:llama", "suites=[nosuch:x]"], ["nosuch", "valid kinds", "--help"]),
    ("regenerate", ["target=tiny:llama", "source=nosuch", "output_dir=OUT"], ["nosuch", "valid kinds"]),
    ("bench", ["target=tiny:llama", "backend=eager", "max_new_tokens=100000"], ["max_new_tokens=100000", "1024"]),
    ("bench", ["target=tiny:llama", "max_new_tokens=1000"], ["max_new_tokens=1000", "compile.capacity >= 1064"]),
    ("latency", ["target=tiny:llama", "context_tokens=5000"], ["context_tokens=5000", "compile.capacity >= 5128"]),
]


def run_command(name: str, argv: list[str]) -> int:
    if name in RECIPES:
        return RECIPES[name](argv)
    return run_main(MAINS[name], argv)


def error_line(name, argv, tmp_path, capsys, monkeypatch) -> tuple[int, str]:
    """(exit status, stderr) of a command run from the checkout's root, OUT in argv a fresh folder."""
    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[1])
    code = run_command(name, [arg.replace("OUT", str(tmp_path / "out")) for arg in argv])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize("name,argv,words", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_exit_2(name, argv, words, tmp_path, capsys, monkeypatch):
    code, err = error_line(name, argv, tmp_path, capsys, monkeypatch)
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("name,argv,words", SHORT_CASES, ids=[f"{c[0]}-short-{i}" for i, c in enumerate(SHORT_CASES)])
def test_common_bad_input_is_short(name, argv, words, tmp_path, capsys, monkeypatch):
    code, err = error_line(name, argv, tmp_path, capsys, monkeypatch)
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert len(err) < SHORT, (len(err), err)
    for word in words:
        assert word in err, (word, err)


FOLDER_OF_RUNS = [
    ("bench", ["target=tiny:llama", "output_dir=RUNS"]),
    ("regenerate", ["target=tiny:llama", "source=gsm8k:train", "limit=1", "output_dir=RUNS"]),
    ("features", ["target=tiny:llama", "source=gsm8k:train", "limit=1", "output_dir=RUNS"]),
]


@pytest.mark.parametrize("name,argv", FOLDER_OF_RUNS, ids=[case[0] for case in FOLDER_OF_RUNS])
def test_a_folder_of_other_runs_is_refused(name, argv, tmp_path, capsys, monkeypatch):
    runs = tmp_path / "runs"
    (runs / "earlier").mkdir(parents=True)
    (runs / "earlier" / "bench.json").write_text("{}")
    code, err = error_line(name, [arg.replace("RUNS", str(runs)) for arg in argv], tmp_path, capsys, monkeypatch)
    assert code == 2 and err.startswith("error: ") and "\n" not in err, err
    assert "other runs' outputs (earlier)" in err, err
    assert sorted(path.name for path in runs.iterdir()) == ["earlier"]
