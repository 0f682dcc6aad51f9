"""DGF / EAGLE feature-drafter recipe (Dovetail III-B/C; EAGLE's training objective).

    accelerate launch train/dgf.py --config train/configs/dgf_tiny.yaml [--resume | --overwrite] [key.path=value ...]
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
           (and optionally top-k logits, topk_logits=K): no target forward per step. The soft target is
           lm_head(final normed state) when the feature layer is -1 (exact), else the cached top-k.

Layout of `output_dir` (train/runtime.py): checkpoints/step_<N>/ (exact `--resume`), final/
(models.artifacts.save_dgf: dgf.safetensors + config.json + manifest.json; train_config.yaml),
metrics.jsonl (also W&B via accelerate's trackers, offline without network).
`eval.decode.drafters.dgf.load_dgf_drafter(final_dir, target)` turns final/ into the decoder's drafter.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn
from torch.nn import functional as F

from draftsmith.config import ConfigError, TextEnum, Unread, config_to_dict, option, refuse_unread, section
from draftsmith.data.features import FeatureDataset, cache_parts, load_index
from draftsmith.data.records import load_records, split_heldout
from draftsmith.eval.decode.drafters.dgf import DGFDrafter
from draftsmith.models.artifacts import MANIFEST_FILE, load_dgf, save_dgf, target_block
from draftsmith.models.dgf import DGFConfig, DGFModel, Fusion, LayerFusion, eagle3_layers
from draftsmith.models.vocab import DraftHead, DraftVocab
from draftsmith.models.target import TargetModel
from draftsmith.train.distributed import even_shard
from draftsmith.train.losses import (IGNORE_INDEX, feature_regression_loss, hard_cross_entropy, soft_cross_entropy,
                                     topk_soft_cross_entropy, unrolled_step_weights)
from draftsmith.train.recipe import (RUN_UNREAD, DataConfig, EvalConfig, LoggingConfig, OptimConfig, RecipeBase, RunConfig,
                                    TrainConfig, measure_tau, pad_id_of, start_from_finished)
from draftsmith.train.runtime import TrainingRun, recipe_cli


@dataclass
class DrafterConfig:
    fusion: Fusion = option(Fusion.DGF, "linear = EAGLE's fc; dgf = Dovetail's Dynamic Gated Fusion; eagle3 = "
                                        "EAGLE-3's block 0 on [norm(e); norm(f)]")
    num_blocks: int = option(1, "M decoder blocks", ge=1, le=32)
    fusion_act: str = option("silu", "DGF token-branch activation (identity = the paper text literally)")
    first_block_norm: bool = option(False, "keep block 0's input norm (EAGLE drops it)")
    fusion_bias: bool = option(True, "bias in the fusion layer (EAGLE: true; vLLM's EAGLE-1 loader has none)")
    feature_layer: int = option(-1, "target hidden_states index the drafter reads (-1: final normed state)")
    feature_layers: list[int] | None = option(None, "several target layers, fused (EAGLE-3); null: [feature_layer]")
    multi_layer: bool = option(False, "with feature_layers null: EAGLE-3's low/mid/high layers")
    layer_fusion: LayerFusion = option(LayerFusion.LINEAR, "several layers -> one feature: EAGLE-3's linear fc, "
                                                           "or a per-dimension softmax gate over the layers")
    draft_vocab: str | None = option(None, "a data.draft_vocab directory: the drafter scores only that subset")
    init_from: str | None = option(None, "a train/dgf.py final/ directory whose weights this run starts from (same "
                                   "architecture and draft vocabulary; a longer run on top of a finished one)")
    head: DraftHead = option(DraftHead.TARGET, "output layer: the target's LM head (full vocabulary), its frozen "
                                               "slice, or an own trainable head")

    def fuses_several_layers(self) -> bool:
        """Whether the drafter reads more than one target layer (an explicit list, or EAGLE-3's three)."""
        return bool(self.feature_layers and len(self.feature_layers) > 1) or (self.multi_layer and not self.feature_layers)

    def layers(self, num_hidden_layers: int) -> list[int]:
        """The target layers read: the explicit list, EAGLE-3's three, or the one feature layer."""
        if self.feature_layers:
            return list(self.feature_layers)
        return eagle3_layers(num_hidden_layers) if self.multi_layer else [self.feature_layer]


class TokenLoss(TextEnum):
    SOFT = "soft"  # cross-entropy to the target's distribution
    HARD = "hard"  # to the data's next token


class DataMode(TextEnum):
    ONLINE = "online"  # the target runs in the loop
    OFFLINE = "offline"  # the target's features come from a cache


@dataclass
class LossConfig:
    feature_weight: float = option(1.0, "weight of the SmoothL1 feature regression (EAGLE: 1.0)", ge=0)
    token_weight: float = option(0.1, "weight of the token loss (EAGLE: 0.1)", ge=0)
    token_loss: TokenLoss = option(TokenLoss.SOFT, "soft: CE to the target's distribution; hard: to the data")
    input_noise: float = option(0.0, "a: uniform U(-a, a) noise on the teacher-forced input features", ge=0)
    unroll_steps: int = option(1, "1 = plain EAGLE; n > 1 = training-time test over n steps", ge=1)
    unroll_decay: float = option(0.8, "weight of step j = decay^j", gt=0)


@dataclass
class DGFDataConfig(DataConfig):
    mode: DataMode = option(DataMode.ONLINE, "online: the target runs in the loop; offline: "
                                                          "data.feature_cache")
    feature_cache: str | None = option(None, "offline: data.features cache directory, or `dir_a + dir_b`")


@dataclass
class DGFEvalConfig(EvalConfig):
    unroll_steps: int = option(3, "held-out accuracy of the drafter fed its own features for j steps", ge=1)


@dataclass
class DGFRecipeConfig(RunConfig):
    output_dir: str = option("outputs/dgf", "run directory (checkpoints/, final/, metrics.jsonl)")
    drafter: DrafterConfig = section(DrafterConfig)
    loss: LossConfig = section(LossConfig)
    data: DGFDataConfig = section(DGFDataConfig)
    optim: OptimConfig = section(OptimConfig, betas=(0.9, 0.95), max_grad_norm=0.5)  # Dovetail / EAGLE
    train: TrainConfig = section(TrainConfig)
    eval: DGFEvalConfig = section(DGFEvalConfig)
    logging: LoggingConfig = section(LoggingConfig)

    def __post_init__(self):
        d = self.drafter
        # EAGLE-3 drafts tokens, it regresses no target feature
        several = d.fuses_several_layers() or d.fusion is Fusion.EAGLE3
        checks = [
            (self.loss.feature_weight + self.loss.token_weight > 0,
             "loss.feature_weight + loss.token_weight must be > 0"),
            (not several or self.loss.feature_weight == 0, "loss.feature_weight: a multi-layer or eagle3 drafter "
             "predicts no target feature (EAGLE-3): set it to 0"),
            (self.loss.token_weight > 0 or not several, "loss.token_weight must be > 0 for a multi-layer drafter"),
            ((d.draft_vocab is None) == (d.head is DraftHead.TARGET),
             "drafter.head: with drafter.draft_vocab choose slice or own; without one, target"),
            (d.init_from is None or (Path(d.init_from) / MANIFEST_FILE).is_file(),
             f"drafter.init_from={d.init_from}: not a train/dgf.py final/ directory (no {MANIFEST_FILE})"),
            (self.data.mode is DataMode.ONLINE or self.data.feature_cache,
             "data.mode=offline needs data.feature_cache"),
            (self.data.max_length >= 4, "data.max_length must be >= 4"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        refuse_unread(self, RUN_UNREAD + DGF_UNREAD)


DGF_UNREAD = [
    Unread("data.feature_cache", lambda c: c.data.mode is DataMode.ONLINE, "read by data.mode=offline"),
    Unread("data.limit", lambda c: c.data.mode is DataMode.OFFLINE, "read by data.mode=online"),
    Unread("loss.unroll_decay", lambda c: c.loss.unroll_steps == 1, "read when loss.unroll_steps > 1"),
    Unread("drafter.layer_fusion", lambda c: not c.drafter.fuses_several_layers(), "read when the drafter fuses "
           "several target layers (drafter.feature_layers with more than one, or drafter.multi_layer)"),
    Unread("drafter.feature_layer", lambda c: bool(c.drafter.feature_layers) or c.drafter.multi_layer,
           "read when drafter.feature_layers is null and drafter.multi_layer is false"),
    Unread("drafter.fusion_act", lambda c: c.drafter.fusion != "dgf", "read by drafter.fusion=dgf"),
]


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

    def forward(self, layers: torch.Tensor, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """layers (B, T', k, H) target features f_t of the layers read, tokens (B, T') x_{t+1} -> per step
        (B, T', H) predictions of f_{t+1} (multi-layer: of the drafter's own next feature)."""
        drafter = self.drafter
        features = drafter.fuse_layers(layers)  # (B, T', H): the layer itself, or EAGLE-3's fused feature
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


def start_from(drafter: DGFModel, path: str, target: TargetModel) -> None:
    """Copy the weights of a finished run (`drafter.init_from`) into `drafter`; its architecture and draft
    vocabulary must be this config's."""
    source, _ = load_dgf(path, target=target)
    start_from_finished(drafter, source, config_to_dict(source.config), config_to_dict(drafter.config), "drafter",
                        path, "its drafter differs")


class StepFeatures(NamedTuple):
    """The target's features of a batch: the layers the drafter reads (B, T, k, H), the final state or None, and
    the target's log-probabilities at step 0's pairs (None without a final state): computed once per micro-batch,
    each later step's pairs are a subset of step 0's in the same order (see DGFRecipe._losses)."""

    layers: torch.Tensor
    final: torch.Tensor | None
    target_logp: torch.Tensor | None = None


class StepPairs(NamedTuple):
    """The (row, position) pairs one unrolled step trains on: `next_positions` = t + 1, whose feature and token
    distribution the pair predicts; `labels` = the data tokens x_{t+2}; `predicted` = the drafter's features."""

    rows: torch.Tensor
    next_positions: torch.Tensor
    labels: torch.Tensor
    predicted: torch.Tensor


class StepLosses(NamedTuple):
    """One unrolled step's results: the weighted loss (with graph), its feature and token parts (detached),
    correct top-1 guesses and the number of valid pairs."""

    loss: torch.Tensor
    feature_loss: torch.Tensor
    token_loss: torch.Tensor
    correct: torch.Tensor
    valid: torch.Tensor


class DGFRecipe(RecipeBase):
    """The feature-drafter behaviour; the run mechanics are the TrainingRun's."""

    def __init__(self, cfg: DGFRecipeConfig, run: TrainingRun):
        self.cfg, self.run = cfg, run
        self.target = TargetModel.from_pretrained(cfg.target, dtype=cfg.dtype, device=run.device,
                                                  attn_implementation=cfg.attn_implementation)
        model = self.target.model.requires_grad_(False).eval()
        self.pad_id = pad_id_of(self.target.tokenizer)
        self.layers = cfg.drafter.layers(model.config.num_hidden_layers)
        self.data_stats: dict = {}
        self.train_records, self.heldout_records = split_heldout(self._load_data(), cfg.data.heldout_fraction,
                                                                 cfg.data.seed, cfg.data.max_heldout)
        run.log.info("data (%s): %d train / %d held-out records", cfg.data.mode, len(self.train_records),
                     len(self.heldout_records))
        d = cfg.drafter
        self.vocab = DraftVocab.load(d.draft_vocab) if d.draft_vocab else None
        self._draft_head_rows: tuple[torch.Tensor, torch.Tensor | None] | None = None  # see _target_logprobs
        self.dgf_config = DGFConfig.for_target(model.config, num_blocks=d.num_blocks, fusion=d.fusion,
                                               fusion_act=d.fusion_act, first_block_norm=d.first_block_norm,
                                               fusion_bias=d.fusion_bias,
                                               feature_layer=self.layers[0],
                                               feature_layers=self.layers if len(self.layers) > 1 else None,
                                               layer_fusion=d.layer_fusion, head=d.head,
                                               draft_vocab_size=self.vocab.size if self.vocab else None)
        drafter = DGFModel(self.dgf_config).to(run.device).attach_target(model)  # float32
        if self.vocab is not None:
            drafter.set_vocab(self.vocab).init_draft_head()  # a resumed run then loads its trained head
        if d.init_from:  # a resumed run then loads its checkpoint over these weights
            start_from(drafter, d.init_from, self.target)
        run.log.info("drafter: fusion=%s M=%d, %.2fM trainable parameters", d.fusion, d.num_blocks,
                     drafter.num_parameters() / 1e6)
        self.step_weights = unrolled_step_weights(cfg.loss.unroll_steps, cfg.loss.unroll_decay)
        run.setup_optimizer(DGFTrainModule(drafter), [{"params": list(drafter.parameters()), "lr": cfg.optim.lr}])

    def _load_data(self) -> list[dict]:
        cfg = self.cfg
        if cfg.data.mode is DataMode.ONLINE:
            records = load_records(cfg.data.source, tokenizer=self.target.tokenizer, max_length=cfg.data.max_length,
                                   limit=cfg.data.limit, model=self.target.model, seed=cfg.data.seed,
                                   stats=self.data_stats)
            self.run.log.info("data mix (records, loss tokens per source): %s", self.data_stats["mix"])
            return records
        records, fields = [], {}
        for cache_dir in cache_parts(cfg.data.feature_cache):
            part = self._load_cache(cache_dir)
            records.extend(part)
            fields[cache_dir] = sorted(part[0]) if part else None
        held = {tuple(keys) for keys in fields.values() if keys is not None}
        if len(held) > 1:
            raise ConfigError("feature caches hold different fields, so their batches cannot be mixed: " + "; ".join(
                f"{cache} {', '.join(keys)}" for cache, keys in fields.items() if keys is not None)
                + ". Rebuild them with the same hidden_layers (and top-k logits where the final state is not cached)")
        if not records:
            raise ConfigError(f"feature cache {cfg.data.feature_cache} holds no record with trainable tokens")
        return records

    def _load_cache(self, cache_dir: str) -> list[dict]:
        """Every sequence of one feature cache, in memory (features stay bf16 until batched): the layers
        read (n, k, H), and the final normed state (n, H) when cached (the exact soft target)."""
        cfg = self.cfg
        index = load_index(cache_dir, self.target)
        final_cached = index["num_layers"] in index["hidden_layers_abs"]  # hidden_states[-1], absolute index L
        layers = self.layers + ([-1] if final_cached and -1 not in self.layers else [])
        dataset = FeatureDataset(cache_dir, target=self.target, hidden_layers=layers, with_logits=True, shuffle=False)
        if cfg.loss.token_loss is TokenLoss.SOFT and not final_cached and not dataset.index["topk_logits"]:
            raise ConfigError(f"loss.token_loss=soft offline needs the target's distribution: cache {cache_dir} "
                              "holds neither the final normed state (layer -1) nor top-k logits")
        final_at = layers.index(-1) if final_cached else None
        records = []
        for rec in dataset:
            n = min(len(rec["input_ids"]), cfg.data.max_length)
            hidden = rec["hidden_states"][:, :n]  # (layers, n, H)
            item = {"input_ids": rec["input_ids"][:n], "loss_mask": rec["loss_mask"][:n],
                    "features": hidden[: len(self.layers)].transpose(0, 1)}  # (n, k, H)
            if final_at is not None:
                item["final"] = hidden[final_at]
            if final_at is None and "topk_values" in rec:  # top-k logits: the soft target only without the final state
                item.update(topk_values=rec["topk_values"][:n], topk_indices=rec["topk_indices"][:n])
            if item["loss_mask"].sum() > 0:
                records.append(item)
            if cfg.data.limit is not None and len(records) >= cfg.data.limit:
                break
        return records

    def _collate(self, records: list[dict]) -> dict[str, torch.Tensor]:
        length = max(len(r["input_ids"]) for r in records)
        batch = len(records)
        ids = torch.full((batch, length), self.pad_id, dtype=torch.long)
        attention = torch.zeros((batch, length), dtype=torch.long)
        loss_mask = torch.zeros((batch, length), dtype=torch.long)
        out = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
        dense = [key for key in ("features", "final", "topk_values", "topk_indices") if key in records[0]]
        for key in dense:  # (B, T, ...) zero-padded
            sample = records[0][key]
            dtype = torch.long if key == "topk_indices" else torch.float32
            out[key] = torch.zeros((batch, length, *sample.shape[1:]), dtype=dtype)
        for i, r in enumerate(records):
            n = len(r["input_ids"])
            ids[i, :n] = torch.as_tensor(r["input_ids"], dtype=torch.long)
            attention[i, :n] = 1
            loss_mask[i, :n] = torch.as_tensor(r["loss_mask"], dtype=torch.long)
            for key in dense:
                out[key][i, :n] = r[key].to(out[key].dtype)
        return out

    @torch.no_grad()
    def _features(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Target features of the layers read (B, T, k, H) float32 and the final normed state (B, T, H)
        for soft targets (None when the soft target comes from cached top-k logits)."""
        if "features" in batch:
            return batch["features"], batch.get("final")
        out = self.target.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                output_hidden_states=True, use_cache=False, logits_to_keep=1)
        layers = torch.stack([out.hidden_states[layer].float() for layer in self.layers], dim=2)
        return layers, out.hidden_states[-1].float()

    def _target_logprobs(self, final: torch.Tensor) -> torch.Tensor:
        """The target's next-token log-probabilities from final normed states (N, H), on the draft vocabulary
        (renormalised there) when there is one: only the head's rows of that vocabulary are multiplied (a sixth
        of the full head for SmolLM2's 8k of 49k), the same logits as slicing the full product."""
        head = self.target.model.get_output_embeddings()
        if self.vocab is None:
            return torch.log_softmax(head(final.to(self.target.dtype)).float(), -1)
        if self._draft_head_rows is None:
            rows = self.vocab.draft_to_target.to(head.weight.device)
            self._draft_head_rows = (head.weight[rows].detach(), None if head.bias is None else head.bias[rows].detach())
        weight, bias = self._draft_head_rows
        return torch.log_softmax(F.linear(final.to(weight.dtype), weight, bias).float(), -1)

    def _losses(self, batch: dict, steps: int, normalizers: torch.Tensor | None, noise: bool):
        """Per-step (loss, feature loss, token loss, correct top-1, valid) for one micro-batch."""
        cfg = self.cfg
        batch = {k: v.to(self.run.device) for k, v in batch.items()}
        layers, final = self._features(batch)  # (B, T, k, H), (B, T, H) or None
        labels = pair_targets(batch["input_ids"], batch["loss_mask"], batch["attention_mask"])  # (B, T-1)
        inputs = layers[:, :-1]
        if noise and cfg.loss.input_noise > 0:
            inputs = inputs + (torch.rand_like(inputs) * 2 - 1) * cfg.loss.input_noise
        preds = self.run.module(inputs, batch["input_ids"][:, 1:], steps)
        rows_all, cols_all = (labels != IGNORE_INDEX).nonzero(as_tuple=True)  # step 0's pairs, row-major
        target_logp = None
        if final is not None and self.cfg.loss.token_loss is not TokenLoss.HARD:
            with torch.no_grad():
                target_logp = self._target_logprobs(final[rows_all, cols_all + 1])
        results = []
        for j, pred in enumerate(preds):
            keep = cols_all >= j  # a step-j chain needs a true prefix ending at t - j >= 0
            rows, cols = rows_all[keep], cols_all[keep]
            norm = normalizers[j] if normalizers is not None else keep.sum().clamp(min=1)
            pairs = StepPairs(rows=rows, next_positions=cols + 1, labels=labels[rows, cols], predicted=pred[rows, cols])
            features = StepFeatures(layers, final, None if target_logp is None else target_logp[keep])
            results.append(self._step_losses(batch, features, pairs, norm))
        return results

    def _step_losses(self, batch, features: "StepFeatures", pairs: "StepPairs", norm) -> StepLosses:
        """The losses of one unrolled step at the selected pairs (see StepPairs)."""
        cfg, drafter = self.cfg, self.run.unwrapped().drafter
        rows, nxt, label, pred = pairs.rows, pairs.next_positions, pairs.labels, pairs.predicted
        ones = torch.ones_like(rows)
        feat_loss = pred.new_zeros(())
        if not self.dgf_config.multi_layer:
            feat_loss = feature_regression_loss(pred, features.layers[rows, nxt, 0], ones, norm)
        logits = drafter.logits(pred)  # (N, V) or (N, draft vocabulary)
        draft_label = label if self.vocab is None else self.vocab.to_draft(label).masked_fill(
            self.vocab.to_draft(label) < 0, IGNORE_INDEX)  # a token outside the subset: no CE target
        if cfg.loss.token_loss is TokenLoss.HARD:
            token_loss = hard_cross_entropy(logits, draft_label, norm)
        elif features.target_logp is not None:
            token_loss = soft_cross_entropy(logits, features.target_logp, ones, norm)
        else:
            indices, values, inside = self._topk_on_draft_vocab(batch["topk_indices"][rows, nxt],
                                                               batch["topk_values"][rows, nxt])
            token_loss = topk_soft_cross_entropy(logits, indices, values, inside, norm)
        loss = cfg.loss.feature_weight * feat_loss + cfg.loss.token_weight * token_loss
        guess = logits.argmax(-1)
        correct = ((guess if self.vocab is None else self.vocab.to_target(guess)) == label).sum()  # vs every label
        return StepLosses(loss, feat_loss.detach(), token_loss.detach(), correct, valid=rows.new_tensor(rows.numel()))

    def _topk_on_draft_vocab(self, indices: torch.Tensor, values: torch.Tensor):
        """Cached top-k target logits (N, k) -> draft-vocabulary indices, values (-inf outside the subset) and
        the rows that keep at least one token."""
        if self.vocab is None:
            return indices, values, torch.ones(indices.shape[0], device=indices.device)
        draft = self.vocab.to_draft(indices)
        values = values.masked_fill(draft < 0, float("-inf"))
        inside = (draft >= 0).any(-1)
        values = torch.where(inside[:, None], values, torch.zeros_like(values))  # empty rows: masked below
        return draft.clamp(min=0), values, inside.float()

    def _pair_counts(self, batches: list[dict]) -> torch.Tensor:
        """Valid pairs per unrolled step of the whole optimizer step, all processes: (steps,)."""
        steps, run = self.cfg.loss.unroll_steps, self.run
        counts = torch.zeros(steps, device=run.device)
        for batch in batches:
            labels = pair_targets(batch["input_ids"], batch["loss_mask"], batch["attention_mask"])
            for j in range(steps):
                counts[j] += (labels[:, j:] != IGNORE_INDEX).sum().to(run.device)
        return run.reduce_sum(counts)

    def train_step(self) -> dict:
        cfg, run = self.cfg, self.run
        steps = cfg.loss.unroll_steps
        batches = [self._collate(records) for _, records in run.micro_batch_records(self.train_records)]
        counts = self._pair_counts(batches)
        norm = counts.clamp(min=1) / run.world  # DDP averages gradients over processes
        weights = self.step_weights.to(run.device)

        def backward_one(batch) -> torch.Tensor:
            results = self._losses(batch, steps, norm, noise=True)
            run.backward(sum(weights[j] * r.loss for j, r in enumerate(results)))
            return torch.stack([torch.stack([r.loss.detach(), r.feature_loss, r.token_loss, r.correct.float()])
                                for r in results])

        sums = run.accumulate(batches, backward_one)  # (steps, 4): loss, feature, token, correct
        metrics = run.optimizer_step((weights * sums[:, 0]).sum(), loss_tokens=float(counts[0]))
        sums = run.reduce_sum(sums)
        sums[:, :3] /= run.world
        for j in range(steps):
            metrics[f"train/step{j}_feature_loss"] = float(sums[j, 1])
            metrics[f"train/step{j}_token_loss"] = float(sums[j, 2])
            metrics[f"train/step{j}_top1"] = float(sums[j, 3] / counts[j].clamp(min=1))
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out losses and top-1 accuracy (vs the data token x_{t+2}) after j = 0..eval.unroll_steps-1
        steps on the drafter's own features (step j ~ a depth-(j+1) draft node), and tau."""
        cfg, run = self.cfg, self.run
        steps = max(cfg.eval.unroll_steps, cfg.loss.unroll_steps)
        run.module.eval()
        sums = torch.zeros(steps, 4, dtype=torch.float64, device=run.device)  # feature, token, correct, valid
        size = cfg.eval.batch_size
        starts = list(range(0, len(self.heldout_records), size))
        for start, real in even_shard(starts, run.accelerator.process_index, run.world):
            batch = self._collate(self.heldout_records[start:start + size])
            for j, step in enumerate(self._losses(batch, steps, None, noise=False)):
                if real:
                    n = float(step.valid)
                    sums[j] += torch.tensor([float(step.feature_loss) * n, float(step.token_loss) * n,
                                             float(step.correct), n], dtype=torch.float64, device=run.device)
        sums = run.reduce_sum(sums)
        metrics = {"eval/tokens": int(sums[0, 3])}
        for j in range(steps):
            n = max(float(sums[j, 3]), 1.0)
            metrics[f"eval/step{j}_feature_loss"] = float(sums[j, 0]) / n
            metrics[f"eval/step{j}_token_loss"] = float(sums[j, 1]) / n
            metrics[f"eval/step{j}_top1"] = float(sums[j, 2]) / n
        metrics["eval/top1"] = metrics["eval/step0_top1"]
        return metrics | measure_tau(self, cfg.eval)

    def drafter(self) -> DGFDrafter:
        """The drafter as the decoder uses it (Dovetail's tree), for tau at evaluation."""
        return DGFDrafter(self.run.unwrapped().drafter)

    def write_final(self, directory: Path) -> None:
        cfg, run = self.cfg, self.run
        data = cfg.data.feature_cache if cfg.data.mode is DataMode.OFFLINE else cfg.data.source
        save_dgf(run.unwrapped().drafter, directory,
                 target_block(self.target, cfg.target, self.dgf_config.layers_read, cfg.dtype),
                 training={"command": run.command, "steps": run.step, "samples_seen": run.samples_seen,
                           "mode": cfg.data.mode, "data": data, "data_stats": self.data_stats,
                           "loss": config_to_dict(cfg.loss)},
                 eval={"before": run.first_eval, "after": run.last_eval})

    def summary(self) -> dict:
        last = self.run.last_eval
        return {"eval_top1": last.get("eval/top1") if last else None}


def main(cfg: DGFRecipeConfig, resume: str | None = None, overwrite: bool = False) -> dict:
    run = TrainingRun(cfg, resume=resume, overwrite=overwrite, logger_name="train.dgf")
    recipe = DGFRecipe(cfg, run)
    run.train(recipe)
    return run.finish(recipe.summary())


def cli(argv: list[str] | None = None) -> int:
    return recipe_cli(DGFRecipeConfig, main, "train/dgf.py", "Train a DGF / EAGLE feature drafter on a frozen target.",
                      argv)


if __name__ == "__main__":
    sys.exit(cli())
