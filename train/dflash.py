"""DFlash recipe: a block drafter (models/dflash.py) trained on the target's own distributions.

    accelerate launch train/dflash.py --config train/configs/dflash_tiny.yaml [--resume | --overwrite] [key.path=value ...]
    python train/dflash.py --config train/configs/dflash_smollm2_curve.yaml train.max_steps=10

The target runs in the loop on every batch (nothing cached) and gives both the drafter's input (its hidden states
at `drafter.target_layer_ids`) and its teacher (the target's next-token distribution). Per record,
`loss.anchors` answer positions a are drawn; the block [x_a, mask, ..., mask] at positions a..a+B-1 sees the
context before a and its own block, and block position k learns the target's distribution for the token at a + k
(cross-entropy to it: forward KL up to the target's entropy), weighted by exp(-(k - 1) / gamma) (DFlash's decaying
weights: an early miss ends the accepted prefix, so early positions count most). Only the drafter trains; its
embedding and LM head are the target's.

Layout of `output_dir` (train/runtime.py: checkpoints, resume, lock, metrics):
    checkpoints/step_<N>/   the drafter's weights, optimizer, scheduler, RNG of every process, data position
    final/                  models.artifacts.save_dflash: dflash.safetensors (z-lab's names), config.json,
                            manifest.json (held-out acceptance per block position), train_config.yaml
    metrics.jsonl           every logged metric (also sent to W&B when `logging.tracker: wandb`)

`eval.decode.drafters.dflash.load_dflash_drafter(final_dir, target)` turns `final/` into the decoder's drafter;
`scripts/export.py` writes it for llama.cpp (draft-dflash) and speculators (models/export_dflash.py).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from draftsmith.config import ConfigError, Unread, config_to_dict, option, refuse_unread, section
from draftsmith.data.records import collate, load_records, split_heldout
from draftsmith.eval.decode.drafters.dflash import DFlashDrafter
from draftsmith.models.artifacts import load_dflash, save_dflash, target_block
from draftsmith.models.dflash import DFlashConfig, DFlashModel, evenly_spaced_layers
from draftsmith.models.target import TargetModel
from draftsmith.train.distributed import even_shard
from draftsmith.train.recipe import (RUN_UNREAD, DataConfig, EvalConfig, LoggingConfig, OptimConfig, RecipeBase,
                                    RunConfig, TrainConfig, measure_tau, pad_id_of, start_from_finished)
from draftsmith.train.runtime import TrainingRun, recipe_cli


@dataclass
class DrafterConfig:
    num_layers: int = option(3, "draft decoder layers (the target's width)", ge=1)
    block_size: int = option(8, "tokens per block: the root and block_size - 1 proposals", ge=2)
    target_layer_ids: list[int] | None = option(None, "target decoder layers whose outputs the drafter reads "
                                                      "(null: num_target_layers evenly spaced)", ge=0)
    num_target_layers: int = option(5, "layers read when target_layer_ids is null", ge=1)
    mask_token_id: int | None = option(None, "the block's mask token (null: the first embedding row the "
                                             "tokenizer does not use)", ge=0)
    init_from: str | None = option(None, "a finished train/dflash.py snapshot or final/ of this target and layout "
                                         "whose weights this run starts from (e.g. continued on other data)")


@dataclass
class DFlashLossConfig:
    anchors: int = option(64, "anchored blocks per record (fewer where the answer is shorter)", ge=1)
    gamma: float = option(4.0, "block position k weighs exp(-(k - 1) / gamma) (DFlash: 4 for blocks of 8, 7 for "
                                "16)", gt=0)


@dataclass
class DFlashRecipeConfig(RunConfig):
    output_dir: str = option("outputs/dflash", "run directory (checkpoints/, final/, metrics.jsonl)")
    drafter: DrafterConfig = section(DrafterConfig)
    loss: DFlashLossConfig = section(DFlashLossConfig)
    data: DataConfig = section(DataConfig)
    optim: OptimConfig = section(OptimConfig, lr=6e-4)
    train: TrainConfig = section(TrainConfig)
    eval: EvalConfig = section(EvalConfig)
    logging: LoggingConfig = section(LoggingConfig)

    def __post_init__(self):
        if self.data.max_length <= self.drafter.block_size:
            raise ConfigError("data.max_length must exceed drafter.block_size")
        if self.drafter.target_layer_ids is not None and len(set(self.drafter.target_layer_ids)) != len(
                self.drafter.target_layer_ids):
            raise ConfigError(f"drafter.target_layer_ids: {self.drafter.target_layer_ids} repeats a layer")
        refuse_unread(self, RUN_UNREAD + DFLASH_UNREAD)


DFLASH_UNREAD = [Unread("drafter.num_target_layers", lambda c: c.drafter.target_layer_ids is not None,
                        "read when drafter.target_layer_ids is null")]


def drafter_config(cfg: DrafterConfig, target: TargetModel) -> DFlashConfig:
    """The drafter's sizes from the target's, its layers and mask token checked against the target."""
    config, layers = target.config, target.num_layers
    ids = cfg.target_layer_ids or evenly_spaced_layers(layers, cfg.num_target_layers)
    if max(ids) >= layers - 1:
        raise ConfigError(f"drafter.target_layer_ids: {ids}: the target's decoder layers are 0..{layers - 1}, and "
                          f"the last one's output is not a layer input llama.cpp can hand over; use ids below "
                          f"{layers - 1}")
    rows, used = target.model.get_input_embeddings().weight.shape[0], len(target.tokenizer)
    mask = cfg.mask_token_id if cfg.mask_token_id is not None else used
    if mask >= rows:
        raise ConfigError(f"drafter.mask_token_id: {mask} is not a row of the target's {rows} embeddings"
                          + (" (the tokenizer uses every row: give a rarely used special token's id)"
                             if mask == used else ""))
    return DFlashConfig.from_target(config, cfg.num_layers, cfg.block_size, ids, mask)


def start_from(drafter: DFlashModel, path: str, target: TargetModel) -> None:
    """Copy a finished run's drafter (`drafter.init_from`, trained for this target) into `drafter`; its layout must be
    this config's, else one line naming what differs."""
    source, _ = load_dflash(path, target=target, device=next(drafter.parameters()).device)
    start_from_finished(drafter, source, source.config.to_dict(), drafter.config.to_dict(), "drafter", path,
                        "its drafter differs")


def anchor_positions(loss_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the answer positions whose next token is an answer token too (where a block may start)."""
    loss = loss_mask.bool()
    return torch.cat([loss[:, :-1] & loss[:, 1:], torch.zeros_like(loss[:, :1])], 1)


def draw_anchors(loss_mask: torch.Tensor, count: int, generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per record, up to `count` of its anchor positions (sorted), padded with position 0: anchors (B, A),
    valid (B, A)."""
    eligible = anchor_positions(loss_mask)
    b = eligible.shape[0]
    anchors = torch.zeros(b, count, dtype=torch.long)
    valid = torch.zeros(b, count, dtype=torch.bool)
    for row in range(b):
        positions = eligible[row].nonzero().flatten().cpu()
        chosen = positions[torch.randperm(positions.numel(), generator=generator)[:count]].sort().values
        anchors[row, :chosen.numel()], valid[row, :chosen.numel()] = chosen, True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


def anchor_count(loss_mask: torch.Tensor, count: int) -> int:
    """How many anchors `draw_anchors` finds in a batch (the loss's normalizer, known before the draw)."""
    return int(anchor_positions(loss_mask).sum(1).clamp(max=count).sum())


def block_targets(loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, block: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions a + k (k = 1..block-1) the block proposes, clamped into the record (B, A, block - 1), and which
    of them are answer tokens of a valid anchor."""
    t = loss_mask.shape[1]
    ahead = anchors[..., None] + torch.arange(1, block, device=anchors.device)  # (B, A, block - 1)
    inside = ahead < t
    ahead = ahead.clamp(max=t - 1)
    answer = loss_mask.bool().gather(1, ahead.flatten(1)).view_as(ahead)
    return ahead, inside & answer & valid[..., None]


class DFlashTrainModule(nn.Module):
    """The frozen target (features and teacher) and the drafter, on one batch."""

    def __init__(self, target: nn.Module, drafter: DFlashModel):
        super().__init__()
        self.target = target
        self.drafter = drafter

    def forward(self, input_ids, attention_mask, anchors, anchor_valid, ahead):
        """-> the drafter's logits and the target's (detached) logits at the proposed positions, each
        (B, A, block - 1, V)."""
        with torch.no_grad():
            out = self.target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                              use_cache=False)
        features = torch.cat([out.hidden_states[i] for i in self.drafter.config.hidden_layers], -1).float()
        hidden = self.drafter(features, input_ids, attention_mask, anchors, anchor_valid)[:, :, 1:]
        logits = self.drafter.lm_head(hidden.to(self.drafter.lm_head.weight.dtype)).float()
        b = input_ids.shape[0]
        rows = torch.arange(b, device=input_ids.device)[:, None, None].expand_as(ahead)
        teacher = out.logits[rows, ahead - 1].detach().float()  # the target's distribution for the token at a + k
        return logits, teacher


def position_weights(block: int, gamma: float, device) -> torch.Tensor:
    return torch.exp(-torch.arange(block - 1, device=device, dtype=torch.float32) / gamma)


class DFlashRecipe(RecipeBase):
    def __init__(self, cfg: DFlashRecipeConfig, run: TrainingRun):
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
        config = drafter_config(cfg.drafter, self.target)
        run.log.info("drafter: %d layers, block %d, target layers %s, mask token %d", config.num_layers,
                     config.block_size, list(config.target_layer_ids), config.mask_token_id)
        drafter = DFlashModel(config).to(run.device).attach_target(model)
        if cfg.drafter.init_from:  # a resumed run then loads its checkpoint over these weights
            start_from(drafter, cfg.drafter.init_from, self.target)
        model.requires_grad_(False)
        self.weights = position_weights(config.block_size, cfg.loss.gamma, run.device)
        run.setup_optimizer(DFlashTrainModule(model, drafter), [{"params": list(drafter.parameters()),
                                                                "lr": cfg.optim.lr}])

    def _losses(self, batch: dict, normalizer: float, generator=None) -> dict:
        """The weighted loss and its parts on one batch (anchors drawn from `generator`, else the global RNG)."""
        block = self.cfg.drafter.block_size
        batch = {name: t.to(self.run.device) for name, t in batch.items()}
        anchors, valid = draw_anchors(batch["loss_mask"], self.cfg.loss.anchors, generator)
        ahead, labelled = block_targets(batch["loss_mask"], anchors, valid, block)
        logits, teacher = self.run.module(batch["input_ids"], batch["attention_mask"], anchors, valid, ahead)
        ce = -(torch.softmax(teacher, -1) * torch.log_softmax(logits, -1)).sum(-1)  # (B, A, block - 1)
        weight = labelled.float() * self.weights
        agree = (logits.argmax(-1) == teacher.argmax(-1)) & labelled
        accepted = (agree | ~labelled).long().cumprod(-1) * labelled.long()  # the leading run of agreements
        return {"loss": (ce * weight).sum() / normalizer, "ce": (ce * labelled).sum((0, 1)),
                "labels": labelled.sum((0, 1)), "agree": agree.sum((0, 1)), "accepted": accepted.sum(),
                "blocks": (valid & labelled[..., 0]).sum()}

    def train_step(self) -> dict:
        cfg, run = self.cfg, self.run
        batches = [collate(records, self.pad_id) for _, records in run.micro_batch_records(self.train_records)]
        answer_tokens = run.reduce_sum(torch.tensor(float(sum(int(b["loss_mask"].sum()) for b in batches)),
                                                    device=run.device))
        blocks = run.reduce_sum(torch.tensor(float(sum(anchor_count(b["loss_mask"], cfg.loss.anchors)
                                                       for b in batches)), device=run.device))
        normalizer = float(blocks.clamp(min=1) * self.weights.sum()) / run.world  # DDP averages over processes

        def backward_one(batch) -> torch.Tensor:
            run.unwrapped().target.eval()
            parts = self._losses(batch, normalizer)
            run.backward(parts["loss"])
            return torch.cat([parts["loss"].detach()[None], parts["labels"].float(), parts["agree"].float()])

        sums = run.accumulate(batches, backward_one)
        metrics = run.optimizer_step(sums[0], loss_tokens=float(answer_tokens))
        sums = run.reduce_sum(sums)
        labels, agree = sums[1:cfg.drafter.block_size], sums[cfg.drafter.block_size:]
        metrics["train/top1_pos1"] = float(agree[0] / labels[0].clamp(min=1))
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss, top-1 agreement with the target per block position, and the mean accepted prefix."""
        cfg, run = self.cfg, self.run
        block = cfg.drafter.block_size
        run.module.eval()
        sums = torch.zeros(3 * (block - 1) + 2, dtype=torch.float64, device=run.device)
        size = cfg.eval.batch_size
        starts = list(range(0, len(self.heldout_records), size))
        for start, real in even_shard(starts, run.accelerator.process_index, run.world):
            generator = torch.Generator().manual_seed(start)  # the same anchors at every evaluation
            parts = self._losses(collate(self.heldout_records[start:start + size], self.pad_id), 1.0, generator)
            if real:
                sums += torch.cat([parts["ce"], parts["labels"], parts["agree"],
                                   torch.stack([parts["accepted"], parts["blocks"]])]).double()
        sums = run.reduce_sum(sums)
        k = block - 1
        ce, labels, agree = sums[:k], sums[k:2 * k].clamp(min=1), sums[2 * k:3 * k]
        metrics = {"eval/loss": float((ce / labels * self.weights.double()).sum()),
                   "eval/tokens": int(sums[k]), "eval/accepted_per_block": float(sums[-2] / sums[-1].clamp(min=1))}
        metrics.update({f"eval/top1_pos{i + 1}": float(agree[i] / labels[i]) for i in range(k)})
        return metrics | measure_tau(self, cfg.eval)

    def drafter(self) -> DFlashDrafter:
        return DFlashDrafter(self.run.unwrapped().drafter)

    def write_final(self, directory: Path) -> None:
        cfg, run = self.cfg, self.run
        model = run.unwrapped().drafter
        last = run.last_eval or {}
        save_dflash(model, directory, target_block(self.target, cfg.target, model.config.hidden_layers, cfg.dtype),
                    training={"command": run.command, "steps": run.step, "samples_seen": run.samples_seen,
                              "data": cfg.data.source, "loss": config_to_dict(cfg.loss)},
                    eval={key.removeprefix("eval/"): value for key, value in last.items()
                          if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value))})

    def summary(self) -> dict:
        return {"eval_after": self.run.last_eval}


def main(cfg: DFlashRecipeConfig, resume: str | None = None, overwrite: bool = False) -> dict:
    run = TrainingRun(cfg, resume=resume, overwrite=overwrite, logger_name="train.dflash")
    recipe = DFlashRecipe(cfg, run)
    run.train(recipe)
    return run.finish(recipe.summary())


def cli(argv: list[str] | None = None) -> int:
    return recipe_cli(DFlashRecipeConfig, main, "train/dflash.py",
                      "Train a DFlash block drafter (one forward proposes a block of tokens).", argv)


if __name__ == "__main__":
    sys.exit(cli())
