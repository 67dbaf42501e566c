"""Write this step's keys and values into the paged KV cache (one program per token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_kv_cache_dtype, check_launchable, next_pow2, on_device


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]   (may be a strided view of a packed qkv tensor)
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping_ptr,  # [num_tokens] int64; slot = block * block_size + offset; -1 = skip
    k_scale_ptr,  # KV_SCALED: fp32 [num_kv_heads]; the cache holds key / k_scale
    v_scale_ptr,  # KV_SCALED: fp32 [num_kv_heads]
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token: leave the cache untouched
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)  # [HEADS_PAD, DIM_PAD]

    k = tl.load(key_ptr + token * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    if KV_SCALED:
        k = quantize_kv(k, k_scale_ptr, h, NUM_KV_HEADS)
        v = quantize_kv(v, v_scale_ptr, h, NUM_KV_HEADS)
    tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kct + h[:, None] * stride_kch + d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct + h[:, None] * stride_vch + d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quantize_kv(x, scale_ptr, h, NUM_KV_HEADS: tl.constexpr):
    """x [HEADS_PAD, D] / scale[h], saturated to fp8's finite range (fp32; the caller casts to the cache dtype).
    The same value as the torch backend's `(x.float() / scale).clamp(-448, 448).to(float8_e4m3fn)`."""
    scale = tl.load(scale_ptr + h, mask=h < NUM_KV_HEADS, other=1.0)  # [HEADS_PAD]
    q = x.to(tl.float32) / scale[:, None]
    q = tl.minimum(tl.maximum(q, -448.0), 448.0)  # FP8_KV_MAX (cbatch/fp8_kv.py)
    # Round to the nearest e4m3 value (ties to even) here, so the cast that follows is exact: the same bits
    # on every GPU and under the interpreter, whose fp8 cast drops the carry of a rounded-up mantissa.
    # (|q| + c) - c rounds |q| to a multiple of c's ulp, 2**(e - 3) for |q| in [2**e, 2**(e+1)), with
    # e >= -6 (e4m3's subnormal step is 2**-9).
    exponent = (q.to(tl.int32, bitcast=True) >> 23) & 0xFF
    c = ((tl.maximum(exponent, 127 - 6) + 20) << 23).to(tl.float32, bitcast=True)
    mag = (tl.abs(q) + c) - c
    return tl.where(q < 0, -mag, mag)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_cache[s // block_size, s % block_size] = key[t] (same for value) for every token t with s = slot_mapping[t] >= 0.

    key/value: [num_tokens, num_kv_heads, head_dim], last dim contiguous (rows may be strided).
    k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], key's dtype, or float8_e4m3fn with
    k_scale/v_scale (fp32 [num_kv_heads]): the cache then holds key / k_scale, saturated to +-448.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    if k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(f"cache shape {tuple(k_cache.shape)} does not fit key {tuple(key.shape)}")
    if key.dtype != value.dtype:
        raise ValueError(f"key ({key.dtype}) and value ({value.dtype}) differ")
    kv_scaled = check_kv_cache_dtype(key.dtype, k_cache, v_cache, k_scale, v_scale)
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [{num_tokens}], got {tuple(slot_mapping.shape)}")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    device = check_launchable(key, value, k_cache, v_cache, slot_mapping)
    if num_tokens == 0:
        return
    with on_device(device):
        _store_kv_kernel[(num_tokens,)](
            key, value, k_cache, v_cache, slot_mapping,
            k_scale if kv_scaled else slot_mapping, v_scale if kv_scaled else slot_mapping,  # read only if KV_SCALED
            key.stride(0), key.stride(1),
            value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            HEADS_PAD=next_pow2(num_kv_heads),
            DIM_PAD=next_pow2(head_dim),
            BLOCK_SIZE=k_cache.shape[1],
            KV_SCALED=kv_scaled,
            num_warps=4 if num_kv_heads * head_dim >= 1024 else 1,
        )
