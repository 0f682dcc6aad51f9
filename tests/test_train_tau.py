"""Every recipe's evaluation step measures tau through the bundled decoder on held-out
prompts (the bench's definition and code path), logged beside the losses, before, during and after training."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftsmith.config import load_config
from draftsmith.train import dgf, distill, medusa
from draftsmith.train.run_guards import MetricsFile

REPO = Path(__file__).resolve().parents[1]

# (recipe module, its config dataclass, its tiny config): an explicit table, one row per recipe.
RECIPES = [
    (dgf, dgf.DGFRecipeConfig, "dgf_tiny.yaml"),
    (distill, distill.DistillRecipeConfig, "distill_tiny.yaml"),
    (medusa, medusa.MedusaRecipeConfig, "medusa_tiny.yaml"),
]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("module,config_class,yaml_name", RECIPES, ids=[row[2] for row in RECIPES])
def test_evaluation_logs_tau_from_the_bundled_decoder(tmp_path, module, config_class, yaml_name):
    cfg = load_config(config_class, REPO / "train" / "configs" / yaml_name,
                      [f"output_dir={tmp_path}", "train.max_steps=2", "train.checkpoint_every=100",
                       "eval.every_steps=1", "eval.tau_prompts=2", "eval.tau_new_tokens=6"])
    module.main(cfg)
    evals = [r for r in MetricsFile.read(tmp_path / "metrics.jsonl") if "eval/tau" in r]
    assert sorted({r["step"] for r in evals}) == [0, 1, 2]
    for row in evals:
        assert row["eval/tau"] >= 1.0 and row["eval/tau_prompts"] == 2
        assert "eval/tau_accept_depth1" in row
