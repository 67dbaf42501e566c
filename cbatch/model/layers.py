"""Building blocks shared by every family: the modules hold parameters, the backend (cbatch.model.backend)
computes. RMSNorm, the gated MLP's activation and FP8 matmuls call the backend the model was built with;
plain linear layers run on oneDNN on CPU (`Linear`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from cbatch.model.quant import FP8_DTYPE

if TYPE_CHECKING:  # the backends import `linear` from here
    from cbatch.model.backend import Backend


class RMSNorm(nn.Module):
    """RMSNorm with HF's numerics (the backend's `rms_norm`). `unit_offset` (Gemma): the scale is
    (1 + weight), applied in float32 before the cast back (Llama casts first, then multiplies by weight)."""

    def __init__(self, size: int, eps: float, backend: Backend, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps, unit_offset=self.unit_offset)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the residual add fused with the norm."""
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps, unit_offset=self.unit_offset)


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


class Fp8Linear(nn.Module):
    """A linear layer whose weight stays in FP8 with its scales (the GPU path: half the bytes of bf16); the
    backend's `fp8_linear` dequantizes inside the matmul. Scales: float32 [out] per channel, or
    [ceil(out / bn), ceil(in / bk)] per `block`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int] | None,
                 backend: Backend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        scale_shape = (out_features,) if block is None else (-(-out_features // block[0]), -(-in_features // block[1]))
        self.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.block = block
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.fp8_linear(x, self.weight, self.weight_scale, self.block, self.bias)


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), gate and up packed into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, activation: str, backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        self.activation = activation  # silu | gelu_tanh
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if self.activation == "gelu_tanh":
            return self.down_proj(self.backend.gelu_tanh_and_mul(gate_up))
        return self.down_proj(self.backend.silu_and_mul(gate_up))
