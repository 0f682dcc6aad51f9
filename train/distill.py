"""Distillation recipe: a small student LM (same tokenizer) trained toward the target, for use as a draft model.

    accelerate launch train/distill.py --config train/configs/distill_tiny.yaml [--resume | --resume-from CKPT] [key.path=value ...]
    python train/distill.py --config train/configs/distill_qwen_cpu.yaml train.max_steps=10

Student (`student.init`):
    pretrained  any HF causal LM (`student.model`: zoo name, dir, hub id, or `tiny:<family>[:seed]`) whose
                tokenizer equals the target's token by token (`models.target.check_same_tokenizer`)
    layers      a copy of the target keeping every `student.layer_stride`-th decoder layer (+ the last;
                or `student.layer_ids`), `models/student.py`
    shallow     the target's config with `student.num_layers` freshly initialised decoder layers (optionally a
                narrower MLP), sharing (copying) the target's embeddings, final norm and LM head
Training: full fine-tune, or LoRA adapters (peft, `lora.enabled`) merged into the weights at export.

Data and loss (`loss.kind`; divergences in train/losses.py, DistillSpec's choices):
    ce          sequence-level KD (Minions, Kim & Rush): cross-entropy on target-written answers, e.g.
                `data.source: conversations:<data.regenerate output>`; wrong GSM8K answers are dropped with
                the checker of data/regenerate.py (`data.filter_wrong`)
    fkl, rkl, jsd (beta), tvd
                token-level KD on every assistant token against the target's distribution: the target runs
                online on each batch, or (`data.feature_cache`) its stored top-k logits + logsumexp from
                data/features.py are used (`loss.topk_tail` says how the tail mass is handled)
    on-policy   (`on_policy.fraction` of the optimizer steps, chosen by a seeded draw per step): the student
                samples continuations of the batch's prompts, the target scores them online, and the
                divergence is taken on those tokens (DistillSpec / GKD on-policy data)
`loss.ce_weight` adds hard-label CE on the data tokens to a divergence.

Layout of `output_dir`:
    checkpoints/step_<N>/   tensors.safetensors + state.json (trainable weights, optimizer, scheduler, RNG of
                            every process, data position); `--resume` continues exactly
    final/                  the student in plain HF `save_pretrained` format (LoRA merged) + the target's
                            tokenizer + manifest.json (target id, vocab fingerprint, loss, data, eval);
                            usable as `generate(assistant_model=AutoModelForCausalLM.from_pretrained(final))`
                            and as `python -m draftsmith.eval.bench --draft <output_dir>/final`
    metrics.jsonl           every logged metric (also W&B when `logging.tracker: wandb`)
"""

from __future__ import annotations

import argparse
import copy
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
import torch.nn.functional as F
from torch import nn

from draftsmith.models.target import check_same_tokenizer, resolve_device, resolve_dtype, vocab_fingerprint
from draftsmith.train.common import (TINY_PREFIX, CheckpointError, ConfigError, MetricsFile, NonFiniteLossError, TinyTokenizer,
                          batch_indices, build_tiny_causal_lm, check_finite, collate, config_to_dict, flatten_dict,
                          latest_checkpoint, load_checkpoint, load_config, load_latest_checkpoint, load_records,
                          load_target, local_rank_zero, prepare_wandb_env, rng_state, save_checkpoint, save_config,
                          seed_everything, set_rng_state, split_heldout, even_shard, gather_trainable_state,
                          print_summary)
from draftsmith.train.losses import KD_KINDS, kd_loss, kd_mask

log = logging.getLogger("train.distill")

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "draftsmith.distilled/1"
TOPK_FIELDS = ("topk_values", "topk_indices", "logsumexp")
RESUME_MAY_CHANGE = {"train.stop_after_steps", "train.max_steps", "logging.run_name", "output_dir", "device"}


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    target: str = "qwen2.5-coder-1.5b-instruct"  # the teacher: zoo name, local dir, hub id, or tiny:<llama|qwen2>
    dtype: str = "float32"  # the target's compute dtype (teacher forwards)
    attn_implementation: str = "sdpa"


@dataclass
class StudentConfig:
    init: Literal["pretrained", "layers", "shallow"] = "pretrained"
    model: str | None = "qwen2.5-coder-0.5b-instruct"  # pretrained: zoo name, dir, hub id or tiny:<family>[:seed]
    layer_stride: int = 2  # layers: keep layers 0, n, 2n, ... and the last
    layer_ids: list[int] | None = None  # layers: explicit ids instead of the stride
    num_layers: int = 2  # shallow: number of (freshly initialised) decoder layers
    intermediate_size: int | None = None  # shallow: MLP width (None: the target's)
    freeze_embeddings: bool = True  # layers/shallow, full fine-tune: embeddings + LM head stay the target's
    dtype: str = "float32"  # training dtype of the student
    seed: int = 0  # shallow: initialisation seed


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                               "up_proj", "down_proj"])


@dataclass
class LossConfig:
    kind: Literal["ce", "fkl", "rkl", "jsd", "tvd"] = "fkl"
    beta: float = 0.5  # generalized JSD(beta)
    temperature: float = 1.0
    topk_tail: Literal["bucket", "renormalize"] = "bucket"  # top-k teachers (data.feature_cache)
    ce_weight: float = 0.0  # + ce_weight x hard-label CE on the data tokens (with a divergence)


@dataclass
class DataConfig:
    source: str = "gsm8k:train"  # load_records spec: conversations:<regenerated dir>, gsm8k:train, a + b, ...
    feature_cache: str | None = None  # data/features.py cache with top-k logits: records + offline teacher
    filter_wrong: bool = True  # drop conversations a data.regenerate checker marks wrong (GSM8K final answers)
    limit: int | None = None
    max_length: int = 512
    heldout_fraction: float = 0.05
    max_heldout: int | None = 64
    seed: int = 0


@dataclass
class OnPolicyConfig:
    fraction: float = 0.0  # share of optimizer steps whose batches the student generates (the target scores)
    max_new_tokens: int = 64
    temperature: float = 1.0  # student sampling temperature (0: greedy)


@dataclass
class OptimConfig:
    lr: float = 1e-4
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
    batch_size: int = 4


@dataclass
class ExportConfig:
    dtype: str = "float32"  # dtype of the exported student weights


@dataclass
class LoggingConfig:
    tracker: Literal["wandb", "none"] = "wandb"
    project: str = "draftsmith"
    run_name: str | None = None


@dataclass
class DistillRecipeConfig:
    output_dir: str = "outputs/distill"
    device: str = "auto"  # auto | cpu | cuda
    model: ModelConfig = field(default_factory=ModelConfig)
    student: StudentConfig = field(default_factory=StudentConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    on_policy: OnPolicyConfig = field(default_factory=OnPolicyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self):
        divergence = self.loss.kind in KD_KINDS
        checks = [
            (self.student.init != "pretrained" or bool(self.student.model),
             "student.model is required with student.init: pretrained"),
            (self.student.layer_stride >= 1, "student.layer_stride must be >= 1"),
            (self.student.num_layers >= 1, "student.num_layers must be >= 1"),
            (0.0 < self.loss.beta < 1.0, "loss.beta must be in (0, 1)"),
            (self.loss.temperature > 0, "loss.temperature must be > 0"),
            (self.loss.ce_weight >= 0, "loss.ce_weight must be >= 0"),
            (not (self.data.feature_cache and self.loss.topk_tail == "bucket" and self.loss.temperature != 1.0),
             "loss.topk_tail: bucket needs loss.temperature 1 (use renormalize for another temperature)"),
            (not (self.data.feature_cache and not divergence),
             "data.feature_cache holds the target's logits: use it with a divergence loss.kind, not ce"),
            (0.0 <= self.on_policy.fraction <= 1.0, "on_policy.fraction must be in [0, 1]"),
            (self.on_policy.fraction == 0 or divergence,
             "on_policy needs a divergence loss.kind (the target scores the student's own samples)"),
            (self.on_policy.max_new_tokens >= 1 and self.on_policy.temperature >= 0,
             "on_policy.max_new_tokens must be >= 1 and on_policy.temperature >= 0"),
            (0.0 <= self.data.heldout_fraction < 1.0, "data.heldout_fraction must be in [0, 1)"),
            (self.data.max_length >= 2, "data.max_length must be >= 2"),
            (self.train.max_steps >= 1, "train.max_steps must be >= 1"),
            (self.train.batch_size >= 1 and self.train.grad_accum_steps >= 1,
             "train.batch_size and train.grad_accum_steps must be >= 1"),
            (self.train.checkpoint_every >= 1 and self.train.log_every >= 1,
             "train.checkpoint_every and train.log_every must be >= 1"),
            (self.lora.r >= 1, "lora.r must be >= 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    @property
    def online_teacher(self) -> bool:
        """The target model runs inside the training loop."""
        return (self.loss.kind in KD_KINDS and not self.data.feature_cache) or self.on_policy.fraction > 0


# ---------------------------------------------------------------------------------------------
# Students
# ---------------------------------------------------------------------------------------------


def load_tokenizer(spec: str):
    """The tokenizer of a zoo name / dir / hub id, or the TinyTokenizer of a `tiny:` model."""
    if spec.startswith(TINY_PREFIX):
        return None  # built with the tiny model (its vocab size is only known then)
    from transformers import AutoTokenizer

    from draftsmith.models.zoo import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(spec))


def load_pretrained_student(spec: str, dtype: torch.dtype):
    """(model, tokenizer) of a pretrained student; `tiny:<family>[:seed]` builds a tiny random one."""
    if spec.startswith(TINY_PREFIX):
        family, _, seed = spec[len(TINY_PREFIX):].partition(":")
        model = build_tiny_causal_lm(family, seed=int(seed or 0), dtype=dtype)
        return model, TinyTokenizer(model.config.vocab_size)
    from transformers import AutoModelForCausalLM

    from draftsmith.models.zoo import resolve_model_path

    path = resolve_model_path(spec)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return model, load_tokenizer(spec)


def shallow_student(target_model, num_layers: int, intermediate_size: int | None, seed: int):
    """The target's architecture with `num_layers` new decoder layers; embeddings, final norm and LM
    head copied from the target (same hidden size, so the token spaces line up from step 0)."""
    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = num_layers
    if intermediate_size is not None:
        config.intermediate_size = intermediate_size
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:num_layers])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        student = type(target_model)(config)
    with torch.no_grad():
        student.get_input_embeddings().weight.copy_(target_model.get_input_embeddings().weight)
        student.get_output_embeddings().weight.copy_(target_model.get_output_embeddings().weight)
        student.get_decoder().norm.weight.copy_(target_model.get_decoder().norm.weight)
    return student


class DistillTrainModule(nn.Module):
    """The student; returns its logits only at the selected positions (no (B, T, V) tensor)."""

    def __init__(self, student: nn.Module):
        super().__init__()
        self.student = student

    def forward(self, input_ids, attention_mask, rows, cols):
        """input_ids/attention_mask (B, T); rows/cols (N,) -> logits (N, V) float32."""
        hidden = self.student.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                            use_cache=False).last_hidden_state  # (B, T, H)
        return self.student.get_output_embeddings()(hidden[rows, cols]).float()


@torch.no_grad()
def teacher_logits_at(model, input_ids, attention_mask, rows, cols) -> torch.Tensor:
    """The target's logits (N, V) float32 at the selected positions."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return model.get_output_embeddings()(hidden[rows, cols]).float()


def lr_lambda(cfg: DistillRecipeConfig):
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
# Data
# ---------------------------------------------------------------------------------------------


def load_conversation_records(spec: str, tokenizer, max_length: int, limit: int | None, filter_wrong: bool,
                              model=None, seed: int = 0) -> tuple[list[dict], dict]:
    """Records of a source spec (`a + b` mixtures too); with `filter_wrong`, conversations that a
    data.regenerate checker marks wrong (GSM8K: final number != reference) are dropped."""
    stats = {"kept": 0, "wrong_answer": 0}
    if " + " in spec:
        records = []
        for part in spec.split(" + "):
            part_records, part_stats = load_conversation_records(part.strip(), tokenizer, max_length, limit,
                                                                 filter_wrong, model, seed)
            records += part_records
            for key, value in part_stats.items():
                stats[key] = stats.get(key, 0) + value
        return records, stats
    if spec.startswith(("records:", "synthetic:")) or not filter_wrong:
        records = load_records(spec, tokenizer=tokenizer, max_length=max_length, limit=limit, model=model, seed=seed)
        stats["kept"] = len(records)
        return records, stats
    from draftsmith.data.chat import render_and_mask
    from draftsmith.data.regenerate import CHECKERS
    from draftsmith.data.sources import load_source

    records = []
    for conv in load_source(spec, limit=limit):
        if not conv.has_response:
            continue
        check = CHECKERS.get(conv.source)
        if check is not None and check(conv) is False:
            stats["wrong_answer"] += 1
            continue
        record = render_and_mask(tokenizer, conv.messages, max_length=max_length)
        if sum(record["loss_mask"]) > 0:
            records.append(record)
    if not records:
        raise ValueError(f"data source {spec!r} gave no record with trainable tokens (after filtering {stats})")
    stats["kept"] = len(records)
    return records, stats


def load_cache_records(path: str, target_fingerprint: str | None, limit: int | None, max_length: int) -> list[dict]:
    """Every sequence of a data/features.py cache with its top-k teacher logits, in cache order."""
    from draftsmith.data.features import FeatureCacheMismatch, FeatureDataset

    dataset = FeatureDataset(path)
    index = dataset.index
    if not index["topk_logits"]:
        raise FeatureCacheMismatch(f"feature cache {path} stores no top-k logits (build it with --topk K)")
    if target_fingerprint is not None and index["vocab_fingerprint"] != target_fingerprint:
        raise FeatureCacheMismatch(f"feature cache {path} was built with {index['model']!r}, whose vocabulary differs "
                                   "from the target's")
    records = []
    for rec in dataset:
        n = min(max_length, len(rec["input_ids"]))
        records.append({"input_ids": rec["input_ids"][:n].tolist(), "loss_mask": rec["loss_mask"][:n].tolist(),
                        "topk_values": rec["topk_values"][:n], "topk_indices": rec["topk_indices"][:n].int(),
                        "logsumexp": rec["logsumexp"][:n]})
        if limit is not None and len(records) >= limit:
            break
    return [r for r in records if sum(r["loss_mask"][1:]) > 0]


def collate_distill(records: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """`train.common.collate` plus right-padded top-k teacher fields when the records carry them."""
    batch = collate(records, pad_id)
    if all("topk_values" in r for r in records):
        length, k = batch["input_ids"].shape[1], records[0]["topk_values"].shape[1]
        values = torch.zeros(len(records), length, k, dtype=records[0]["topk_values"].dtype)
        indices = torch.zeros(len(records), length, k, dtype=torch.long)
        lse = torch.zeros(len(records), length, dtype=torch.float32)
        for i, r in enumerate(records):
            n = len(r["input_ids"])
            values[i, :n], indices[i, :n], lse[i, :n] = r["topk_values"], r["topk_indices"], r["logsumexp"]
        batch.update(topk_values=values, topk_indices=indices, logsumexp=lse)
    return batch


# ---------------------------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------------------------


class DistillRecipe:
    """setup -> train -> save_checkpoint / save_final -> cleanup."""

    def __init__(self, cfg: DistillRecipeConfig):
        self.cfg = cfg
        self.output_dir = Path(cfg.output_dir)
        self.checkpoints_dir = self.output_dir / "checkpoints"
        self.final_dir = self.output_dir / "final"
        self.step = 0
        self.samples_seen = 0
        self.eval_before: dict | None = None
        self.last_eval: dict | None = None
        self.data_stats: dict = {}
        self.run_id = uuid.uuid4().hex[:8]
        self._resume_state: dict | None = None

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

        # The target: loaded when it teaches online or the student is built from it; else its tokenizer only.
        student_dtype = resolve_dtype(cfg.student.dtype)
        self.target = None
        if cfg.online_teacher or cfg.student.init != "pretrained" or cfg.model.target.startswith(TINY_PREFIX):
            self.target = load_target(cfg.model.target, dtype=cfg.model.dtype, device=acc.device,
                                      attn_implementation=cfg.model.attn_implementation)
            self.target.model.requires_grad_(False).eval()
            self.tokenizer = self.target.tokenizer
            target_vocab = self.target.model.config.vocab_size
        else:
            from transformers import AutoConfig

            from draftsmith.models.zoo import resolve_model_path

            self.tokenizer = load_tokenizer(cfg.model.target)
            target_vocab = AutoConfig.from_pretrained(resolve_model_path(cfg.model.target)).vocab_size
        self.target_fingerprint = vocab_fingerprint(self.tokenizer)

        if cfg.student.init == "pretrained":
            student, student_tokenizer = load_pretrained_student(cfg.student.model, student_dtype)
            check_same_tokenizer(self.tokenizer, student_tokenizer, what="student")
        elif cfg.student.init == "layers":
            from draftsmith.models.student import every_nth_layer, layer_subset_student

            layers = self.target.model.config.num_hidden_layers
            ids = cfg.student.layer_ids or every_nth_layer(layers, cfg.student.layer_stride)
            student = layer_subset_student(self.target.model, list(ids)).to(student_dtype)
            student.requires_grad_(True)
        else:
            student = shallow_student(self.target.model, cfg.student.num_layers, cfg.student.intermediate_size,
                                      cfg.student.seed).to(student_dtype)
        if student.config.vocab_size != target_vocab:
            raise ConfigError(f"the student's vocabulary has {student.config.vocab_size} logits, the target's "
                              f"{target_vocab}: token-level KD needs one logit per token of the shared tokenizer")
        student = student.to(acc.device)
        if cfg.student.init != "pretrained" and cfg.student.freeze_embeddings and not cfg.lora.enabled:
            student.get_input_embeddings().weight.requires_grad_(False)
            student.get_output_embeddings().weight.requires_grad_(False)
        if cfg.lora.enabled:
            from peft import LoraConfig as PeftLoraConfig, get_peft_model

            try:
                student = get_peft_model(student, PeftLoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                                 lora_dropout=cfg.lora.dropout, bias="none",
                                                                 target_modules=list(cfg.lora.target_modules)))
            except ValueError as err:
                raise ConfigError(f"lora.target_modules {cfg.lora.target_modules}: {err}") from err
        self.student_info = {"init": cfg.student.init, "model": cfg.student.model if cfg.student.init == "pretrained"
                             else None, "model_type": student.config.model_type,
                             "num_layers": student.config.num_hidden_layers,
                             "hidden_size": student.config.hidden_size,
                             "parameters": sum(p.numel() for p in student.parameters()),
                             "trainable_parameters": sum(p.numel() for p in student.parameters() if p.requires_grad)}
        if cfg.student.init == "layers":
            self.student_info["layer_ids"] = list(ids)

        self.pad_id = self._pad_id()
        if cfg.data.feature_cache:
            records = load_cache_records(cfg.data.feature_cache, self.target_fingerprint, cfg.data.limit,
                                         cfg.data.max_length)
            self.data_stats = {"kept": len(records), "feature_cache": cfg.data.feature_cache}
        else:
            records, self.data_stats = load_conversation_records(
                cfg.data.source, self.tokenizer, cfg.data.max_length, cfg.data.limit, cfg.data.filter_wrong,
                model=self.target.model if self.target is not None else None, seed=cfg.data.seed)
        self.train_records, self.heldout_records = split_heldout(records, cfg.data.heldout_fraction, cfg.data.seed,
                                                                 cfg.data.max_heldout)
        log.info("data: %d train / %d held-out records (%s)", len(self.train_records), len(self.heldout_records),
                 self.data_stats)

        params = [p for p in student.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the student has no trainable parameter (check lora.target_modules)")
        optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
                                      weight_decay=cfg.optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
        self.module, self.optimizer = acc.prepare(DistillTrainModule(student), optimizer)

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
            self.eval_before = self.last_eval = self.evaluate()
            self._log(self.last_eval)

    def _resume_path(self, resume: str | None) -> Path | None:
        if resume is None:
            return None
        if resume == "auto":
            found = load_latest_checkpoint(self.checkpoints_dir, quarantine=local_rank_zero())
            if found is None:
                log.warning("--resume: no checkpoint in %s, starting from scratch", self.checkpoints_dir)
                return None
            path, self._resume_state = found
            return path
        return Path(resume)

    def _pad_id(self) -> int:
        for value in (getattr(self.tokenizer, "pad_token_id", None), getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(value, int):
                return value
        return 0  # padded positions are masked out of attention and loss anyway

    def _student(self):
        return self.accelerator.unwrap_model(self.module).student

    def _trainable(self) -> dict[str, nn.Parameter]:
        module = self.accelerator.unwrap_model(self.module)
        return {name: p for name, p in module.named_parameters() if p.requires_grad}

    # -- data ---------------------------------------------------------------------------------

    def _is_on_policy(self, step: int) -> bool:
        fraction = self.cfg.on_policy.fraction
        if fraction <= 0:
            return False
        draw = torch.rand((), generator=torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + step))
        return bool(draw < fraction)

    @torch.no_grad()
    def _rollout(self, record: dict, seed: int) -> dict:
        """The record's prompt (tokens before the first trained token) + a student continuation."""
        cfg = self.cfg.on_policy
        mask = record["loss_mask"]
        prompt = record["input_ids"][: mask.index(1)] if 1 in mask else record["input_ids"][:-1]
        room = self.cfg.data.max_length - len(prompt)
        if room < 1:
            return {"input_ids": record["input_ids"], "loss_mask": record["loss_mask"]}
        student = self._student()
        was_training = student.training
        student.eval()
        eos = sorted(self.target.eos_token_ids) if self.target is not None else []
        ids = torch.tensor([prompt], device=self.accelerator.device)
        sampling = {"do_sample": True, "temperature": cfg.temperature, "top_k": 0, "top_p": 1.0} \
            if cfg.temperature > 0 else {"do_sample": False}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = student.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                   max_new_tokens=min(cfg.max_new_tokens, room), pad_token_id=self.pad_id,
                                   eos_token_id=eos or None, **sampling)
        student.train(was_training)
        continuation = out[0, len(prompt):].tolist()
        return {"input_ids": prompt + continuation, "loss_mask": [0] * len(prompt) + [1] * len(continuation)}

    def _micro_batches(self) -> tuple[list[dict[str, torch.Tensor]], bool]:
        """This process's micro-batches of the next optimizer step (fixed by samples_seen and step)."""
        cfg, acc = self.cfg, self.accelerator
        per_micro = cfg.train.batch_size
        total = per_micro * self.world * cfg.train.grad_accum_steps
        indices = batch_indices(len(self.train_records), self.samples_seen, total, cfg.data.seed)
        on_policy = self._is_on_policy(self.step)
        batches = []
        for micro in range(cfg.train.grad_accum_steps):
            start = (micro * self.world + acc.process_index) * per_micro
            records = [self.train_records[i] for i in indices[start:start + per_micro]]
            if on_policy:
                base = (cfg.train.seed * 1_000_003 + self.step) * 10_007 + start
                records = [self._rollout(r, base + j) for j, r in enumerate(records)]
            batches.append(collate_distill(records, self.pad_id))
        return batches, on_policy

    # -- loss ---------------------------------------------------------------------------------

    def _losses(self, batch: dict, normalizer, online: bool) -> dict:
        """Loss terms of one micro-batch: sums over its distilled positions + the scaled loss."""
        cfg = self.cfg
        device = self.accelerator.device
        batch = {name: t.to(device) for name, t in batch.items()}
        mask = kd_mask(batch["loss_mask"], batch["attention_mask"])  # (B, T)
        rows, cols = mask.nonzero(as_tuple=True)  # (N,), (N,)
        labels = batch["input_ids"][rows, cols + 1]  # (N,) the data's next tokens
        logits = self.module(batch["input_ids"], batch["attention_mask"], rows, cols)  # (N, V)
        ce = F.cross_entropy(logits, labels, reduction="sum")
        teacher_top1 = labels
        if cfg.loss.kind == "ce":
            loss, divergence = ce / normalizer, ce.detach()
        else:
            if online:
                teacher = teacher_logits_at(self.target.model, batch["input_ids"], batch["attention_mask"], rows, cols)
                out = kd_loss(logits, cfg.loss.kind, teacher_logits=teacher, beta=cfg.loss.beta,
                              temperature=cfg.loss.temperature, normalizer=normalizer)
                teacher_top1 = teacher.argmax(-1)
            else:
                if "topk_values" not in batch:
                    raise RuntimeError("offline top-k teacher asked for a batch without cached logits")
                top = {name: batch[name][rows, cols] for name in TOPK_FIELDS}
                out = kd_loss(logits, cfg.loss.kind, **top, beta=cfg.loss.beta, temperature=cfg.loss.temperature,
                              tail=cfg.loss.topk_tail, normalizer=normalizer)
                teacher_top1 = top["topk_indices"][:, 0]
            loss, divergence = out.loss, out.total
            if cfg.loss.ce_weight > 0:
                loss = loss + cfg.loss.ce_weight * ce / normalizer
        agree = (logits.detach().argmax(-1) == teacher_top1).sum()
        return {"loss": loss, "divergence": divergence, "ce": ce.detach(), "agree": agree,
                "tokens": torch.tensor(len(rows), device=device)}

    def train_step(self) -> dict:
        cfg, acc = self.cfg, self.accelerator
        micro_batches, on_policy = self._micro_batches()
        online = cfg.online_teacher and (on_policy or not cfg.data.feature_cache)
        count = torch.zeros((), device=acc.device)
        for batch in micro_batches:
            count += kd_mask(batch["loss_mask"], batch["attention_mask"]).sum().to(acc.device)
        count = acc.reduce(count, "sum") if self.world > 1 else count
        normalizer = count.clamp(min=1) / self.world  # DDP averages gradients over processes
        self.module.train()
        sums = torch.zeros(5, device=acc.device)  # loss, divergence, ce, agree, tokens
        for i, batch in enumerate(micro_batches):
            sync = i == len(micro_batches) - 1
            with nullcontext() if sync else acc.no_sync(self.module):
                terms = self._losses(batch, normalizer, online)
                acc.backward(terms["loss"])
            sums += torch.stack([terms["loss"].detach(), terms["divergence"], terms["ce"], terms["agree"].float(),
                                 terms["tokens"].float()])
        grad_norm = None
        if cfg.optim.max_grad_norm is not None:
            grad_norm = acc.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]],
                                            cfg.optim.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.samples_seen += cfg.train.batch_size * self.world * cfg.train.grad_accum_steps
        self.step += 1
        if self.world > 1:
            sums = acc.reduce(sums, "sum")
            sums[0] /= self.world
        check_finite(sums[0], self.step, "training loss", self.checkpoints_dir)
        if grad_norm is not None:
            check_finite(grad_norm, self.step, "gradient norm", self.checkpoints_dir)
        tokens = sums[4].clamp(min=1)
        metrics = {"train/loss": float(sums[0]), f"train/{cfg.loss.kind}": float(sums[1] / tokens),
                   "train/ce": float(sums[2] / tokens), "train/agreement": float(sums[3] / tokens),
                   "train/tokens": int(sums[4]), "train/on_policy": int(on_policy), "train/lr": lr,
                   "train/samples_seen": self.samples_seen}
        if grad_norm is not None:
            metrics["train/grad_norm"] = float(grad_norm)
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out divergence (or CE), CE on the data tokens, and top-1 agreement with the teacher
        (the student's argmax == the target's argmax; a proxy of greedy draft acceptance)."""
        cfg, acc = self.cfg, self.accelerator
        self.module.eval()
        sums = torch.zeros(4, dtype=torch.float64, device=acc.device)  # divergence, ce, agree, tokens
        online = cfg.loss.kind in KD_KINDS and not cfg.data.feature_cache
        size = cfg.eval.batch_size
        starts = list(range(0, len(self.heldout_records), size))
        for start, real in even_shard(starts, acc.process_index, self.world):  # same forward count on every rank
            batch = collate_distill(self.heldout_records[start:start + size], self.pad_id)
            terms = self._losses(batch, 1.0, online)
            if not real:
                continue
            sums += torch.stack([terms["divergence"], terms["ce"], terms["agree"].float(),
                                 terms["tokens"].float()]).double()
        if self.world > 1:
            sums = acc.reduce(sums, "sum")
        tokens = sums[3].clamp(min=1)
        return {f"eval/{cfg.loss.kind}": float(sums[0] / tokens), "eval/ce": float(sums[1] / tokens),
                "eval/agreement": float(sums[2] / tokens), "eval/tokens": int(sums[3])}

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
                log.info("step %d loss %.4f agreement %.3f", self.step, metrics["train/loss"],
                         metrics["train/agreement"])
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
                "eval_before": self.eval_before,
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
                                  f"unexpected {unexpected[:5]} (was it written with another student/lora config?)")
        if state["num_train_records"] != len(self.train_records):
            raise CheckpointError(f"checkpoint {path} was trained on {state['num_train_records']} records, this run has "
                                  f"{len(self.train_records)}: the data (source, limit, split, filter) changed")
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
        self.eval_before = state["eval_before"]
        rng = state["rng"]
        index = self.accelerator.process_index
        if len(rng) != self.world:
            log.warning("checkpoint has RNG states of %d processes, this run has %d: reusing process 0's",
                        len(rng), self.world)
            index = 0
        set_rng_state(rng[index])
        log.info("resumed from %s at step %d (%d samples seen)", path, self.step, self.samples_seen)

    def export_model(self):
        """A standalone copy of the student (LoRA merged) in the export dtype."""
        student = copy.deepcopy(self._student())
        if self.cfg.lora.enabled:
            student = student.merge_and_unload()
        student = student.to("cpu", resolve_dtype(self.cfg.export.dtype))
        student.requires_grad_(False)
        if self.target is not None:  # stop tokens of the target's generation config
            student.generation_config.eos_token_id = self.target.model.generation_config.eos_token_id
        return student

    def save_final(self) -> Path:
        """The student in HF format + tokenizer + manifest into output_dir/final, atomically."""
        acc = self.accelerator
        if self.last_eval is None:
            self.last_eval = self.evaluate()
        if acc.is_main_process:
            tmp = self.output_dir / ".tmp_final"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            student = self.export_model()
            student.save_pretrained(str(tmp))
            saved_tokenizer = hasattr(self.tokenizer, "save_pretrained")
            if saved_tokenizer:
                self.tokenizer.save_pretrained(str(tmp))
            (tmp / MANIFEST_FILE).write_text(json.dumps(self.manifest(saved_tokenizer), indent=2))
            save_config(self.cfg, tmp / "train_config.yaml")
            if self.final_dir.exists():
                shutil.rmtree(self.final_dir)
            os.replace(tmp, self.final_dir)
            log.info("saved %s", self.final_dir)
        acc.wait_for_everyone()
        return self.final_dir

    def manifest(self, saved_tokenizer: bool) -> dict:
        cfg = self.cfg
        return {
            "format": MANIFEST_FORMAT,
            "method": "distilled-student",
            "target": {"name": cfg.model.target, "vocab_fingerprint": self.target_fingerprint,
                       "vocab_size": len(self.tokenizer), "dtype": cfg.model.dtype},
            "student": {**self.student_info, "lora_merged": cfg.lora.enabled, "dtype": cfg.export.dtype,
                        "tokenizer_saved": saved_tokenizer},
            "training": {"steps": self.step, "samples_seen": self.samples_seen,
                         "data": {"source": None if cfg.data.feature_cache else cfg.data.source,
                                  "feature_cache": cfg.data.feature_cache, "filter_wrong": cfg.data.filter_wrong,
                                  "train_records": len(self.train_records),
                                  "heldout_records": len(self.heldout_records), "stats": self.data_stats},
                         "loss": config_to_dict(cfg.loss), "on_policy": config_to_dict(cfg.on_policy),
                         "lora": config_to_dict(cfg.lora) if cfg.lora.enabled else None,
                         "optim": config_to_dict(cfg.optim)},
            "eval": {"before": self.eval_before, "after": self.last_eval},
        }

    # -- cleanup ------------------------------------------------------------------------------

    def cleanup(self) -> dict:
        summary = {"step": self.step, "output_dir": str(self.output_dir), "eval_before": self.eval_before,
                   "eval_after": self.last_eval,
                   "final": str(self.final_dir) if self.step == self.cfg.train.max_steps else None}
        if self.cfg.logging.tracker != "none":
            self.accelerator.end_training()
        self.accelerator.free_memory()
        return summary


def main(cfg: DistillRecipeConfig, resume: str | None = None) -> dict:
    recipe = DistillRecipe(cfg)
    recipe.setup(resume)
    recipe.train()
    return recipe.cleanup()


def read_manifest(final_dir: str | Path) -> dict:
    path = Path(final_dir) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: not a train/distill.py export")
    doc = json.loads(path.read_text())
    if doc.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: format {doc.get('format')!r} is not {MANIFEST_FORMAT!r}")
    return doc


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Distil a small student LM toward the target (a draft model).")
    parser.add_argument("--config", required=True, help="YAML config (see train/configs/distill_*.yaml)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in output_dir/checkpoints (fresh start if none)")
    parser.add_argument("--resume-from", metavar="CHECKPOINT_DIR", default=None,
                        help="continue from this checkpoint directory (output_dir/checkpoints/step_<N>)")
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. train.max_steps=10")
    return parser.parse_args(argv)


def cli(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg = load_config(DistillRecipeConfig, args.config, args.overrides)
    summary = main(cfg, resume=args.resume_from or ("auto" if args.resume else None))
    print_summary(summary)
    return summary


if __name__ == "__main__":
    try:
        cli()
    except (ConfigError, CheckpointError, NonFiniteLossError) as err:
        sys.exit(f"error: {err}")
