"""Building blocks of the Llama family: the modules hold parameters, the backend (cbatch.model.backend)
computes. RMSNorm and the activation call the backend the model was built with; linear layers run on
oneDNN on CPU (`Linear`).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cbatch.model.backend import Backend


class RMSNorm(nn.Module):
    """RMSNorm with HF's numerics (the backend's `rms_norm`)."""

    def __init__(self, size: int, eps: float, backend: Backend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the residual add fused with the norm."""
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps)


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

    Why: torch sends CPU float32 matmuls to MKL, which runs its AVX2 kernels on AMD CPUs; oneDNN uses
    AVX-512 there (about twice the rate: benchmarks/NOTES.md). Results differ from MKL's only in
    summation order. bfloat16 already goes to oneDNN through F.linear.
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

    Why: unpacked, oneDNN reorders the weight on every call; prepacked, decode-sized matmuls run
    markedly faster and prefill-sized ones as fast as before (benchmarks/NOTES.md, session 2).
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
