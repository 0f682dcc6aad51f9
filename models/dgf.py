"""EAGLE-style feature drafter with Dynamic Gated Fusion and M decoder blocks (Dovetail, III-B/C).

At sequence position t the drafter reads the target's feature f_t (hidden state `feature_layer`,
default -1 = the final normed state that feeds the LM head: what EAGLE's code calls the
"second-to-top-layer feature", the LM head being the top layer; Dovetail's "second-to-top hidden
state") and the embedding e_{t+1} of the token that follows, fuses them, runs M decoder blocks and
predicts the next feature f_{t+1}; the target's frozen LM head turns that into logits for x_{t+2}:

    u_t    = fuse(f_t, e_{t+1})                       # (B, T, H)
    f^_t+1 = blocks(u_<=t)                            # causal / tree-masked attention, own KV cache
    logits = lm_head(f^_t+1)                          # the target's LM head (not a copy)

Fusion (one class, `fusion` in the config):
  linear  EAGLE-1/2:  u = W [e; f] + b   (Linear(2H -> H); EAGLE's `fc`, embedding first as in its
          `torch.cat((inputs_embeds, hidden_states), -1)`)
  dgf     Dovetail's Dynamic Gated Fusion, exactly:
              h1 = W1 f + b1                 (feature branch, linear)
              h2 = act(W2 e + b2)            (token branch; act = `fusion_act`, default SiLU)
              z  = sigmoid(Wz [h1; h2] + bz) (a per-dimension gate, Linear(2H -> H))
              u  = z * h1 + (1 - z) * h2
          Against the paper text: it says both inputs get "linear transformations", the gate is a
          linear layer + sigmoid on the concatenation [h1; h2], and the fused feature is the
          gate-weighted sum - all as above. The text names no activation on either branch; we put
          one on the token branch (as the gated multimodal unit [12] it cites does with tanh);
          `fusion_act: identity` gives the literal text. Whether the gate is a scalar or a vector is
          not stated; we use a vector (as GMU). bz = 0 so the gate starts at 0.5.

Decoder blocks are transformers' own decoder-layer class of the target's family
(`LlamaDecoderLayer`, `Qwen2DecoderLayer`, ...), looked up from the config's model type, with the
family's rotary embedding; block 0 has no input norm (EAGLE: the fused input is not normalised;
`first_block_norm: true` keeps it). No final norm: the LM head reads the last block's output, as
in EAGLE. The target's embedding and LM head are referenced (`attach_target`), never registered
as submodules, so they are neither trained nor saved.

On disk (`save_dgf` / `load_dgf`): `dgf.safetensors` (fusion + blocks, float32), `config.json`
(DGFConfig), `manifest.json` (format draftsmith.dgf/1: target name, model type, hidden size, vocab
size and fingerprint, hidden layer ids, fusion, number of blocks). `export_eagle` / `load_eagle`
write and read EAGLE's checkpoint layout (see their docstrings) for `fusion: linear`.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from draftsmith.models.target import additive_mask, resolve_device, vocab_fingerprint

MANIFEST_FORMAT = "draftsmith.dgf/1"
WEIGHTS_FILE = "dgf.safetensors"
CONFIG_FILE = "config.json"
MANIFEST_FILE = "manifest.json"
EAGLE_WEIGHTS_FILE = "model.safetensors"
FUSIONS = ("linear", "dgf")
ACTIVATIONS = {"silu": nn.SiLU, "gelu": nn.GELU, "tanh": nn.Tanh, "relu": nn.ReLU, "identity": nn.Identity}
# Keys of the target's HF config that describe that checkpoint, not a decoder block.
_DROP_CONFIG_KEYS = ("architectures", "_name_or_path", "auto_map", "transformers_version", "torch_dtype", "dtype",
                     "quantization_config", "_attn_implementation_autoset")


@dataclass
class DGFConfig:
    hidden_size: int
    vocab_size: int
    target_config: dict  # the target's HF config as a dict (model_type, heads, rope, norms, ...)
    num_blocks: int = 1  # M decoder blocks (Dovetail: 4; EAGLE: 1)
    fusion: Literal["linear", "dgf"] = "dgf"
    fusion_act: str = "silu"  # DGF token-branch activation (identity = the paper text literally)
    fusion_bias: bool = True
    first_block_norm: bool = False  # EAGLE drops block 0's input norm
    feature_layer: int = -1  # output_hidden_states index of the target feature the drafter reads

    def __post_init__(self):
        if self.fusion not in FUSIONS:
            raise ValueError(f"fusion must be one of {FUSIONS}, got {self.fusion!r}")
        if self.fusion_act not in ACTIVATIONS:
            raise ValueError(f"fusion_act must be one of {sorted(ACTIVATIONS)}, got {self.fusion_act!r}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if "model_type" not in self.target_config:
            raise ValueError("target_config must be a HF config dict with a model_type")

    @classmethod
    def for_target(cls, target_config, **kwargs) -> "DGFConfig":
        """A config for a target (its HF `PretrainedConfig`); kwargs set the drafter's own fields."""
        config = {k: v for k, v in target_config.to_dict().items() if k not in _DROP_CONFIG_KEYS}
        return cls(hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size,
                   target_config=config, **kwargs)

    def to_dict(self) -> dict:
        return asdict(self)

    def block_config(self):
        """The target's HF config trimmed to `num_blocks` layers (what the blocks and cache are built from)."""
        from transformers import AutoConfig

        data = dict(self.target_config)
        model_type = data.pop("model_type")
        data["num_hidden_layers"] = self.num_blocks
        layer_types = data.get("layer_types")
        if layer_types:
            data["layer_types"] = (list(layer_types) * self.num_blocks)[: self.num_blocks]
        config = AutoConfig.for_model(model_type, **data)
        config._attn_implementation = "sdpa"
        return config


def family_classes(config) -> tuple[type, type]:
    """(DecoderLayer class, RotaryEmbedding class) of a HF config's model family, from transformers."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    model_type = config.model_type
    base_name = MODEL_MAPPING_NAMES.get(model_type)
    if base_name is None:
        raise ValueError(f"transformers knows no base model for model_type {model_type!r}")
    module = importlib.import_module(f"transformers.models.{model_type.replace('-', '_')}.modeling_{model_type.replace('-', '_')}")
    prefix = base_name[: -len("Model")] if base_name.endswith("Model") else base_name
    layer_cls = getattr(module, f"{prefix}DecoderLayer", None)
    rotary_cls = getattr(module, f"{prefix}RotaryEmbedding", None)
    if layer_cls is None or rotary_cls is None:
        raise ValueError(f"{module.__name__} has no {prefix}DecoderLayer / {prefix}RotaryEmbedding: model type "
                         f"{model_type!r} is not supported by the DGF drafter")
    return layer_cls, rotary_cls


class LinearFusion(nn.Module):
    """EAGLE: u = fc([e; f])."""

    def __init__(self, config: DGFConfig):
        super().__init__()
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.fusion_bias)

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:  # (…, H) x2 -> (…, H)
        return self.fc(torch.cat([embeddings, features], dim=-1))


class GatedFusion(nn.Module):
    """Dovetail DGF: h1 = W1 f, h2 = act(W2 e), z = sigmoid(Wz [h1; h2]), u = z h1 + (1 - z) h2."""

    def __init__(self, config: DGFConfig):
        super().__init__()
        hidden, bias = config.hidden_size, config.fusion_bias
        self.feature_proj = nn.Linear(hidden, hidden, bias=bias)  # W1
        self.token_proj = nn.Linear(hidden, hidden, bias=bias)  # W2
        self.act = ACTIVATIONS[config.fusion_act]()
        self.gate = nn.Linear(2 * hidden, hidden, bias=True)  # Wz
        nn.init.zeros_(self.gate.bias)

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        h1 = self.feature_proj(features)  # (…, H)
        h2 = self.act(self.token_proj(embeddings))  # (…, H)
        z = torch.sigmoid(self.gate(torch.cat([h1, h2], dim=-1)))  # (…, H)
        return z * h1 + (1.0 - z) * h2


class DGFModel(nn.Module):
    """Fusion + M decoder blocks; predicts the target's next feature. Trainable part only."""

    def __init__(self, config: DGFConfig):
        super().__init__()
        self.config = config
        self.block_config = config.block_config()
        layer_cls, rotary_cls = family_classes(self.block_config)
        self.fusion = LinearFusion(config) if config.fusion == "linear" else GatedFusion(config)
        self.layers = nn.ModuleList(layer_cls(self.block_config, layer_idx=i) for i in range(config.num_blocks))
        if not config.first_block_norm:
            self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = rotary_cls(config=self.block_config)
        self._embed: nn.Module | None = None  # the target's, referenced (not a submodule)
        self._lm_head: nn.Module | None = None

    # -- the target's frozen modules -----------------------------------------------------------

    def attach_target(self, target_model) -> "DGFModel":
        """Reference the target's input embedding and LM head (a HF causal LM), checking sizes."""
        embed, head = target_model.get_input_embeddings(), target_model.get_output_embeddings()
        if embed.weight.shape != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"target embedding {tuple(embed.weight.shape)} does not fit the drafter "
                             f"(vocab {self.config.vocab_size}, hidden {self.config.hidden_size})")
        if head.weight.shape != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"target LM head {tuple(head.weight.shape)} does not fit the drafter")
        self.__dict__["_embed"], self.__dict__["_lm_head"] = embed, head
        return self

    def _need_target(self):
        if self._embed is None or self._lm_head is None:
            raise RuntimeError("DGFModel needs the target's embedding and LM head: call attach_target(model) first")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._need_target()
        return self._embed(input_ids.to(self._embed.weight.device)).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted features (…, H) -> float32 logits (…, V) through the target's LM head."""
        self._need_target()
        head = self._lm_head
        return head(hidden.to(head.weight.dtype)).float()

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].post_attention_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].post_attention_layernorm.weight.device

    # -- forward ---------------------------------------------------------------------------------

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                cache=None, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """features (B, T, H) f_t and input_ids (B, T) x_{t+1} -> predicted features (B, T, H) of t + 1.

        `cache`: a DynamicCache the T new entries are appended to (None: no cache).
        `allowed` (B or 1, 1, T, past + T) bool: which cached/new entries each query may attend to;
        None = causal over past + T. `position_ids` (B, T) default past .. past + T - 1.
        """
        batch, length, _ = features.shape
        past = cache.get_seq_length() if cache is not None else 0
        device = features.device
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=device).expand(batch, -1)
        mask = None
        if allowed is None and length > 1:
            allowed = torch.ones(length, past + length, dtype=torch.bool, device=device).tril(past)[None, None]
        if allowed is not None:
            mask = additive_mask(allowed.to(device), self.dtype)
        hidden = self.fusion(features.to(self.dtype), self.embed(input_ids).to(device))  # (B, T, H)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                           use_cache=cache is not None, position_embeddings=position_embeddings)
            if isinstance(hidden, tuple):  # older transformers return (hidden, ...)
                hidden = hidden[0]
        return hidden

    def new_cache(self):
        from transformers import DynamicCache

        return DynamicCache()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ---------------------------------------------------------------------------------------------
# Manifest helpers
# ---------------------------------------------------------------------------------------------


def target_manifest(target, name: str, feature_layer: int, dtype: str | None = None) -> dict:
    """The manifest's `target` block for a TargetModel (what load-time checks compare)."""
    config = target.config
    return {"name": name, "model_type": config.model_type, "hidden_size": config.hidden_size,
            "vocab_size": config.vocab_size, "num_hidden_layers": config.num_hidden_layers,
            "vocab_fingerprint": vocab_fingerprint(target.tokenizer), "hidden_layer": feature_layer,
            "hidden_layers": [feature_layer], "dtype": dtype}


def read_manifest(path: str | Path) -> dict:
    from draftsmith.models.medusa import read_manifest as read_any

    return read_any(path, expected_format=MANIFEST_FORMAT)


def check_manifest_target(manifest: dict, target, where: str = "DGF checkpoint") -> None:
    """Refuse a drafter trained for another target (hidden size, vocab size/fingerprint, layers)."""
    from draftsmith.models.medusa import check_manifest_target as check_any

    check_any(manifest, target, where=where, hidden_layer=manifest["target"].get("hidden_layer"))
    num_layers = manifest["target"].get("num_hidden_layers")
    if num_layers is not None and num_layers != target.config.num_hidden_layers:
        raise ValueError(f"{where} was trained for target {manifest['target'].get('name')!r} with {num_layers} layers "
                         f"(features of layer {manifest['target'].get('hidden_layer')}); the given target has "
                         f"{target.config.num_hidden_layers}")


# ---------------------------------------------------------------------------------------------
# Save / load
# ---------------------------------------------------------------------------------------------


def drafter_state(model: DGFModel) -> dict[str, torch.Tensor]:
    return {name: t.detach().float().cpu().contiguous() for name, t in model.state_dict().items()}


def save_dgf(model: DGFModel, out_dir: str | Path, target_block: dict, extra: dict | None = None) -> Path:
    """Write weights + config + manifest into `out_dir` (created; files replaced)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(drafter_state(model), str(out / WEIGHTS_FILE), metadata={"format": MANIFEST_FORMAT})
    (out / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2))
    manifest = {"format": MANIFEST_FORMAT, "method": "dgf" if model.config.fusion == "dgf" else "eagle",
                "target": target_block,
                "drafter": {"file": WEIGHTS_FILE, "config": CONFIG_FILE, "dtype": "float32",
                            "fusion": model.config.fusion, "num_blocks": model.config.num_blocks,
                            "parameters": model.num_parameters()},
                **(extra or {})}
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2))
    return out


def _load_weights(file: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not file.is_file():
        raise FileNotFoundError(f"checkpoint is incomplete: {file} is missing")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise ValueError(f"{file} is corrupt or truncated ({err})") from err


def load_dgf(path: str | Path, target=None, device: str | torch.device | None = None,
             dtype: torch.dtype = torch.float32) -> tuple[DGFModel, dict]:
    """(DGFModel, manifest) from a `save_dgf` directory. With `target` (a TargetModel): refuse a
    manifest for another target, then attach its embedding and LM head and move to its device."""
    path = Path(path)
    manifest = read_manifest(path)
    if target is not None:
        check_manifest_target(manifest, target, where=f"DGF checkpoint {path}")
    config_file = path / manifest["drafter"]["config"]
    if not config_file.is_file():
        raise FileNotFoundError(f"DGF checkpoint {path} is incomplete: {config_file.name} is missing")
    config = DGFConfig(**json.loads(config_file.read_text()))
    model = DGFModel(config)
    state = _load_weights(path / manifest["drafter"]["file"])
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{path / manifest['drafter']['file']} does not match {config_file.name}: {err}") from err
    if target is not None:
        device = target.device if device is None else device
        model.attach_target(target.model)
    return model.to(device=resolve_device(device), dtype=dtype).eval(), manifest


# ---------------------------------------------------------------------------------------------
# EAGLE checkpoint layout
# ---------------------------------------------------------------------------------------------


def export_eagle(model: "DGFModel | DGFDrafter", out_dir: str | Path) -> Path:
    """Write a `fusion: linear` drafter in EAGLE's checkpoint layout (SafeAILab/EAGLE `cnets.py`).

    config.json: the target family's HF config with num_hidden_layers = M (as EAGLE's configs are),
    plus `"bias"` (EAGLE reads it for `fc`). model.safetensors: `fc.weight`, `fc.bias`,
    `layers.{i}.self_attn.{q,k,v,o}_proj.*`, `layers.{i}.mlp.{gate,up,down}_proj.weight`,
    `layers.{i}.post_attention_layernorm.weight` and, for i > 0, `layers.{i}.input_layernorm.weight`
    - the names of EAGLE's `Model`. Differences from EAGLE's own files: weights are safetensors
    (EAGLE-1 ships pytorch_model.bin), float32, and `embed_tokens.weight` is not stored (EAGLE copies
    it from the base model at load time too); the feature is the target's final normed state,
    as in EAGLE's code.
    """
    from safetensors.torch import save_file

    model = getattr(model, "model", model)  # a DGFDrafter works too
    if model.config.fusion != "linear":
        raise ValueError("EAGLE's layout has no gated fusion: only fusion='linear' drafters export to it "
                         "(save DGF drafters with save_dgf and their manifest)")
    if model.config.first_block_norm:
        raise ValueError("EAGLE's layer 0 has no input norm; this drafter has one (first_block_norm=true)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {name.removeprefix("fusion."): t for name, t in drafter_state(model).items()}
    save_file(state, str(out / EAGLE_WEIGHTS_FILE), metadata={"format": "pt"})
    config = model.block_config.to_dict()
    config.update(bias=model.config.fusion_bias, architectures=["LlamaForCausalLM"] if config["model_type"] == "llama"
                  else config.get("architectures"))
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, default=str))
    return out


def load_eagle(path: str | Path, target_model=None) -> DGFModel:
    """A `fusion: linear` DGFModel from an EAGLE-layout directory (config.json + model.safetensors)."""
    path = Path(path)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise FileNotFoundError(f"{path} has no {CONFIG_FILE} (expected an EAGLE checkpoint directory)")
    hf = json.loads(config_file.read_text())
    num_blocks = int(hf["num_hidden_layers"])
    bias = bool(hf.pop("bias", True))
    target_config = {k: v for k, v in hf.items() if k not in _DROP_CONFIG_KEYS}
    config = DGFConfig(hidden_size=hf["hidden_size"], vocab_size=hf["vocab_size"], target_config=target_config,
                       num_blocks=num_blocks, fusion="linear", fusion_bias=bias)
    model = DGFModel(config)
    state = _load_weights(path / EAGLE_WEIGHTS_FILE)
    state.pop("embed_tokens.weight", None)  # EAGLE's own files may carry the base model's embedding
    state = {(f"fusion.{k}" if k.startswith("fc.") else k): v for k, v in state.items()}
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{path / EAGLE_WEIGHTS_FILE} does not fit its {CONFIG_FILE}: {err}") from err
    if target_model is not None:
        model.attach_target(target_model)
    return model.eval()
