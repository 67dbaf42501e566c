"""RMSNorm, optionally fused with the residual add, with HF Llama's numerics.

HF LlamaRMSNorm:
    h = x.float(); var = h.pow(2).mean(-1); h = h * rsqrt(var + eps); return weight * h.to(x.dtype)
The cast back to x.dtype happens BEFORE the weight product, and the product is done in the (promoted)
input dtype. Both are reproduced here: products of two bf16/fp16 values are exact in fp32, so computing
them in fp32 and rounding once gives the same bits as eager torch.
unit_offset (HF's Gemma RMSNorm): out = (h * rsqrt(var + eps) * (1 + weight)) in fp32, rounded once to x.dtype.
One program normalises one row; the whole row lives in registers (hidden <= 65536).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_launchable, next_pow2, on_device

_MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden]
    residual_ptr,  # [num_tokens, hidden] (only when HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden]
    new_residual_ptr,  # [num_tokens, hidden] x + residual (only when HAS_RESIDUAL)
    stride_x, stride_r, stride_o, stride_nr,
    hidden,
    eps,
    BLOCK: tl.constexpr,  # next power of 2 >= hidden
    HAS_RESIDUAL: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,  # Gemma: scale by (1 + weight) in fp32, no rounding before the product
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # x + residual in the activation dtype, exactly as the eager model adds them
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(new_residual_ptr + row * stride_nr + cols, x, mask=mask)
    h = x.to(tl.float32)
    var = tl.sum(h * h, axis=0) / hidden  # masked lanes are 0 and do not count
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if UNIT_OFFSET:
        out = h * tl.rsqrt(var + eps) * (1.0 + w.to(tl.float32))
    else:
        normed = (h * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)  # HF rounds to the input dtype here
        out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x, residual, weight, eps, unit_offset):
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if hidden > _MAX_HIDDEN:
        raise ValueError(f"hidden={hidden} > {_MAX_HIDDEN} is not supported (one row per program)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError("residual must match x in shape and dtype")
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
    weight = weight.contiguous()
    device = check_launchable(x, weight, *([residual] if residual is not None else []))
    # weight * normed follows torch promotion (bf16 * bf16 -> bf16; fp32 weight * bf16 -> fp32); Gemma's is x's dtype
    out_dtype = x.dtype if unit_offset else torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty((num_tokens, hidden), dtype=out_dtype, device=device)
    new_residual = torch.empty_like(x) if residual is not None else None
    if num_tokens == 0:
        return out, new_residual
    block = next_pow2(hidden)
    with on_device(device):
        _rms_norm_kernel[(num_tokens,)](
            x, residual if residual is not None else x, weight, out,
            new_residual if new_residual is not None else out,
            x.stride(0),
            residual.stride(0) if residual is not None else 0,
            out.stride(0),
            new_residual.stride(0) if new_residual is not None else 0,
            hidden,
            float(eps),
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            UNIT_OFFSET=unit_offset,
            # ~16 fp32 values per thread: 4096 -> 8 warps, 1024 -> 2 warps
            num_warps=min(16, max(1, block // 512)),
        )
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """out = weight * rms_normalise(x) with HF Llama numerics (Gemma's with unit_offset). x: [num_tokens, hidden]."""
    out, _ = _launch(x, None, weight, eps, unit_offset)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; the sum is rounded to x's dtype first, like eager.

    Returns new tensors; x and residual are not modified.
    """
    return _launch(x, residual, weight, eps, unit_offset)
