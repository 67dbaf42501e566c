"""Rotary position embeddings: what config.json says (`RopeSpec`) and the float32 cos/sin table a model
reads at each position (`rope_table`), with every scaling HF transformers implements for these families.

    default   1 / theta^(2i/d)
    linear    default / factor
    dynamic   NTK-aware: theta grows once a sequence passes max_position_embeddings; cbatch never runs
              past max_position_embeddings (--max-model-len is capped there), where it equals default
    llama3    long wavelengths slowed by `factor`, short ones kept, the band between interpolated
    yarn      per-frequency blend of interpolation and extrapolation (beta_fast/beta_slow ramp), with
              cos and sin scaled by the attention factor (0.1 ln(factor) + 1 unless given)
    longrope  per-frequency divisors: `short_factor` within original_max_position_embeddings, `long_factor`
              beyond it; cos and sin scaled by the attention factor (see `RopeSpec.long_context`)

Each function mirrors `transformers.modeling_rope_utils` (the same float32 operations in the same order),
so the tables are bit-identical to HF's; tests/test_rope.py checks them against HF's init functions.
Partial rotary (Phi-3, Phi-4-mini): the table covers the first `rotary_dim` of each head's dimensions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from cbatch.model.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    theta: float
    rotary_dim: int  # leading dimensions of each head that rotate (head_dim unless partial)
    scaling: dict[str, Any] | None  # rope_type and its parameters; None for plain RoPE

    @property
    def rope_type(self) -> str:
        return "default" if self.scaling is None else self.scaling["rope_type"]

    def long_context(self, max_model_len: int) -> bool:
        """longrope: whether the engine uses the long factors.

        HF picks them per sequence once it is longer than original_max_position_embeddings, and then
        recomputes that sequence's whole KV cache with them. cbatch picks once per engine, from the
        longest sequence the engine admits: with --max-model-len at or below the original context every
        sequence uses the short factors (as in HF), above it every sequence uses the long ones (as HF does
        for every sequence longer than the original context)."""
        return self.rope_type == "longrope" and max_model_len > int(self.scaling["original_max_position_embeddings"])


def rope_spec(params: dict[str, Any], head_dim: int, max_position_embeddings: int) -> RopeSpec:
    """`params`: one standardised rope dict (rope_type, rope_theta, partial_rotary_factor, scaling keys)."""
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    rotary_dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise UnsupportedModelError(f"partial_rotary_factor gives {rotary_dim} rotary dimensions of {head_dim}; need an even number")
    theta = float(params.get("rope_theta", 10000.0))
    if rope_type in ("default", "dynamic"):  # dynamic equals default up to max_position_embeddings
        return RopeSpec(theta, rotary_dim, None)
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor", "type")}
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn", "longrope"):
        scaling.setdefault("original_max_position_embeddings", max_position_embeddings)
    required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
                "yarn": (), "longrope": ("short_factor", "long_factor")}[rope_type]
    missing = [k for k in required if scaling.get(k) is None]
    if missing:
        raise UnsupportedModelError(f"RoPE scaling {rope_type!r} lacks {', '.join(missing)} in config.json")
    scaling["max_position_embeddings"] = max_position_embeddings  # yarn and longrope derive defaults from it
    return RopeSpec(theta, rotary_dim, scaling)


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor = float(s["factor"])
    low_freq_factor, high_freq_factor = float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_context = float(s["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context scaled `scale` times (1 when not scaled)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_factor(s: dict[str, Any]) -> float:
    """A YaRN scaling's factor: as stated, else the context's growth over the original (1 when neither is known)."""
    if s.get("factor"):
        return float(s["factor"])
    original, extended = s.get("original_max_position_embeddings"), s.get("max_position_embeddings")
    return extended / original if original and extended else 1.0


def _yarn(theta: float, dim: int, s: dict[str, Any]) -> tuple[torch.Tensor, float]:
    original = s["original_max_position_embeddings"]
    factor = yarn_factor(s)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times over `original`
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as HF: avoids a division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate (low frequencies)
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def _longrope(theta: float, dim: int, s: dict[str, Any], long: bool) -> tuple[torch.Tensor, float]:
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or s["max_position_embeddings"] / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext_factors = torch.tensor(s["long_factor"] if long else s["short_factor"], dtype=torch.float32)
    inv_freq_shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (ext_factors * theta**inv_freq_shape), float(attention_factor)


def rope_inv_freq(rope: RopeSpec, max_model_len: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2] float32, attention factor that scales cos and sin)."""
    dim, s = rope.rotary_dim, rope.scaling
    if s is None:
        return _default_inv_freq(rope.theta, dim), 1.0
    kind = s["rope_type"]
    if kind == "linear":
        return _default_inv_freq(rope.theta, dim) / float(s["factor"]), 1.0
    if kind == "llama3":
        return _llama3(_default_inv_freq(rope.theta, dim), s), 1.0
    if kind == "yarn":
        return _yarn(rope.theta, dim, s)
    return _longrope(rope.theta, dim, s, rope.long_context(max_model_len))


def rope_table(rope: RopeSpec, max_model_len: int) -> torch.Tensor:
    """[max_model_len, rotary_dim] float32: cos in the first half of the columns, sin in the second, each
    already multiplied by the attention factor (as HF scales cos and sin)."""
    inv_freq, attention_factor = rope_inv_freq(rope, max_model_len)
    freqs = torch.outer(torch.arange(max_model_len, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return torch.cat([cos, sin], dim=-1)
