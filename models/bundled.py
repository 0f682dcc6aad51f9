"""Drafters shipped inside the package: one small feature drafter per registry target that has one (a
reduced draft vocabulary whose head is a frozen slice of the target's LM head, re-read from the target
at load, so only the blocks and the fusion are stored, in bfloat16). Each directory is a `train/dgf.py`
final/ directory exported with `scripts/export.py dgf ... layout=dgf dtype=bfloat16`; its model
card (README.md) records the training command, so a user can retrain it."""

from __future__ import annotations

from pathlib import Path

from draftsmith.errors import UserError

BUNDLED_DIR = Path(__file__).resolve().parent / "bundled"
DEFAULT_TARGET = "smollm2-135m-instruct"  # every command's target when none is named (declared here only)

# registry target name -> directory under BUNDLED_DIR
BUNDLED_DRAFTERS: dict[str, str] = {
    "smollm2-135m-instruct": "smollm2-135m-instruct-eagle3",
}
# smollm2-135m-instruct-eagle3 holds the EAGLE-3 drafter trained on all regenerated data (the one
# before it is drafters/eagle3_smollm2_human_then_regen/loss_tokens_1000000, exported the same way).
# smollm2-135m-instruct-dgf, the bundled drafter until 2026-11-26 (DGF, 1 block; 0.96x alone where the EAGLE-3 one
# gives 1.15x, results/regenerated_smollm2), stays: its 8k draft vocabulary is the one the SmolLM2 training configs
# name (drafter.draft_vocab), and its weights let a reader rerun the older studies.


def bundled_drafter(target_name: str) -> Path:
    """The directory of the drafter bundled for `target_name` (a registry name); a user error names the
    targets that have one."""
    table, root = BUNDLED_DRAFTERS, BUNDLED_DIR
    if target_name not in table:
        raise UserError(f"dgf: no path= given and no drafter is bundled for target {target_name!r}; bundled "
                        f"drafters: {', '.join(table) or 'none'} (train one: train/dgf.py)")
    path = root / table[target_name]
    if not (path / "manifest.json").is_file():
        raise UserError(f"dgf: the drafter bundled for {target_name!r} is missing from {path} (a partial "
                        f"checkout?): reinstall draftsmith or pass path=<a train/dgf.py final/ directory>")
    return path


def has_bundled_drafter(target_name: str) -> bool:
    try:
        bundled_drafter(target_name)
    except UserError:
        return False
    return True
