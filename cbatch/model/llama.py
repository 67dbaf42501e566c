"""One decoder for the Llama family: Llama 2/3 (SmolLM2, TinyLlama), Mistral, Qwen2, Qwen3.

The switches come from `ModelSpec` (q/k/v bias, Qwen3's q/k norm, sliding window, tied embeddings).
The model sees a flat batch of tokens and an `AttentionMetadata`; it knows nothing of requests. It is
built with one compute backend (cbatch.model.backend) that every layer calls.
q/k/v and gate/up projections are packed into one matmul each (the loader packs the weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from cbatch.model.backend import AttentionMetadata, Backend, KVLayer, RotaryStep
from cbatch.model.layers import Linear, RMSNorm, linear, packed_linear, prepack_weight, rope_cos_sin_cache, rope_inv_freq
from cbatch.model.spec import ModelSpec


@dataclass(slots=True)
class KVCacheView:
    """The per-layer K and V caches the attention layers write to and read from."""

    k: list[torch.Tensor]  # one per layer, `kv_cache_shape`
    v: list[torch.Tensor]
    scales: torch.Tensor | None = None  # fp8 caches: float32 [layers, 2 (K|V), num_kv_heads]

    def layer(self, i: int) -> KVLayer:
        if self.scales is None:
            return KVLayer(self.k[i], self.v[i])
        return KVLayer(self.k[i], self.v[i], self.scales[i, 0], self.scales[i, 1])


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        self.layer_idx = layer_idx
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.scale = spec.head_dim**-0.5
        self.sliding_window = spec.sliding_window
        self.qkv_proj = Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, backend) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, backend) if spec.qk_norm else None

    def forward(self, hidden: torch.Tensor, rope: RotaryStep, ctx: "ForwardContext") -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        # the backend splits heads, applies q/k norms and rotary, stores k/v and attends
        out = self.backend.attention(qkv, self, rope, ctx.kv.layer(self.layer_idx), ctx.meta)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, backend: Backend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        self.self_attn = Attention(spec, layer_idx, backend)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        self.mlp = MLP(spec, backend)

    def forward(self, hidden, residual, rope: RotaryStep, ctx):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.self_attn(hidden, rope, ctx)
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        return self.mlp(hidden), residual


@dataclass(slots=True)
class ForwardContext:
    """What every layer of one step needs besides activations."""

    kv: KVCacheView
    meta: AttentionMetadata


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, max_positions: int, backend: Backend) -> None:
        super().__init__()
        self.spec = spec
        self.backend = backend
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, backend) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.max_positions = max_positions
        self.cos_sin: torch.Tensor | None = None  # set by `build_rope_cache` once the device is known

    def build_rope_cache(self, device: torch.device) -> None:
        # float32 on purpose, whatever the model's dtype (HF computes RoPE angles in float32);
        # a plain attribute, not a buffer, so `.to(dtype)` leaves it alone.
        inv_freq = rope_inv_freq(self.spec.head_dim, self.spec.rope_theta, self.spec.rope_scaling)
        self.cos_sin = rope_cos_sin_cache(self.max_positions, inv_freq).to(device)  # [max_positions, head_dim]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        hidden = self.embed_tokens(input_ids)
        rope = self.backend.rotary(positions, self.cos_sin, hidden.dtype)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, rope, ctx)
        hidden, _ = self.norm.add_forward(hidden, residual)
        return hidden

    def prepack_for_cpu(self) -> None:
        """oneDNN-prepacked weights for every linear layer and the logits (see `layers.prepack_weight`).
        A tied embedding keeps its plain copy for the lookup; the logits get a packed one beside it."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
        if self.lm_head is None:
            self.packed_logits_weight = prepack_weight(self.embed_tokens.weight)

    packed_logits_weight: torch.Tensor | None = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab] (only for the rows that sample)."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.packed_logits_weight is not None:
            return packed_linear(hidden, self.packed_logits_weight).float()
        return linear(hidden, self.embed_tokens.weight).float()
