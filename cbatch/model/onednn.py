"""CPU matmuls on oneDNN: `linear` (F.linear, with CPU float32 through oneDNN instead of MKL) and prepacked
weights (`prepack_weight`, `packed_linear`). Below the layers and the backends, which both call `linear`."""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
