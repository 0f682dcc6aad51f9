"""The built wheel installs one top-level name, `draftsmith`, and works outside the checkout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = tmp_path_factory.mktemp("source") / "draftsmith"  # a copy: setuptools' build/ stays out of the checkout
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".git", "outputs", "build", "results", "*.egg-info",
                                                                "__pycache__", "wandb"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(out), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("draftsmith-*.whl")
    return built


def test_wheel_has_one_top_level_name(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"draftsmith"}
    for module in ("draftsmith/eval/decode/decoder.py", "draftsmith/eval/decode/drafters/lm.py", "draftsmith/models/target.py",
                   "draftsmith/train/runtime.py", "draftsmith/train/configs/medusa_tiny.yaml"):
        assert module in names, module


def test_installed_wheel_decodes_outside_the_checkout(wheel, tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    code = (
        "import draftsmith, torch\n"
        "from draftsmith.eval.decode.decoder import DecodeConfig, SpeculativeDecoder\n"
        "from draftsmith.eval.decode.drafters.ngram import NgramDrafter\n"
        "from draftsmith.models.target import TargetModel\n"
        f"assert draftsmith.__file__.startswith({str(site)!r}), draftsmith.__file__\n"
        "target = TargetModel.from_pretrained('tiny:llama')\n"
        "prompt = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2]])\n"
        "out = SpeculativeDecoder(target, NgramDrafter(), DecodeConfig(max_new_tokens=8)).generate(prompt)\n"
        "ref = target.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)\n"
        "assert out.tokens == ref[0, prompt.shape[1]:].tolist()\n"
        "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
