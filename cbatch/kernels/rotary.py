"""Rotary position embedding (NeoX / HF `rotate_half` style), in place on q and k.

HF: cos, sin = cos.to(x.dtype), sin.to(x.dtype); x_out = x * cos + rotate_half(x) * sin,
    rotate_half(x) = cat(-x[..., half:], x[..., :half]).
With x = [x1, x2] (halves) and c, s the half-width cos/sin of position * inv_freq:
    out1 = x1 * c - x2 * s,   out2 = x2 * c + x1 * s.
Eager torch rounds every product and the sum to x's dtype; the kernel does the same (a no-op for fp32),
so bf16/fp16 results match eager HF bit for bit up to the cos/sin values themselves.
One program handles one token: all its q heads and all its k heads.
Partial rotary (Phi-3): a table narrower than the head rotates the head's first `table width` dimensions
and leaves the rest as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_launchable, next_pow2, on_device


@triton.jit
def _rotate_heads(
    base_ptr,  # this token's first head
    stride_h,
    c,  # [HALF_PAD] fp32, already rounded through x's dtype
    s,  # [HALF_PAD]
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    h = tl.arange(0, HEADS_PAD)
    j = tl.arange(0, HALF_PAD)
    mask = (h[:, None] < NUM_HEADS) & (j[None, :] < HALF)  # [HEADS_PAD, HALF_PAD]
    ptr1 = base_ptr + h[:, None] * stride_h + j[None, :]
    ptr2 = ptr1 + HALF
    x1 = tl.load(ptr1, mask=mask, other=0.0)
    x2 = tl.load(ptr2, mask=mask, other=0.0)
    out1, out2 = rotate_halves(x1.to(tl.float32), x2.to(tl.float32), c, s, x1.dtype)
    tl.store(ptr1, out1, mask=mask)
    tl.store(ptr2, out2, mask=mask)


@triton.jit
def rotate_halves(x1, x2, c, s, dt):
    """NeoX rotary of heads given as halves [HEADS, HALF] (fp32 values of dtype `dt`), c/s [HALF]: every
    product and the sum rounded to `dt`, as eager torch does. Returns the rotated halves in `dt`."""
    a1 = (x1 * c[None, :]).to(dt).to(tl.float32)
    b1 = (-x2 * s[None, :]).to(dt).to(tl.float32)
    a2 = (x2 * c[None, :]).to(dt).to(tl.float32)
    b2 = (x1 * s[None, :]).to(dt).to(tl.float32)
    return (a1 + b1).to(dt), (a2 + b2).to(dt)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]  (strided view allowed; last dim contiguous)
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    positions_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_pos, head_dim] fp32: [:, :HALF] = cos, [:, HALF:] = sin
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    jm = j < HALF
    dt = q_ptr.dtype.element_ty
    # HF casts cos/sin to the activation dtype before using them
    c = tl.load(cos_sin_ptr + pos * stride_cs + j, mask=jm, other=0.0).to(dt).to(tl.float32)  # [HALF_PAD]
    s = tl.load(cos_sin_ptr + pos * stride_cs + HALF + j, mask=jm, other=0.0).to(dt).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, c, s, NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, c, s, NUM_KV_HEADS, KV_HEADS_PAD, HALF, HALF_PAD)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Rotate q [T, num_q_heads, head_dim] and k [T, num_kv_heads, head_dim] in place at `positions` [T].

    q and k may be strided views (e.g. of a packed qkv projection) as long as the last dim is contiguous.
    cos_sin_cache: fp32 [max_pos, R], cos in the first R/2 columns, sin in the rest; R <= head_dim
    dimensions of each head rotate (R < head_dim: partial rotary).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    if k.dim() != 3 or k.shape[0] != num_tokens or k.shape[2] != head_dim:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)}")
    if q.dtype != k.dtype:
        raise ValueError(f"q ({q.dtype}) and k ({k.dtype}) must share a dtype")
    rotary_dim = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"cos_sin_cache must be [max_pos, R] with R even and <= {head_dim}, got {tuple(cos_sin_cache.shape)}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [{num_tokens}], got {tuple(positions.shape)}")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k must have a contiguous last dimension (they are updated in place)")
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    device = check_launchable(q, k, positions, cos_sin_cache)
    if num_tokens == 0:
        return
    num_kv_heads = k.shape[1]
    half = rotary_dim // 2
    with on_device(device):
        _rotary_kernel[(num_tokens,)](
            q, k, positions, cos_sin_cache,
            q.stride(0), q.stride(1),
            k.stride(0), k.stride(1),
            cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads,
            NUM_KV_HEADS=num_kv_heads,
            Q_HEADS_PAD=next_pow2(num_q_heads),
            KV_HEADS_PAD=next_pow2(num_kv_heads),
            HALF=half,
            HALF_PAD=next_pow2(half),
            num_warps=4,
        )
