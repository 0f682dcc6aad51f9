"""Medusa-1 / Medusa-2 recipe: K decoding heads on a target's final hidden state.

    accelerate launch train/medusa.py --config train/configs/medusa_tiny.yaml [--resume | --resume-from CKPT] [key.path=value ...]
    python train/medusa.py --config train/configs/medusa_tiny.yaml train.max_steps=10

Medusa-1: the target is frozen; only the heads (ResBlocks + an LM head copied from the target's)
train, on  sum_k lambda_k L_k  (train/losses.py: CE to the token k + 1 ahead, optionally mixed with
KL to the target's own distribution for that token). Medusa-2 (`medusa2.enabled`): LoRA adapters
(peft) on the target train jointly, adding `medusa2.lm_weight` x the target's next-token loss so
the target keeps its quality; its held-out LM loss is reported before and after.

Layout of `output_dir`:
    checkpoints/step_<N>/   tensors.safetensors + state.json (trainable weights, optimizer,
                            scheduler, RNG of every process, data position); the newest
                            `train.keep_checkpoints` are kept; `--resume` continues exactly.
    final/                  medusa_heads.safetensors, config.json (MedusaConfig), manifest.json,
                            head_accuracy.json (held-out per-rank accuracies, for ARCA trees),
                            train_config.yaml, and target_lora/ for Medusa-2
    metrics.jsonl           every logged metric (also sent to W&B when `logging.tracker: wandb`)

`eval.drafters.medusa.load_medusa_drafter(final_dir, target)` turns `final/` into the decoder's MedusaDrafter after
checking that the manifest's target (hidden size, vocab fingerprint) is the given one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from draftsmith.models.medusa import (ACCURACY_FILE, CONFIG_FILE, HEADS_FILE, HIDDEN_LAYER, MANIFEST_FILE, MANIFEST_FORMAT,
                           MedusaConfig, MedusaHeads)
from draftsmith.models.target import resolve_device, vocab_fingerprint
from draftsmith.train.common import (MetricsFile, CheckpointError, ConfigError, NonFiniteLossError, batch_indices, check_finite,
                          collate, config_to_dict, flatten_dict, latest_checkpoint, load_checkpoint, load_config,
                          load_latest_checkpoint, load_records, load_target, local_rank_zero, prepare_wandb_env,
                          rng_state, save_checkpoint, save_config, seed_everything, set_rng_state, split_heldout,
                          even_shard, gather_trainable_state, print_summary)
from draftsmith.train.losses import (IGNORE_INDEX, head_weights, lm_labels, lm_loss, medusa_labels, medusa_loss, rank_hits,
                          teacher_positions)

log = logging.getLogger("train.medusa")

LORA_DIR = "target_lora"
# Keys a resumed run may change without a warning (everything else is compared with the checkpoint's config).
RESUME_MAY_CHANGE = {"train.stop_after_steps", "train.max_steps", "logging.run_name", "output_dir", "device"}


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    target: str = "smollm2-135m-instruct"  # zoo name, local dir, hub id, or tiny:<llama|qwen2>
    dtype: str = "float32"  # the target's dtype; heads always train in float32
    attn_implementation: str = "sdpa"


@dataclass
class HeadsConfig:
    num_heads: int = 4
    num_layers: int = 1  # ResBlocks per head
    # False: every head's LM head stays the frozen copy of the target's; only the ResBlocks train.
    # Large vocabularies (Qwen: 152k x 1536 per head) then need no optimizer state or weight grads there.
    train_lm_head: bool = True


@dataclass
class LossConfig:
    head_decay: float = 0.8  # lambda_k = head_decay^(k-1)
    head_weights: list[float] | None = None  # explicit lambda_1..lambda_K instead of the decay
    distill_weight: float = 0.0  # 0: hard labels; 1: KL to the target's distribution only
    distill_temperature: float = 1.0


@dataclass
class Medusa2Config:
    enabled: bool = False
    lm_weight: float = 1.0  # weight of the target's own next-token loss in the joint loss
    lora_r: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = 0.05
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    lora_lr: float = 1e-4  # the backbone learns slower than the heads (Medusa-2's differential lr)
    heads_only_steps: int = 0  # warm-up: the LoRA learning rate is 0 for these first steps


@dataclass
class DataConfig:
    source: str = "gsm8k:train"  # data.sources spec, records:/path.jsonl, or synthetic:<n> (tiny targets)
    limit: int | None = None  # at most this many conversations / records
    max_length: int = 512
    heldout_fraction: float = 0.05
    max_heldout: int | None = 256
    seed: int = 0  # split and shuffling


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 1.0


@dataclass
class TrainConfig:
    max_steps: int = 1000
    batch_size: int = 4  # records per micro-batch and process
    grad_accum_steps: int = 1
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    stop_after_steps: int | None = None  # exit right after this step's checkpoint (interruption tests)


@dataclass
class EvalConfig:
    every_steps: int = 100  # held-out evaluation period (0: only before and after training)
    batch_size: int = 8
    topk: int = 5  # logged as top-<topk> accuracy next to top-1
    max_rank: int = 10  # per-rank accuracy table size (head_accuracy.json, ARCA trees)


@dataclass
class LoggingConfig:
    tracker: Literal["wandb", "none"] = "wandb"
    project: str = "draftsmith"
    run_name: str | None = None


@dataclass
class MedusaRecipeConfig:
    output_dir: str = "outputs/medusa"
    device: str = "auto"  # auto | cpu | cuda
    model: ModelConfig = field(default_factory=ModelConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    medusa2: Medusa2Config = field(default_factory=Medusa2Config)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self):
        checks = [
            (self.heads.num_heads >= 1, "heads.num_heads must be >= 1"),
            (self.heads.num_layers >= 0, "heads.num_layers must be >= 0"),
            (0.0 <= self.loss.distill_weight <= 1.0, "loss.distill_weight must be in [0, 1]"),
            (self.loss.distill_temperature > 0, "loss.distill_temperature must be > 0"),
            (self.loss.head_weights is None or len(self.loss.head_weights) == self.heads.num_heads,
             "loss.head_weights must have heads.num_heads entries"),
            (0.0 <= self.data.heldout_fraction < 1.0, "data.heldout_fraction must be in [0, 1)"),
            (self.data.max_length > self.heads.num_heads + 1, "data.max_length must exceed heads.num_heads + 1"),
            (self.train.max_steps >= 1, "train.max_steps must be >= 1"),
            (self.train.batch_size >= 1 and self.train.grad_accum_steps >= 1,
             "train.batch_size and train.grad_accum_steps must be >= 1"),
            (self.train.checkpoint_every >= 1, "train.checkpoint_every must be >= 1"),
            (self.train.log_every >= 1, "train.log_every must be >= 1"),
            (self.eval.max_rank >= self.eval.topk >= 1, "eval.max_rank must be >= eval.topk >= 1"),
            (self.medusa2.enabled or self.medusa2.heads_only_steps == 0,
             "medusa2.heads_only_steps needs medusa2.enabled"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


# ---------------------------------------------------------------------------------------------
# The trained module: target (frozen or LoRA) + heads, one forward for DDP
# ---------------------------------------------------------------------------------------------


class MedusaTrainModule(nn.Module):
    """Runs the target and the heads on the positions that some head has a label for."""

    def __init__(self, target: nn.Module, heads: MedusaHeads, train_target: bool):
        super().__init__()
        self.target = target
        self.heads = heads
        self.train_target = train_target

    def forward(self, input_ids, attention_mask, rows, cols, want_logits: bool, want_teacher: bool):
        """input_ids/attention_mask (B, T); rows/cols (N,) selected positions.

        Returns head logits (K, N, V), the target's logits (B, T, V) or None, and the teacher
        logits (K, N, V) for distillation (the frozen target: with adapters disabled for Medusa-2).
        """
        grad = torch.is_grad_enabled() and self.train_target
        with torch.set_grad_enabled(grad):
            out = self.target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                              use_cache=False, logits_to_keep=0 if (want_logits or want_teacher) else 1)
        hidden = out.hidden_states[HIDDEN_LAYER][rows, cols].float()  # (N, H)
        head_logits = self.heads(hidden)  # (K, N, V)
        target_logits = out.logits if want_logits else None
        teacher = None
        if want_teacher:
            teacher_all = out.logits.detach()
            if self.train_target:
                with torch.no_grad(), self.target.disable_adapter():
                    teacher_all = self.target(input_ids=input_ids, attention_mask=attention_mask,
                                              use_cache=False).logits
            times = teacher_positions(cols, self.heads.config.num_heads).clamp(max=input_ids.shape[1] - 1)  # (K, N)
            teacher = teacher_all[rows[None, :].expand_as(times), times]  # (K, N, V)
        return head_logits, target_logits, teacher


def lr_lambda(cfg: MedusaRecipeConfig, hold_steps: int = 0):
    """Multiplier of the base lr after `step` optimizer steps (warm-up, then the schedule)."""
    optim, max_steps = cfg.optim, cfg.train.max_steps

    def factor(step: int) -> float:
        if step < hold_steps:
            return 0.0
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1.0 - progress
        return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * shape

    return factor


# ---------------------------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------------------------


class MedusaRecipe:
    """setup -> train -> save_checkpoint / save_final -> cleanup."""

    def __init__(self, cfg: MedusaRecipeConfig):
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.checkpoints_dir = self.output_dir / "checkpoints"
        self.final_dir = self.output_dir / "final"
        self.step = 0
        self.samples_seen = 0
        self.lm_loss_before: float | None = None
        self.last_eval: dict | None = None
        self.run_id = uuid.uuid4().hex[:8]
        self._resume_state: dict | None = None  # loaded by _resume_path for --resume

    # -- setup --------------------------------------------------------------------------------

    def setup(self, resume: str | None = None) -> None:
        from accelerate import Accelerator

        cfg = self.cfg
        device = resolve_device(cfg.device)
        resume_path = self._resume_path(resume)
        if resume_path is None and latest_checkpoint(self.checkpoints_dir) is not None:
            raise RuntimeError(f"{self.checkpoints_dir} already holds checkpoints: pass --resume to continue that run, "
                               "or choose another output_dir")
        if resume_path is not None:
            state = self._resume_state if self._resume_state is not None else load_checkpoint(resume_path)
            self.run_id = state["run_id"]
        log_with = None
        if cfg.logging.tracker == "wandb":
            prepare_wandb_env(self.output_dir)
            log_with = "wandb"
        self.accelerator = Accelerator(cpu=device.type == "cpu", log_with=log_with, project_dir=str(self.output_dir))
        acc = self.accelerator
        self.world = acc.num_processes
        if acc.is_main_process:
            self.output_dir.mkdir(parents=True, exist_ok=True)
        self.metrics = MetricsFile(self.output_dir / "metrics.jsonl", enabled=acc.is_main_process)
        if resume_path is None and acc.is_main_process and self.metrics.path.exists():
            self.metrics.path.unlink()

        seed_everything(cfg.train.seed)
        self.target = load_target(cfg.model.target, dtype=cfg.model.dtype, device=acc.device,
                                  attn_implementation=cfg.model.attn_implementation)
        model = self.target.model
        self.pad_id = self._pad_id()
        records = load_records(cfg.data.source, tokenizer=self.target.tokenizer, max_length=cfg.data.max_length,
                               limit=cfg.data.limit, model=model, seed=cfg.data.seed)
        self.train_records, self.heldout_records = split_heldout(records, cfg.data.heldout_fraction, cfg.data.seed,
                                                                 cfg.data.max_heldout)
        log.info("data: %d train / %d held-out records from %s", len(self.train_records),
                 len(self.heldout_records), cfg.data.source)

        self.medusa_config = MedusaConfig(hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size,
                                          num_heads=cfg.heads.num_heads, num_layers=cfg.heads.num_layers)
        heads = MedusaHeads(self.medusa_config).to(acc.device)  # float32 whatever the target's dtype
        heads.init_lm_heads(model.get_output_embeddings().weight)
        if not cfg.heads.train_lm_head:  # re-initialised identically from the target on resume
            for head in heads.medusa_head:
                head[-1].weight.requires_grad_(False)
        model.requires_grad_(False)
        param_groups = [{"params": [p for p in heads.parameters() if p.requires_grad], "lr": cfg.optim.lr}]
        if cfg.medusa2.enabled:
            from peft import LoraConfig, get_peft_model

            m2 = cfg.medusa2
            try:
                model = get_peft_model(model, LoraConfig(r=m2.lora_r, lora_alpha=m2.lora_alpha,
                                                         lora_dropout=m2.lora_dropout, bias="none",
                                                         target_modules=list(m2.lora_target_modules)))
            except ValueError as err:
                raise ConfigError(f"medusa2.lora_target_modules {m2.lora_target_modules}: {err}") from err
            lora = [p for p in model.parameters() if p.requires_grad]
            if not lora:
                raise ConfigError(f"medusa2.lora_target_modules {m2.lora_target_modules} matched no module")
            param_groups.append({"params": lora, "lr": m2.lora_lr})
        module = MedusaTrainModule(model, heads, train_target=cfg.medusa2.enabled)
        self.weights = head_weights(cfg.heads.num_heads, cfg.loss.head_decay, cfg.loss.head_weights)
        optimizer = torch.optim.AdamW(param_groups, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                                      weight_decay=cfg.optim.weight_decay)
        lambdas = [lr_lambda(cfg)] + ([lr_lambda(cfg, cfg.medusa2.heads_only_steps)] if cfg.medusa2.enabled else [])
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambdas)
        self.module, self.optimizer = acc.prepare(module, optimizer)  # the scheduler steps once per step, unprepared

        if resume_path is not None:
            self._restore(state, resume_path)
            self.metrics.drop_after(self.step)  # the steps after the checkpoint are redone and logged again
        else:
            seed_everything(cfg.train.seed + acc.process_index)
        if acc.is_main_process:
            save_config(cfg, self.output_dir / "train_config.yaml")
        if cfg.logging.tracker == "wandb":
            acc.init_trackers(cfg.logging.project, config=flatten_dict(config_to_dict(cfg)),
                              init_kwargs={"wandb": {"name": cfg.logging.run_name, "id": self.run_id,
                                                     "resume": "allow", "dir": str(self.output_dir)}})
        if resume_path is None:
            self.last_eval = self.evaluate()
            self.lm_loss_before = self.last_eval["eval/lm_loss"]
            self._log(self.last_eval)

    def _resume_path(self, resume: str | None) -> Path | None:
        if resume is None:
            return None
        if resume == "auto":  # the newest checkpoint that loads (a corrupt newest one is set aside with a warning)
            found = load_latest_checkpoint(self.checkpoints_dir, quarantine=local_rank_zero())
            if found is None:
                log.warning("--resume: no checkpoint in %s, starting from scratch", self.checkpoints_dir)
                return None
            path, self._resume_state = found
            return path
        return Path(resume)

    def _pad_id(self) -> int:
        tok = self.target.tokenizer
        for value in (getattr(tok, "pad_token_id", None), getattr(tok, "eos_token_id", None)):
            if isinstance(value, int):
                return value
        return 0  # padded positions are masked out of attention and loss anyway

    def _trainable(self) -> dict[str, nn.Parameter]:
        module = self.accelerator.unwrap_model(self.module)
        return {name: p for name, p in module.named_parameters() if p.requires_grad}

    # -- train --------------------------------------------------------------------------------

    def _micro_batches(self) -> list[dict[str, torch.Tensor]]:
        """This process's micro-batches of the next optimizer step (the global batch is fixed by
        samples_seen, so any number of processes sees the same data per step)."""
        cfg, acc = self.cfg, self.accelerator
        per_micro = cfg.train.batch_size
        total = per_micro * self.world * cfg.train.grad_accum_steps
        indices = batch_indices(len(self.train_records), self.samples_seen, total, cfg.data.seed)
        batches = []
        for micro in range(cfg.train.grad_accum_steps):
            start = (micro * self.world + acc.process_index) * per_micro
            batches.append(collate([self.train_records[i] for i in indices[start:start + per_micro]], self.pad_id))
        return batches

    def _forward(self, batch, want_logits: bool):
        """Labels and logits of one batch on the accelerator's device."""
        k = self.cfg.heads.num_heads
        device = self.accelerator.device
        batch = {name: t.to(device) for name, t in batch.items()}
        labels = medusa_labels(batch["input_ids"], batch["loss_mask"], k)  # (K, B, T)
        rows, cols = (labels != IGNORE_INDEX).any(0).nonzero(as_tuple=True)  # (N,), (N,)
        want_teacher = self.cfg.loss.distill_weight > 0
        head_logits, target_logits, teacher = self.module(batch["input_ids"], batch["attention_mask"], rows, cols,
                                                          want_logits, want_teacher)
        return batch, labels[:, rows, cols], head_logits, target_logits, teacher

    def train_step(self) -> dict:
        cfg, acc = self.cfg, self.accelerator
        medusa2 = cfg.medusa2.enabled
        micro_batches = self._micro_batches()
        # Normalisers: valid tokens of the whole optimizer step (all micro-batches, all processes),
        # divided by the number of processes because DDP averages gradients.
        counts = torch.zeros(cfg.heads.num_heads + 1, device=acc.device)
        for batch in micro_batches:
            counts[:-1] += (medusa_labels(batch["input_ids"], batch["loss_mask"], cfg.heads.num_heads) != IGNORE_INDEX
                            ).sum((1, 2)).to(acc.device)
            counts[-1] += (lm_labels(batch["input_ids"], batch["loss_mask"]) != IGNORE_INDEX).sum().to(acc.device)
        counts = acc.reduce(counts, "sum") if self.world > 1 else counts
        norm = counts.clamp(min=1) / self.world
        self.module.train()
        if not medusa2:
            self.accelerator.unwrap_model(self.module).target.eval()
        sums = torch.zeros(3 + 2 * cfg.heads.num_heads, device=acc.device)  # loss, lm, tokens, ce_k, kl_k
        for i, batch in enumerate(micro_batches):
            sync = i == len(micro_batches) - 1
            with nullcontext() if sync else acc.no_sync(self.module):
                batch, labels, head_logits, target_logits, teacher = self._forward(batch, want_logits=medusa2)
                out = medusa_loss(head_logits, labels, self.weights, teacher, cfg.loss.distill_weight,
                                  cfg.loss.distill_temperature, normalizer=norm[:-1])
                loss = out.loss
                if medusa2:
                    lm = lm_loss(target_logits, lm_labels(batch["input_ids"], batch["loss_mask"]), norm[-1])
                    loss = loss + cfg.medusa2.lm_weight * lm
                    sums[1] += lm.detach()
                acc.backward(loss)
            sums[0] += loss.detach()
            sums[2] += batch["attention_mask"].sum()
            sums[3:3 + cfg.heads.num_heads] += out.head_ce
            sums[3 + cfg.heads.num_heads:] += out.head_kl
        grad_norm = None
        if cfg.optim.max_grad_norm is not None:
            grad_norm = acc.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]],
                                            cfg.optim.max_grad_norm)
        lrs = [group["lr"] for group in self.optimizer.param_groups]  # the rates this step uses
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.samples_seen += cfg.train.batch_size * self.world * cfg.train.grad_accum_steps
        self.step += 1

        if self.world > 1:
            sums = acc.reduce(sums, "sum")
            sums[:2] /= self.world  # per-process losses were scaled by world / N_total
        # Same value on every process, checked before this step can be checkpointed: all ranks stop together.
        check_finite(sums[0], self.step, "training loss", self.checkpoints_dir)
        if grad_norm is not None:
            check_finite(grad_norm, self.step, "gradient norm", self.checkpoints_dir)
        k = cfg.heads.num_heads
        metrics = {"train/loss": float(sums[0]), "train/lr": lrs[0],
                   "train/tokens": int(sums[2]), "train/samples_seen": self.samples_seen}
        if medusa2:
            metrics["train/lm_loss"] = float(sums[1])
            metrics["train/lora_lr"] = lrs[1]
        if grad_norm is not None:
            metrics["train/grad_norm"] = float(grad_norm)
        for h in range(k):
            metrics[f"train/head{h + 1}_ce"] = float(sums[3 + h] / counts[h].clamp(min=1))
            if cfg.loss.distill_weight > 0:
                metrics[f"train/head{h + 1}_kl"] = float(sums[3 + k + h] / counts[h].clamp(min=1))
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out per-head CE, top-1 / top-k / per-rank accuracy, and the target's LM loss."""
        cfg, acc = self.cfg, self.accelerator
        k, max_rank = cfg.heads.num_heads, cfg.eval.max_rank
        self.module.eval()
        hits = torch.zeros(k, max_rank, dtype=torch.long, device=acc.device)
        sums = torch.zeros(2 * k + 2, dtype=torch.float64, device=acc.device)  # ce_k, tokens_k, lm ce, lm tokens
        size = cfg.eval.batch_size
        starts = list(range(0, len(self.heldout_records), size))
        for start, real in even_shard(starts, acc.process_index, self.world):  # same forward count on every rank
            batch = collate(self.heldout_records[start:start + size], self.pad_id)
            batch, labels, head_logits, target_logits, _ = self._forward(batch, want_logits=True)
            if not real:
                continue
            hits += rank_hits(head_logits, labels, max_rank)
            out = medusa_loss(head_logits, labels, self.weights)
            sums[:k] += out.head_ce.double()
            sums[k:2 * k] += out.head_tokens.double()
            lm_target = lm_labels(batch["input_ids"], batch["loss_mask"])
            sums[2 * k] += float(lm_loss(target_logits, lm_target, normalizer=1.0))
            sums[2 * k + 1] += float((lm_target != IGNORE_INDEX).sum())
        if self.world > 1:
            hits, sums = acc.reduce(hits, "sum"), acc.reduce(sums, "sum")
        tokens = sums[k:2 * k].clamp(min=1)
        rank_acc = (hits.double() / tokens[:, None]).tolist()
        metrics = {"eval/lm_loss": float(sums[2 * k] / sums[2 * k + 1].clamp(min=1)),
                   "eval/tokens": int(sums[k:2 * k].max())}
        ce = sums[:k] / tokens
        metrics["eval/loss"] = float((self.weights.double().to(ce.device) * ce).sum())
        for h in range(k):
            metrics[f"eval/head{h + 1}_loss"] = float(ce[h])
            metrics[f"eval/head{h + 1}_top1"] = rank_acc[h][0]
            metrics[f"eval/head{h + 1}_top{cfg.eval.topk}"] = sum(rank_acc[h][:cfg.eval.topk])
        metrics["rank_accuracy"] = rank_acc
        return metrics

    def _log(self, metrics: dict) -> None:
        scalars = {name: value for name, value in metrics.items() if not isinstance(value, list)}
        self.metrics.write({"step": self.step, **scalars})
        if self.cfg.logging.tracker != "none":
            self.accelerator.log(scalars, step=self.step)

    def train(self) -> None:
        cfg = self.cfg
        stop_at = min(cfg.train.max_steps, cfg.train.stop_after_steps or cfg.train.max_steps)
        started = time.perf_counter()
        while self.step < stop_at:
            metrics = self.train_step()
            if self.step % cfg.train.log_every == 0 or self.step == stop_at:
                metrics["train/elapsed_s"] = time.perf_counter() - started
                self._log(metrics)
                log.info("step %d loss %.4f", self.step, metrics["train/loss"])
            at_end = self.step == cfg.train.max_steps
            if (cfg.eval.every_steps and self.step % cfg.eval.every_steps == 0) or at_end:
                self.last_eval = self.evaluate()
                self._log(self.last_eval)
            if self.step % cfg.train.checkpoint_every == 0 or self.step == cfg.train.stop_after_steps:
                self.save_checkpoint()
        if self.step == cfg.train.max_steps:
            self.save_final()

    # -- checkpoints --------------------------------------------------------------------------

    def save_checkpoint(self) -> Path:
        from accelerate.utils import gather_object

        acc = self.accelerator
        rng = gather_object([rng_state()]) if self.world > 1 else [rng_state()]
        trainable = gather_trainable_state(acc, self.module)  # every rank: collective under FSDP / ZeRO-3
        path = self.checkpoints_dir / f"step_{self.step}"
        if acc.is_main_process:
            state = {
                "step": self.step,
                "samples_seen": self.samples_seen,
                "num_train_records": len(self.train_records),
                "run_id": self.run_id,
                "lm_loss_before": self.lm_loss_before,
                "trainable": trainable,
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "rng": rng,
                "config": config_to_dict(self.cfg),
            }
            path = save_checkpoint(self.checkpoints_dir, self.step, state, keep_last=self.cfg.train.keep_checkpoints)
            log.info("saved %s", path)
        acc.wait_for_everyone()
        return path

    def _restore(self, state: dict, path: Path) -> None:
        trainable = self._trainable()
        saved = state["trainable"]
        missing, unexpected = sorted(set(trainable) - set(saved)), sorted(set(saved) - set(trainable))
        if missing or unexpected:
            raise CheckpointError(f"checkpoint {path} does not match this run's trainable weights: missing {missing[:5]}, "
                                  f"unexpected {unexpected[:5]} (was it written with another heads/medusa2 config?)")
        if state["num_train_records"] != len(self.train_records):
            raise CheckpointError(f"checkpoint {path} was trained on {state['num_train_records']} records, this run has "
                                  f"{len(self.train_records)}: the data (source, limit, split) changed")
        with torch.no_grad():
            for name, p in trainable.items():
                if saved[name].shape != p.shape:
                    raise CheckpointError(f"checkpoint {path}: {name} has shape {tuple(saved[name].shape)}, "
                                          f"expected {tuple(p.shape)}")
                p.copy_(saved[name])
        saved_cfg, cfg_now = flatten_dict(state["config"]), flatten_dict(config_to_dict(self.cfg))
        changed = [key for key in sorted(set(saved_cfg) | set(cfg_now))
                   if saved_cfg.get(key) != cfg_now.get(key) and key not in RESUME_MAY_CHANGE]
        if changed:
            log.warning("resuming with a config that differs from the checkpoint's in %s", ", ".join(
                f"{key} ({saved_cfg.get(key)!r} -> {cfg_now.get(key)!r})" for key in changed))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The config's optimizer settings win over the saved ones (identical when nothing changed).
        base_lrs = [self.cfg.optim.lr] + ([self.cfg.medusa2.lora_lr] if self.cfg.medusa2.enabled else [])
        self.scheduler.base_lrs = base_lrs
        for group, base, factor in zip(self.optimizer.param_groups, base_lrs, self.scheduler.lr_lambdas):
            group.update(lr=base * factor(self.scheduler.last_epoch), initial_lr=base, betas=tuple(self.cfg.optim.betas),
                         eps=self.cfg.optim.eps, weight_decay=self.cfg.optim.weight_decay)
        self.step, self.samples_seen = state["step"], state["samples_seen"]
        self.lm_loss_before = state["lm_loss_before"]
        rng = state["rng"]
        index = self.accelerator.process_index
        if len(rng) != self.world:
            log.warning("checkpoint has RNG states of %d processes, this run has %d: reusing process 0's",
                        len(rng), self.world)
            index = 0
        set_rng_state(rng[index])
        log.info("resumed from %s at step %d (%d samples seen)", path, self.step, self.samples_seen)

    def save_final(self) -> Path:
        """heads + MedusaConfig + manifest (+ LoRA adapter) into output_dir/final, atomically."""
        from safetensors.torch import save_file

        acc = self.accelerator
        if self.last_eval is None:
            self.last_eval = self.evaluate()
        if acc.is_main_process:
            module = acc.unwrap_model(self.module)
            tmp = self.output_dir / ".tmp_final"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            heads_state = {name: t.detach().float().cpu().contiguous() for name, t in module.heads.state_dict().items()}
            save_file(heads_state, str(tmp / HEADS_FILE), metadata={"format": MANIFEST_FORMAT})
            (tmp / CONFIG_FILE).write_text(json.dumps(self.medusa_config.to_dict(), indent=2))
            if self.cfg.medusa2.enabled:
                module.target.save_pretrained(str(tmp / LORA_DIR))
            accuracy = self._accuracy_doc(self.last_eval)
            (tmp / ACCURACY_FILE).write_text(json.dumps(accuracy, indent=2))
            (tmp / MANIFEST_FILE).write_text(json.dumps(self.manifest(accuracy), indent=2))
            save_config(self.cfg, tmp / "train_config.yaml")
            if self.final_dir.exists():
                shutil.rmtree(self.final_dir)
            os.replace(tmp, self.final_dir)
            log.info("saved %s", self.final_dir)
        acc.wait_for_everyone()
        return self.final_dir

    def _accuracy_doc(self, ev: dict) -> dict:
        k, topk = self.cfg.heads.num_heads, self.cfg.eval.topk
        return {"step": self.step, "tokens": ev["eval/tokens"], "topk": topk,
                "top1": [ev[f"eval/head{h + 1}_top1"] for h in range(k)],
                f"top{topk}": [ev[f"eval/head{h + 1}_top{topk}"] for h in range(k)],
                "rank_accuracy": ev["rank_accuracy"]}

    def manifest(self, accuracy: dict) -> dict:
        cfg, config = self.cfg, self.target.config
        lm_after = self.last_eval["eval/lm_loss"] if self.last_eval else None
        return {
            "format": MANIFEST_FORMAT,
            "method": "medusa-2" if cfg.medusa2.enabled else "medusa-1",
            "target": {
                "name": cfg.model.target,
                "model_type": config.model_type,
                "hidden_size": config.hidden_size,
                "vocab_size": config.vocab_size,
                "num_hidden_layers": config.num_hidden_layers,
                "vocab_fingerprint": vocab_fingerprint(self.target.tokenizer),
                "hidden_layer": HIDDEN_LAYER,
                "dtype": cfg.model.dtype,
            },
            "heads": {"file": HEADS_FILE, "config": CONFIG_FILE, "dtype": "float32", **self.medusa_config.to_dict()},
            "target_adapter": LORA_DIR if cfg.medusa2.enabled else None,
            "training": {"steps": self.step, "samples_seen": self.samples_seen, "data": cfg.data.source,
                         "loss": config_to_dict(cfg.loss), "medusa2": config_to_dict(cfg.medusa2)},
            "eval": {"lm_loss_before": self.lm_loss_before, "lm_loss_after": lm_after,
                     "top1": accuracy["top1"], f"top{accuracy['topk']}": accuracy[f"top{accuracy['topk']}"],
                     "accuracy_file": ACCURACY_FILE},
        }

    # -- cleanup ------------------------------------------------------------------------------

    def cleanup(self) -> dict:
        summary = {"step": self.step, "output_dir": str(self.output_dir), "lm_loss_before": self.lm_loss_before,
                   "lm_loss_after": self.last_eval["eval/lm_loss"] if self.last_eval else None,
                   "final": str(self.final_dir) if self.step == self.cfg.train.max_steps else None}
        if self.cfg.logging.tracker != "none":
            self.accelerator.end_training()
        self.accelerator.free_memory()
        return summary


def main(cfg: MedusaRecipeConfig, resume: str | None = None) -> dict:
    recipe = MedusaRecipe(cfg)
    recipe.setup(resume)
    recipe.train()
    return recipe.cleanup()


# ---------------------------------------------------------------------------------------------
# Loading a trained checkpoint into the decoder
# ---------------------------------------------------------------------------------------------


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train Medusa heads (Medusa-1, or Medusa-2 with LoRA on the target).")
    parser.add_argument("--config", required=True, help="YAML config (see train/configs/)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in output_dir/checkpoints (fresh start if none)")
    parser.add_argument("--resume-from", metavar="CHECKPOINT_DIR", default=None,
                        help="continue from this checkpoint directory (output_dir/checkpoints/step_<N>)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. train.max_steps=10")
    return parser.parse_args(argv)


def cli(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config(MedusaRecipeConfig, args.config, args.overrides)
    summary = main(cfg, resume=args.resume_from or ("auto" if args.resume else None))
    print_summary(summary)
    return summary


if __name__ == "__main__":
    try:
        cli()
    except (ConfigError, CheckpointError, NonFiniteLossError) as err:
        sys.exit(f"error: {err}")
