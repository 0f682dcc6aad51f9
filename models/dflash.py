"""DFlash block drafter: target features in, one forward proposes a whole block of tokens.

The drafter reads the target's hidden states at a few decoder layers (`target_layer_ids`: the outputs of those
layers, HF `hidden_states[id + 1]`), fuses them per position (`fc`: kH -> H, then `hidden_norm`), and every draft
layer turns that fused context into keys and values of its own attention (its k_proj / k_norm / v_proj, rotary at
the context position). A round drafts from one forward over the block

    [root, mask, mask, ..., mask]      at positions L, L + 1, ..., L + B - 1

(root: the token the target just chose, not yet in its cache; L: the tokens the target has processed), whose
queries attend to the whole context and to the whole block (no causal mask inside the block); the logits at block
position k (k >= 1) propose the token at position L + k, through the drafter's final norm and the target's LM head.
Every draft layer is a Qwen3 decoder layer (q_norm / k_norm on each head), as z-lab's DFlash, llama.cpp's
`dflash` architecture (src/models/dflash.cpp) and speculators' `DFlashDraftModel` build it; the token embeddings
and the LM head are the target's (referenced, not registered: neither trained nor saved).

Training (`forward`): for each record, A anchors a (answer positions), each with the block [x_a, mask...] at
positions a..a+B-1 that sees the context features of positions < a and its own block; block position k learns the
target's distribution for the token at a + k (speculators' anchored blocks, DFlash's exponentially decaying
weights per position, train/dflash.py).

Inference (the decoder's drafter): EagerDFlashEngine keeps a request's context keys and values in ContextBuffers and
runs the block after them; models/compiled_dflash.py runs the same two forwards (`context_into`, `block_cached`) as
compiled graphs over a static cache.

Parameter names are z-lab's (`fc`, `hidden_norm`, `layers.N.self_attn.q_proj`, `norm`), so the state dict is the
checkpoint llama.cpp's converter and speculators read (models/export_dflash.py writes their configs).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_positions: int
    block_size: int
    target_layer_ids: tuple[int, ...]  # decoder layers whose outputs are read (HF hidden_states[id + 1])
    mask_token_id: int

    def __post_init__(self):
        object.__setattr__(self, "target_layer_ids", tuple(int(i) for i in self.target_layer_ids))

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """The target's hidden-state indices the drafter reads (0 = embeddings: layer id + 1)."""
        return tuple(i + 1 for i in self.target_layer_ids)

    @classmethod
    def from_target(cls, target_config, num_layers: int, block_size: int, target_layer_ids: list[int],
                    mask_token_id: int) -> "DFlashConfig":
        """Draft layers of the target's sizes (width, heads, MLP, rotary base)."""
        heads = target_config.num_attention_heads
        head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // heads
        return cls(hidden_size=target_config.hidden_size, num_layers=num_layers, num_heads=heads,
                   num_kv_heads=getattr(target_config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   intermediate_size=target_config.intermediate_size, rms_norm_eps=target_config.rms_norm_eps,
                   rope_theta=rope_theta_of(target_config), vocab_size=target_config.vocab_size,
                   max_positions=target_config.max_position_embeddings, block_size=block_size,
                   target_layer_ids=tuple(target_layer_ids), mask_token_id=mask_token_id)

    def to_dict(self) -> dict:
        return {**asdict(self), "target_layer_ids": list(self.target_layer_ids)}

    @classmethod
    def from_dict(cls, data: dict) -> "DFlashConfig":
        return cls(**data)


def rope_theta_of(config) -> float:
    """The rotary base of a transformers config (`rope_parameters` in transformers 5, `rope_theta` before)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in parameters:
        return float(parameters["rope_theta"])
    return float(getattr(config, "rope_theta", 10000.0))


def evenly_spaced_layers(num_target_layers: int, count: int) -> list[int]:
    """Up to `count` decoder layers from the second to the fourth-last, evenly spaced (DFlash's choice); never the
    last layer, whose output is the final norm's input rather than a layer input an engine hands over."""
    first = min(1, num_target_layers - 2)
    last = max(first, num_target_layers - 3)
    if count == 1:
        return [last]
    return sorted({first + round(i * (last - first) / (count - 1)) for i in range(count)})


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, D); cos, sin (B, T, D)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class Attention(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, T, H) -> keys, values (B, kv heads, T, D), keys normed and rotated."""
        b, t, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rotary(k, cos, sin), v

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """(B, Q, H) -> queries (B, heads, Q, D), normed and rotated."""
        b, q_len, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        return apply_rotary(q, cos, sin)

    kernel_attention = False  # True: draftsmith::attention (models.kernels), reading only the keys the mask shows

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Queries (B, heads, Q, D) over keys / values (B, kv, C, D) -> the output projection (B, Q, H)."""
        b, _, q_len, _ = q.shape
        if self.kernel_attention:  # (B, Q, heads, D); masked keys skipped, not computed (a static cache's tail)
            shape = (b, 1, q_len, k.shape[2])
            additive = (torch.zeros(shape, dtype=torch.float32, device=q.device) if mask is None else
                        torch.zeros(mask.shape, dtype=torch.float32, device=q.device).masked_fill(~mask, -torch.inf))
            out = torch.ops.draftsmith.attention(q, k, v, additive, self.head_dim ** -0.5)
            return self.o_proj(out.reshape(b, q_len, -1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))

    def forward(self, x, context_k, context_v, cos, sin, mask, length: int | None = None):
        """x (B, Q, H) the block's normed states; context keys/values (B, kv, C, D); mask (B, 1, Q, C + Q) bool or
        None (every query sees everything). With `length`, the context is the first `length` slots of buffers
        (ContextBuffers) and the block's keys and values are written after them: the context is not copied."""
        q = self.queries(x, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        if length is None:
            k, v = torch.cat([context_k, k], 2), torch.cat([context_v, v], 2)
        else:
            end = length + x.shape[1]
            context_k[:, :, length:end], context_v[:, :, length:end] = k, v
            k, v = context_k[:, :, :end], context_v[:, :, :end]
        return self.attend(q, k, v, mask)

    def forward_cached(self, x, keys, values, slots, cos, sin, mask):
        """The block over static buffers (the compiled engine's): its keys and values written at cache `slots`
        (Q,) of keys / values (B, kv, capacity, D), every query attending where the bool `mask` (B, 1, Q, capacity)
        allows."""
        q = self.queries(x, cos, sin)
        k, v = self.keys_values(x, cos, sin)
        keys.index_copy_(2, slots, k)
        values.index_copy_(2, slots, v)
        return self.attend(q, keys, values, mask)


class MLP(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, context_k, context_v, cos, sin, mask, length: int | None = None):
        x = x + self.self_attn(self.input_layernorm(x), context_k, context_v, cos, sin, mask, length)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_cached(self, x, keys, values, slots, cos, sin, mask):
        x = x + self.self_attn.forward_cached(self.input_layernorm(x), keys, values, slots, cos, sin, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashModel(nn.Module):
    def __init__(self, config: DFlashConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, config.head_dim, 2, dtype=torch.float32)
                                               / config.head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        for module in self.modules():  # transformers' initialisation (initializer_range 0.02)
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        # the target's embedding and LM head, referenced (in __dict__: not registered, neither trained nor saved)
        self.__dict__["target_embedding"] = self.__dict__["target_head"] = None

    def use_kernel_attention(self) -> "DFlashModel":
        """Every layer's attention through draftsmith::attention (the batch-invariant kernels' op, loaded by
        models.kernels.invariant_model): it reads only the keys a mask shows, so a block over a static cache costs
        what the context holds, not the cache's capacity. In place; returns the model."""
        for layer in self.layers:
            layer.self_attn.kernel_attention = True
        return self

    def attach_target(self, target_model) -> "DFlashModel":
        """Reference the target's token embedding and LM head (a full-vocabulary drafter)."""
        embedding, head = target_model.get_input_embeddings(), target_model.get_output_embeddings()
        if embedding.weight.shape != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"the target's embedding {tuple(embedding.weight.shape)} does not match the drafter's "
                             f"vocabulary x width ({self.config.vocab_size}, {self.config.hidden_size})")
        self.__dict__["target_embedding"], self.__dict__["target_head"] = embedding, head
        return self

    @property
    def embedding(self) -> nn.Module:
        return self._need_target()[0]

    @property
    def lm_head(self) -> nn.Module:
        return self._need_target()[1]

    def _need_target(self) -> tuple[nn.Module, nn.Module]:
        if self.__dict__["target_embedding"] is None:
            raise RuntimeError("DFlashModel needs attach_target(target_model) first (the embedding and LM head)")
        return self.__dict__["target_embedding"], self.__dict__["target_head"]

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) -> cos, sin (B, T, D) in float32 (HF's default rotary)."""
        angles = positions.float()[..., None] * self.inv_freq.to(positions.device)
        angles = torch.cat([angles, angles], -1)
        return angles.cos(), angles.sin()

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """(..., k * H) concatenated target layers -> the fused context (..., H)."""
        return self.hidden_norm(self.fc(features))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features (B, T, k * H) at positions (B, T) -> each layer's context keys and values (B, kv, T, D)."""
        fused = self.fuse(features.to(self.hidden_norm.weight.dtype))
        cos, sin = self.rotary(positions)
        return [layer.self_attn.keys_values(fused, cos.to(fused.dtype), sin.to(fused.dtype)) for layer in self.layers]

    def block_input(self, block_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The block's embedded tokens and its rotary cos / sin, in the drafter's dtype."""
        x = self.embedding(block_ids).to(self.hidden_norm.weight.dtype)
        cos, sin = self.rotary(positions)
        return x, cos.to(x.dtype), sin.to(x.dtype)

    def block_hidden(self, block_ids: torch.Tensor, positions: torch.Tensor,
                     context: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor | None,
                     length: int | None = None) -> torch.Tensor:
        """block_ids / positions (B, Q) -> the final normed states (B, Q, H). `context`: each layer's keys and
        values, or with `length` each layer's buffers (ContextBuffers.layers) whose first `length` slots hold them."""
        x, cos, sin = self.block_input(block_ids, positions)
        for layer, (k, v) in zip(self.layers, context):
            x = layer(x, k, v, cos, sin, mask, length)
        return self.norm(x)

    def context_into(self, features: torch.Tensor, positions: torch.Tensor, cache: list[torch.Tensor]) -> None:
        """Static buffers (the compiled engine's): features (1, T, k * H) at positions (1, T) -> each layer's
        context keys and values written at those slots of `cache` (every layer's keys, then every layer's values,
        (1, kv, capacity, D) each)."""
        slots, count = positions[0], len(self.layers)
        for index, (keys, values) in enumerate(self.context_kv(features, positions)):
            cache[index].index_copy_(2, slots, keys)
            cache[count + index].index_copy_(2, slots, values)

    def block_cached(self, block_ids: torch.Tensor, positions: torch.Tensor, cache: list[torch.Tensor]) -> torch.Tensor:
        """Static buffers: the block block_ids / positions (1, Q) after the context in the first positions[0, 0]
        slots of `cache` (its own keys and values written after them) -> the final normed states (1, Q, H)."""
        x, cos, sin = self.block_input(block_ids, positions)
        slots, count = positions[0], len(self.layers)
        capacity = cache[0].shape[2]
        mask = (torch.arange(capacity, device=positions.device) <= positions[0, -1]).expand(1, 1, x.shape[1], -1)
        for index, layer in enumerate(self.layers):
            x = layer.forward_cached(x, cache[index], cache[count + index], slots, cos, sin, mask)
        return self.norm(x)

    def forward(self, features: torch.Tensor, input_ids: torch.Tensor, valid: torch.Tensor, anchors: torch.Tensor,
                anchor_valid: torch.Tensor) -> torch.Tensor:
        """Training: features (B, T, k * H), input_ids (B, T), valid (B, T) real tokens, anchors (B, A) positions,
        anchor_valid (B, A) -> the final normed states of every anchored block (B, A, block, H)."""
        b, t = input_ids.shape
        a, block = anchors.shape[1], self.config.block_size
        positions = torch.arange(t, device=input_ids.device).expand(b, t)
        context = self.context_kv(features, positions)
        offsets = torch.arange(block, device=input_ids.device)
        block_positions = (anchors[..., None] + offsets).reshape(b, a * block)  # (B, A * block)
        block_ids = torch.full_like(block_positions, self.config.mask_token_id)
        block_ids.view(b, a, block)[..., 0] = input_ids.gather(1, anchors)
        mask = anchored_block_mask(anchors, anchor_valid, valid, block)
        hidden = self.block_hidden(block_ids, block_positions, context, mask)
        return hidden.view(b, a, block, -1)


class ContextBuffers:
    """Each draft layer's context keys and values at inference, in buffers with room after them (B, kv heads,
    capacity, D): the first `length` slots hold the context. A round's new context is written after it and the
    block's own keys and values after that (Attention.forward with `length`), so a round never copies the whole
    context (concatenating did, once in observe and once per layer in the block); the buffers double when full."""

    def __init__(self):
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.layers[0][0].shape[2] if self.layers else 0

    def append(self, new: list[tuple[torch.Tensor, torch.Tensor]], room: int) -> None:
        """Each layer's (keys, values) (B, kv, m, D) of m new context positions, keeping `room` slots free after
        them (the block a round runs)."""
        count = new[0][0].shape[2]
        end = self.length + count
        if end + room > self.capacity:
            self._grow(max(end + room, 2 * self.capacity, 256), new)
        for (keys, values), (new_keys, new_values) in zip(self.layers, new):
            keys[:, :, self.length:end], values[:, :, self.length:end] = new_keys, new_values
        self.length = end

    def _grow(self, capacity: int, like: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Buffers of `capacity` slots shaped as `like`'s keys and values, the context so far copied into them."""
        grown = [tuple(t.new_empty(*t.shape[:2], capacity, t.shape[3]) for t in pair) for pair in like]
        for new_pair, old_pair in zip(grown, self.layers):  # none the first time
            for buffer, old in zip(new_pair, old_pair):
                buffer[:, :, :self.length] = old[:, :, :self.length]
        self.layers = grown


class EagerDFlashEngine:
    """A drafter's forwards at inference in eager PyTorch: one request's context in ContextBuffers, a round's block
    of `width` tokens after it, the draft logits from `head` (the interface of models.compiled_dflash's engine)."""

    graphs = ()  # nothing to build before timing (the compiled engine's packages)

    def __init__(self, model: DFlashModel, head: nn.Module, width: int):
        self.model, self.head, self.width = model, head, width
        self.buffers = ContextBuffers()

    def begin(self) -> None:
        self.buffers = ContextBuffers()

    @property
    def length(self) -> int:
        """Context positions with keys and values."""
        return self.buffers.length

    def append(self, features: torch.Tensor) -> None:
        """features (1, m, k * H) of the next m context positions."""
        positions = torch.arange(self.length, self.length + features.shape[1], device=features.device)[None]
        self.buffers.append(self.model.context_kv(features, positions), room=self.width)

    def logits(self, block_ids: torch.Tensor) -> torch.Tensor:
        """block_ids (1, width) at the positions after the context -> the draft logits of block positions 1 ..
        width - 1 (1, width - 1, V): the root's row proposes nothing."""
        positions = torch.arange(self.length, self.length + self.width, device=block_ids.device)[None]
        hidden = self.model.block_hidden(block_ids, positions, self.buffers.layers, None, self.length)
        return self.head(hidden[:, 1:])


def anchored_block_mask(anchors: torch.Tensor, anchor_valid: torch.Tensor, valid: torch.Tensor,
                        block: int) -> torch.Tensor:
    """(B, 1, A * block, T + A * block) bool: block j's queries see the real context positions before anchor j and
    every position of block j (a padded anchor sees only its own block)."""
    b, a = anchors.shape
    t = valid.shape[1]
    query_anchor = anchors.repeat_interleave(block, 1)  # (B, Q)
    query_valid = anchor_valid.repeat_interleave(block, 1)
    context = (torch.arange(t, device=anchors.device)[None, None, :] < query_anchor[..., None]) & valid[:, None, :].bool()
    context = context & query_valid[..., None]
    query_block = torch.arange(a * block, device=anchors.device) // block
    own = (query_block[:, None] == query_block[None, :]).expand(b, -1, -1)
    return torch.cat([context, own], -1)[:, None]
