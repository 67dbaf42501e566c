"""Building blocks of the Llama family in plain torch, with the numerics of HF transformers.

Each op has a fused Triton twin in `cbatch.kernels`; `use_fused_kernels(True)` switches the model to
them (GPU path). The torch versions are the reference and the CPU path.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_FUSED = {"on": False}


def use_fused_kernels(enabled: bool) -> None:
    """Routes RMSNorm, rotary and SiLU-and-mul through the Triton kernels (GPU path)."""
    _FUSED["on"] = enabled


class RMSNorm(nn.Module):
    """HF's LlamaRMSNorm: variance in float32, normalised value cast back before the weight multiply."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _FUSED["on"]:
            from cbatch.kernels import rms_norm

            # the kernel takes [rows, hidden]; Qwen3's per-head q/k norms come as [T, heads, head_dim]
            return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the residual add fused with the norm."""
        if _FUSED["on"]:
            from cbatch.kernels import fused_add_rms_norm

            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self.forward(residual), residual


def _onednn_linear_works() -> bool:
    """oneDNN's linear op (an internal op inductor uses) exists here and agrees with F.linear."""
    try:
        x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
        got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return torch.backends.mkldnn.is_available() and torch.allclose(got, F.linear(x, w, b), atol=1e-5)
    except (AttributeError, RuntimeError):
        return False


_ONEDNN_LINEAR = _onednn_linear_works()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; CPU float32 goes through oneDNN instead of MKL.

    Why: torch sends CPU float32 matmuls to MKL, which runs its AVX2 kernels on AMD CPUs (measured on
    Zen 5: about 100 GFLOP/s a core, and 3-8 GB/s of weight streaming at decode sizes); oneDNN uses
    AVX-512 there (about 220 GFLOP/s a core, twice the small-batch speed). Results differ from MKL's
    only in summation order. bfloat16 already goes to oneDNN through F.linear.
    """
    if _ONEDNN_LINEAR and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _onednn_prepack_works() -> bool:
    """oneDNN's weight prepacking (what inductor's CPU backend uses) exists and agrees with F.linear."""
    if not _ONEDNN_LINEAR:
        return False
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(3, 32).to(dtype), torch.randn(8, 32).to(dtype)
            got = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
            if not torch.allclose(got.float(), F.linear(x, w).float(), atol=0.1 if dtype == torch.bfloat16 else 1e-4):
                return False
        return True
    except (AttributeError, RuntimeError):
        return False


_ONEDNN_PREPACK = _onednn_prepack_works()


def prepack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a CPU float32/bfloat16 [out, in] weight for `packed_linear`, or None where
    prepacking is unavailable. The copy is opaque: only `packed_linear` can use it (anything else raises).

    Why: unpacked, oneDNN reorders the weight on every call; prepacked, decode-sized matmuls run 1.2-1.9x
    faster on the 2-core CPU (SmolLM2-135M's linears, 30 layers: bfloat16 10.3 -> 7.0 ms at 1 row,
    26 -> 22 ms at 64; float32 19.7 -> 10.4 ms at 4 rows) and prefill-sized ones as fast as before.
    """
    if not _ONEDNN_PREPACK or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """nn.Linear whose forward is `linear` above (same parameters and state-dict names), or oneDNN's
    prepacked matmul once `prepack()` has run."""

    packed: torch.Tensor | None = None

    def prepack(self) -> None:
        """Swaps the weight for its prepacked copy (CPU only; a no-op where unavailable). The plain
        weight is dropped, so the model holds one copy."""
        packed = prepack_weight(self.weight)
        if packed is not None:
            self.packed = packed
            self.weight = None  # nothing may use the plain weight from here on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return linear(x, self.weight, self.bias)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * intermediate] (gate | up) -> [num_tokens, intermediate]"""
    if _FUSED["on"]:
        from cbatch.kernels import silu_and_mul as fused

        return fused(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # one [T, intermediate] allocation, not two


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, with linear or llama3 scaling folded in."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "linear":
        return inv_freq / float(scaling["factor"])
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin_cache(max_positions: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """[max_positions, head_dim] float32: cos of position x inv_freq in the first half, sin in the second."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


@dataclass(slots=True)
class RotaryStep:
    """The rotary angles of one step's tokens, built once per step and shared by every layer."""

    positions: torch.Tensor  # int64 [T]
    cos_sin: torch.Tensor  # the model's float32 [max_positions, D] table (what the fused kernel reads)
    cos: torch.Tensor | None = None  # [T, 1, D] in the activations' dtype (the torch path)
    sin: torch.Tensor | None = None  # [T, 1, D], rotate_half's sign folded in: (-sin | +sin)

    @classmethod
    def build(cls, positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype) -> "RotaryStep":
        if _FUSED["on"]:
            return cls(positions, cos_sin)
        cos, sin = cos_sin[positions].to(dtype).chunk(2, dim=-1)  # [T, D/2] each
        return cls(positions, cos_sin, torch.cat([cos, cos], dim=-1).unsqueeze(1), torch.cat([-sin, sin], dim=-1).unsqueeze(1))


def apply_rotary(q: torch.Tensor, k: torch.Tensor, rope: RotaryStep) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style rotary (HF's rotate_half) on q [T, Hq, D] and k [T, Hkv, D]."""
    if _FUSED["on"]:
        from cbatch.kernels import apply_rotary as fused

        fused(q, k, rope.positions, rope.cos_sin)
        return q, k
    return _rotate(q, rope), _rotate(k, rope)


def _rotate(x: torch.Tensor, rope: RotaryStep) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bit for bit as HF computes it: rotate_half(x) = (-x2 | x1), and
    (-x2) * sin == x2 * (-sin) exactly, so the halves are swapped (one copy) and the sign rides on sin."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2 | x1)
    return (x * rope.cos).add_(swapped.mul_(rope.sin))
