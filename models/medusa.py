"""Medusa heads (Cai et al., 2024): K extra decoding heads on the target's final hidden state.

Head k (k = 1..K) predicts the token k + 1 positions after the position it reads (the target's
own LM head predicts 1 ahead). Each head = `num_layers` ResBlocks (x + SiLU(W x + b), W zero-
initialised so an untrained head starts as the target's LM head) followed by an LM head
initialised from the target's. Parameter names follow the FasterDecoding Medusa layout
(`medusa_head.{k}.{j}.linear.*` for ResBlocks, `medusa_head.{k}.{num_layers}.weight` for the LM
head) so exports need no renaming. On disk: `models.artifacts.save_medusa` / `load_medusa_heads`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

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
