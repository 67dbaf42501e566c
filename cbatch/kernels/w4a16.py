"""The W4A16 GEMM: x @ W.T with W stored as packed 4-bit (or 8-bit) integers, unpacked and dequantized in
registers tile by tile (weight-only quantization: AWQ, GPTQ, compressed-tensors; `layers.Int4Linear`).

    w4a16_linear(x, weight, scale, zero, perm, group_size, bits, bias)

Layout (`Int4Linear`'s, to which every format is repacked at load; K inputs, N outputs, G groups):
    x        [M, K] float16 / bfloat16 (float32 for tests)
    weight   int32 [N, K * bits / 32]: value k of row n in bits (k % (32/bits)) * bits of word k // (32/bits)
    scale    float32 [N, G];  zero uint8 [N, G]: w[n, k] = (q[n, k] - zero[n, g]) x scale[n, g]
    perm     int32 [K] or None: act-order layers hold their rows sorted by group; weight row k' multiplies
             input column perm[k'] (None: k' itself). Row k' is in group k' // group_size either way.
Each program computes a [BLOCK_M, BLOCK_N] tile of the output over K in BLOCK_K steps: the B tile's words are
loaded once per value (neighbouring values share a word, served from cache), shifted and masked, dequantized
in float32 and rounded to x's dtype before the dot (fp32 accumulation): the tensor cores see exactly
`int4.dequantize_kept`'s weights. BLOCK_K divides the group (or one group spans K), so a K step has one scale
and zero per column, loaded once; act-order gathers the step's x columns through perm instead (M x BLOCK_K
values, against BLOCK_K x BLOCK_N scales and zeros a per-row group lookup would gather).

Tiles: decode-sized M (<= 64) takes 16-row tiles with a long K step (the weight stream dominates); prefill
64 x 128 tiles. No host syncs and fixed-size allocations: the launch is CUDA-graph safe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_launchable, interpreting, next_pow2, on_device


@triton.jit
def _w4a16_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # int32 [N, K / PER]
    scale_ptr,  # float32 [N, G]
    zero_ptr,  # uint8 [N, G]
    perm_ptr,  # HAS_PERM: int32 [K]
    bias_ptr,  # HAS_BIAS: [N]
    out_ptr,  # [M, N]
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_zn, stride_om,
    GROUP: tl.constexpr,  # input rows per group (K for one group per channel)
    BITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # interpreter only: bf16 dots in fp32 (numpy has no bf16 matmul)
):
    PER: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_ok = offs_m < M
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        bk_ok = k_ok[:, None] & n_ok[None, :]
        if HAS_PERM:
            cols = tl.load(perm_ptr + offs_k, mask=k_ok, other=0)  # [BLOCK_K]: the inputs these rows multiply
        else:
            cols = offs_k
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        words = tl.load(w_ptr + offs_n[None, :] * stride_wn + (offs_k // PER)[:, None], mask=bk_ok, other=0)
        q = (words >> ((offs_k % PER) * BITS)[:, None]) & MASK  # [BLOCK_K, BLOCK_N]
        group = k0 // GROUP  # BLOCK_K divides the group (or one group spans K): one scale row per step
        s = tl.load(scale_ptr + offs_n * stride_sn + group, mask=n_ok, other=0.0)[None, :]  # [1, BLOCK_N]
        z = tl.load(zero_ptr + offs_n * stride_zn + group, mask=n_ok, other=0)[None, :]
        b = ((q.to(tl.float32) - z.to(tl.float32)) * s).to(a.dtype)  # [BLOCK_K, BLOCK_N]
        if DOT_UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def w4a16_tiles(rows: int, n: int, k: int, group: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): decode (rows <= 64) 16 x 64 tiles with 128-deep K steps, prefill 64 x 128 x 64;
    float32 (tests) keeps tiles small. A K step never spans two groups of 32 or 64. Untuned: the GPU session measures."""
    small = dtype == torch.float32
    if rows <= 64:
        block_m, block_n, block_k = 16, 32 if small else 64, 32 if small else 128
    else:
        block_m, block_n, block_k = (32, 32, 32) if small else (64, 128, 64)
    block_n = min(block_n, max(16, next_pow2(n)))
    block_k = min(block_k, max(16, next_pow2(k)))
    if group < k:
        block_k = min(block_k, group)  # group sizes are powers of two >= 16 (int4.py): the step divides the group
    return block_m, block_n, block_k


def w4a16_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                 perm: torch.Tensor | None, group_size: int, bits: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(weight [N, K * bits / 32]).T (+ bias) -> [M, N] in x's dtype (act-order: the
    weight's rows sorted by group, `perm` [K] the input each multiplies)."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"x must be [rows, K] and x, weight contiguous in their last dimension; got x {tuple(x.shape)}")
    if bits not in (4, 8) or weight.dtype != torch.int32 or weight.shape[1] * (32 // bits) != x.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not fit a {bits}-bit packed weight {tuple(weight.shape)} {weight.dtype}")
    if scale.shape != zero.shape or scale.shape[0] != weight.shape[0] or scale.stride(1) != 1 or zero.stride(1) != 1:
        raise ValueError(f"scale {tuple(scale.shape)} and zero {tuple(zero.shape)} must be [N, groups], row-major")
    check_launchable(x, weight, scale, zero)
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    bm, bn, bk = w4a16_tiles(rows, n, k, group_size, x.dtype)
    if group_size % bk and group_size < k:
        raise ValueError(f"group_size {group_size}: the K step ({bk}) must divide it (group sizes are powers of two >= 16)")
    with on_device(x.device):
        _w4a16_kernel[(triton.cdiv(rows, bm), triton.cdiv(n, bn))](
            x, weight, scale, zero, perm if perm is not None else weight, bias if bias is not None else out, out,
            rows, n, k,
            x.stride(0), weight.stride(0), scale.stride(0), zero.stride(0), out.stride(0),
            GROUP=group_size, BITS=bits, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            HAS_PERM=perm is not None, HAS_BIAS=bias is not None,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            DOT_UPCAST=interpreting() and x.dtype == torch.bfloat16,
            num_warps=4,
        )
    return out
