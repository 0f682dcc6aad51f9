"""The methods HF transformers runs itself: `generate` of the target (the plain baseline every bench measures
against), optionally assisted by a draft model (HF assisted generation, the peer)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch

from draftsmith.eval.decode.decoder import DecodeConfig, DecodeResult, Method
from draftsmith.models.engine import Backend
from draftsmith.models.target import TargetModel


class HFGenerate(Method):
    """HF `generate` of the target (greedy, or sampling with top_k=0, top_p=1), optionally assisted.
    `assistant_settings`: generation-config fields of the assistant this method sets for its own calls
    (HF reads the draft length and confidence stop from the assistant's config, which methods may share)."""

    backend = Backend.EAGER

    def __init__(self, name: str, assistant=None, assistant_settings: Mapping[str, Any] | None = None):
        self.name, self.assistant = name, assistant
        self.assistant_settings = dict(assistant_settings or {})

    def make_decoder(self, target: TargetModel, config: DecodeConfig) -> "HFDecoder":
        return HFDecoder(target, config, self.assistant, self.assistant_settings)


class HFDecoder:
    def __init__(self, target: TargetModel, config: DecodeConfig, assistant=None,
                 assistant_settings: Mapping[str, Any] | None = None):
        self.target, self.config, self.assistant = target, config, assistant
        self.assistant_settings = dict(assistant_settings or {})

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor) -> DecodeResult:
        config, extra = self.config, {}
        if config.temperature > 0:
            torch.manual_seed(config.seed)
            extra.update(do_sample=True, temperature=config.temperature, top_k=0, top_p=1.0)
        else:
            extra["do_sample"] = False
        if self.assistant is not None:
            extra["assistant_model"] = self.assistant
        input_ids = input_ids.to(self.target.device)
        with assistant_config(self.assistant, self.assistant_settings):
            out = self.target.model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                             max_new_tokens=config.max_new_tokens, **extra)
        return DecodeResult(tokens=out[0, input_ids.shape[1]:].tolist(), stats=None)


@contextlib.contextmanager
def assistant_config(assistant, settings: Mapping[str, Any]):
    """The assistant's generation config with `settings` set for one call, restored afterwards."""
    if assistant is None or not settings:
        yield
        return
    generation_config = assistant.generation_config
    before = {name: getattr(generation_config, name, None) for name in settings}
    for name, value in settings.items():
        setattr(generation_config, name, value)
    try:
        yield
    finally:
        for name, value in before.items():
            setattr(generation_config, name, value)
