"""Training inputs of a parallel (PARD) draft model: k draft tokens from one forward (arXiv 2504.18583).

At decode time (eval/decode/drafters/lm.py, mode `parallel`) the drafter sees the context x_0..x_t followed by
k - 1 copies of a mask token at positions t+1 .. t+k-1; the logits at x_t propose x_{t+1} and those of the j-th
mask x_{t+j+1}. Training shows every such situation at once, as PARD does: the sequence (copy 0) is followed by
k - 1 copies made only of mask tokens, all with positions 0..T-1. The mask at position p of copy j stands for the
j-th mask after the context x_0..x_{p-j}: it attends to copy 0 up to p - j and to the masks of copies 1..j at
positions p-j+1 .. p (itself last), exactly what the j-th mask sees at decode time. Its label is the label of
position p in copy 0 (x_{p+1}, or the target's distribution there: averaged over the data, the soft label of the
realised prefix gives the marginal the mask must predict). Positions with p - j < 0 have no context and are not
trained. Pure tensor functions; the distillation recipe (train/distill.py, `parallel:`) uses them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ParallelInputs(NamedTuple):
    """A batch of B sequences of T tokens laid out as `copies` blocks of T."""

    input_ids: torch.Tensor  # (B, copies * T)
    position_ids: torch.Tensor  # (B, copies * T): 0..T-1 in every block
    allowed: torch.Tensor  # (B, 1, copies * T, copies * T) bool: query may attend to key


def parallel_attention(length: int, copies: int) -> torch.Tensor:
    """(copies * T, copies * T) bool: which slot each slot may attend to (see the module docstring)."""
    block = torch.arange(copies).repeat_interleave(length)  # copy index of each slot
    position = torch.arange(length).repeat(copies)  # position of each slot
    query_block, key_block = block[:, None], block[None, :]
    context_end = position[:, None] - query_block  # the last real token a query may see
    sees_sequence = (key_block == 0) & (position[None, :] <= context_end)
    sees_mask = (key_block >= 1) & (key_block <= query_block) & (position[None, :] == context_end + key_block)
    return sees_sequence | sees_mask


def parallel_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor, copies: int,
                    mask_token: int) -> ParallelInputs:
    """Right-padded (B, T) batch -> the PARD layout; padded sequence slots are never attended to."""
    batch, length = input_ids.shape
    masks = torch.full((batch, (copies - 1) * length), mask_token, dtype=input_ids.dtype, device=input_ids.device)
    ids = torch.cat([input_ids, masks], dim=1)
    positions = torch.arange(length, device=input_ids.device).repeat(copies)[None].expand(batch, -1)
    allowed = parallel_attention(length, copies).to(input_ids.device)[None].expand(batch, -1, -1).clone()
    allowed[:, :, :length] &= attention_mask.bool()[:, None, :]  # no query sees a padded sequence slot
    return ParallelInputs(ids, positions.contiguous(), allowed[:, None])


def parallel_positions(rows: torch.Tensor, cols: torch.Tensor, length: int,
                       copies: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Trained (row, column) pairs of copy 0 -> those of every copy j whose context is not empty (col >= j):
    (rows, columns in the PARD layout, index into the given pairs of the label each one takes, the copy of each:
    0 the sequence, j the j-th mask)."""
    out_rows, out_cols, source, copy_of = [], [], [], []
    for copy in range(copies):
        keep = (cols >= copy).nonzero(as_tuple=True)[0]
        out_rows.append(rows[keep])
        out_cols.append(cols[keep] + copy * length)
        source.append(keep)
        copy_of.append(torch.full_like(keep, copy))
    return torch.cat(out_rows), torch.cat(out_cols), torch.cat(source), torch.cat(copy_of)


def parallel_pair_count(trained: torch.Tensor, copies: int) -> torch.Tensor:
    """Pairs trained over every copy, from copy 0's (B, T) bool mask of trained positions (col >= copy)."""
    return sum(trained[:, copy:].sum() for copy in range(copies))
