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
  eagle3  EAGLE-3: no fusion layer; block 0 reads u = [norm_e(e); norm_h(f)] (its q/k/v take 2H),
          its residual is f, and a final norm precedes the head. The blocks are Llama decoder layers
          built from the target's sizes (no attention bias) whatever the target's family, as EAGLE-3,
          vLLM's speculators and SGLang build them; parameter names are theirs
          (`layers.0.hidden_norm`, `norm`), so models.exports writes both layouts by renaming.
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

Multi-layer features (EAGLE-3): with `feature_layers` = several target layers (EAGLE-3's low, mid
and high by default in the recipe), f_t is first fused from them, then treated as above:
  layer_fusion linear  f = W [h_l1; h_l2; ...]                     (EAGLE-3's fc, kH -> H)
               gated   f = sum_l g_l * (W_l h_l), g = softmax_l(W_g [W_1 h_1; ...; W_k h_k])
                       (per dimension; Dovetail's gate extended from 2 inputs to k layers - new,
                       neither paper has it)
Then the drafter's output is in the fused space (no feature regression target exists, as in
EAGLE-3) and is fed back as f for the next draft step.

Draft vocabulary (models.vocab, FR-Spec / EAGLE-3): `draft_vocab_size` set, the logits cover only
the subset (`draft_to_target` saved as a buffer); `head` picks the output layer:
  target  the target's full LM head, referenced (no draft vocabulary)
  slice   a frozen slice of the target's LM head (rows draft_to_target; only the indices are saved)
  own     a trainable Linear(H -> size), initialised from that slice (saved)

Decoder blocks are transformers' own decoder-layer class of the target's family
(`LlamaDecoderLayer`, `Qwen2DecoderLayer`, ...), looked up from the config's model type, with the
family's rotary embedding; block 0 has no input norm (EAGLE: the fused input is not normalised;
`first_block_norm: true` keeps it). No final norm: the LM head reads the last block's output, as
in EAGLE. The target's embedding and LM head are referenced (`attach_target`), never registered
as submodules, so they are neither trained nor saved.

On disk: `models.artifacts.save_dgf` / `load_dgf` (dgf.safetensors + config.json + manifest.json);
EAGLE-1/2 and EAGLE-3 layouts: models.eagle_layouts (via models.exports.export_dgf).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
from dataclasses import asdict, dataclass

import torch
from torch import nn
from transformers import AutoConfig, DynamicCache
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

from draftsmith.models.engine import EagerBuild, additive_mask, with_cache
from draftsmith.models.kernels import WeightPrecision, argmax_last, gather_weights, invariant_model, invariant_rows
from draftsmith.config import TextEnum, enum_member
from draftsmith.models.vocab import DraftHead, DraftVocab


class Fusion(TextEnum):
    """How the drafter joins a target feature and the next token's embedding (the module docstring's table)."""

    LINEAR = "linear"  # EAGLE-1/2's fc over [e; f]
    DGF = "dgf"  # Dovetail's Dynamic Gated Fusion
    EAGLE3 = "eagle3"  # no fusion layer: block 0 reads [norm_e(e); norm_h(f)]


class LayerFusion(TextEnum):
    """How several target layers become one feature."""

    LINEAR = "linear"  # EAGLE-3's fc, kH -> H
    GATED = "gated"  # a softmax gate over the projected layers

ACTIVATIONS = {"silu": nn.SiLU, "gelu": nn.GELU, "tanh": nn.Tanh, "relu": nn.ReLU, "identity": nn.Identity}
# Keys of the target's HF config that describe that checkpoint, not a decoder block.
DROP_CONFIG_KEYS = ("architectures", "_name_or_path", "auto_map", "transformers_version", "torch_dtype", "dtype",
                     "quantization_config", "_attn_implementation_autoset")


@dataclass
class DGFConfig:
    hidden_size: int
    vocab_size: int
    target_config: dict  # the target's HF config as a dict (model_type, heads, rope, norms, ...)
    num_blocks: int = 1  # M decoder blocks (Dovetail: 4; EAGLE: 1)
    fusion: Fusion = Fusion.DGF
    fusion_act: str = "silu"  # DGF token-branch activation (identity = the paper text literally)
    fusion_bias: bool = True
    first_block_norm: bool = False  # EAGLE drops block 0's input norm
    feature_layer: int = -1  # output_hidden_states index of the target feature the drafter reads
    feature_layers: list[int] | None = None  # several layers (EAGLE-3); None: [feature_layer]
    layer_fusion: LayerFusion = LayerFusion.LINEAR  # how several layers become one feature
    draft_vocab_size: int | None = None  # None: the target's full vocabulary
    head: DraftHead = DraftHead.TARGET

    def __post_init__(self):
        self.fusion = enum_member(Fusion, self.fusion, "fusion")
        self.layer_fusion = enum_member(LayerFusion, self.layer_fusion, "layer_fusion")
        self.head = enum_member(DraftHead, self.head, "head")
        if (self.head is DraftHead.TARGET) != (self.draft_vocab_size is None):
            raise ValueError("a draft vocabulary needs head 'slice' or 'own'; head 'target' scores the full vocabulary")
        if self.feature_layers is not None and not self.feature_layers:
            raise ValueError("feature_layers: give at least one layer (or null for [feature_layer])")
        if self.fusion_act not in ACTIVATIONS:
            raise ValueError(f"fusion_act must be one of {sorted(ACTIVATIONS)}, got {self.fusion_act!r}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if "model_type" not in self.target_config:
            raise ValueError("target_config must be a HF config dict with a model_type")

    @classmethod
    def for_target(cls, target_config, **kwargs) -> "DGFConfig":
        """A config for a target (its HF `PretrainedConfig`); kwargs set the drafter's own fields."""
        config = {k: v for k, v in target_config.to_dict().items() if k not in DROP_CONFIG_KEYS}
        return cls(hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size,
                   target_config=config, **kwargs)

    def to_dict(self) -> dict:
        """Plain JSON values (the enums as their text)."""
        return {key: value.value if isinstance(value, enum.Enum) else value for key, value in asdict(self).items()}

    @property
    def method(self) -> str:
        """The method a manifest names: `dgf` for Dovetail's fusion, `eagle` for the EAGLE-1/2/3 ones."""
        return "dgf" if self.fusion is Fusion.DGF else "eagle"

    @property
    def layers_read(self) -> list[int]:
        """The target hidden-state layers the drafter reads (output_hidden_states indices)."""
        return list(self.feature_layers) if self.feature_layers is not None else [self.feature_layer]

    @property
    def multi_layer(self) -> bool:
        return len(self.layers_read) > 1

    def block_config(self):
        """The target's HF config trimmed to `num_blocks` layers (what the blocks and cache are built from);
        for EAGLE-3 a Llama config of the target's sizes."""
        data = eagle3_layer_config(self.target_config) if self.fusion is Fusion.EAGLE3 else dict(self.target_config)
        model_type = data.pop("model_type")
        data["num_hidden_layers"] = self.num_blocks
        layer_types = data.get("layer_types")
        if layer_types:
            data["layer_types"] = (list(layer_types) * self.num_blocks)[: self.num_blocks]
        config = AutoConfig.for_model(model_type, **data)
        config._attn_implementation = "sdpa"
        return config


EAGLE3_LAYER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters",
                     "rope_theta", "rope_scaling", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id")


def eagle3_layer_config(target_config: dict) -> dict:
    """A Llama decoder-layer config dict with the target's sizes and rotary settings (no biases)."""
    data = {key: target_config[key] for key in EAGLE3_LAYER_KEYS if target_config.get(key) is not None}
    data.setdefault("head_dim", data["hidden_size"] // data["num_attention_heads"])
    return {"model_type": "llama", **data, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}


def eagle3_layers(num_hidden_layers: int) -> list[int]:
    """EAGLE-3's low, mid and high features: hidden-state indices 2, L // 2 and L - 3 (index i = the
    input of decoder layer i = output_hidden_states[i]; vLLM's and speculators'
    `eagle_aux_hidden_state_layer_ids` default), ascending; shallow models get the distinct ones that exist."""
    wanted = [2, num_hidden_layers // 2, num_hidden_layers - 3]
    return sorted({min(max(index, 1), num_hidden_layers) for index in wanted})


def family_classes(config) -> tuple[type, type]:
    """(DecoderLayer class, RotaryEmbedding class) of a HF config's model family, from transformers."""
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


class ConcatFusion(nn.Module):
    """EAGLE-3: [e; f] goes to block 0 whole (it normalises each half itself)."""

    def __init__(self, config: DGFConfig):
        super().__init__()

    def forward(self, features: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:  # (…, H) x2 -> (…, 2H)
        return torch.cat([embeddings, features], dim=-1)


class Eagle3FirstBlock(nn.Module):
    """EAGLE-3's block 0, built from a decoder layer: q/k/v read [input_layernorm(e); hidden_norm(f)]
    (2H), the residual is f; then the layer's own MLP half."""

    def __init__(self, layer: nn.Module, config):
        super().__init__()
        attention = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attention, name)
            setattr(attention, name, nn.Linear(2 * config.hidden_size, old.out_features, bias=old.bias is not None))
        self.self_attn, self.mlp = attention, layer.mlp
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.hidden_norm = type(layer.post_attention_layernorm)(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, use_cache: bool = False,
                position_embeddings=None, **kwargs) -> torch.Tensor:
        """`kwargs` carries the KV cache under this transformers' name for it (models.engine.CACHE_KEYWORD)."""
        embeddings, features = hidden_states.chunk(2, dim=-1)  # (B, T, H) each
        normed = torch.cat([self.input_layernorm(embeddings), self.hidden_norm(features)], dim=-1)  # (B, T, 2H)
        attended, _ = self.self_attn(hidden_states=normed, attention_mask=attention_mask, position_ids=position_ids,
                                     use_cache=use_cache,
                                     position_embeddings=position_embeddings, **kwargs)
        hidden = features + attended
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LinearLayerFusion(nn.Module):
    """EAGLE-3: f = fc([h_1; ...; h_k]) (kH -> H)."""

    def __init__(self, config: DGFConfig):
        super().__init__()
        self.fc = nn.Linear(len(config.layers_read) * config.hidden_size, config.hidden_size, bias=False)

    def forward(self, layers: torch.Tensor) -> torch.Tensor:  # (…, k, H) -> (…, H)
        return self.fc(layers.flatten(-2))


class GatedLayerFusion(nn.Module):
    """f = sum_l g_l * W_l h_l with g = softmax over l of W_g [W_1 h_1; ...; W_k h_k] (per dimension)."""

    def __init__(self, config: DGFConfig):
        super().__init__()
        k, hidden = len(config.layers_read), config.hidden_size
        self.proj = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(k))
        self.gate = nn.Linear(k * hidden, k * hidden, bias=True)
        nn.init.zeros_(self.gate.bias)

    def forward(self, layers: torch.Tensor) -> torch.Tensor:  # (…, k, H) -> (…, H)
        projected = torch.stack([proj(layers[..., i, :]) for i, proj in enumerate(self.proj)], -2)  # (…, k, H)
        gates = torch.softmax(self.gate(projected.flatten(-2)).unflatten(-1, projected.shape[-2:]), dim=-2)
        return (gates * projected).sum(-2)


FUSION_CLASSES = {Fusion.LINEAR: LinearFusion, Fusion.DGF: GatedFusion, Fusion.EAGLE3: ConcatFusion}
LAYER_FUSION_CLASSES = {LayerFusion.LINEAR: LinearLayerFusion, LayerFusion.GATED: GatedLayerFusion}


class DGFModel(nn.Module):
    """(Layer fusion) + token fusion + M decoder blocks (+ a draft head); predicts the next feature.
    The trainable part only: the target's embedding and LM head are referenced."""

    def __init__(self, config: DGFConfig):
        super().__init__()
        self.config = config
        self.block_config = config.block_config()
        layer_cls, rotary_cls = family_classes(self.block_config)
        self.layer_fusion = (None if not config.multi_layer else
                             LAYER_FUSION_CLASSES[config.layer_fusion](config))
        self.fusion = FUSION_CLASSES[config.fusion](config)
        self.layers = nn.ModuleList(layer_cls(self.block_config, layer_idx=i) for i in range(config.num_blocks))
        self.norm = None  # EAGLE-3's final norm before the head
        if config.fusion is Fusion.EAGLE3:
            self.layers[0] = Eagle3FirstBlock(self.layers[0], self.block_config)
            self.norm = type(self.layers[0].post_attention_layernorm)(config.hidden_size,
                                                                       eps=self.block_config.rms_norm_eps)
        elif not config.first_block_norm:
            self.layers[0].input_layernorm = nn.Identity()
        self.rotary_emb = rotary_cls(config=self.block_config)
        self._embed: nn.Module | None = None  # the target's, referenced (not a submodule)
        self._lm_head: nn.Module | None = None
        size = config.draft_vocab_size
        if size is not None:
            self.register_buffer("draft_to_target", torch.arange(size), persistent=True)  # set by set_vocab / loading
            sliced = size if config.head is DraftHead.SLICE else 0
            self.register_buffer("sliced_head", torch.zeros(sliced, config.hidden_size),
                                 persistent=False)  # the target's rows, filled by attach_target
        self.draft_head = nn.Linear(config.hidden_size, size, bias=False) if config.head is DraftHead.OWN else None

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
        self._fill_slice()
        return self

    def set_vocab(self, vocab: DraftVocab) -> "DGFModel":
        """Use this draft vocabulary (before training; a loaded drafter brings its own)."""
        if vocab.size != self.config.draft_vocab_size or vocab.target_size != self.config.vocab_size:
            raise ValueError(f"a draft vocabulary of {vocab.size} of {vocab.target_size} tokens does not fit this "
                             f"drafter ({self.config.draft_vocab_size} of {self.config.vocab_size})")
        self.draft_to_target.copy_(vocab.draft_to_target)
        self._fill_slice()
        return self

    @torch.no_grad()
    def init_draft_head(self) -> None:
        """An own head starts as the target's rows of the draft vocabulary."""
        self._need_target()
        if self.draft_head is not None:
            self.draft_head.weight.copy_(self._lm_head.weight[self.draft_to_target.to(self._lm_head.weight.device)])

    @torch.no_grad()
    def _fill_slice(self) -> None:
        if self.config.head is DraftHead.SLICE and self._lm_head is not None:
            weight = self._lm_head.weight
            self.sliced_head = weight[self.draft_to_target.to(weight.device)].to(self.sliced_head.dtype).to(
                self.sliced_head.device)

    @property
    def draft_vocab(self) -> DraftVocab | None:
        if self.config.draft_vocab_size is None:
            return None
        return DraftVocab(self.draft_to_target.cpu(), self.config.vocab_size)

    def fuse_layers(self, layers: torch.Tensor) -> torch.Tensor:
        """Target features (…, k, H) of the layers read -> the drafter's input feature (…, H)."""
        if self.layer_fusion is None:
            return layers[..., 0, :].to(self.dtype)
        return self.layer_fusion(layers.to(self.dtype))

    def _need_target(self):
        if self._embed is None or self._lm_head is None:
            raise RuntimeError("DGFModel needs the target's embedding and LM head: call attach_target(model) first")

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._need_target()
        return self._embed(input_ids.to(self._embed.weight.device)).to(self.dtype)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted features (…, H) -> float32 logits (…, V), or (…, draft vocabulary size)."""
        return self.head_logits(hidden).float()

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output layer in its own dtype: the target's LM head, its frozen slice, or the own head
        (EAGLE-3: after the drafter's final norm)."""
        return self.head_output(self.head_input(hidden))

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the output layer reads: `hidden` after the drafter's final norm (EAGLE-3), in the head's dtype."""
        self._need_target()
        if self.norm is not None:
            hidden = self.norm(hidden)
        if self.config.head is DraftHead.OWN:
            return hidden.to(self.dtype)
        return hidden.to(self.sliced_head.dtype if self.config.head is DraftHead.SLICE else self._lm_head.weight.dtype)

    def head_output(self, inputs: torch.Tensor) -> torch.Tensor:
        """The output layer on its inputs (head_input's): logits over the vocabulary the drafter scores."""
        if self.config.head is DraftHead.OWN:
            return self.draft_head(inputs)
        if self.config.head is DraftHead.SLICE:
            return nn.functional.linear(inputs, self.sliced_head)
        return self._lm_head(inputs)

    def head_linear(self) -> nn.Linear:
        """The output layer as a Linear over the model's own rows (a slice's rows wrapped, not copied)."""
        self._need_target()
        if self.config.head is DraftHead.OWN:
            return self.draft_head
        if self.config.head is DraftHead.SLICE:
            linear = nn.Linear(self.config.hidden_size, self.sliced_head.shape[0], bias=False, device="meta")
            linear.weight = nn.Parameter(self.sliced_head, requires_grad=False)
            return linear
        return self._lm_head

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
        return self.blocks(features, input_ids, position_ids, mask, cache)

    def blocks(self, features: torch.Tensor, input_ids: torch.Tensor, position_ids: torch.Tensor,
               mask: torch.Tensor | None, cache=None) -> torch.Tensor:
        """Fusion + the M blocks: features (B, T, H), input_ids (B, T), position_ids (B, T), `mask` additive
        (B or 1, 1, T, cache slots) or None (causal) -> (B, T, H); the new keys/values go to `cache`."""
        hidden = self.fusion(features.to(self.dtype), self.embed(input_ids).to(features.device))  # (B, T, H)
        position_embeddings = self.rotary_emb(hidden, position_ids)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, **with_cache(cache),
                           use_cache=cache is not None, position_embeddings=position_embeddings)
            if isinstance(hidden, tuple):  # older transformers return (hidden, ...)
                hidden = hidden[0]
        return hidden

    def new_cache(self):
        return DynamicCache()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


class EagerDGFEngine(EagerBuild):
    """The drafter's forwards in eager PyTorch over a DynamicCache (models.compiled.CompiledDGFEngine is
    the static-shape one); the interface the DGF drafter uses."""

    def __init__(self, model: DGFModel):
        self.model = model

    def new_cache(self, max_length: int | None = None) -> DynamicCache:
        return DynamicCache()

    def fuse_layers(self, layers: torch.Tensor) -> torch.Tensor:
        return self.model.fuse_layers(layers)

    @torch.inference_mode()
    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, cache, position_ids: torch.Tensor | None = None,
                allowed: torch.Tensor | None = None, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted features (1, n, H), float32 logits (1, n or 1, V)); `last_only`: the last row's logits."""
        hidden = self.model(features, input_ids, position_ids, cache, allowed)
        return hidden, self.model.logits(hidden[:, -1:] if last_only else hidden)

    def forward_argmax(self, features: torch.Tensor, input_ids: torch.Tensor, cache,
                       last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(predicted features (1, n, H), each row's most likely draft token (1, n or 1)): a causal forward whose
        reader needs only the argmax (a greedy chain)."""
        hidden, logits = self.forward(features, input_ids, cache, last_only=last_only)
        return hidden, argmax_last(logits)


def invariant_drafter(model: DGFModel, precision: WeightPrecision) -> DGFModel:
    """A feature drafter on the batch-invariant kernels (kernels.invariant_model); a frozen slice of the target's
    LM head becomes the copy's own head (an InvariantLinear over the same rows), so it streams like the rest."""
    runs = invariant_model(model, precision, gather=False)
    if runs.config.head is DraftHead.SLICE:
        runs.draft_head = invariant_rows(runs.sliced_head, precision)
        runs.config = dataclasses.replace(runs.config, head=DraftHead.OWN)
    gather_weights(runs)
    return runs
