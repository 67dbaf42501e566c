"""The attention prologue in one launch: per-head q/k RMSNorm (Qwen3), rotary on q and k, and the K/V store.

Reads the packed qkv projection output in place ([T, (Hq + 2 Hkv) * D], no split or .contiguous()
copies), writes the rotated q back into its columns of qkv (paged attention reads it there, strided) and
this step's rotated k and v into the paged cache (fp8 caches get k / k_scale, saturated). One program
per token, all heads of it: it replaces up to four launches per layer (q norm, k norm, rotary, store_kv)
and the v copy.

Numerics are the unfused kernels' (and so HF's): RMSNorm rounds the normalised value to the activation
dtype before the weight product (rmsnorm.py), rotary rounds each product and the sum (rotary.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_kv_cache_dtype, check_launchable, next_pow2, on_device
from .kv_store import quantize_kv
from .rotary import rotate_halves


@triton.jit
def _norm_halves(x1, x2, w_ptr, eps, dt, HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    """HF RMSNorm of each head (row) given as its two halves [HEADS_PAD, HALF_PAD] (fp32 values of dtype `dt`,
    the weight's dtype too, as in the model)."""
    var = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)  # [HEADS_PAD]; padded lanes are 0
    r = tl.rsqrt(var + eps)[:, None]
    j = tl.arange(0, HALF_PAD)
    w1 = tl.load(w_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    y1 = (w1 * (x1 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    y2 = (w2 * (x2 * r).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    return y1, y2


@triton.jit
def _norm_rope_store_kernel(
    qkv_ptr,  # [num_tokens, >= (Hq + 2 Hkv) * D]: q | k | v per row, last dim contiguous
    q_norm_ptr,  # QK_NORM: [D] (Qwen3's q_norm weight); unused otherwise
    k_norm_ptr,  # QK_NORM: [D]
    positions_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_pos, D] fp32: [:, :HALF] = cos, [:, HALF:] = sin
    slot_mapping_ptr,  # [num_tokens] int64; -1 = do not store (padding)
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    k_scale_ptr,  # KV_SCALED: fp32 [Hkv]
    v_scale_ptr,
    eps,
    stride_t,  # qkv row stride
    stride_cs,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,  # head_dim / 2
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QK_NORM: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dt = qkv_ptr.dtype.element_ty
    head_dim = 2 * HALF
    row = qkv_ptr + token * stride_t
    j = tl.arange(0, HALF_PAD)
    jm = j < HALF
    pos = tl.load(positions_ptr + token).to(tl.int64)
    # HF casts cos/sin to the activation dtype before using them
    c = tl.load(cos_sin_ptr + pos * stride_cs + j, mask=jm, other=0.0).to(dt).to(tl.float32)  # [HALF_PAD]
    s = tl.load(cos_sin_ptr + pos * stride_cs + HALF + j, mask=jm, other=0.0).to(dt).to(tl.float32)

    # q: normalise, rotate, write back in place
    hq = tl.arange(0, Q_HEADS_PAD)
    q_mask = (hq[:, None] < NUM_Q_HEADS) & jm[None, :]  # [Q_HEADS_PAD, HALF_PAD]
    q_ptr1 = row + hq[:, None] * head_dim + j[None, :]
    q1 = tl.load(q_ptr1, mask=q_mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr1 + HALF, mask=q_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        q1, q2 = _norm_halves(q1, q2, q_norm_ptr, eps, dt, HALF, HALF_PAD)
    q1, q2 = rotate_halves(q1, q2, c, s, dt)
    tl.store(q_ptr1, q1, mask=q_mask)
    tl.store(q_ptr1 + HALF, q2, mask=q_mask)

    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token: q is rotated (harmlessly), the cache is left untouched
    # k: normalise, rotate, store; v: store
    hk = tl.arange(0, KV_HEADS_PAD)
    kv_mask = (hk[:, None] < NUM_KV_HEADS) & jm[None, :]  # [KV_HEADS_PAD, HALF_PAD]
    k_ptr1 = row + NUM_Q_HEADS * head_dim + hk[:, None] * head_dim + j[None, :]
    v_ptr1 = k_ptr1 + NUM_KV_HEADS * head_dim
    k1 = tl.load(k_ptr1, mask=kv_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr1 + HALF, mask=kv_mask, other=0.0).to(tl.float32)
    if QK_NORM:
        k1, k2 = _norm_halves(k1, k2, k_norm_ptr, eps, dt, HALF, HALF_PAD)
    k1, k2 = rotate_halves(k1, k2, c, s, dt)
    v1 = tl.load(v_ptr1, mask=kv_mask, other=0.0)
    v2 = tl.load(v_ptr1 + HALF, mask=kv_mask, other=0.0)
    if KV_SCALED:
        k1 = quantize_kv(k1, k_scale_ptr, hk, NUM_KV_HEADS)
        k2 = quantize_kv(k2, k_scale_ptr, hk, NUM_KV_HEADS)
        v1 = quantize_kv(v1, v_scale_ptr, hk, NUM_KV_HEADS)
        v2 = quantize_kv(v2, v_scale_ptr, hk, NUM_KV_HEADS)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    kc = k_cache_ptr + block * stride_kcb + offset * stride_kct + hk[:, None] * stride_kch + j[None, :]
    vc = v_cache_ptr + block * stride_vcb + offset * stride_vct + hk[:, None] * stride_vch + j[None, :]
    cache_dt = k_cache_ptr.dtype.element_ty
    tl.store(kc, k1.to(cache_dt), mask=kv_mask)
    tl.store(kc + HALF, k2.to(cache_dt), mask=kv_mask)
    tl.store(vc, v1.to(cache_dt), mask=kv_mask)
    tl.store(vc + HALF, v2.to(cache_dt), mask=kv_mask)


def norm_rope_store(
    qkv: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotates q in place inside `qkv` and stores this step's k, v; returns q as a [T, Hq, D] view of qkv.

    qkv: [T, (Hq + 2 Hkv) * D] (the fused projection's output, last dim contiguous). q_norm/k_norm: the
    per-head RMSNorm weights [D] (Qwen3), applied before rotary, or None. cos_sin_cache: fp32 [max_pos, D].
    The cache takes k/v at slot_mapping[t] >= 0 (fp8 caches: / k_scale, v_scale, fp32 [Hkv]).
    """
    num_tokens = qkv.shape[0]
    num_blocks, block_size, cache_heads, head_dim = k_cache.shape
    if cache_heads != num_kv_heads or qkv.shape[1] != (num_q_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not fit {num_q_heads}+2x{num_kv_heads} heads of "
                         f"the cache {tuple(k_cache.shape)}")
    if qkv.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or head_dim % 2:
        raise ValueError("qkv and the caches need a contiguous last dimension and an even head_dim")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    if cos_sin_cache.shape[-1] != head_dim or positions.shape != (num_tokens,) or slot_mapping.shape != (num_tokens,):
        raise ValueError("positions/slot_mapping must be [T] and cos_sin_cache [max_pos, head_dim]")
    kv_scaled = check_kv_cache_dtype(qkv.dtype, k_cache, v_cache, k_scale, v_scale)
    device = check_launchable(qkv, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    if num_tokens == 0:
        return q
    half = head_dim // 2
    with on_device(device):
        _norm_rope_store_kernel[(num_tokens,)](
            qkv, q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv,
            positions, cos_sin_cache, slot_mapping, k_cache, v_cache,
            k_scale if kv_scaled else cos_sin_cache, v_scale if kv_scaled else cos_sin_cache,
            float(eps),
            qkv.stride(0),
            cos_sin_cache.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NUM_Q_HEADS=num_q_heads,
            NUM_KV_HEADS=num_kv_heads,
            Q_HEADS_PAD=next_pow2(num_q_heads),
            KV_HEADS_PAD=next_pow2(num_kv_heads),
            HALF=half,
            HALF_PAD=next_pow2(half),
            BLOCK_SIZE=block_size,
            QK_NORM=q_norm is not None,
            KV_SCALED=kv_scaled,
            num_warps=4,
        )
    return q
