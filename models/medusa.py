"""Medusa heads (Cai et al., 2024): K extra decoding heads on the target's final hidden state.

Head k (k = 1..K) predicts the token k + 1 positions after the position it reads (the target's
own LM head predicts 1 ahead). Each head = `num_layers` ResBlocks (x + SiLU(W x + b), W zero-
initialised so an untrained head starts as the target's LM head) followed by an LM head
initialised from the target's. Parameter names follow the FasterDecoding Medusa layout
(`medusa_head.{k}.{j}.linear.*` for ResBlocks, `medusa_head.{k}.{num_layers}.weight` for the LM
head) so exports need no renaming.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from draftsmith.models.target import resolve_device, vocab_fingerprint

# On-disk layout of a trained-heads directory (the Medusa recipe's final/): manifest + config + weights.
MANIFEST_FORMAT = "draftsmith.medusa/1"
HEADS_FILE = "medusa_heads.safetensors"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
ACCURACY_FILE = "head_accuracy.json"
HIDDEN_LAYER = -1  # the final normed hidden state, as the target's LM head (and MedusaDrafter) read it


@dataclass
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4
    num_layers: int = 1  # ResBlocks per head

    def to_dict(self) -> dict:
        return asdict(self)


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)  # identity at start: the head begins as the LM head
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (…, H) -> (…, H)
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig):
        super().__init__()
        self.config = config
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(config.hidden_size) for _ in range(config.num_layers)],
                          nn.Linear(config.hidden_size, config.vocab_size, bias=False))
            for _ in range(config.num_heads))

    @torch.no_grad()
    def init_lm_heads(self, lm_head_weight: torch.Tensor) -> None:
        """Copy the target's LM head (V, H) into every head's output layer."""
        for head in self.medusa_head:
            head[-1].weight.copy_(lm_head_weight.to(head[-1].weight.dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (…, H) target final hidden states -> logits (K, …, V), head k at index k - 1."""
        return torch.stack([head(hidden) for head in self.medusa_head])


def read_manifest(path: str | Path, expected_format: str = MANIFEST_FORMAT) -> dict:
    """manifest.json of a drafter directory; `expected_format` other drafter types (e.g. draftsmith.dgf/1)."""
    path = Path(path)
    file = path / MANIFEST_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no {MANIFEST_FILE} in {path} (expected a recipe's final/ directory of format "
                                f"{expected_format})")
    try:
        manifest = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{file} is corrupt ({err})") from err
    if manifest.get("format") != expected_format:
        raise ValueError(f"{file}: format {manifest.get('format')!r} is not {expected_format!r}")
    return manifest


def check_manifest_target(manifest: dict, target, where: str = "checkpoint", hidden_layer: int = HIDDEN_LAYER) -> None:
    """Refuse heads trained for another target: say which of hidden size / vocab / layer differs.
    `hidden_layer`: the layer the loading drafter feeds (other drafter types pass their own)."""
    want = manifest["target"]
    config = target.config
    if target.tokenizer is None:
        raise ValueError(f"the target has no tokenizer, so its vocabulary cannot be checked against {where}")
    have = {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
            "vocab_fingerprint": vocab_fingerprint(target.tokenizer)}
    if want.get("num_hidden_layers") is not None:  # layer ids (hidden_layer) only mean the same at the same depth
        have["num_hidden_layers"] = config.num_hidden_layers
    problems = [f"{key}: {want.get(key)!r} in the manifest vs {value!r} for the given target"
                for key, value in have.items() if want.get(key) != value]
    if want.get("hidden_layer") != hidden_layer:
        problems.append(f"hidden_layer: the checkpoint reads layer {want.get('hidden_layer')}, the drafter feeds {hidden_layer}")
    if problems:
        raise ValueError(f"{where} was trained for target {want.get('name')!r} and does not fit the given target "
                         f"{getattr(target, 'name', '')!r}: " + "; ".join(problems))


def load_medusa_heads(path: str | Path, device: str | torch.device | None = None) -> tuple[MedusaHeads, dict]:
    """(MedusaHeads in float32, manifest) from a recipe's final/ directory (no target check)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    manifest = read_manifest(path)
    config_file, heads_file = path / manifest["heads"]["config"], path / manifest["heads"]["file"]
    for file in (config_file, heads_file):
        if not file.is_file():
            raise FileNotFoundError(f"Medusa checkpoint {path} is incomplete: {file.name} is missing")
    config = MedusaConfig(**json.loads(config_file.read_text()))
    heads = MedusaHeads(config)
    try:
        state = load_file(str(heads_file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"{heads_file} is corrupt or truncated ({err})") from err
    try:
        heads.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{heads_file} does not match {config_file.name}: {err}") from err
    return heads.to(resolve_device(device)).eval(), manifest
