"""CPU matmuls on oneDNN: `linear` (F.linear, with CPU float32 through oneDNN instead of MKL) and prepacked
weights (`prepack_weight`, `packed_linear`). Below the layers and the backends, which both call `linear`."""
from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F


# The two probes run at first use, not at import: a oneDNN call starts OpenMP's thread pool, and a process that
# forks after that (a user's multiprocessing around `import cbatch`) hangs in its child's first parallel region.
@cache
def _onednn_linear_works() -> bool:
    """oneDNN's linear op (an internal op inductor uses) exists here and agrees with F.linear."""
    try:
        x, w, b = torch.randn(3, 8), torch.randn(5, 8), torch.randn(5)
        got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return torch.backends.mkldnn.is_available() and torch.allclose(got, F.linear(x, w, b), atol=1e-5)
    except (AttributeError, RuntimeError):
        return False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; CPU float32 goes through oneDNN instead of MKL.

    Why: torch sends CPU float32 matmuls to MKL, which runs its AVX2 kernels on AMD CPUs; oneDNN uses
    AVX-512 there (about twice the rate: benchmarks/NOTES.md). Results differ from MKL's only in
    summation order. bfloat16 already goes to oneDNN through F.linear. As in `packed_linear`, one row goes
    through as two: oneDNN sums a lone row in another order (at every K with unpacked weights), and an MoE expert
    that gets one token in a step must give it the bits it would among others (batch invariance:
    docs/speculative.md).
    """
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and _onednn_linear_works():
        if x.shape[0] == 1:
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), weight, bias, "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@cache
def _onednn_prepack_dtypes() -> frozenset[torch.dtype]:
    """The dtypes whose weights oneDNN prepacks here (what inductor's CPU backend uses), each checked against
    F.linear on its own: CPUs without AVX-512 (or AVX-NE-CONVERT) refuse bfloat16 but prepack float32."""
    if not _onednn_linear_works():
        return frozenset()
    works = set()
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.1)):
        try:
            x, w = torch.randn(3, 32).to(dtype), torch.randn(8, 32).to(dtype)
            got = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w), None, "none", [], "")
            if torch.allclose(got.float(), F.linear(x, w).float(), atol=tol):
                works.add(dtype)
        except (AttributeError, RuntimeError):  # no such op in this build, or this ISA cannot run the dtype's path
            pass
    return frozenset(works)



def prepack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a CPU float32/bfloat16 [out, in] weight for `packed_linear`, or None where
    prepacking is unavailable for its dtype. The copy is opaque: only `packed_linear` can use it (anything else raises).

    Why: unpacked, oneDNN reorders the weight on every call; prepacked, decode-sized matmuls run
    markedly faster and prefill-sized ones as fast as before (benchmarks/NOTES.md, session 2).
    """
    if weight.device.type != "cpu" or weight.dtype not in _onednn_prepack_dtypes():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, in] @ packed -> [M, out]. A row's result is the same bits whatever M: oneDNN sums a one-row input
    in another order when the inner dimension is large (seen from K = 1536, SmolLM2's down projection: last-bit
    differences), so one row goes through as two (the copy costs nothing next to the weight reads). Batch
    invariance rests on it: a lone row's decode step must equal the same row in a fuller step (and speculative
    decoding's verify rows, docs/speculative.md)."""
    if x.dim() == 2 and x.shape[0] == 1:
        return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), packed, bias, "none", [], "")[:1]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
