"""The parts a distilled student is made of, shared by train/distill.py and the tests: a freshly initialised shallow
student, the training module that pairs it with the target, the teacher's logits at the trained positions, LoRA
adapters (their config section, adding, continuing from a saved adapter, writing) and a pretrained student."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from torch import nn

from draftsmith.config import ConfigError, option
from draftsmith.errors import first_detail
from draftsmith.models.artifacts import ADAPTER_CONFIG, write_adapter_sidecar
from draftsmith.models.target import TargetModel


@dataclass
class LoraConfig:
    enabled: bool = option(False, "train LoRA adapters instead of the full student (merged at export)")
    r: int = option(16, "LoRA rank", ge=1)
    alpha: float = option(32.0, "LoRA alpha", gt=0)
    dropout: float = option(0.0, "LoRA dropout", ge=0, lt=1)
    target_modules: list[str] = option(factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj"], help="modules that get adapters")
    adapter: str | None = option(None, "start the adapters from a PEFT adapter directory (a run's final/adapter, "
                                       "or a committed one) instead of zero: a run continued on another machine; "
                                       "its r, alpha and target modules must equal these")
    adapter_samples_seen: int = option(0, "samples the adapter's run had trained on: this run's data order "
                                          "continues there (0: from the start)", ge=0)


def shallow_student(target_model, num_layers: int, intermediate_size: int | None, seed: int):
    """The target's architecture with `num_layers` new decoder layers; embeddings, final norm and LM
    head copied from the target (same hidden size, so the token spaces line up from step 0)."""
    config = copy.deepcopy(target_model.config)
    config.num_hidden_layers = num_layers
    if intermediate_size is not None:
        config.intermediate_size = intermediate_size
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:num_layers])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        student = type(target_model)(config)
    with torch.no_grad():
        student.get_input_embeddings().weight.copy_(target_model.get_input_embeddings().weight)
        student.get_output_embeddings().weight.copy_(target_model.get_output_embeddings().weight)
        student.get_decoder().norm.weight.copy_(target_model.get_decoder().norm.weight)
    return student


class DistillTrainModule(nn.Module):
    """The student; returns its logits only at the selected positions (no (B, T, V) tensor)."""

    def __init__(self, student: nn.Module):
        super().__init__()
        self.student = student

    def forward(self, input_ids, attention_mask, rows, cols, position_ids=None):
        """input_ids (B, T), attention_mask (B, T) or a 4D additive mask (with position_ids: the parallel
        layout of train/parallel_draft.py); rows/cols (N,) -> logits (N, V) float32."""
        hidden = self.student.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                            position_ids=position_ids, use_cache=False).last_hidden_state
        return self.student.get_output_embeddings()(hidden[rows, cols]).float()


@torch.no_grad()
def teacher_logits_at(model, input_ids, attention_mask, rows, cols) -> torch.Tensor:
    """The target's logits (N, V) float32 at the selected positions."""
    hidden = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
    return model.get_output_embeddings()(hidden[rows, cols]).float()


def add_lora(cfg: LoraConfig, student):
    """The student with trainable LoRA adapters: new ones (zero update), or lora.adapter's weights."""
    if cfg.adapter:
        return load_adapter(cfg, student)
    try:
        return get_peft_model(student, PeftLoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                                                      bias="none", target_modules=list(cfg.target_modules)))
    except ValueError as err:
        raise ConfigError(f"lora.target_modules {cfg.target_modules}: {err}") from err


def load_adapter(cfg: LoraConfig, student):
    """lora.adapter loaded as trainable adapters on the student, after checking it is the configured shape."""
    directory = Path(cfg.adapter)
    if not (directory / ADAPTER_CONFIG).is_file():
        raise ConfigError(f"lora.adapter {directory}: no {ADAPTER_CONFIG} there (a PEFT adapter directory)")
    saved = PeftConfig.from_pretrained(str(directory))
    differences = [f"{name} {theirs} (lora.{option_name}: {ours})" for name, option_name, theirs, ours in
                   [("r", "r", saved.r, cfg.r), ("lora_alpha", "alpha", saved.lora_alpha, cfg.alpha),
                    ("target_modules", "target_modules", sorted(saved.target_modules), sorted(cfg.target_modules))]
                   if theirs != ours]
    if differences:
        raise ConfigError(f"lora.adapter {directory} has " + ", ".join(differences))
    saved.lora_dropout = cfg.dropout
    try:
        return PeftModel.from_pretrained(student, str(directory), config=saved, is_trainable=True)
    except (ValueError, RuntimeError, KeyError) as err:  # another base model's shapes or module names
        raise ConfigError(f"lora.adapter {directory} does not fit student.model: {first_detail(err)}") from err


def write_adapter(peft_model, directory: Path, dtype: torch.dtype, base: str | None) -> None:
    """The trained adapters alone in PEFT's format (what `PeftModel.from_pretrained` and lora.adapter read), and
    beside them what `scripts/export.py student` needs to merge them into a standalone model: the base model
    (None where the student is not a loadable model, e.g. pruned) and the PARD mask token (ADAPTER_SIDECAR)."""
    directory.mkdir(parents=True, exist_ok=True)
    write_adapter_sidecar(directory, base, getattr(peft_model.config, "pard_token", None))
    state = {name: tensor.detach().to("cpu", dtype).contiguous()
             for name, tensor in get_peft_model_state_dict(peft_model).items()}
    save_file(state, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(peft_model.peft_config["default"])
    config.inference_mode = True
    config.save_pretrained(str(directory))


def load_pretrained_student(spec: str, dtype: torch.dtype):
    """(model, tokenizer) of a pretrained student; `tiny:<family>[,seed=N]` builds a tiny random one."""
    loaded = TargetModel.from_pretrained(spec, dtype=dtype)
    return loaded.model, loaded.tokenizer
