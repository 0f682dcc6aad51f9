"""The run every training recipe shares, written once: the run's directory, resume, optimizer step, checkpoints,
snapshots, the train loop, logging and the command line. What a recipe is to the run (its config sections and the
Recipe protocol) is train/recipe.py; the run's small guards (lock, metrics file, stop requests) train/run_guards.py.

A recipe (train/medusa.py, train/dgf.py, train/distill.py) keeps only its behaviour: which modules
train, its loss (`train_step`), its held-out metrics (`evaluate`), the drafter it would decode with
(`drafter`, for tau) and what `final/` holds (`write_final`). It drives a `TrainingRun`:

    run = TrainingRun(cfg, resume=..., overwrite=...)     # directory lock, accelerator, tracker env
    recipe = MyRecipe(cfg, run)                           # builds data, modules; run.setup_optimizer(...)
    run.train(recipe)                                     # resume, loop, checkpoints, final/
    summary = run.finish(recipe.summary())

Guarantees (README "Guarantees", tests/test_faults.py):
- one run per output directory at a time: `output_dir/.lock` (flock) names the holder; a second run
  refuses in one line;
- nothing is replaced without `--overwrite`: a fresh run refuses a directory holding checkpoints,
  `final/` or `metrics.jsonl` (with `--overwrite` they are removed first), and any run a folder that holds other
  runs' outputs (`drafters/`, say);
- exact resume: `--resume` continues from the newest checkpoint that verifies (size + sha256 of its
  tensors), with the optimizer, scheduler, data position and every process's RNG;
- SIGINT / SIGTERM: the run saves a checkpoint at the next step boundary and exits with one line
  saying how to resume;
- a NaN / inf loss or gradient norm stops every process at the same step, naming the last good
  checkpoint.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import broadcast_object_list, gather_object
from tqdm.auto import tqdm

from draftsmith.config import ConfigError, command_parser, config_to_dict, flatten_dict, parse_command, save_config
from draftsmith.data.records import batch_indices
from draftsmith.errors import UserError, run_main
from draftsmith.fileio import atomic_write_json, refuse_folder_of_runs
from draftsmith.models.target import resolve_device
from draftsmith.tracking import prepare_wandb_env
from draftsmith.train.checkpoints import (CheckpointError, latest_verified_checkpoint, load_checkpoint,
                                          load_latest_checkpoint, save_checkpoint)
from draftsmith.train.distributed import gather_trainable_state, local_rank_zero
from draftsmith.train.recipe import Recipe, Tracker, lr_factor
from draftsmith.train.rng import rng_state, seed_everything, set_rng_state
from draftsmith.train.run_guards import (METRICS_FILE, RUN_FOLDERS, DirectoryLock, Interrupted, MetricsFile,
                                         RunDirectoryError, StopRequest, check_finite, launch_command, print_summary,
                                         without_resume_flags)

log = logging.getLogger("draftsmith.train")

# Keys a resumed run may change without a warning (everything else is compared with the checkpoint's config).
RESUME_MAY_CHANGE = {"train.stop_after_steps", "train.max_steps", "logging.run_name", "output_dir", "device",
                     "train.progress"}


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


class TrainingRun:
    """The mechanics of one recipe run (see the module docstring); the recipe owns its behaviour."""

    def __init__(self, cfg, resume: str | None = None, overwrite: bool = False, logger_name: str = "train"):
        self.cfg, self.overwrite = cfg, overwrite
        self.log = logging.getLogger(f"draftsmith.{logger_name}")
        self.output_dir = Path(cfg.output_dir)
        self.checkpoints_dir = self.output_dir / "checkpoints"
        self.final_dir = self.output_dir / "final"
        self.step, self.samples_seen = 0, 0
        self.loss_tokens_seen = 0  # loss-bearing tokens trained on (recipes that report train/loss_tokens)
        self.resumed_at_tokens = 0  # loss tokens of the checkpoint resumed from: milestones at or below it are passed
        self._lengths: list[int] | None = None  # record lengths, for data.group_by_length
        self.first_eval: dict | None = None  # held-out metrics before training
        self.last_eval: dict | None = None
        self.run_id = uuid.uuid4().hex[:8]
        self.stop = StopRequest()
        device = resolve_device(cfg.device)
        self.lock = DirectoryLock(self.output_dir)
        log_with = None
        if cfg.logging.tracker is Tracker.WANDB:
            prepare_wandb_env(self.output_dir)
            log_with = "wandb"
        self.accelerator = Accelerator(cpu=device.type == "cpu", log_with=log_with, project_dir=str(self.output_dir))
        self.world = self.accelerator.num_processes
        self.is_main = self.accelerator.is_main_process
        if not self.is_main:  # every line once under DDP: only the main process logs at INFO
            logging.getLogger("draftsmith").setLevel(logging.WARNING)
        self._claim_directory(resume)
        self.metrics = MetricsFile(self.output_dir / METRICS_FILE, enabled=self.is_main)
        self.resume_path, self.resume_state = self._find_resume(resume)
        if self.resume_state is not None:
            self.run_id = self.resume_state["run_id"]
        seed_everything(cfg.train.seed)
        self._warn_single_thread(device)
        self.optimizer = self.scheduler = self.module = None
        self.base_lrs: list[float] = []

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def _warn_single_thread(self, device: torch.device) -> None:
        """On a CPU, accelerate's launcher starts each process with OMP_NUM_THREADS=1 unless given
        --num_cpu_threads_per_process: one process then trains on one core of several. Said once, with the fix."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        spare = cores // self.world
        launched = "ACCELERATE_MIXED_PRECISION" in os.environ  # accelerate's launcher sets it in every process
        if device.type == "cpu" and launched and torch.get_num_threads() == 1 and spare > 1 and self.is_main:
            self.log.warning("each of the %d process(es) computes on 1 thread of %d cores (accelerate launch sets "
                             "OMP_NUM_THREADS=1): pass --cpu or --num_cpu_threads_per_process %d to use them",
                             self.world, cores, spare)

    # -- the directory ------------------------------------------------------------------------

    def _claim_directory(self, resume: str | None) -> None:
        """Lock the directory (main process; every rank learns the outcome) and refuse to replace a
        finished or running run's files without --overwrite."""
        problem = None
        if self.is_main:
            try:
                # whatever the flags (--overwrite would write among them); before the lock, so a refusal leaves no file
                refuse_folder_of_runs(self.output_dir, "run", RUN_FOLDERS)
                self.lock.acquire()
                self._check_existing(resume)
            except UserError as err:
                problem = str(err)
        if self.world > 1:
            shared = [problem]
            broadcast_object_list(shared)
            problem = shared[0]
        if problem is not None:
            self.lock.release()
            raise RunDirectoryError(problem)

    def _check_existing(self, resume: str | None) -> None:
        existing = [p for p in (self.checkpoints_dir, self.final_dir, self.output_dir / METRICS_FILE) if p.exists()]
        has_checkpoint = latest_verified_checkpoint(self.checkpoints_dir) is not None
        if resume is not None and (has_checkpoint or resume != "auto"):
            return
        if existing and not self.overwrite:
            names = ", ".join(p.name for p in existing)
            if resume is not None:
                raise UserError(f"--resume: {self.checkpoints_dir} holds no usable checkpoint, but {self.output_dir} "
                                f"holds {names} of an earlier run; pass --overwrite to start again from scratch")
            hint = "pass --resume to continue it, " if has_checkpoint else ""
            raise UserError(f"{self.output_dir} already holds {names} of an earlier run: {hint}pass --overwrite to "
                            "replace it, or choose another output_dir")
        for path in existing:  # --overwrite: the earlier run's files go
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()

    def _find_resume(self, resume: str | None) -> tuple[Path | None, dict | None]:
        if resume is None:
            return None, None
        if resume == "auto":  # the newest checkpoint that verifies (a corrupt newest one is set aside)
            found = load_latest_checkpoint(self.checkpoints_dir, quarantine=local_rank_zero())
            if found is None:
                self.log.warning("--resume: no checkpoint in %s, starting from scratch", self.checkpoints_dir)
                return None, None
            return found
        return Path(resume), load_checkpoint(resume)

    # -- optimizer ----------------------------------------------------------------------------

    def setup_optimizer(self, module: torch.nn.Module, param_groups: list[dict],
                        hold_steps: Sequence[int] = ()) -> None:
        """AdamW over `param_groups` (each with its "lr"), one schedule per group (`hold_steps[i]`: steps
        at learning rate 0 first), then accelerate.prepare. Call once, after building the modules."""
        cfg = self.cfg
        optimizer = torch.optim.AdamW(param_groups, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                                      weight_decay=cfg.optim.weight_decay)
        holds = list(hold_steps) + [0] * (len(param_groups) - len(hold_steps))
        self.base_lrs = [group["lr"] for group in param_groups]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, [lr_factor(cfg.optim, cfg.train.max_steps, hold) for hold in holds])
        self.module, self.optimizer = self.accelerator.prepare(module, optimizer)  # the scheduler is not prepared
        if self.accelerator.mixed_precision != "no":  # `accelerate launch --mixed_precision bf16`: said once
            self.log.info("mixed precision %s: the module's forward (and a frozen teacher's) runs under autocast; "
                          "the weights and AdamW's state keep their dtype", self.accelerator.mixed_precision)

    def unwrapped(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.module)

    def autocast(self):
        """The mixed precision the module's forward runs under, for a forward outside it (e.g. a frozen teacher);
        a no-op without mixed precision."""
        return self.accelerator.autocast()

    def trainable(self) -> dict[str, torch.nn.Parameter]:
        return {name: p for name, p in self.unwrapped().named_parameters() if p.requires_grad}

    def micro_batch_records(self, records: Sequence[Any]) -> list[tuple[int, list[Any]]]:
        """This process's micro-batches of the next optimizer step as (offset in the global batch, records):
        the global batch is fixed by samples_seen, so any number of processes sees the same data per step."""
        cfg, rank = self.cfg.train, self.accelerator.process_index
        total = cfg.batch_size * self.world * cfg.grad_accum_steps
        window = self.cfg.data.group_by_length
        if window and self._lengths is None:
            self._lengths = [len(record["input_ids"]) for record in records]
        position = self.cfg.data.skip_samples + self.samples_seen
        indices = batch_indices(len(records), position, total, self.cfg.data.seed,
                                self._lengths if window else None, window)
        out = []
        for micro in range(cfg.grad_accum_steps):
            start = (micro * self.world + rank) * cfg.batch_size
            out.append((start, [records[i] for i in indices[start:start + cfg.batch_size]]))
        return out

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(tensor, "sum") if self.world > 1 else tensor

    def accumulate(self, micro_batches: Sequence[Any], backward_one: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """Run `backward_one(batch) -> detached sums` on each micro-batch (gradients synchronised on the
        last one only) and return the summed sums."""
        total = None
        self.module.train()
        for i, batch in enumerate(micro_batches):
            sync = i == len(micro_batches) - 1
            with nullcontext() if sync else self.accelerator.no_sync(self.module):
                sums = backward_one(batch)
            total = sums if total is None else total + sums
        return total

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def optimizer_step(self, loss_sum: torch.Tensor, loss_tokens: float | None = None) -> dict:
        """Clip, step, schedule, advance the data position; stop on a non-finite loss or gradient norm.
        `loss_sum`: this process's loss (reduced and averaged over processes here); `loss_tokens`: the
        loss-bearing tokens of the step's global batch, counted into loss_tokens_seen. Returns the step's
        learning rates and gradient norm as metrics."""
        cfg = self.cfg
        grad_norm = None
        if cfg.optim.max_grad_norm is not None:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            grad_norm = self.accelerator.clip_grad_norm_(params, cfg.optim.max_grad_norm)
        lrs = [group["lr"] for group in self.optimizer.param_groups]  # the rates this step used
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.samples_seen += cfg.train.batch_size * self.world * cfg.train.grad_accum_steps
        self.step += 1
        loss = self.reduce_sum(loss_sum.detach().clone()) / self.world
        check_finite(loss, self.step, "training loss", self.checkpoints_dir)  # the same value on every process
        metrics = {"train/loss": float(loss), "train/lr": lrs[0], "train/samples_seen": self.samples_seen}
        if loss_tokens is not None:
            self.loss_tokens_seen += int(loss_tokens)
            metrics["train/loss_tokens_seen"] = self.loss_tokens_seen
        metrics.update({f"train/lr_group{i}": lr for i, lr in enumerate(lrs[1:], start=1)})
        if grad_norm is not None:
            check_finite(grad_norm, self.step, "gradient norm", self.checkpoints_dir)
            metrics["train/grad_norm"] = float(grad_norm)
        return metrics

    # -- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self, num_train_records: int, extra: Mapping | None = None) -> Path:
        rng = gather_object([rng_state()]) if self.world > 1 else [rng_state()]
        trainable = gather_trainable_state(self.accelerator, self.module)  # every rank: collective under FSDP
        path = self.checkpoints_dir / f"step_{self.step}"
        if self.is_main:
            state = {"step": self.step, "samples_seen": self.samples_seen, "num_train_records": num_train_records,
                     "loss_tokens_seen": self.loss_tokens_seen,
                     "run_id": self.run_id, "first_eval": self.first_eval, "trainable": trainable,
                     "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                     "rng": rng, "config": config_to_dict(self.cfg), "extra": dict(extra or {})}
            path = save_checkpoint(self.checkpoints_dir, self.step, state, keep_last=self.cfg.train.keep_checkpoints)
            self.log.info("saved %s", path)
        self.accelerator.wait_for_everyone()
        return path

    def restore(self, num_train_records: int) -> dict:
        """Load the resume checkpoint into the prepared module/optimizer/scheduler; returns its `extra`."""
        state, path = self.resume_state, self.resume_path
        self._restore_weights(state, path, num_train_records)
        self._warn_config_changes(state["config"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        else:  # a lean checkpoint (train.checkpoints lean): the moments restart, the schedule goes on
            self.log.warning("%s holds no optimizer state (a lean checkpoint): AdamW's moments restart at step %d",
                             path, state["step"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The config's optimizer settings win over the saved ones (identical when nothing changed).
        self.scheduler.base_lrs = list(self.base_lrs)
        optim = self.cfg.optim
        for group, base, factor in zip(self.optimizer.param_groups, self.base_lrs, self.scheduler.lr_lambdas):
            group.update(lr=base * factor(self.scheduler.last_epoch), initial_lr=base, betas=tuple(optim.betas),
                         eps=optim.eps, weight_decay=optim.weight_decay)
        self.step, self.samples_seen = state["step"], state["samples_seen"]
        self.loss_tokens_seen = self.resumed_at_tokens = state.get("loss_tokens_seen", 0)
        self.first_eval = state.get("first_eval")
        rng, index = state["rng"], self.accelerator.process_index
        if len(rng) != self.world:
            self.log.warning("checkpoint has RNG states of %d processes, this run has %d: reusing process 0's",
                             len(rng), self.world)
            index = 0
        set_rng_state(rng[index])
        self.log.info("resumed from %s at step %d (%d samples seen)", path, self.step, self.samples_seen)
        return state.get("extra") or {}

    def _restore_weights(self, state: dict, path: Path, num_train_records: int) -> None:
        trainable, saved = self.trainable(), state["trainable"]
        missing, unexpected = sorted(set(trainable) - set(saved)), sorted(set(saved) - set(trainable))
        if missing or unexpected:
            raise CheckpointError(f"checkpoint {path} does not match this run's trainable weights: missing "
                                  f"{missing[:5]}, unexpected {unexpected[:5]} (written with another model config?)")
        if state["num_train_records"] != num_train_records:
            raise CheckpointError(f"checkpoint {path} was trained on {state['num_train_records']} records, this run "
                                  f"has {num_train_records}: the data (source, limit, split, filter) changed")
        with torch.no_grad():
            for name, p in trainable.items():
                if saved[name].shape != p.shape:
                    raise CheckpointError(f"checkpoint {path}: {name} has shape {tuple(saved[name].shape)}, "
                                          f"expected {tuple(p.shape)}")
                p.copy_(saved[name])

    def _warn_config_changes(self, saved: dict) -> None:
        before, now = flatten_dict(saved), flatten_dict(config_to_dict(self.cfg))
        changed = [key for key in sorted(set(before) | set(now))
                   if before.get(key) != now.get(key) and key not in RESUME_MAY_CHANGE]
        if changed:
            self.log.warning("resuming with a config that differs from the checkpoint's in %s", ", ".join(
                f"{key} ({before.get(key)!r} -> {now.get(key)!r})" for key in changed))

    def save_final(self, write: Callable[[Path], None]) -> Path:
        """`write(tmp_dir)` on the main process, then tmp_dir is renamed to final/ (the run's own final/,
        if an interrupted run had written one, is replaced; another run's never: see _check_existing)."""
        if self.is_main:
            tmp = self.output_dir / ".tmp_final"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            write(tmp)
            save_config(self.cfg, tmp / "train_config.yaml")
            if self.final_dir.exists():
                shutil.rmtree(self.final_dir)
            os.replace(tmp, self.final_dir)
            self.log.info("saved %s", self.final_dir)
        self.accelerator.wait_for_everyone()
        return self.final_dir

    # -- logging and the loop -------------------------------------------------------------------

    def log_metrics(self, metrics: dict) -> None:
        scalars = {name: value for name, value in metrics.items() if not isinstance(value, (list, dict))}
        self.metrics.write({"step": self.step, **scalars})
        if self.cfg.logging.tracker is not Tracker.NONE:
            self.accelerator.log(scalars, step=self.step)

    def _start(self, recipe: Recipe) -> None:
        if self.resume_state is not None:
            recipe.restore_extra(self.restore(len(recipe.train_records)))
            self.metrics.drop_after(self.step)  # the steps after the checkpoint are redone and logged again
        else:
            seed_everything(self.cfg.train.seed + self.accelerator.process_index)
        if self.is_main:
            save_config(self.cfg, self.output_dir / "train_config.yaml")
        if self.cfg.logging.tracker is Tracker.WANDB:
            self.accelerator.init_trackers(
                self.cfg.logging.project, config=flatten_dict(config_to_dict(self.cfg)),
                init_kwargs={"wandb": {"name": self.cfg.logging.run_name, "id": self.run_id, "resume": "allow",
                                       "dir": str(self.output_dir)}})
        if self.resume_state is None:
            self.first_eval = self.last_eval = self.evaluate(recipe)

    def evaluate(self, recipe: Recipe) -> dict:
        metrics = recipe.evaluate()
        self.log_metrics(metrics)
        return metrics

    def train(self, recipe: Recipe) -> None:
        """Resume or start, then step until train.max_steps (or train.stop_after_steps / a signal)."""
        cfg = self.cfg.train
        self._start(recipe)
        stop_at = min(cfg.max_steps, cfg.stop_after_steps or cfg.max_steps)
        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="train", unit="step", dynamic_ncols=True,
                   disable=not (self.is_main and cfg.progress))
        started = time.perf_counter()
        self.stop.install()
        try:
            while self.step < stop_at:
                metrics = recipe.train_step()
                bar.update(1)
                bar.set_postfix_str(f"loss {metrics['train/loss']:.4f}")
                self._after_step(recipe, metrics, started, stop_at)
                if self._stop_requested():
                    self._interrupt(recipe)
                if self._every_snapshot_written():
                    if not self._checkpoint_due():  # else _after_step has just saved this step
                        self.save_checkpoint(len(recipe.train_records), self._extra(recipe))
                    self.log.info("every snapshot of train.snapshots_at_loss_tokens is written: stopping at step %d",
                                  self.step)
                    break
        finally:
            self.stop.restore()
            bar.close()
        if self.step == cfg.max_steps:
            if self.last_eval is None:
                self.last_eval = self.evaluate(recipe)
            self.save_final(recipe.write_final)

    def _after_step(self, recipe: Recipe, metrics: dict, started: float, stop_at: int) -> None:
        cfg = self.cfg
        if self.step % cfg.train.log_every == 0 or self.step == stop_at:
            metrics["train/elapsed_s"] = time.perf_counter() - started
            self.log_metrics(metrics)
            self.log.info("step %d loss %.4f", self.step, metrics["train/loss"])
        at_end = self.step == cfg.train.max_steps
        if (cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0) or at_end:
            self.last_eval = self.evaluate(recipe)
        if self._checkpoint_due():
            self.save_checkpoint(len(recipe.train_records), self._extra(recipe))
        if cfg.train.snapshots_at_loss_tokens and "train/loss_tokens_seen" not in metrics:
            raise ConfigError("train.snapshots_at_loss_tokens: this recipe does not count its loss-bearing tokens "
                              "(train/dgf.py and train/medusa.py do); drop the option")
        self._snapshots(recipe, metrics.get("train/loss_tokens_seen"))

    def _snapshots(self, recipe: Recipe, seen: int | None) -> None:
        """snapshots/loss_tokens_<N>/ for each milestone N this step reached (once: an existing one is kept)."""
        for milestone in self.cfg.train.snapshots_at_loss_tokens:
            directory = self._snapshot_dir(milestone)
            if seen is None or seen < milestone or self._milestone_done(milestone):
                continue
            self.last_eval = self.evaluate(recipe)  # the snapshot's own held-out figures (every process)
            if self.is_main:
                tmp = directory.with_name(directory.name + ".tmp")
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
                recipe.write_final(tmp)
                save_config(self.cfg, tmp / "train_config.yaml")
                atomic_write_json(tmp / "snapshot.json", {"loss_tokens_seen": seen, "step": self.step,
                                                         "samples_seen": self.samples_seen, "milestone": milestone,
                                                         "held_out": self.last_eval})
                os.replace(tmp, directory)
                self.log.info("snapshot %s (%d loss tokens seen at step %d)", directory, seen, self.step)
            self.accelerator.wait_for_everyone()

    def _checkpoint_due(self) -> bool:
        return self.step % self.cfg.train.checkpoint_every == 0 or self.step == self.cfg.train.stop_after_steps

    def _snapshot_dir(self, milestone: int) -> Path:
        return self.output_dir / "snapshots" / f"loss_tokens_{milestone}"

    def _milestone_done(self, milestone: int) -> bool:
        """Written, or passed before the checkpoint this run resumed from."""
        return milestone <= self.resumed_at_tokens or self._snapshot_dir(milestone).exists()

    def _every_snapshot_written(self) -> bool:
        """A curve run (train.snapshots_at_loss_tokens) ends at its last milestone, not at max_steps."""
        milestones = self.cfg.train.snapshots_at_loss_tokens
        return bool(milestones) and all(self._milestone_done(milestone) for milestone in milestones)

    @staticmethod
    def _extra(recipe: Recipe) -> dict:
        return recipe.checkpoint_extra()

    def _stop_requested(self) -> bool:
        flag = torch.tensor(float(self.stop.signal is not None), device=self.device)
        return bool(self.reduce_sum(flag) > 0)  # every rank stops at the same step

    @property
    def command(self) -> str:
        """The command line of this run (recorded with final/ so a user can retrain it)."""
        return launch_command(sys.argv, os.environ)

    def _interrupt(self, recipe: Recipe) -> None:
        path = self.save_checkpoint(len(recipe.train_records), self._extra(recipe))
        name = signal.Signals(self.stop.signal).name if self.stop.signal else "a signal"
        raise Interrupted(f"{name} at step {self.step}: saved {path}; resume with: "
                          f"{launch_command(without_resume_flags(sys.argv), os.environ)} --resume")

    def finish(self, summary: dict) -> dict:
        summary = {"step": self.step, "output_dir": str(self.output_dir), "processes": self.world,
                   "final": str(self.final_dir) if self.step == self.cfg.train.max_steps else None, **summary}
        if self.cfg.logging.tracker is not Tracker.NONE:
            self.accelerator.end_training()
        self.accelerator.free_memory()
        self.lock.release()
        return {**summary, "is_main": self.is_main}


# ---------------------------------------------------------------------------------------------
# The command line every recipe uses
# ---------------------------------------------------------------------------------------------


def recipe_cli(config_cls: type, main: Callable[..., dict], prog: str, description: str,
               argv: Sequence[str] | None = None) -> int:
    """`python train/<recipe>.py --config X.yaml [--resume | --resume-from DIR] [--overwrite]
    [--no-progress] [key.path=value ...]`: one line and exit 2 on a user error (run_main)."""

    def run(args: list[str]) -> int:
        parser = command_parser(prog, description, config_cls)
        parser.add_argument("--resume", action="store_true",
                            help="continue from the newest checkpoint in output_dir/checkpoints")
        parser.add_argument("--resume-from", metavar="CHECKPOINT_DIR", default=None,
                            help="continue from this checkpoint directory (output_dir/checkpoints/step_<N>)")
        parser.add_argument("--overwrite", action="store_true",
                            help="replace an earlier run's checkpoints, final/ and metrics in output_dir")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")
        cfg, flags = parse_command(parser, config_cls, args)
        if flags.no_progress:
            cfg.train.progress = False
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        resume = flags.resume_from or ("auto" if flags.resume else None)
        summary = main(cfg, resume=resume, overwrite=flags.overwrite)
        if summary.get("is_main", True):
            print_summary({k: v for k, v in summary.items() if k != "is_main"})
        return 0

    return run_main(run, argv)
