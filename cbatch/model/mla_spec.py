"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): what config.json says about it (`MLASpec`).

MLA caches one latent per token and layer, [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]: the normalised
compressed KV and the rotated key part every head shares. Per-head keys and values are up-projections of c_kv
through kv_b_proj (W_UK: the first qk_nope_head_dim rows of each head, W_UV: the next v_head_dim rows).
Seen from the cache, MLA is one KV "head" of kv_lora_rank + qk_rope_head_dim values whose first kv_lora_rank
values are also the (latent) value: `ModelSpec` describes it so (num_kv_heads 1, head_dim = latent size, one
cache part instead of K and V).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cbatch.model.rope import yarn_factor, yarn_mscale

# HF's DeepseekV2/V3 q_a_layernorm and kv_a_layernorm are built with RMSNorm's default eps, not rms_norm_eps
MLA_NORM_EPS = 1e-6


@dataclass(frozen=True, slots=True)
class MLASpec:
    q_lora_rank: int | None  # None: one q_proj (DeepSeek-V2-Lite); else q_a_proj -> RMSNorm -> q_b_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # the checkpoint's rotary pairs are (2i, 2i+1) (DeepSeek's layout): they are de-interleaved to halves
    # (i, i + R/2) before the half-split rotation, for q and k alike, so q.k is unchanged
    rope_interleave: bool

    @property
    def latent_size(self) -> int:
        """Values one token holds in one layer's cache."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def attention_params(self, hidden: int, num_heads: int) -> int:
        """Matrix parameters of one layer's attention."""
        q = (hidden * self.q_lora_rank + self.q_lora_rank * num_heads * self.qk_head_dim if self.q_lora_rank
             else hidden * num_heads * self.qk_head_dim)
        kv = hidden * self.latent_size + self.kv_lora_rank * num_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + num_heads * self.v_head_dim * hidden


def parse_mla(cfg: dict[str, Any], family: str) -> MLASpec:
    q_lora_rank = cfg.get("q_lora_rank")
    return MLASpec(
        q_lora_rank=int(q_lora_rank) if q_lora_rank else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        # DeepSeek-V2 rotates adjacent pairs (complex multiplication); V3 says so in rope_interleave (default on)
        rope_interleave=True if family == "deepseek_v2" else bool(cfg.get("rope_interleave", True)),
    )


def mla_softmax_scale(mla: MLASpec, rope_params: dict[str, Any]) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 when a scaled RoPE states mscale_all_dim
    (DeepSeek's YaRN: the long-context softmax temperature), as HF's DeepSeek attention computes it."""
    scale = mla.qk_head_dim**-0.5
    mscale_all_dim = rope_params.get("mscale_all_dim") or 0
    if rope_params.get("rope_type", "default") != "default" and mscale_all_dim:
        mscale = yarn_mscale(yarn_factor(rope_params), float(mscale_all_dim))
        scale = scale * mscale * mscale
    return scale
