"""DGF / EAGLE feature-drafter recipe (Dovetail III-B/C; EAGLE's training objective).

    accelerate launch train/dgf.py --config train/configs/dgf_tiny.yaml [--resume | --resume-from CKPT] [key.path=value ...]
    python train/dgf.py --config train/configs/dgf_smollm2_cpu.yaml drafter.fusion=linear drafter.num_blocks=1

The target is frozen; only the drafter (fusion + M decoder blocks, models/dgf.py) trains. At pair
t the drafter reads (f_t, x_{t+1}) and predicts f_{t+1}; the loss (train/losses.py) is

    sum_j decay^j [ feature_weight * SmoothL1(f^j_{t+1}, f_{t+1}) + token_weight * CE_t ]

over positions whose predicted token x_{t+2} carries the loss mask. CE_t is the soft CE against
the target's distribution for x_{t+2} (`token_loss: soft`, EAGLE) or the hard CE to x_{t+2}. Step
j = 0 is teacher forced (true features, optionally + uniform noise U(-a, a), `input_noise`);
steps j >= 1 (`unroll_steps` > 1, EAGLE-3's "training-time test") feed the drafter its own
predicted features from step j - 1 and attend exactly as a depth-(j+1) draft node does at decode
time: to the true prefix up to t - j and to its own chain of predicted entries (one shared KV cache
across steps, diagonal masks).

Data modes:
  online   `data.source` records; the frozen target runs in the loop (features + LM-head targets)
  offline  `data.feature_cache` built once by `python -m draftsmith.data.features` with the feature layer
           (and optionally --topk logits): no target forward per step. The soft target is
           lm_head(final normed state) when the feature layer is -1 (exact), else the cached top-k.

Layout of `output_dir` (as the Medusa recipe): checkpoints/step_<N>/ (exact `--resume`),
final/ (dgf.safetensors + config.json + manifest.json, see models/dgf.py; train_config.yaml),
metrics.jsonl (also W&B via accelerate's trackers, offline without network).
`eval.drafters.dgf.load_dgf_drafter(final_dir, target)` turns final/ into the decoder's drafter.
"""

from __future__ import annotations

import argparse
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

from draftsmith.models.dgf import DGFConfig, DGFModel, save_dgf, target_manifest
from draftsmith.models.target import resolve_device
from draftsmith.train.common import (MetricsFile, CheckpointError, ConfigError, batch_indices, config_to_dict, flatten_dict,
                          latest_checkpoint, load_checkpoint, load_config, load_records, load_target, prepare_wandb_env,
                          rng_state, save_checkpoint, save_config, seed_everything, set_rng_state, split_heldout,
                          even_shard, check_finite, load_latest_checkpoint, local_rank_zero, gather_trainable_state,
                          print_summary)
from draftsmith.train.losses import (IGNORE_INDEX, feature_regression_loss, hard_cross_entropy, soft_cross_entropy,
                          topk_soft_cross_entropy, unrolled_step_weights)

log = logging.getLogger("train.dgf")

RESUME_MAY_CHANGE = {"train.stop_after_steps", "train.max_steps", "logging.run_name", "output_dir", "device"}


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    target: str = "smollm2-135m-instruct"  # zoo name, local dir, hub id, or tiny:<llama|qwen2>
    dtype: str = "float32"  # the target's dtype; the drafter trains in float32
    attn_implementation: str = "sdpa"


@dataclass
class DrafterConfig:
    fusion: Literal["linear", "dgf"] = "dgf"  # linear = EAGLE baseline
    num_blocks: int = 1  # M
    fusion_act: str = "silu"
    first_block_norm: bool = False
    feature_layer: int = -1  # target hidden_states index the drafter reads


@dataclass
class LossConfig:
    feature_weight: float = 1.0  # EAGLE: w_reg 1.0
    token_weight: float = 0.1  # EAGLE: w_cls 0.1
    token_loss: Literal["soft", "hard"] = "soft"
    input_noise: float = 0.0  # a: uniform U(-a, a) added to the teacher-forced input features
    unroll_steps: int = 1  # 1 = plain EAGLE; n > 1 = training-time test over n steps
    unroll_decay: float = 0.8  # weight of step j = decay^j


@dataclass
class DataConfig:
    mode: Literal["online", "offline"] = "online"
    source: str = "gsm8k:train"  # online: data source spec (see train.common.load_records)
    feature_cache: str | None = None  # offline: data.features cache directory, or "dir_a + dir_b" (limit: each)
    limit: int | None = None
    max_length: int = 512
    heldout_fraction: float = 0.05
    max_heldout: int | None = 256
    seed: int = 0


@dataclass
class OptimConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)  # Dovetail / EAGLE
    eps: float = 1e-8
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    max_grad_norm: float | None = 0.5  # EAGLE clips at 0.5


@dataclass
class TrainConfig:
    max_steps: int = 1000
    batch_size: int = 4
    grad_accum_steps: int = 1
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    stop_after_steps: int | None = None


@dataclass
class EvalConfig:
    every_steps: int = 100  # 0: only before and after training
    batch_size: int = 8
    unroll_steps: int = 3  # held-out accuracy of the drafter fed its own features for j steps (depth j+1)


@dataclass
class LoggingConfig:
    tracker: Literal["wandb", "none"] = "wandb"
    project: str = "draftsmith"
    run_name: str | None = None


@dataclass
class DGFRecipeConfig:
    output_dir: str = "outputs/dgf"
    device: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self):
        checks = [
            (1 <= self.drafter.num_blocks <= 32, "drafter.num_blocks must be in 1..32"),
            (self.loss.feature_weight >= 0 and self.loss.token_weight >= 0, "loss weights must be >= 0"),
            (self.loss.feature_weight + self.loss.token_weight > 0, "loss.feature_weight + loss.token_weight must be > 0"),
            (self.loss.input_noise >= 0, "loss.input_noise must be >= 0"),
            (self.loss.unroll_steps >= 1, "loss.unroll_steps must be >= 1"),
            (self.loss.unroll_decay > 0, "loss.unroll_decay must be > 0"),
            (self.data.mode == "online" or self.data.feature_cache, "data.mode=offline needs data.feature_cache"),
            (0.0 <= self.data.heldout_fraction < 1.0, "data.heldout_fraction must be in [0, 1)"),
            (self.data.max_length >= 4, "data.max_length must be >= 4"),
            (self.train.max_steps >= 1, "train.max_steps must be >= 1"),
            (self.train.batch_size >= 1 and self.train.grad_accum_steps >= 1,
             "train.batch_size and train.grad_accum_steps must be >= 1"),
            (self.train.checkpoint_every >= 1 and self.train.log_every >= 1,
             "train.checkpoint_every and train.log_every must be >= 1"),
            (self.eval.unroll_steps >= 1, "eval.unroll_steps must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)


def lr_lambda(cfg: DGFRecipeConfig):
    optim, max_steps = cfg.optim, cfg.train.max_steps

    def factor(step: int) -> float:
        if optim.warmup_steps and step < optim.warmup_steps:
            return (step + 1) / optim.warmup_steps
        if optim.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - optim.warmup_steps) / max(1, max_steps - optim.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1.0 - progress
        return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * shape

    return factor


# ---------------------------------------------------------------------------------------------
# Pure pieces: masks, labels, the unrolled forward
# ---------------------------------------------------------------------------------------------


def unrolled_mask(length: int, step: int, device=None) -> torch.Tensor:
    """Bool (length, (step + 1) * length): what unrolled step `step` (queries at pairs t) may attend to.

    Keys are the entries of steps 0..step (length each). Step-j query t (descending from the true
    prefix ending at t - j) sees step-0 keys s <= t - j and step-k keys s = t - j + k, k = 1..j
    (its own chain of predicted entries, itself last): the mask a depth-(j+1) tree node has.
    """
    t = torch.arange(length, device=device)[:, None]
    s = torch.arange(length, device=device)[None, :]
    blocks = [s <= t - step] + [s == t - step + k for k in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


def pair_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, attention_mask: torch.Tensor):
    """Per pair t = 0..T-2: labels (B, T-1) = x_{t+2} where it exists and carries the loss mask, else IGNORE."""
    batch, length = input_ids.shape
    labels = torch.full((batch, length - 1), IGNORE_INDEX, dtype=torch.long, device=input_ids.device)
    keep = (loss_mask[:, 2:] > 0) & (attention_mask[:, 2:] > 0)
    labels[:, : length - 2] = torch.where(keep, input_ids[:, 2:], torch.full_like(input_ids[:, 2:], IGNORE_INDEX))
    return labels


class DGFTrainModule(nn.Module):
    """The drafter, run for `steps` unrolled steps in one forward (one forward per backward for DDP)."""

    def __init__(self, drafter: DGFModel):
        super().__init__()
        self.drafter = drafter

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """features (B, T', H) f_t, tokens (B, T') x_{t+1} -> per step (B, T', H) predictions of f_{t+1}."""
        drafter = self.drafter
        length = features.shape[1]
        cache = drafter.new_cache() if steps > 1 else None
        preds = [drafter(features, tokens, cache=cache)]
        positions = torch.arange(length, device=features.device)[None].expand(features.shape[0], -1)
        for step in range(1, steps):
            # Input feature at t = the previous step's prediction of f_t (made at pair t - 1).
            shifted = torch.cat([preds[-1][:, :1] * 0, preds[-1][:, :-1]], dim=1)
            allowed = unrolled_mask(length, step, features.device)[None, None]
            preds.append(drafter(shifted, tokens, positions, cache, allowed))
        return preds


# ---------------------------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------------------------


class DGFRecipe:
    """setup -> train -> save_checkpoint / save_final -> cleanup."""

    def __init__(self, cfg: DGFRecipeConfig):
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.checkpoints_dir = self.output_dir / "checkpoints"
        self.final_dir = self.output_dir / "final"
        self.step = 0
        self.samples_seen = 0
        self.last_eval: dict | None = None
        self.first_eval: dict | None = None
        self.run_id = uuid.uuid4().hex[:8]

    # -- setup --------------------------------------------------------------------------------

    def setup(self, resume: str | None = None) -> None:
        from accelerate import Accelerator

        cfg = self.cfg
        device = resolve_device(cfg.device)
        resume_path = self._resume_path(resume)
        if resume_path is None and latest_checkpoint(self.checkpoints_dir) is not None:
            raise RuntimeError(f"{self.checkpoints_dir} already holds checkpoints: pass --resume to continue that run, "
                               "or choose another output_dir")
        state = None
        if resume_path is not None:
            state = getattr(self, "_resume_state", None) or load_checkpoint(resume_path)
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
        model = self.target.model.requires_grad_(False).eval()
        self.pad_id = self._pad_id()
        records = self._load_data()
        self.train_records, self.heldout_records = split_heldout(records, cfg.data.heldout_fraction, cfg.data.seed,
                                                                 cfg.data.max_heldout)
        log.info("data (%s): %d train / %d held-out records", cfg.data.mode, len(self.train_records),
                 len(self.heldout_records))

        d = cfg.drafter
        self.dgf_config = DGFConfig.for_target(model.config, num_blocks=d.num_blocks, fusion=d.fusion,
                                               fusion_act=d.fusion_act, first_block_norm=d.first_block_norm,
                                               feature_layer=d.feature_layer)
        drafter = DGFModel(self.dgf_config).to(acc.device).attach_target(model)  # float32
        log.info("drafter: fusion=%s M=%d, %.2fM trainable parameters", d.fusion, d.num_blocks,
                 drafter.num_parameters() / 1e6)
        self.step_weights = unrolled_step_weights(cfg.loss.unroll_steps, cfg.loss.unroll_decay)
        optimizer = torch.optim.AdamW(drafter.parameters(), lr=cfg.optim.lr, betas=tuple(cfg.optim.betas),
                                      eps=cfg.optim.eps, weight_decay=cfg.optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        self.module, self.optimizer = acc.prepare(DGFTrainModule(drafter), optimizer)

        if state is not None:
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
        if state is None:
            self.first_eval = self.last_eval = self.evaluate()
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
        return 0

    def _load_data(self) -> list[dict]:
        cfg = self.cfg
        if cfg.data.mode == "online":
            return load_records(cfg.data.source, tokenizer=self.target.tokenizer, max_length=cfg.data.max_length,
                                limit=cfg.data.limit, model=self.target.model, seed=cfg.data.seed)
        from draftsmith.data.features import FeatureDataset

        records = []
        for cache_dir in (part.strip() for part in cfg.data.feature_cache.split(" + ")):
            records.extend(self._load_cache(FeatureDataset, cache_dir))
        if not records:
            raise ValueError(f"feature cache {cfg.data.feature_cache} holds no record with trainable tokens")
        return records

    def _load_cache(self, dataset_cls, cache_dir: str) -> list[dict]:
        """Every sequence of one feature cache, in memory (features stay bf16 until batched)."""
        cfg = self.cfg
        dataset = dataset_cls(cache_dir, target=self.target, hidden_layers=[cfg.drafter.feature_layer],
                              with_logits=True, shuffle=False)
        if cfg.loss.token_loss == "soft" and cfg.drafter.feature_layer != -1 and not dataset.index["topk_logits"]:
            raise ConfigError(f"loss.token_loss=soft offline needs the target's distribution: cache "
                              f"{cache_dir} has no top-k logits and the feature layer is not -1")
        records = []
        for rec in dataset:
            n = min(len(rec["input_ids"]), cfg.data.max_length)
            item = {"input_ids": rec["input_ids"][:n], "loss_mask": rec["loss_mask"][:n],
                    "features": rec["hidden_states"][0, :n]}
            if "topk_values" in rec:
                item.update(topk_values=rec["topk_values"][:n], topk_indices=rec["topk_indices"][:n])
            if item["loss_mask"].sum() > 0:
                records.append(item)
            if cfg.data.limit is not None and len(records) >= cfg.data.limit:
                break
        return records

    def _trainable(self) -> dict[str, nn.Parameter]:
        module = self.accelerator.unwrap_model(self.module)
        return {name: p for name, p in module.named_parameters() if p.requires_grad}

    # -- batches ------------------------------------------------------------------------------

    def _collate(self, records: list[dict]) -> dict[str, torch.Tensor]:
        length = max(len(r["input_ids"]) for r in records)
        batch = len(records)
        ids = torch.full((batch, length), self.pad_id, dtype=torch.long)
        attention = torch.zeros((batch, length), dtype=torch.long)
        loss_mask = torch.zeros((batch, length), dtype=torch.long)
        out = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
        offline = "features" in records[0]
        if offline:
            hidden = records[0]["features"].shape[-1]
            out["features"] = torch.zeros((batch, length, hidden), dtype=torch.float32)
            if "topk_values" in records[0]:
                k = records[0]["topk_values"].shape[-1]
                out["topk_values"] = torch.zeros((batch, length, k), dtype=torch.float32)
                out["topk_indices"] = torch.zeros((batch, length, k), dtype=torch.long)
        for i, r in enumerate(records):
            n = len(r["input_ids"])
            ids[i, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
            attention[i, :n] = 1
            loss_mask[i, :n] = torch.as_tensor(r["loss_mask"], dtype=torch.long)
            if offline:
                out["features"][i, :n] = r["features"].float()
                if "topk_values" in out:
                    out["topk_values"][i, :n] = r["topk_values"].float()
                    out["topk_indices"][i, :n] = r["topk_indices"]
        return out

    def _micro_batches(self) -> list[dict[str, torch.Tensor]]:
        cfg, acc = self.cfg, self.accelerator
        per_micro = cfg.train.batch_size
        total = per_micro * self.world * cfg.train.grad_accum_steps
        indices = batch_indices(len(self.train_records), self.samples_seen, total, cfg.data.seed)
        batches = []
        for micro in range(cfg.train.grad_accum_steps):
            start = (micro * self.world + acc.process_index) * per_micro
            batches.append(self._collate([self.train_records[i] for i in indices[start:start + per_micro]]))
        return batches

    @torch.no_grad()
    def _features(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target features (B, T, H) float32 and the final normed state (B, T, H) for soft targets
        (None when the soft target comes from cached top-k logits)."""
        if "features" in batch:
            feats = batch["features"]
            return feats, feats if self.cfg.drafter.feature_layer == -1 else None
        out = self.target.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                output_hidden_states=True, use_cache=False, logits_to_keep=1)
        return (out.hidden_states[self.cfg.drafter.feature_layer].float(), out.hidden_states[-1])

    def _losses(self, batch: dict, steps: int, normalizers: torch.Tensor | None, noise: bool):
        """Per-step (loss, feature loss, token loss, correct top-1, valid) for one micro-batch."""
        cfg = self.cfg
        device = self.accelerator.device
        batch = {k: v.to(device) for k, v in batch.items()}
        feats, final = self._features(batch)
        labels = pair_targets(batch["input_ids"], batch["loss_mask"], batch["attention_mask"])  # (B, T-1)
        inputs = feats[:, :-1]
        if noise and cfg.loss.input_noise > 0:
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * cfg.loss.input_noise
        preds = self.module(inputs, batch["input_ids"][:, 1:], steps)
        drafter = self.accelerator.unwrap_model(self.module).drafter
        valid_all = labels != IGNORE_INDEX
        results = []
        for j, pred in enumerate(preds):
            valid = valid_all.clone()
            valid[:, :j] = False  # a step-j chain needs a true prefix ending at t - j >= 0
            rows, cols = valid.nonzero(as_tuple=True)
            norm = normalizers[j] if normalizers is not None else valid.sum().clamp(min=1)
            feat_loss = feature_regression_loss(pred[rows, cols], feats[rows, cols + 1], torch.ones_like(rows), norm)
            logits = drafter.logits(pred[rows, cols])  # (N, V)
            label = labels[rows, cols]
            if cfg.loss.token_loss == "hard":
                token_loss = hard_cross_entropy(logits, label, norm)
            elif final is not None:
                with torch.no_grad():
                    target_logp = torch.log_softmax(drafter.logits(final[rows, cols + 1]), -1)
                token_loss = soft_cross_entropy(logits, target_logp, torch.ones_like(rows), norm)
            else:
                token_loss = topk_soft_cross_entropy(logits, batch["topk_indices"][rows, cols + 1],
                                                     batch["topk_values"][rows, cols + 1], torch.ones_like(rows), norm)
            loss = cfg.loss.feature_weight * feat_loss + cfg.loss.token_weight * token_loss
            correct = (logits.argmax(-1) == label).sum()
            results.append((loss, feat_loss.detach(), token_loss.detach(), correct, valid.sum()))
        return results

    def train_step(self) -> dict:
        cfg, acc = self.cfg, self.accelerator
        steps = cfg.loss.unroll_steps
        micro_batches = self._micro_batches()
        counts = torch.zeros(steps, device=acc.device)
        for batch in micro_batches:
            labels = pair_targets(batch["input_ids"], batch["loss_mask"], batch["attention_mask"])
            for j in range(steps):
                counts[j] += (labels[:, j:] != IGNORE_INDEX).sum().to(acc.device)
        counts = acc.reduce(counts, "sum") if self.world > 1 else counts
        norm = counts.clamp(min=1) / self.world
        self.module.train()
        weights = self.step_weights.to(acc.device)
        sums = torch.zeros(4 * steps, device=acc.device)  # per step: loss, feature, token, correct
        for i, batch in enumerate(micro_batches):
            sync = i == len(micro_batches) - 1
            with nullcontext() if sync else acc.no_sync(self.module):
                results = self._losses(batch, steps, norm, noise=True)
                loss = sum(weights[j] * r[0] for j, r in enumerate(results))
                acc.backward(loss)
            for j, (step_loss, feat, token, correct, _) in enumerate(results):
                sums[4 * j:4 * j + 4] += torch.stack([step_loss.detach(), feat, token, correct.float()])
        grad_norm = None
        if cfg.optim.max_grad_norm is not None:
            grad_norm = acc.clip_grad_norm_(self.module.parameters(), cfg.optim.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.samples_seen += cfg.train.batch_size * self.world * cfg.train.grad_accum_steps
        self.step += 1
        if self.world > 1:
            sums = acc.reduce(sums, "sum")
            for j in range(steps):
                sums[4 * j:4 * j + 3] /= self.world
        # Same value on every process (after the reduce), before this step can be checkpointed.
        check_finite(sums[0], self.step, "training loss", self.checkpoints_dir)
        if grad_norm is not None:
            check_finite(grad_norm, self.step, "gradient norm", self.checkpoints_dir)
        metrics = {"train/loss": float(sum(weights[j] * sums[4 * j] for j in range(steps))), "train/lr": lr,
                   "train/samples_seen": self.samples_seen}
        if grad_norm is not None:
            metrics["train/grad_norm"] = float(grad_norm)
        for j in range(steps):
            metrics[f"train/step{j}_feature_loss"] = float(sums[4 * j + 1])
            metrics[f"train/step{j}_token_loss"] = float(sums[4 * j + 2])
            metrics[f"train/step{j}_top1"] = float(sums[4 * j + 3] / counts[j].clamp(min=1))
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out losses and top-1 accuracy (vs the data token x_{t+2}) after j = 0..eval.unroll_steps-1
        steps on the drafter's own features (step j ~ a depth-(j+1) draft node)."""
        cfg, acc = self.cfg, self.accelerator
        steps = max(cfg.eval.unroll_steps, cfg.loss.unroll_steps)
        self.module.eval()
        sums = torch.zeros(steps, 4, dtype=torch.float64, device=acc.device)  # feature, token, correct, valid
        size = cfg.eval.batch_size
        starts = list(range(0, len(self.heldout_records), size))
        for start, real in even_shard(starts, acc.process_index, self.world):  # same forward count on every rank
            batch = self._collate(self.heldout_records[start:start + size])
            for j, (_, feat, token, correct, valid) in enumerate(self._losses(batch, steps, None, noise=False)):
                if not real:
                    continue
                n = float(valid)
                sums[j] += torch.tensor([float(feat) * n, float(token) * n, float(correct), n], dtype=torch.float64,
                                        device=acc.device)
        if self.world > 1:
            sums = acc.reduce(sums, "sum")
        metrics = {"eval/tokens": int(sums[0, 3])}
        for j in range(steps):
            n = max(float(sums[j, 3]), 1.0)
            metrics[f"eval/step{j}_feature_loss"] = float(sums[j, 0]) / n
            metrics[f"eval/step{j}_token_loss"] = float(sums[j, 1]) / n
            metrics[f"eval/step{j}_top1"] = float(sums[j, 2]) / n
        metrics["eval/top1"] = metrics["eval/step0_top1"]
        return metrics

    def _log(self, metrics: dict) -> None:
        self.metrics.write({"step": self.step, **metrics})
        if self.cfg.logging.tracker != "none":
            self.accelerator.log(metrics, step=self.step)

    def train(self) -> None:
        cfg = self.cfg
        stop_at = min(cfg.train.max_steps, cfg.train.stop_after_steps or cfg.train.max_steps)
        started = time.perf_counter()
        while self.step < stop_at:
            metrics = self.train_step()
            if self.step % cfg.train.log_every == 0 or self.step == stop_at:
                metrics["train/elapsed_s"] = time.perf_counter() - started
                self._log(metrics)
                log.info("step %d loss %.4f top1 %.3f", self.step, metrics["train/loss"], metrics["train/step0_top1"])
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
            state = {"step": self.step, "samples_seen": self.samples_seen,
                     "num_train_records": len(self.train_records), "run_id": self.run_id,
                     "first_eval": self.first_eval,
                     "trainable": trainable,
                     "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                     "rng": rng, "config": config_to_dict(self.cfg)}
            path = save_checkpoint(self.checkpoints_dir, self.step, state, keep_last=self.cfg.train.keep_checkpoints)
            log.info("saved %s", path)
        acc.wait_for_everyone()
        return path

    def _restore(self, state: dict, path: Path) -> None:
        trainable = self._trainable()
        saved = state["trainable"]
        missing, unexpected = sorted(set(trainable) - set(saved)), sorted(set(saved) - set(trainable))
        if missing or unexpected:
            raise CheckpointError(f"checkpoint {path} does not match this drafter: missing {missing[:5]}, unexpected "
                                  f"{unexpected[:5]} (written with another drafter.fusion / num_blocks?)")
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
        self.scheduler.base_lrs = [self.cfg.optim.lr]
        for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group.update(lr=self.cfg.optim.lr * factor(self.scheduler.last_epoch), initial_lr=self.cfg.optim.lr,
                         betas=tuple(self.cfg.optim.betas), eps=self.cfg.optim.eps,
                         weight_decay=self.cfg.optim.weight_decay)
        self.step, self.samples_seen = state["step"], state["samples_seen"]
        self.first_eval = state.get("first_eval")
        rng = state["rng"]
        index = self.accelerator.process_index
        if len(rng) != self.world:
            log.warning("checkpoint has RNG states of %d processes, this run has %d: reusing process 0's",
                        len(rng), self.world)
            index = 0
        set_rng_state(rng[index])
        log.info("resumed from %s at step %d (%d samples seen)", path, self.step, self.samples_seen)

    def save_final(self) -> Path:
        acc = self.accelerator
        if self.last_eval is None:
            self.last_eval = self.evaluate()
        if acc.is_main_process:
            drafter = acc.unwrap_model(self.module).drafter
            tmp = self.output_dir / ".tmp_final"
            shutil.rmtree(tmp, ignore_errors=True)
            cfg = self.cfg
            extra = {"training": {"steps": self.step, "samples_seen": self.samples_seen, "mode": cfg.data.mode,
                                  "data": cfg.data.feature_cache if cfg.data.mode == "offline" else cfg.data.source,
                                  "loss": config_to_dict(cfg.loss)},
                     "eval": {"before": self.first_eval, "after": self.last_eval}}
            block = target_manifest(self.target, cfg.model.target, cfg.drafter.feature_layer, cfg.model.dtype)
            save_dgf(drafter, tmp, block, extra)
            save_config(cfg, tmp / "train_config.yaml")
            if self.final_dir.exists():
                shutil.rmtree(self.final_dir)
            os.replace(tmp, self.final_dir)
            log.info("saved %s", self.final_dir)
        acc.wait_for_everyone()
        return self.final_dir

    # -- cleanup ------------------------------------------------------------------------------

    def cleanup(self) -> dict:
        summary = {"step": self.step, "output_dir": str(self.output_dir),
                   "eval_top1": self.last_eval.get("eval/top1") if self.last_eval else None,
                   "final": str(self.final_dir) if self.step == self.cfg.train.max_steps else None}
        if self.cfg.logging.tracker != "none":
            self.accelerator.end_training()
        self.accelerator.free_memory()
        return summary


def main(cfg: DGFRecipeConfig, resume: str | None = None) -> dict:
    recipe = DGFRecipe(cfg)
    recipe.setup(resume)
    recipe.train()
    return recipe.cleanup()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Train a DGF / EAGLE feature drafter on a frozen target.")
    parser.add_argument("--config", required=True, help="YAML config (see train/configs/)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in output_dir/checkpoints (fresh start if none)")
    parser.add_argument("--resume-from", metavar="CHECKPOINT_DIR", default=None,
                        help="continue from this checkpoint directory (output_dir/checkpoints/step_<N>)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. drafter.num_blocks=2")
    return parser.parse_args(argv)


def cli(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config(DGFRecipeConfig, args.config, args.overrides)
    summary = main(cfg, resume=args.resume_from or ("auto" if args.resume else None))
    print_summary(summary)
    return summary


if __name__ == "__main__":
    try:
        cli()
    except (ConfigError, CheckpointError, FloatingPointError) as err:
        sys.exit(f"error: {err}")
