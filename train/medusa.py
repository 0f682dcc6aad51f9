"""Medusa-1 / Medusa-2 recipe: K decoding heads on a target's final hidden state.

    accelerate launch train/medusa.py --config train/configs/medusa_tiny.yaml [--resume | --overwrite] [key.path=value ...]
    python train/medusa.py --config train/configs/medusa_tiny.yaml train.max_steps=10

Medusa-1: the target is frozen; only the heads (ResBlocks + an LM head copied from the target's)
train, on  sum_k lambda_k L_k  (train/losses.py: CE to the token k + 1 ahead, optionally mixed with
KL to the target's own distribution for that token). Medusa-2 (`medusa2.enabled`): LoRA adapters
(peft) on the target train jointly, adding `medusa2.lm_weight` x the target's next-token loss so
the target keeps its quality; its held-out LM loss is reported before and after.

Layout of `output_dir` (train/runtime.py: checkpoints, resume, lock, metrics):
    checkpoints/step_<N>/   trainable weights, optimizer, scheduler, RNG of every process, data position
    final/                  models.artifacts.save_medusa: medusa_heads.safetensors, config.json,
                            head_accuracy.json (held-out per-rank accuracies, for ARCA trees),
                            manifest.json, train_config.yaml, and target_lora/ for Medusa-2
    metrics.jsonl           every logged metric (also sent to W&B when `logging.tracker: wandb`)

`eval.decode.drafters.medusa.load_medusa_drafter(final_dir, target)` turns `final/` into the decoder's
drafter.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch import nn

from draftsmith.config import ConfigError, Unread, config_to_dict, option, refuse_unread, section
from draftsmith.data.records import collate, load_records, split_heldout
from draftsmith.eval.decode.drafters.medusa import MedusaDrafter
from draftsmith.models.artifacts import MANIFEST_FILE, load_medusa_heads, save_medusa, target_block
from draftsmith.models.medusa import HIDDEN_LAYER, MedusaConfig, MedusaHeads
from draftsmith.models.vocab import DraftHead, DraftVocab
from draftsmith.models.target import TargetModel
from draftsmith.train.distributed import even_shard
from draftsmith.train.losses import (IGNORE_INDEX, head_weights, lm_labels, lm_loss, medusa_labels, medusa_loss,
                                     rank_hits, teacher_positions)
from draftsmith.train.recipe import (RUN_UNREAD, DataConfig, EvalConfig, LoggingConfig, OptimConfig, RecipeBase, RunConfig,
                                    TrainConfig, measure_tau, pad_id_of, start_from_finished)
from draftsmith.train.runtime import TrainingRun, recipe_cli

LORA_DIR = "target_lora"


@dataclass
class HeadsConfig:
    num_heads: int = option(4, "K heads (head k predicts the token k + 1 ahead)", ge=1)
    num_layers: int = option(1, "ResBlocks per head", ge=0)
    train_lm_head: bool = option(True, "train each head's LM head (false: frozen copies of the target's; large "
                                       "vocabularies then need no optimizer state there)")
    draft_vocab: str | None = option(None, "a data.draft_vocab directory: the heads score only that subset")
    head: DraftHead = option(DraftHead.OWN, "own: an output layer per head (draft vocabulary rows of the "
                                            "target's, trained unless train_lm_head=false); slice: one frozen "
                                            "slice of the target's LM head shared by the heads (only indices saved)")
    init_from: str | None = option(None, "a train/medusa.py final/ directory whose heads this run starts from (same "
                                   "heads and draft vocabulary; a longer run, or other data, on top of a finished one)")


@dataclass
class LossConfig:
    head_decay: float = option(0.8, "lambda_k = head_decay^(k-1)", gt=0)
    head_weights: list[float] | None = option(None, "explicit lambda_1..lambda_K instead of the decay", ge=0)
    distill_weight: float = option(0.0, "0: hard labels; 1: KL to the target's distribution only", ge=0, le=1)
    distill_temperature: float = option(1.0, "temperature of the KL term", gt=0)


@dataclass
class Medusa2Config:
    enabled: bool = option(False, "train LoRA adapters on the target jointly (Medusa-2)")
    lm_weight: float = option(1.0, "weight of the target's own next-token loss in the joint loss", ge=0)
    lora_r: int = option(8, "LoRA rank", ge=1)
    lora_alpha: float = option(16.0, "LoRA alpha", gt=0)
    lora_dropout: float = option(0.05, "LoRA dropout", ge=0, lt=1)
    lora_target_modules: list[str] = option(factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
                                            help="modules that get adapters")
    lora_lr: float = option(1e-4, "learning rate of the adapters (Medusa-2's differential rate)", gt=0)
    heads_only_steps: int = option(0, "warm-up steps with the adapters' learning rate at 0", ge=0)


@dataclass
class MedusaEvalConfig(EvalConfig):
    topk: int = option(5, "logged as top-<topk> accuracy next to top-1", ge=1)
    max_rank: int = option(10, "per-rank accuracy table size (head_accuracy.json, ARCA trees)", ge=1)


@dataclass
class MedusaRecipeConfig(RunConfig):
    output_dir: str = option("outputs/medusa", "run directory (checkpoints/, final/, metrics.jsonl)")
    heads: HeadsConfig = section(HeadsConfig)
    loss: LossConfig = section(LossConfig)
    medusa2: Medusa2Config = section(Medusa2Config)
    data: DataConfig = section(DataConfig)
    optim: OptimConfig = section(OptimConfig)
    train: TrainConfig = section(TrainConfig)
    eval: MedusaEvalConfig = section(MedusaEvalConfig)
    logging: LoggingConfig = section(LoggingConfig)

    def __post_init__(self):
        checks = [
            (self.loss.head_weights is None or len(self.loss.head_weights) == self.heads.num_heads,
             "loss.head_weights must have heads.num_heads entries"),
            (self.data.max_length > self.heads.num_heads + 1, "data.max_length must exceed heads.num_heads + 1"),
            (self.eval.max_rank >= self.eval.topk, "eval.max_rank must be >= eval.topk"),
            (self.heads.head is not DraftHead.TARGET, "heads.head: own or slice (a Medusa head scores with its own "
             "rows or a slice of the target's)"),
            (self.medusa2.enabled or self.medusa2.heads_only_steps == 0,
             "medusa2.heads_only_steps needs medusa2.enabled"),
            (self.heads.init_from is None or (Path(self.heads.init_from) / MANIFEST_FILE).is_file(),
             f"heads.init_from={self.heads.init_from}: not a train/medusa.py final/ directory (no {MANIFEST_FILE})"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        refuse_unread(self, RUN_UNREAD + MEDUSA_UNREAD)


MEDUSA_UNREAD = [
    *[Unread(f"medusa2.{key}", lambda c: not c.medusa2.enabled, "read by medusa2.enabled=true")
      for key in ("lm_weight", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_lr")],
    Unread("loss.head_decay", lambda c: c.loss.head_weights is not None, "read when loss.head_weights is null"),
    Unread("loss.distill_temperature", lambda c: c.loss.distill_weight == 0, "read when loss.distill_weight > 0"),
]


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


def build_heads(cfg: MedusaRecipeConfig, target: TargetModel, device, vocab: DraftVocab | None) -> MedusaHeads:
    """Heads (float32) initialised from the target's LM head (its draft-vocabulary rows), or from a finished run's
    heads (`heads.init_from`); frozen output layers when not trained."""
    model = target.model
    config = MedusaConfig(hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size,
                          num_heads=cfg.heads.num_heads, num_layers=cfg.heads.num_layers,
                          draft_vocab_size=vocab.size if vocab else None, head=cfg.heads.head)
    heads = MedusaHeads(config).to(device)
    if vocab is not None:
        heads.set_vocab(vocab)
    heads.init_lm_heads(model.get_output_embeddings().weight)
    if cfg.heads.init_from:  # a resumed run then loads its checkpoint over these weights
        start_from(heads, cfg.heads.init_from, target)
    if not cfg.heads.train_lm_head and cfg.heads.head is DraftHead.OWN:  # re-initialised identically on resume
        for head in heads.medusa_head:
            head[-1].weight.requires_grad_(False)
    return heads


def start_from(heads: MedusaHeads, path: str, target: TargetModel) -> None:
    """Copy the heads of a finished run (`heads.init_from`) into `heads`; their layout and draft vocabulary must be
    this config's, and they must have been trained for this target."""
    source, _ = load_medusa_heads(path, device=next(heads.parameters()).device, target=target)
    start_from_finished(heads, source, source.config.to_dict(), heads.config.to_dict(), "heads", path,
                        "its heads differ")


def add_lora(cfg: Medusa2Config, model):
    """(the target with LoRA adapters, the adapters' parameters) for Medusa-2."""
    try:
        model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, bias="none",
                                                 lora_dropout=cfg.lora_dropout,
                                                 target_modules=list(cfg.lora_target_modules)))
    except ValueError as err:
        raise ConfigError(f"medusa2.lora_target_modules {cfg.lora_target_modules}: {err}") from err
    lora = [p for p in model.parameters() if p.requires_grad]
    if not lora:
        raise ConfigError(f"medusa2.lora_target_modules {cfg.lora_target_modules} matched no module")
    return model, lora


class MedusaRecipe(RecipeBase):
    """The Medusa behaviour; the run mechanics are the TrainingRun's."""

    def __init__(self, cfg: MedusaRecipeConfig, run: TrainingRun):
        self.cfg, self.run = cfg, run
        self.target = TargetModel.from_pretrained(cfg.target, dtype=cfg.dtype, device=run.device,
                                                  attn_implementation=cfg.attn_implementation)
        model = self.target.model
        self.pad_id = pad_id_of(self.target.tokenizer)
        records = load_records(cfg.data.source, tokenizer=self.target.tokenizer, max_length=cfg.data.max_length,
                               limit=cfg.data.limit, model=model, seed=cfg.data.seed)
        self.train_records, self.heldout_records = split_heldout(records, cfg.data.heldout_fraction, cfg.data.seed,
                                                                 cfg.data.max_heldout)
        run.log.info("data: %d train / %d held-out records from %s", len(self.train_records),
                     len(self.heldout_records), cfg.data.source)
        self.vocab = DraftVocab.load(cfg.heads.draft_vocab) if cfg.heads.draft_vocab else None
        heads = build_heads(cfg, self.target, run.device, self.vocab)
        model.requires_grad_(False)
        param_groups = [{"params": [p for p in heads.parameters() if p.requires_grad], "lr": cfg.optim.lr}]
        if cfg.medusa2.enabled:
            model, lora = add_lora(cfg.medusa2, model)
            param_groups.append({"params": lora, "lr": cfg.medusa2.lora_lr})
        self.weights = head_weights(cfg.heads.num_heads, cfg.loss.head_decay, cfg.loss.head_weights)
        holds = [0, cfg.medusa2.heads_only_steps] if cfg.medusa2.enabled else [0]
        run.setup_optimizer(MedusaTrainModule(model, heads, train_target=cfg.medusa2.enabled), param_groups, holds)

    def _forward(self, batch, want_logits: bool):
        """Labels and logits of one batch on the run's device: labels (K, N) in the heads' vocabulary
        (a token outside the draft vocabulary: IGNORE), and how many labels each head has in all."""
        k = self.cfg.heads.num_heads
        batch = {name: t.to(self.run.device) for name, t in batch.items()}
        labels = medusa_labels(batch["input_ids"], batch["loss_mask"], k)  # (K, B, T)
        rows, cols = (labels != IGNORE_INDEX).any(0).nonzero(as_tuple=True)  # (N,), (N,)
        want_teacher = self.cfg.loss.distill_weight > 0
        head_logits, target_logits, teacher = self.run.module(batch["input_ids"], batch["attention_mask"], rows,
                                                              cols, want_logits, want_teacher)
        labels = labels[:, rows, cols]
        all_labels = (labels != IGNORE_INDEX).sum(1)  # (K,): accuracy counts a token outside the subset as a miss
        if self.vocab is not None:
            draft = self.vocab.to_draft(labels.clamp(min=0))
            labels = torch.where((labels != IGNORE_INDEX) & (draft >= 0), draft, IGNORE_INDEX)
            teacher = None if teacher is None else teacher[..., self.vocab.draft_to_target.to(teacher.device)]
        return batch, labels, head_logits, target_logits, teacher, all_labels

    def _token_counts(self, batches: list[dict]) -> torch.Tensor:
        """Valid tokens per head (+ LM) of the whole optimizer step, all processes: (K + 1,)."""
        k, run = self.cfg.heads.num_heads, self.run
        counts = torch.zeros(k + 1, device=run.device)
        for batch in batches:
            counts[:-1] += (medusa_labels(batch["input_ids"], batch["loss_mask"], k) != IGNORE_INDEX
                            ).sum((1, 2)).to(run.device)
            counts[-1] += (lm_labels(batch["input_ids"], batch["loss_mask"]) != IGNORE_INDEX).sum().to(run.device)
        return run.reduce_sum(counts)

    def train_step(self) -> dict:
        cfg, run = self.cfg, self.run
        k, medusa2 = cfg.heads.num_heads, cfg.medusa2.enabled
        batches = [collate(records, self.pad_id) for _, records in run.micro_batch_records(self.train_records)]
        counts = self._token_counts(batches)
        norm = counts.clamp(min=1) / run.world  # DDP averages gradients over processes

        def backward_one(batch) -> torch.Tensor:
            if not medusa2:
                run.unwrapped().target.eval()
            batch, labels, head_logits, target_logits, teacher, _ = self._forward(batch, want_logits=medusa2)
            out = medusa_loss(head_logits, labels, self.weights, teacher, cfg.loss.distill_weight,
                              cfg.loss.distill_temperature, normalizer=norm[:-1])
            loss, lm = out.loss, torch.zeros((), device=run.device)
            if medusa2:
                lm = lm_loss(target_logits, lm_labels(batch["input_ids"], batch["loss_mask"]), norm[-1])
                loss = loss + cfg.medusa2.lm_weight * lm
            run.backward(loss)
            return torch.cat([torch.stack([loss.detach(), lm.detach(), batch["attention_mask"].sum().float()]),
                              out.head_ce, out.head_kl])

        sums = run.accumulate(batches, backward_one)  # loss, lm, tokens, ce_k, kl_k
        metrics = run.optimizer_step(sums[0], loss_tokens=float(counts[0]))  # head 1's labels: the answer tokens
        sums = run.reduce_sum(sums)
        metrics["train/tokens"] = int(sums[2])
        if medusa2:
            metrics["train/lm_loss"] = float(sums[1] / run.world)
            metrics["train/lora_lr"] = metrics.pop("train/lr_group1")
        for h in range(k):
            metrics[f"train/head{h + 1}_ce"] = float(sums[3 + h] / counts[h].clamp(min=1))
            if cfg.loss.distill_weight > 0:
                metrics[f"train/head{h + 1}_kl"] = float(sums[3 + k + h] / counts[h].clamp(min=1))
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out per-head CE, top-1 / top-k / per-rank accuracy, the target's LM loss (and tau)."""
        cfg, run = self.cfg, self.run
        k, max_rank = cfg.heads.num_heads, cfg.eval.max_rank
        run.module.eval()
        hits = torch.zeros(k, max_rank, dtype=torch.long, device=run.device)
        sums = torch.zeros(3 * k + 2, dtype=torch.float64, device=run.device)  # ce_k, tokens_k, lm ce, lm tokens, labels_k
        size = cfg.eval.batch_size
        starts = list(range(0, len(self.heldout_records), size))
        for start, real in even_shard(starts, run.accelerator.process_index, run.world):
            batch = collate(self.heldout_records[start:start + size], self.pad_id)
            batch, labels, head_logits, target_logits, _, all_labels = self._forward(batch, want_logits=True)
            if not real:
                continue
            sums[2 * k + 2:] += all_labels.double()
            hits += rank_hits(head_logits, labels, max_rank)
            out = medusa_loss(head_logits, labels, self.weights)
            sums[:k] += out.head_ce.double()
            sums[k:2 * k] += out.head_tokens.double()
            lm_target = lm_labels(batch["input_ids"], batch["loss_mask"])
            sums[2 * k] += float(lm_loss(target_logits, lm_target, normalizer=1.0))
            sums[2 * k + 1] += float((lm_target != IGNORE_INDEX).sum())
        hits, sums = run.reduce_sum(hits), run.reduce_sum(sums)
        return self._eval_metrics(hits, sums) | measure_tau(self, cfg.eval)

    def _eval_metrics(self, hits: torch.Tensor, sums: torch.Tensor) -> dict:
        k, topk = self.cfg.heads.num_heads, self.cfg.eval.topk
        tokens = sums[k:2 * k].clamp(min=1)
        rank_acc = (hits.double() / sums[2 * k + 2:].clamp(min=1)[:, None]).tolist()  # over every label
        ce = sums[:k] / tokens
        metrics = {"eval/lm_loss": float(sums[2 * k] / sums[2 * k + 1].clamp(min=1)),
                   "eval/tokens": int(sums[k:2 * k].max()),
                   "eval/loss": float((self.weights.double().to(ce.device) * ce).sum())}
        for h in range(k):
            metrics[f"eval/head{h + 1}_loss"] = float(ce[h])
            metrics[f"eval/head{h + 1}_top1"] = rank_acc[h][0]
            metrics[f"eval/head{h + 1}_top{topk}"] = sum(rank_acc[h][:topk])
        metrics["rank_accuracy"] = rank_acc
        return metrics

    def drafter(self) -> MedusaDrafter:
        """The heads as the decoder's drafter (the default tree), for tau at evaluation."""
        return MedusaDrafter(self.run.unwrapped().heads)  # draft-vocabulary ids mapped by the drafter

    def write_final(self, directory: Path) -> None:
        cfg, run = self.cfg, self.run
        module = run.unwrapped()
        accuracy = self._accuracy_doc(run.last_eval)
        if cfg.medusa2.enabled:
            module.target.save_pretrained(str(directory / LORA_DIR))
        save_medusa(module.heads, directory, target_block(self.target, cfg.target, [HIDDEN_LAYER], cfg.dtype),
                    accuracy, method="medusa-2" if cfg.medusa2.enabled else "medusa-1",
                    target_adapter=LORA_DIR if cfg.medusa2.enabled else None,
                    training={"command": run.command, "steps": run.step, "samples_seen": run.samples_seen, "data": cfg.data.source,
                              "loss": config_to_dict(cfg.loss), "medusa2": config_to_dict(cfg.medusa2)},
                    eval={"lm_loss_before": self.lm_loss_before, "lm_loss_after": run.last_eval["eval/lm_loss"],
                          "top1": accuracy["top1"], f"top{accuracy['topk']}": accuracy[f"top{accuracy['topk']}"],
                          "tau": run.last_eval.get("eval/tau"), "accuracy_file": "head_accuracy.json"})

    def _accuracy_doc(self, ev: dict) -> dict:
        k, topk = self.cfg.heads.num_heads, self.cfg.eval.topk
        return {"step": self.run.step, "tokens": ev["eval/tokens"], "topk": topk,
                "top1": [ev[f"eval/head{h + 1}_top1"] for h in range(k)],
                f"top{topk}": [ev[f"eval/head{h + 1}_top{topk}"] for h in range(k)],
                "rank_accuracy": ev["rank_accuracy"]}

    @property
    def lm_loss_before(self) -> float | None:
        return self.run.first_eval["eval/lm_loss"] if self.run.first_eval else None

    def summary(self) -> dict:
        last = self.run.last_eval
        return {"lm_loss_before": self.lm_loss_before, "lm_loss_after": last["eval/lm_loss"] if last else None}


def main(cfg: MedusaRecipeConfig, resume: str | None = None, overwrite: bool = False) -> dict:
    run = TrainingRun(cfg, resume=resume, overwrite=overwrite, logger_name="train.medusa")
    recipe = MedusaRecipe(cfg, run)
    run.train(recipe)
    return run.finish(recipe.summary())


def cli(argv: list[str] | None = None) -> int:
    return recipe_cli(MedusaRecipeConfig, main, "train/medusa.py",
                      "Train Medusa heads (Medusa-1, or Medusa-2 with LoRA on the target).", argv)


if __name__ == "__main__":
    sys.exit(cli())
