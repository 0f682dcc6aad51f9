"""Multi-process helpers shared by the recipes (DDP, FSDP, DeepSpeed ZeRO through accelerate)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

import torch

T = TypeVar("T")


def gather_trainable_state(accelerator, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU copies of `module`'s trainable parameters, by name.

    Call on EVERY process: under FSDP / DeepSpeed ZeRO-3 `accelerator.get_state_dict` gathers the
    shards collectively (and returns them on the main process); under DDP it is a local copy.
    Frozen parameters (the target) are left out, so drafter checkpoints stay small.
    """
    unwrapped = accelerator.unwrap_model(module)
    trainable = {name for name, p in unwrapped.named_parameters() if p.requires_grad}
    state = accelerator.get_state_dict(module, unwrap=True) or {}
    return {name: t.detach().cpu().contiguous() for name, t in state.items() if name in trainable}


def even_shard(items: Sequence[T], rank: int, world: int) -> list[tuple[T, bool]]:
    """This rank's items (`i % world == rank`) as (item, real) pairs, padded with (items[0], False)
    so that every rank gets the same count.

    Evaluation loops need it: a DDP forward broadcasts buffers and an FSDP / ZeRO-3 forward gathers
    parameters, both collectives, so a rank that runs one batch more than another hangs the run.
    Run the forward for every pair and drop the results of the padding ones (`real` False).
    """
    mine = [(item, True) for item in items[rank::world]]
    longest = -(-len(items) // world) if items else 0
    return mine + [(items[0], False) for _ in range(longest - len(mine))]


def local_rank_zero() -> bool:
    """True in the process that should write shared files, before an Accelerator exists
    (`RANK` from torchrun / `accelerate launch`; 0 when not launched)."""
    return int(os.environ.get("RANK", "0") or 0) == 0
