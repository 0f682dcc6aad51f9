"""Dovetail placement (section III-A): the target on one device, the drafter on another.

The target model (large, memory-bound) stays where it is (CPU in Dovetail); the drafter runs on
a second device (the GPU). Per decoding round only token ids and the hidden states the drafter
declares (`Drafter.hidden_layers`) cross between them:

  target -> drafter: the newly committed tokens and their target hidden states (observe), the
                     context tokens the drafter has not been sent yet (propose; the root included)
  drafter -> target: the draft tree (tokens, parents, depths; plus q rows when sampling)

`PlacedDrafter` wraps any drafter and does exactly these copies, counting the bytes (the count
is what crosses the boundary; when both devices are the same, `.to()` copies nothing but the
count is the same). `DovetailPolicy.make_decoder` runs the ordinary SpeculativeDecoder with it
and reports the bytes in `DecodeStats.transfer_bytes`. The drafter's modules are moved to the
drafter device (deep copies when they live elsewhere, so a target or draft model shared with
other methods in the same benchmark run is never moved).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from draftsmith.eval.decode.decoder import DecodeResult, Method, SpeculativeDecoder
from draftsmith.eval.decode.drafters.base import Drafter, Sampling
from draftsmith.eval.decode.tree import DraftTree
from draftsmith.models.target import resolve_device


def tensor_bytes(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def move_drafter(drafter: Drafter, device: torch.device) -> Drafter:
    """Put every nn.Module attribute of `drafter` on `device` (a deep copy when it lives elsewhere)."""
    for attr, value in list(vars(drafter).items()):
        if isinstance(value, nn.Module):
            param = next(value.parameters(), None)
            if param is not None and param.device != device:
                setattr(drafter, attr, copy.deepcopy(value).to(device))
    return drafter


class PlacedDrafter(Drafter):
    """Runs `inner` on `device`; only tokens and the declared hidden states cross devices."""

    def __init__(self, inner: Drafter, device: str | torch.device, target_device: str | torch.device = "cpu"):
        self.inner = move_drafter(inner, resolve_device(device))
        self.device = resolve_device(device)
        self.target_device = resolve_device(target_device)
        self.name = f"dovetail[{inner.name}]"
        self.hidden_layers = tuple(inner.hidden_layers)
        self.tokenizer = inner.tokenizer
        self.transfer_bytes = 0  # since the last reset
        self._context: torch.Tensor | None = None  # the drafter-side copy of the committed context

    def begin(self, prompt_ids: torch.Tensor) -> None:
        self._context = prompt_ids.to(self.device)
        self.transfer_bytes += tensor_bytes(prompt_ids)
        self.inner.begin(self._context)

    def forget(self) -> None:
        self.inner.forget()

    def observe(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor]) -> None:
        self.transfer_bytes += tensor_bytes(tokens) + sum(tensor_bytes(h) for h in hidden.values())
        self.inner.observe(tokens.to(self.device), {k: v.to(self.device) for k, v in hidden.items()})

    def propose(self, root: int, context: torch.Tensor, sampling: Sampling | None,
                generator: torch.Generator | None) -> DraftTree:
        known = 0 if self._context is None else self._context.numel()
        if known > context.numel():
            raise RuntimeError("the decoding context shrank between rounds (begin() not called for a new request?)")
        delta = context[known:]  # only the tokens the drafter side has not seen (the root among them)
        self.transfer_bytes += tensor_bytes(delta)
        self._context = delta.to(self.device) if self._context is None else torch.cat(
            [self._context, delta.to(self.device)])
        drafter_generator = generator
        if generator is not None and generator.device != self.device:
            drafter_generator = torch.Generator(device=self.device).manual_seed(int(torch.randint(
                0, 2**62, (1,), generator=generator)))
        tree = self.inner.propose(root, self._context, sampling, drafter_generator)
        self.transfer_bytes += sum(tensor_bytes(t) for t in (tree.tokens, tree.parents, tree.depths, tree.draft_probs))
        device = self.target_device
        probs = None if tree.draft_probs is None else tree.draft_probs.to(device)
        return DraftTree(tree.tokens.to(device), tree.parents.to(device), tree.depths.to(device), probs)


class DovetailPolicy(Method):
    """A decoding method: the target where it was loaded, the drafter on `device`; the decoder's stats
    carry the bytes that crossed between them."""

    def __init__(self, inner: Drafter, device: str | torch.device, name: str = "dovetail"):
        self.inner, self.device, self.name = inner, device, name
        self.drafter: PlacedDrafter | None = None

    def make_decoder(self, target, config) -> "DovetailDecoder":
        if self.drafter is None or self.drafter.target_device != target.device:
            self.drafter = PlacedDrafter(self.inner, self.device, target.device)
        return DovetailDecoder(SpeculativeDecoder(target, self.drafter, config, self.kept_prompt(config)), self.drafter)


class DovetailDecoder:
    """A SpeculativeDecoder over a PlacedDrafter; each request's stats get its transfer bytes."""

    def __init__(self, inner: SpeculativeDecoder, drafter: PlacedDrafter):
        self.inner, self.drafter = inner, drafter

    def generate(self, input_ids: torch.Tensor) -> DecodeResult:
        self.drafter.transfer_bytes = 0
        result = self.inner.generate(input_ids)
        result.stats.transfer_bytes += self.drafter.transfer_bytes
        return result
