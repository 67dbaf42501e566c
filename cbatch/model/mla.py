"""DeepSeek-V2/V3's (and Kimi K2's) multi-head latent attention layer: the projections, as HF names them; the
backend's `mla_attention` does rotary, the latent cache and the attention (model/backend/mla.py).

    q        q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x)))        [T, H, N + R] -> q_nope | q_pe
    latent   kv_a_proj_with_mqa(x)                                      [T, rank + R] -> kv_a_layernorm(c_kv) | k_pe
    out      o_proj(attention)                                          [T, H * V] -> [T, hidden]

kv_b_proj (the per-head up-projection of c_kv) is read by the attention itself: decodes absorb it into q and the
output, so it is a plain weight here, never prepacked or kept in FP8.
"""
from __future__ import annotations

import torch
from torch import nn

from cbatch.model.backend import Backend, RotaryStep
from cbatch.model.layers import Linear, RMSNorm
from cbatch.model.mla_spec import MLA_NORM_EPS
from cbatch.model.spec import ModelSpec


class LatentProjection(nn.Module):
    """kv_b_proj's weight [H * (N + V), kv_lora_rank], read by the backend (naive: a matmul; absorbed: per-head
    blocks W_UK, W_UV)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))


class MLAAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, backend: Backend) -> None:
        super().__init__()
        mla = spec.mla
        self.backend = backend
        self.layer_idx = layer_idx
        self.num_heads = spec.num_heads
        self.kv_lora_rank = mla.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.v_head_dim = mla.v_head_dim
        self.scale = spec.softmax_scale
        self.rope_index = spec.layer_rope[layer_idx]
        bias = spec.o_bias  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
        q_out = spec.num_heads * mla.qk_head_dim
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(spec.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = Linear(spec.hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, MLA_NORM_EPS, backend)
            self.q_b_proj = Linear(mla.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(spec.hidden_size, mla.latent_size, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, MLA_NORM_EPS, backend)
        self.kv_b_proj = LatentProjection(mla.kv_lora_rank, spec.num_heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        self.o_proj = Linear(spec.num_heads * mla.v_head_dim, spec.hidden_size, bias=bias)
        # de-interleaving: rotary pair (2i, 2i + 1) -> (i, i + R/2), so the half-split rotation turns DeepSeek's pairs
        self.rope_order = None
        if mla.rope_interleave:
            r = mla.qk_rope_head_dim
            self.rope_order = [*range(0, r, 2), *range(1, r, 2)]

    def forward(self, hidden: torch.Tensor, ropes: list[RotaryStep], ctx) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)  # [T, H, N], [T, H, R]
        latent = self.kv_a_proj_with_mqa(hidden)  # [T, rank + R]
        c_kv, k_pe = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv.contiguous())
        if self.rope_order is not None:
            q_pe, k_pe = q_pe[..., self.rope_order], k_pe[..., self.rope_order]
        out = self.backend.mla_attention(q_nope, q_pe.contiguous(), c_kv, k_pe.contiguous(), self,
                                         ropes[self.rope_index], ctx.kv.layer(self.layer_idx), ctx.meta)  # [T, H, V]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_head_dim))
