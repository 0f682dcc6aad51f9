"""What a training recipe is to the run: the config sections every recipe shares (a recipe may change a default:
`section(OptimConfig, lr=1e-4)`), the Recipe protocol the run drives (train/runtime.py), the learning-rate schedule
and the helpers the recipes share (pad id, a record's prompt, tau of a recipe's drafter)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from draftsmith.config import ConfigError, TextEnum, Unread, option
from draftsmith.eval.decode.decoder import DecodeConfig, DecodeStats, SpeculativeDecoder
from draftsmith.eval.decode.drafters.base import Drafter
from draftsmith.models.bundled import DEFAULT_TARGET
from draftsmith.models.target import TargetModel


@dataclass
class RunConfig:
    """The keys every recipe's config starts with (a recipe redeclares a key to change its default)."""

    output_dir: str = option("outputs/run", "run directory (checkpoints/, final/, metrics.jsonl)")
    device: str = option("auto", "auto | cpu | cuda")
    target: str = option(DEFAULT_TARGET, "the target: registry name, model directory, hub id or tiny:<family>")
    dtype: str = option("float32", "the target's dtype (drafters train in float32)")
    attn_implementation: str = option("sdpa", "the target's attention implementation (transformers)")


@dataclass
class DataConfig:
    source: str = option("gsm8k:train", "data source spec (data.sources / data.records; `a + b` mixes sources)")
    limit: int | None = option(None, "at most this many conversations / records per source", ge=1)
    max_length: int = option(512, "tokens per record (longer ones are cut)", ge=2)
    heldout_fraction: float = option(0.05, "share of records held out for evaluation", gt=0, lt=1)
    max_heldout: int | None = option(256, "at most this many held-out records", ge=1)
    seed: int = option(0, "seed of the held-out split and the shuffling")
    group_by_length: int = option(0, "records per window of the shuffled order sorted by length before batching "
                                     "(0: off): less padding, the same data", ge=0)
    skip_samples: int = option(0, "start the data stream this many samples in (the held-out split unchanged): a run "
                                  "that continues a finished snapshot (init_from) on the records after those it "
                                  "trained on", ge=0)


class Schedule(TextEnum):
    """The learning rate after warm-up."""

    CONSTANT = "constant"
    LINEAR = "linear"  # down to min_lr_ratio
    COSINE = "cosine"  # down to min_lr_ratio


class Tracker(TextEnum):
    WANDB = "wandb"
    NONE = "none"


@dataclass
class OptimConfig:
    lr: float = option(1e-3, "peak learning rate", gt=0)
    weight_decay: float = option(0.0, "AdamW weight decay", ge=0)
    betas: tuple[float, float] = option((0.9, 0.999), "AdamW betas", ge=0, lt=1)
    eps: float = option(1e-8, "AdamW epsilon", gt=0)
    schedule: Schedule = option(Schedule.COSINE, "learning-rate schedule after warm-up")
    warmup_steps: int = option(0, "linear warm-up steps", ge=0)
    min_lr_ratio: float = option(0.0, "final learning rate / peak (linear, cosine)", ge=0, le=1)
    max_grad_norm: float | None = option(1.0, "gradient clipping norm (null: no clipping)", gt=0)


@dataclass
class TrainConfig:
    max_steps: int = option(1000, "optimizer steps", ge=1)
    batch_size: int = option(4, "records per micro-batch and process", ge=1)
    grad_accum_steps: int = option(1, "micro-batches per optimizer step", ge=1)
    seed: int = option(0, "seed of initialisation, dropout and noise")
    log_every: int = option(10, "steps between logged training metrics", ge=1)
    checkpoint_every: int = option(500, "steps between checkpoints", ge=1)
    keep_checkpoints: int = option(2, "newest checkpoints kept", ge=1)
    stop_after_steps: int | None = option(None, "exit right after this step's checkpoint (interruption tests)", ge=1)
    snapshots_at_loss_tokens: list[int] = option(factory=list, help="write the drafter as trained so far to "
                                                 "snapshots/loss_tokens_<N>/ (final/'s layout) at the first step "
                                                 "whose loss-bearing tokens seen reach N: a data curve from one run",
                                                 ge=1)
    progress: bool = option(True, "progress bar (main process only; --no-progress turns it off)")


@dataclass
class EvalConfig:
    every_steps: int = option(100, "steps between held-out evaluations (0: before and after training only)", ge=0)
    batch_size: int = option(8, "held-out records per batch", ge=1)
    tau_prompts: int = option(0, "held-out prompts decoded by the bundled decoder for tau (0: off)", ge=0)
    tau_new_tokens: int = option(32, "new tokens per prompt for tau", ge=1)


@dataclass
class LoggingConfig:
    tracker: Tracker = option(Tracker.WANDB, "experiment tracker (W&B runs offline without network)")
    project: str = option("draftsmith", "W&B project")
    run_name: str | None = option(None, "W&B run name")


# Options of the shared sections that some settings do not read (each recipe adds its own: refuse_unread).
RUN_UNREAD = [
    Unread("optim.min_lr_ratio", lambda c: c.optim.schedule is Schedule.CONSTANT,
           "read by optim.schedule=linear|cosine"),
    Unread("eval.tau_new_tokens", lambda c: c.eval.tau_prompts == 0, "read when eval.tau_prompts > 0"),
    Unread("logging.project", lambda c: c.logging.tracker is Tracker.NONE, "read by logging.tracker=wandb"),
    Unread("logging.run_name", lambda c: c.logging.tracker is Tracker.NONE, "read by logging.tracker=wandb"),
]


class Recipe(Protocol):
    """What a recipe gives the run (train/runtime.py) and tau's measurement (`measure_tau`); `RecipeBase` has the
    optional parts. `target` is None where the recipe runs without the target (a distillation on cached logits)."""

    train_records: list
    heldout_records: list
    target: TargetModel | None

    def train_step(self) -> dict: ...

    def drafter(self) -> Drafter: ...

    def evaluate(self) -> dict: ...

    def write_final(self, directory: Path) -> None: ...

    def checkpoint_extra(self) -> dict: ...

    def restore_extra(self, extra: dict) -> None: ...


class RecipeBase:
    """The parts of the Recipe protocol most recipes leave as they are: no state beyond the model, optimizer,
    RNG and batch order (which the run checkpoints itself)."""

    def checkpoint_extra(self) -> dict:
        """Recipe state to put in a checkpoint."""
        return {}

    def restore_extra(self, extra: dict) -> None:
        """Take back what `checkpoint_extra` saved."""


def lr_factor(optim: OptimConfig, max_steps: int, hold_steps: int = 0) -> Callable[[int], float]:
    """Multiplier of the base learning rate after `step` optimizer steps (hold, warm-up, schedule)."""

    def factor(step: int) -> float:
        if step < hold_steps:
            return 0.0
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule is Schedule.CONSTANT:
            return 1.0
        progress = min(1.0, (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if optim.schedule is Schedule.COSINE else 1.0 - progress
        return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * shape

    return factor


def start_from_finished(model: torch.nn.Module, source: torch.nn.Module, theirs: Mapping, ours: Mapping,
                        section: str, path: str, differs: str) -> None:
    """Copy a finished run's weights (`source`, loaded from `<section>.init_from=path`) into `model`. Its model config
    (`theirs`, against this run's `ours`) and draft vocabulary (where it has one) must be this run's: otherwise one
    ConfigError line naming what differs (`differs`: its subject, e.g. "its heads differ")."""
    option = f"{section}.init_from={path}"
    refuse_differences(option, differs, theirs, ours)
    if getattr(model.config, "draft_vocab_size", None) and not torch.equal(source.draft_to_target.cpu(), model.draft_to_target.cpu()):
        raise ConfigError(f"{option}: its draft vocabulary differs from {section}.draft_vocab")
    model.load_state_dict(source.state_dict())


def refuse_differences(option: str, differs: str, theirs: Mapping, ours: Mapping) -> None:
    """One ConfigError line naming every key where a finished run's description (`theirs`) is not this run's."""
    differ = [f"{key}={theirs.get(key)!r} (this config: {ours.get(key)!r})" for key in sorted(set(theirs) | set(ours))
              if theirs.get(key) != ours.get(key)]
    if differ:
        raise ConfigError(f"{option}: {differs} from this config's: {', '.join(differ)}")


def pad_id_of(tokenizer) -> int:
    """The tokenizer's pad id, else its EOS id, else 0 (padded positions are masked out anyway)."""
    for value in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            return value
    return 0


def record_prompt(record: Mapping) -> list[int]:
    """The tokens of a record before its first trained token (the prompt of a held-out answer)."""
    mask = list(record["loss_mask"])
    ids = [int(t) for t in record["input_ids"]]
    return ids[: mask.index(1)] if 1 in mask else ids[:-1]


@torch.no_grad()
def measure_tau(recipe: Recipe, eval_cfg: EvalConfig) -> dict:
    """tau of the recipe's drafter on its first `eval_cfg.tau_prompts` held-out prompts, through the
    bundled decoder (greedy; the bench's definition and code path). {} when tau_prompts is 0."""
    if eval_cfg.tau_prompts == 0 or recipe.target is None:
        return {}
    drafter = recipe.drafter()
    decoder = SpeculativeDecoder(recipe.target, drafter, DecodeConfig(max_new_tokens=eval_cfg.tau_new_tokens))
    stats = DecodeStats()
    for record in recipe.heldout_records[: eval_cfg.tau_prompts]:
        prompt = record_prompt(record)
        if prompt:
            stats.merge(decoder.generate(torch.tensor([prompt], device=recipe.target.device)).stats)
    out = {"eval/tau": stats.tau, "eval/tau_prompts": min(eval_cfg.tau_prompts, len(recipe.heldout_records))}
    out.update({f"eval/tau_accept_depth{depth}": rate for depth, rate in stats.depth_acceptance.items()})
    return out
