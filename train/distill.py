"""Distillation recipe: a small student LM (same tokenizer) trained toward the target, for use as a draft model.

    accelerate launch train/distill.py --config train/configs/distill_tiny.yaml [--resume | --overwrite] [key.path=value ...]
    python train/distill.py --config train/configs/distill_qwen_cpu.yaml train.max_steps=10

Student (`student.init`):
    pretrained  any HF causal LM (`student.model`: registry name, dir, hub id, or `tiny:<family>[,seed=N]`) whose
                tokenizer equals the target's token by token (`models.target.check_same_tokenizer`)
    layers      a copy of the target keeping every `student.layer_stride`-th decoder layer (+ the last;
                or `student.layer_ids`), `models/student.py`; `student.init_from` continues a finished lean
                student (export.lean) of the same target and layers, e.g. on another data set
    pruned      the same layer subset of the pretrained `student.model` (a layer-pruned copy of a smaller model
                of the family, e.g. 8 of the 0.5B's 24 layers)
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
Parallel drafting (`parallel.copies` k > 1, PARD): the student also learns to propose k tokens from one forward,
over k - 1 mask tokens after the context (train/parallel_draft.py); every loss above applies to every mask copy.

Layout of `output_dir`:
    checkpoints/step_<N>/   tensors.safetensors + state.json (trainable weights, optimizer, scheduler, RNG of
                            every process, data position); `--resume` continues exactly
    final/                  the student in plain HF `save_pretrained` format (LoRA merged; the adapters alone
                            in final/adapter/, PEFT's format, which `lora.adapter` continues from) + the target's
                            tokenizer + manifest.json (target id, vocab fingerprint, loss, data, eval);
                            usable as `generate(assistant_model=AutoModelForCausalLM.from_pretrained(final))`
                            and as `python -m draftsmith.eval.bench --draft <output_dir>/final`
    metrics.jsonl           every logged metric (also W&B when `logging.tracker: wandb`)
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from draftsmith.config import ConfigError, TextEnum, Unread, config_to_dict, option, refuse_unread, section
from draftsmith.data.features import FeatureCacheMismatch, FeatureDataset, cache_parts
from draftsmith.data.records import collate, load_records, spec_needs_model, split_heldout
from draftsmith.eval.decode.drafters.lm import LMDrafter
from draftsmith.models.artifacts import read_student_manifest, write_student_manifest
from draftsmith.models.engine import additive_mask
from draftsmith.models.student import (every_nth_layer, layer_subset_student, lean_student_spec, load_lean_weights,
                                       save_lean_student)
from draftsmith.models.target import (TargetModel, check_same_tokenizer, load_model_config, load_tokenizer,
                                      resolve_dtype, vocab_fingerprint)
from draftsmith.train.distributed import even_shard
from draftsmith.train.losses import Divergence, TopkTail, kd_loss, kd_mask
from draftsmith.train.parallel_draft import parallel_inputs, parallel_pair_count, parallel_positions
from draftsmith.train.recipe import (RUN_UNREAD, DataConfig, EvalConfig, LoggingConfig, OptimConfig, RecipeBase, RunConfig,
                                    TrainConfig, measure_tau, pad_id_of, record_prompt, refuse_differences)
from draftsmith.train.runtime import TrainingRun, recipe_cli
from draftsmith.train.student_parts import (DistillTrainModule, LoraConfig, add_lora, load_pretrained_student,
                                            shallow_student, teacher_logits_at, write_adapter)

TOPK_FIELDS = ("topk_values", "topk_indices", "logsumexp")


class StudentInit(TextEnum):
    PRETRAINED = "pretrained"  # student.model as it is
    LAYERS = "layers"  # a layer subset of the target
    PRUNED = "pruned"  # a layer subset of student.model
    SHALLOW = "shallow"  # new shallow layers between the target's embeddings and head


class DistillLoss(TextEnum):
    CE = "ce"  # sequence-level KD: cross-entropy on the target's regenerated tokens
    FKL = "fkl"
    RKL = "rkl"
    JSD = "jsd"
    TVD = "tvd"


# The divergence to the target's distribution each loss kind minimises (ce: none).
DIVERGENCE_OF = {DistillLoss.FKL: Divergence.FKL, DistillLoss.RKL: Divergence.RKL, DistillLoss.JSD: Divergence.JSD,
                 DistillLoss.TVD: Divergence.TVD}


@dataclass
class StudentConfig:
    init: StudentInit = option(
        StudentInit.PRETRAINED, "pretrained model, a layer subset of the target, a layer subset of the pretrained "
                                "model, or new shallow layers")
    model: str | None = option("qwen2.5-coder-0.5b-instruct",
                               "pretrained, pruned: registry name, dir, hub id or tiny:<family>")
    layer_stride: int = option(2, "layers, pruned: keep layers 0, n, 2n, ... and the last", ge=1)
    layer_ids: list[int] | None = option(None, "layers, pruned: explicit ids instead of the stride", ge=0)
    init_from: str | None = option(None, "layers: a finished lean student directory (export.lean) of this target "
                                         "and these layers to start from")
    num_layers: int = option(2, "shallow: number of freshly initialised decoder layers", ge=1)
    intermediate_size: int | None = option(None, "shallow: MLP width (null: the target's)", ge=1)
    freeze_embeddings: bool = option(True, "layers/pruned/shallow, full fine-tune: embeddings + LM head stay "
                                           "as copied")
    dtype: str = option("float32", "training dtype of the student")
    seed: int = option(0, "shallow: initialisation seed")


@dataclass
class LossConfig:
    kind: DistillLoss = option(DistillLoss.FKL, "ce: sequence-level KD; else a divergence to the target's "
                                                "distribution")
    beta: float = option(0.5, "generalized JSD(beta)", gt=0, lt=1)
    temperature: float = option(1.0, "softmax temperature of both distributions", gt=0)
    topk_tail: TopkTail = option(TopkTail.BUCKET, "top-k teachers (data.feature_cache): tail mass")
    ce_weight: float = option(0.0, "+ ce_weight x hard-label CE on the data tokens (with a divergence)", ge=0)


@dataclass
class DistillDataConfig(DataConfig):
    feature_cache: str | None = option(None, "data/features.py cache with top-k logits (or `dir_a + dir_b`): "
                                                 "records + offline teacher")
    filter_wrong: bool = option(True, "drop conversations a checker marks wrong (GSM8K final answers)")


@dataclass
class OnPolicyConfig:
    fraction: float = option(0.0, "share of optimizer steps whose batches the student generates", ge=0, le=1)
    max_new_tokens: int = option(64, "tokens the student generates per record", ge=1)
    temperature: float = option(1.0, "student sampling temperature (0: greedy)", ge=0)


@dataclass
class ParallelConfig:
    copies: int = option(1, "k > 1: train a parallel (PARD) draft model that proposes k tokens from one forward "
                            "(train/parallel_draft.py; decoded by the bench's lm-parallel:budget=k)", ge=1)
    mask_token: int | None = option(None, "the mask token id (saved as config.pard_token); null: the first "
                                          "embedding row the tokenizer does not use", ge=0)


@dataclass
class ExportConfig:
    dtype: str = option("float32", "dtype of the exported student weights")
    lean: bool = option(False, "student.init=layers, full fine-tune, frozen embeddings: write only the trained "
                               "layers and final norm (the rest is the target's, rebuilt at load: models/student.py)")


@dataclass
class DistillRecipeConfig(RunConfig):
    output_dir: str = option("outputs/distill", "run directory (checkpoints/, final/, metrics.jsonl)")
    target: str = option("qwen2.5-coder-1.5b-instruct", "the teacher: registry name, model directory, hub id or "
                                                         "tiny:<family>")
    student: StudentConfig = section(StudentConfig)
    lora: LoraConfig = section(LoraConfig)
    loss: LossConfig = section(LossConfig)
    data: DistillDataConfig = section(DistillDataConfig, max_heldout=64)
    on_policy: OnPolicyConfig = section(OnPolicyConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    optim: OptimConfig = section(OptimConfig, lr=1e-4)
    train: TrainConfig = section(TrainConfig)
    eval: EvalConfig = section(EvalConfig, batch_size=4)
    export: ExportConfig = section(ExportConfig)
    logging: LoggingConfig = section(LoggingConfig)

    def __post_init__(self):
        divergence = self.loss.kind in DIVERGENCE_OF
        checks = [
            (self.student.init not in PRETRAINED_INITS or bool(self.student.model),
             f"student.model is required with student.init: {self.student.init}"),
            (not (self.data.feature_cache and self.loss.topk_tail is TopkTail.BUCKET and self.loss.temperature != 1.0),
             "loss.topk_tail: bucket needs loss.temperature 1 (use renormalize for another temperature)"),
            (not (self.data.feature_cache and not divergence),
             "data.feature_cache holds the target's logits: use it with a divergence loss.kind, not ce"),
            (self.on_policy.fraction == 0 or divergence,
             "on_policy needs a divergence loss.kind (the target scores the student's own samples)"),
            (not self.export.lean or (self.student.init is StudentInit.LAYERS and self.student.freeze_embeddings
                                      and not self.lora.enabled and self.parallel.copies == 1),
             "export.lean needs student.init=layers with frozen embeddings, no LoRA and no parallel copies (the "
             "only students whose untrained part is the target's)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        refuse_unread(self, RUN_UNREAD + DISTILL_UNREAD)

    @property
    def online_teacher(self) -> bool:
        """The target model runs inside the training loop."""
        return (self.loss.kind in DIVERGENCE_OF and not self.data.feature_cache) or self.on_policy.fraction > 0


PRETRAINED_INITS = (StudentInit.PRETRAINED, StudentInit.PRUNED)  # student.init kinds that start from student.model
SUBSET_INITS = (StudentInit.LAYERS, StudentInit.PRUNED)  # student.init kinds that keep a subset of decoder layers

DISTILL_UNREAD = [
    *[Unread(f"student.{key}", lambda c: c.student.init not in SUBSET_INITS, "read by student.init=layers|pruned")
      for key in ("layer_stride", "layer_ids")],
    Unread("student.init_from", lambda c: c.student.init is not StudentInit.LAYERS, "read by student.init=layers"),
    *[Unread(f"student.{key}", lambda c: c.student.init is not StudentInit.SHALLOW, "read by student.init=shallow")
      for key in ("num_layers", "intermediate_size", "seed")],
    *[Unread(f"lora.{key}", lambda c: not c.lora.enabled, "read by lora.enabled=true")
      for key in ("r", "alpha", "dropout", "target_modules", "adapter")],
    Unread("lora.adapter_samples_seen", lambda c: not c.lora.adapter, "read with lora.adapter"),
    Unread("loss.beta", lambda c: c.loss.kind is not DistillLoss.JSD, "read by loss.kind=jsd"),
    Unread("loss.topk_tail", lambda c: not c.data.feature_cache, "read with data.feature_cache (top-k teachers)"),
    *[Unread(f"on_policy.{key}", lambda c: c.on_policy.fraction == 0, "read when on_policy.fraction > 0")
      for key in ("max_new_tokens", "temperature")],
    Unread("parallel.mask_token", lambda c: c.parallel.copies == 1, "read when parallel.copies > 1"),
]


# ---------------------------------------------------------------------------------------------
# Students
# ---------------------------------------------------------------------------------------------


def build_student(cfg: DistillRecipeConfig, target: TargetModel | None, tokenizer) -> tuple[nn.Module, dict]:
    """(student in the student dtype, its description for the manifest)."""
    dtype = resolve_dtype(cfg.student.dtype)
    init = cfg.student.init
    info = {"init": init, "model": cfg.student.model if init in PRETRAINED_INITS else None}
    if init in PRETRAINED_INITS:
        student, student_tokenizer = load_pretrained_student(cfg.student.model, dtype)
        check_same_tokenizer(tokenizer, student_tokenizer, what="student")
    if init in SUBSET_INITS:
        source = student if init is StudentInit.PRUNED else target.model
        ids = list(cfg.student.layer_ids or every_nth_layer(source.config.num_hidden_layers, cfg.student.layer_stride))
        student = layer_subset_student(source, ids).to(dtype).requires_grad_(True)
        info["layer_ids"] = ids
        if cfg.student.init_from:
            ours = {"target": cfg.target, "layer_ids": ids}
            continue_lean_student(student, cfg.student.init_from, ours)
            info["init_from"] = cfg.student.init_from
    elif init is StudentInit.SHALLOW:
        student = shallow_student(target.model, cfg.student.num_layers, cfg.student.intermediate_size,
                                  cfg.student.seed).to(dtype)
    if init is not StudentInit.PRETRAINED and cfg.student.freeze_embeddings and not cfg.lora.enabled:
        student.get_input_embeddings().weight.requires_grad_(False)
        student.get_output_embeddings().weight.requires_grad_(False)
    if cfg.lora.enabled:
        student = add_lora(cfg.lora, student)
    info.update(model_type=student.config.model_type, num_layers=student.config.num_hidden_layers,
                hidden_size=student.config.hidden_size, parameters=sum(p.numel() for p in student.parameters()),
                trainable_parameters=sum(p.numel() for p in student.parameters() if p.requires_grad))
    return student, info


def continue_lean_student(student: nn.Module, path: str, ours: dict) -> None:
    """Load a finished lean student's weights into `student`; its target and layer ids (`ours`) must be this run's."""
    option = f"student.init_from={path}"
    spec = lean_student_spec(path)
    if spec is None:
        raise ConfigError(f"{option}: not a lean student directory (a finished run's final/ or snapshot written "
                          f"with export.lean)")
    refuse_differences(option, "its student differs", {key: spec.get(key) for key in ours}, ours)
    load_lean_weights(student, path, spec)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_cache_records(spec: str, target_fingerprint: str | None, limit: int | None, max_length: int) -> list[dict]:
    """Every sequence of a data/features.py cache (or of several joined by ` + `) with its top-k teacher
    logits, in cache order; at most `limit` in all."""
    records = []
    for path in cache_parts(spec):
        records.extend(_cache_part_records(path, target_fingerprint, max_length,
                                           None if limit is None else limit - len(records)))
        if limit is not None and len(records) >= limit:
            break
    return [r for r in records if sum(r["loss_mask"][1:]) > 0]


def _cache_part_records(path: str, target_fingerprint: str | None, max_length: int, limit: int | None) -> list[dict]:
    dataset = FeatureDataset(path)
    index = dataset.index
    if not index["topk_logits"]:
        raise FeatureCacheMismatch(f"feature cache {path} stores no top-k logits (build it with topk_logits=K)")
    if target_fingerprint is not None and index["vocab_fingerprint"] != target_fingerprint:
        raise FeatureCacheMismatch(f"feature cache {path} was built with {index['model']!r}, whose vocabulary differs "
                                   "from the target's")
    records = []
    for rec in dataset:
        if limit is not None and len(records) >= limit:
            break
        n = min(max_length, len(rec["input_ids"]))
        records.append({"input_ids": rec["input_ids"][:n].tolist(), "loss_mask": rec["loss_mask"][:n].tolist(),
                        "topk_values": rec["topk_values"][:n], "topk_indices": rec["topk_indices"][:n].int(),
                        "logsumexp": rec["logsumexp"][:n]})
    return records


def collate_distill(records: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """`data.records.collate` plus right-padded top-k teacher fields when the records carry them."""
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


class DistillRecipe(RecipeBase):
    """The distillation behaviour; the run mechanics are the TrainingRun's."""

    def __init__(self, cfg: DistillRecipeConfig, run: TrainingRun):
        self.cfg, self.run = cfg, run
        self._load_target()
        student, self.student_info = build_student(cfg, self.target, self.tokenizer)
        if student.config.vocab_size != self.target_vocab:
            raise ConfigError(f"the student's vocabulary has {student.config.vocab_size} logits, the target's "
                              f"{self.target_vocab}: token-level KD needs one logit per token of the shared tokenizer")
        self.mask_token = self._parallel_mask_token(student) if cfg.parallel.copies > 1 else None
        student = student.to(run.device)
        self.pad_id = pad_id_of(self.tokenizer)
        self._load_data()
        params = [p for p in student.parameters() if p.requires_grad]
        if not params:
            raise ConfigError("the student has no trainable parameter (check lora.target_modules)")
        run.setup_optimizer(DistillTrainModule(student), [{"params": params, "lr": cfg.optim.lr}])
        if cfg.lora.adapter:  # the data order goes on where the adapter's run stopped (a resume overrides it)
            run.samples_seen = cfg.lora.adapter_samples_seen

    def _parallel_mask_token(self, student) -> int:
        """parallel.mask_token, or the first embedding row the tokenizer never produces; written into the
        student's config as `pard_token` (PARD's name), where the lm-parallel drafter reads it."""
        rows, used = student.get_input_embeddings().weight.shape[0], len(self.tokenizer)
        token = self.cfg.parallel.mask_token if self.cfg.parallel.mask_token is not None else used
        if token >= rows:
            raise ConfigError(f"parallel.mask_token: {token} is not a row of the student's {rows} embeddings"
                              + (" (the tokenizer uses every row: give an id to repurpose)" if token == used else ""))
        student.config.pard_token = token
        return token

    def _load_target(self) -> None:
        """The target model when it teaches online, the student is built from it, or tau is measured;
        else its tokenizer and config only."""
        cfg = self.cfg
        self.target = None
        needs_model = spec_needs_model(cfg.data.source) and not cfg.data.feature_cache
        if (cfg.online_teacher or cfg.student.init is not StudentInit.PRETRAINED or cfg.eval.tau_prompts > 0
                or needs_model):
            self.target = TargetModel.from_pretrained(cfg.target, dtype=cfg.dtype, device=self.run.device,
                                                      attn_implementation=cfg.attn_implementation)
            self.target.model.requires_grad_(False).eval()
            self.tokenizer, self.target_vocab = self.target.tokenizer, self.target.model.config.vocab_size
        else:
            self.tokenizer = load_tokenizer(cfg.target)
            self.target_vocab = load_model_config(cfg.target).vocab_size
        self.target_fingerprint = vocab_fingerprint(self.tokenizer)

    def _load_data(self) -> None:
        cfg = self.cfg
        if cfg.data.feature_cache:
            records = load_cache_records(cfg.data.feature_cache, self.target_fingerprint, cfg.data.limit,
                                         cfg.data.max_length)
            self.data_stats = {"kept": len(records), "feature_cache": cfg.data.feature_cache}
        else:
            self.data_stats = {"kept": 0, "wrong_answer": 0}
            records = load_records(cfg.data.source, tokenizer=self.tokenizer, max_length=cfg.data.max_length,
                                   limit=cfg.data.limit, model=self.target.model if self.target is not None else None,
                                   seed=cfg.data.seed, filter_wrong=cfg.data.filter_wrong, stats=self.data_stats)
        self.train_records, self.heldout_records = split_heldout(records, cfg.data.heldout_fraction, cfg.data.seed,
                                                                 cfg.data.max_heldout)
        self.run.log.info("data: %d train / %d held-out records (%s)", len(self.train_records),
                          len(self.heldout_records), self.data_stats)

    def _student(self):
        return self.run.unwrapped().student

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
        prompt = record_prompt(record)
        room = self.cfg.data.max_length - len(prompt)
        if room < 1:
            return {"input_ids": record["input_ids"], "loss_mask": record["loss_mask"]}
        student = self._student()
        was_training = student.training
        student.eval()
        eos = sorted(self.target.eos_token_ids) if self.target is not None else []
        ids = torch.tensor([prompt], device=self.run.device)
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
        run = self.run
        on_policy = self._is_on_policy(run.step)
        batches = []
        for start, records in run.micro_batch_records(self.train_records):
            if on_policy:
                base = (self.cfg.train.seed * 1_000_003 + run.step) * 10_007 + start
                records = [self._rollout(r, base + j) for j, r in enumerate(records)]
            batches.append(collate_distill(records, self.pad_id))
        return batches, on_policy

    # -- loss ---------------------------------------------------------------------------------

    def _losses(self, batch: dict, normalizer, online: bool) -> dict:
        """Loss terms of one micro-batch: sums over its distilled positions + the scaled loss."""
        cfg = self.cfg
        device = self.run.device
        batch = {name: t.to(device) for name, t in batch.items()}
        mask = kd_mask(batch["loss_mask"], batch["attention_mask"])  # (B, T)
        rows, cols = mask.nonzero(as_tuple=True)  # (N,), (N,)
        labels = batch["input_ids"][rows, cols + 1]  # (N,) the data's next tokens
        logits, source, copy = self._student_logits(batch, rows, cols)  # (N', V); pair i: labels of source[i]
        pick = (lambda t: t) if source is None else (lambda t: t[source])  # ordinary students: no copy
        labels = pick(labels)
        ce = F.cross_entropy(logits, labels, reduction="sum")
        teacher_top1 = labels
        if cfg.loss.kind is DistillLoss.CE:
            loss, divergence = ce / normalizer, ce.detach()
        else:
            if online:
                with self.run.autocast():  # the student's mixed precision (bf16: ~3x faster on AVX-512 BF16)
                    teacher = teacher_logits_at(self.target.model, batch["input_ids"], batch["attention_mask"],
                                                rows, cols)
                teacher = pick(teacher)
                out = kd_loss(logits, DIVERGENCE_OF[cfg.loss.kind], teacher_logits=teacher, beta=cfg.loss.beta,
                              temperature=cfg.loss.temperature, normalizer=normalizer)
                teacher_top1 = teacher.argmax(-1)
            else:
                if "topk_values" not in batch:
                    raise ConfigError("offline top-k teacher asked for a batch without cached logits")
                top = {name: pick(batch[name][rows, cols]) for name in TOPK_FIELDS}
                out = kd_loss(logits, DIVERGENCE_OF[cfg.loss.kind], **top, beta=cfg.loss.beta,
                              temperature=cfg.loss.temperature, tail=cfg.loss.topk_tail, normalizer=normalizer)
                teacher_top1 = top["topk_indices"][:, 0]
            loss, divergence = out.loss, out.total
            if cfg.loss.ce_weight > 0:
                loss = loss + cfg.loss.ce_weight * ce / normalizer
        hits = logits.detach().argmax(-1) == teacher_top1
        copies = self.cfg.parallel.copies
        return {"loss": loss, "divergence": divergence, "ce": ce.detach(), "agree": hits.sum(),
                "tokens": torch.tensor(len(labels), device=device),
                "agree_by_copy": torch.zeros(copies, device=device).index_add_(0, copy, hits.float()),
                "tokens_by_copy": torch.bincount(copy, minlength=copies).float()}

    def _student_logits(self, batch: dict, rows: torch.Tensor, cols: torch.Tensor):
        """The student's logits at the trained pairs: those of copy 0, and with parallel.copies > 1 those of
        every mask copy too (train/parallel_draft.py); with the index of the copy-0 pair each one learns (None:
        copy 0 only, pair i learns pair i's labels) and the copy of each (0: the sequence, j: the j-th mask)."""
        copies = self.cfg.parallel.copies
        if copies == 1:
            logits = self.run.module(batch["input_ids"], batch["attention_mask"], rows, cols)
            return logits, None, torch.zeros_like(rows)
        layout = parallel_inputs(batch["input_ids"], batch["attention_mask"], copies, self.mask_token)
        layout_rows, layout_cols, source, copy = parallel_positions(rows, cols, batch["input_ids"].shape[1], copies)
        mask = additive_mask(layout.allowed, self._student().dtype)
        return self.run.module(layout.input_ids, mask, layout_rows, layout_cols, layout.position_ids), source, copy


    def train_step(self) -> dict:
        cfg, run = self.cfg, self.run
        batches, on_policy = self._micro_batches()
        online = cfg.online_teacher and (on_policy or not cfg.data.feature_cache)
        count = torch.zeros((), device=run.device)
        for batch in batches:
            count += parallel_pair_count(kd_mask(batch["loss_mask"], batch["attention_mask"]),
                                         cfg.parallel.copies).to(run.device)
        normalizer = run.reduce_sum(count).clamp(min=1) / run.world  # DDP averages gradients over processes

        def backward_one(batch) -> torch.Tensor:
            terms = self._losses(batch, normalizer, online)
            run.backward(terms["loss"])
            return torch.stack([terms["loss"].detach(), terms["divergence"], terms["ce"], terms["agree"].float(),
                                terms["tokens"].float()])

        sums = run.accumulate(batches, backward_one)  # loss, divergence, ce, agree, tokens (this process)
        totals = run.reduce_sum(sums.clone())
        metrics = run.optimizer_step(sums[0], float(totals[4]))  # totals[4]: the step's loss-bearing data tokens
        tokens = totals[4].clamp(min=1)
        metrics.update({f"train/{cfg.loss.kind}": float(totals[1] / tokens), "train/ce": float(totals[2] / tokens),
                        "train/agreement": float(totals[3] / tokens), "train/tokens": int(totals[4]),
                        "train/on_policy": int(on_policy)})
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out divergence (or CE), CE on the data tokens, top-1 agreement with the teacher (the
        student's argmax == the target's argmax; a proxy of greedy draft acceptance), and tau."""
        cfg, run = self.cfg, self.run
        run.module.eval()
        sums = torch.zeros(4, dtype=torch.float64, device=run.device)  # divergence, ce, agree, tokens
        copies = cfg.parallel.copies
        by_copy = torch.zeros(2, copies, dtype=torch.float64, device=run.device)  # agree, tokens per copy
        online = cfg.loss.kind in DIVERGENCE_OF and not cfg.data.feature_cache
        size = cfg.eval.batch_size
        starts = list(range(0, len(self.heldout_records), size))
        for start, real in even_shard(starts, run.accelerator.process_index, run.world):
            terms = self._losses(collate_distill(self.heldout_records[start:start + size], self.pad_id), 1.0, online)
            if real:
                sums += torch.stack([terms["divergence"], terms["ce"], terms["agree"].float(),
                                     terms["tokens"].float()]).double()
                by_copy += torch.stack([terms["agree_by_copy"], terms["tokens_by_copy"]]).double()
        sums, by_copy = run.reduce_sum(sums), run.reduce_sum(by_copy)
        tokens = sums[3].clamp(min=1)
        metrics = {f"eval/{cfg.loss.kind}": float(sums[0] / tokens), "eval/ce": float(sums[1] / tokens),
                   "eval/agreement": float(sums[2] / tokens), "eval/tokens": int(sums[3])}
        if copies > 1:  # the sequence (copy 0) and each mask: the j-th mask proposes the (j + 1)-th draft token
            metrics.update({f"eval/agreement_copy{copy}": float(by_copy[0, copy] / by_copy[1, copy].clamp(min=1))
                            for copy in range(copies)})
        return metrics | measure_tau(self, cfg.eval)

    def drafter(self) -> LMDrafter:
        """The student as a chain drafter of 4 tokens (the bench's lm-chain), for tau at evaluation; a parallel
        student drafts its k tokens from one forward (lm-parallel:budget=k)."""
        if self.cfg.parallel.copies > 1:
            return LMDrafter(self._student(), self.tokenizer, mode="parallel", budget=self.cfg.parallel.copies,
                             name="student")
        return LMDrafter(self._student(), self.tokenizer, mode="chain", budget=4, name="student")

    # -- final --------------------------------------------------------------------------------

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


    def write_final(self, directory: Path) -> None:
        """The student in HF format (LoRA merged) + the target's tokenizer + manifest."""
        cfg, run = self.cfg, self.run
        if cfg.export.lean:
            save_lean_student(self._student(), directory, cfg.target, self.student_info["layer_ids"],
                              resolve_dtype(cfg.export.dtype))
        else:
            self.export_model().save_pretrained(str(directory))
        if cfg.lora.enabled:
            base = cfg.student.model if cfg.student.init is StudentInit.PRETRAINED else None
            write_adapter(self._student(), directory / "adapter", resolve_dtype(cfg.export.dtype), base)
        saved_tokenizer = hasattr(self.tokenizer, "save_pretrained") and not cfg.export.lean
        if saved_tokenizer:
            self.tokenizer.save_pretrained(str(directory))
        target = {"name": cfg.target, "vocab_fingerprint": self.target_fingerprint, "vocab_size": len(self.tokenizer),
                  "dtype": cfg.dtype, "hidden_layers": []}
        data = {"source": None if cfg.data.feature_cache else cfg.data.source, "feature_cache": cfg.data.feature_cache,
                "filter_wrong": cfg.data.filter_wrong, "train_records": len(self.train_records),
                "heldout_records": len(self.heldout_records), "stats": self.data_stats}
        write_student_manifest(
            directory, target,
            student={**self.student_info, "lora_merged": cfg.lora.enabled, "dtype": cfg.export.dtype,
                     "tokenizer_saved": saved_tokenizer},
            training={"command": run.command, "steps": run.step, "samples_seen": run.samples_seen, "data": data,
                      "loss": config_to_dict(cfg.loss), "on_policy": config_to_dict(cfg.on_policy),
                      "lora": config_to_dict(cfg.lora) if cfg.lora.enabled else None,
                      "optim": config_to_dict(cfg.optim)},
            eval={"before": run.first_eval, "after": run.last_eval})

    def summary(self) -> dict:
        return {"eval_before": self.run.first_eval, "eval_after": self.run.last_eval}


def main(cfg: DistillRecipeConfig, resume: str | None = None, overwrite: bool = False) -> dict:
    run = TrainingRun(cfg, resume=resume, overwrite=overwrite, logger_name="train.distill")
    recipe = DistillRecipe(cfg, run)
    run.train(recipe)
    return run.finish(recipe.summary())


def read_manifest(final_dir: str | Path) -> dict:
    """The manifest of a train/distill.py final/ directory."""
    manifest = read_student_manifest(final_dir)
    if manifest is None:
        raise ConfigError(f"{Path(final_dir)} holds no distillation manifest: not a train/distill.py final/")
    return manifest


def cli(argv: list[str] | None = None) -> int:
    return recipe_cli(DistillRecipeConfig, main, "train/distill.py",
                      "Distil a small student LM toward the target (a draft model).", argv)


if __name__ == "__main__":
    sys.exit(cli())
