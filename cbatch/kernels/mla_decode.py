"""MLA decode attention in latent space (DeepSeek-V2/V3, Kimi K2), over the paged latent cache.

One program per (sequence, block of heads): each query row holds its heads' absorbed queries
q = (q_nope W_UK | q_pe) [H, rank + R]; the program streams its sequence's cached latents [c_kv | k_pe]
(rank + R values per token, read once for every head of the block: MLA's bandwidth saving) BLOCK_N tokens at a
time through the block table, scores = q_lat . c_kv + q_pe . k_pe, an online softmax in float32, and
acc += p . c_kv. Output: the latent attention o_lat [B, H, rank] in float32, which the caller multiplies by W_UV.
The reference is cbatch/model/backend/mla.py's absorbed decode (tests/test_kernels_mla.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_launchable, interpreting, next_pow2, on_device

BLOCK_N = 16  # cached tokens per iteration
MIN_DOT = 16  # tl.dot's smallest tile side


@triton.jit(do_not_specialize=["num_seqs", "stride_bt"])
def _mla_decode_kernel(
    q_ptr,  # [num_seqs, H, RANK + ROPE] (q_lat | q_pe)
    cache_ptr,  # [num_slots, RANK + ROPE]: slot = block * BLOCK_SIZE + offset
    block_table_ptr,  # int32 [num_seqs, max_blocks]
    seq_lens_ptr,  # int32 [num_seqs]
    out_ptr,  # float32 [num_seqs, H, RANK]
    scale,
    num_seqs,
    stride_qs, stride_qh, stride_bt, stride_os, stride_oh,
    NUM_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # interpreter only: bf16 dots in fp32 (numpy has no bf16 matmul)
):
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = heads < NUM_HEADS
    r = tl.arange(0, RANK_PAD)
    rm = r < RANK
    e = tl.arange(0, ROPE_PAD)
    em = e < ROPE
    q_row = q_ptr + seq * stride_qs + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + r[None, :], mask=hm[:, None] & rm[None, :], other=0.0)  # [BLOCK_H, RANK_PAD]
    q_pe = tl.load(q_row + RANK + e[None, :], mask=hm[:, None] & em[None, :], other=0.0)  # [BLOCK_H, ROPE_PAD]
    if DOT_UPCAST:
        q_lat, q_pe = q_lat.to(tl.float32), q_pe.to(tl.float32)
    ctx = tl.load(seq_lens_ptr + seq)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    for start in range(0, ctx, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        pm = pos < ctx
        block = tl.load(block_table_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pm, other=0).to(tl.int64)
        slot = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * (RANK + ROPE)
        c = tl.load(cache_ptr + slot[:, None] + r[None, :], mask=pm[:, None] & rm[None, :], other=0.0)  # [N, RANK_PAD]
        k_pe = tl.load(cache_ptr + slot[:, None] + RANK + e[None, :], mask=pm[:, None] & em[None, :], other=0.0)
        if DOT_UPCAST:
            c, k_pe = c.to(tl.float32), k_pe.to(tl.float32)
        scores = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe), scores, input_precision=DOT_PRECISION) * scale  # [BLOCK_H, N]
        scores = tl.where(pm[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m - m_new)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)  # p rounded as the cache
        m = m_new
    out = acc / denom[:, None]
    tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + r[None, :], out, mask=hm[:, None] & rm[None, :])


def mla_decode_attention(q: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                         rank: int, scale: float) -> torch.Tensor:
    """q [B, H, rank + R] (absorbed q_lat | rotated q_pe), one layer's latent cache [num_blocks, block_size, 1,
    rank + R], block_table int32 [B, max_blocks], seq_lens int32 [B] (each >= 1) -> float32 o_lat [B, H, rank]."""
    num_seqs, num_heads, width = q.shape
    num_blocks, block_size = cache.shape[0], cache.shape[1]
    if cache.shape[-1] != width or cache.dtype != q.dtype:
        raise ValueError(f"cache {tuple(cache.shape)} {cache.dtype} does not hold q's {width} latent values ({q.dtype})")
    if block_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("block_table and seq_lens must be int32")
    q, cache = q.contiguous(), cache.contiguous()
    device = check_launchable(q, cache, block_table, seq_lens)
    out = torch.empty(num_seqs, num_heads, rank, dtype=torch.float32, device=q.device)
    if num_seqs == 0:
        return out
    rope = width - rank
    block_h = MIN_DOT  # heads per program: a [16, rank] float32 accumulator (rank 512: 32 KiB of registers)
    with on_device(device):
        _mla_decode_kernel[(num_seqs, triton.cdiv(num_heads, block_h))](
            q, cache.view(num_blocks * block_size, width), block_table, seq_lens, out, scale, num_seqs,
            q.stride(0), q.stride(1), block_table.stride(0), out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, BLOCK_SIZE=block_size, RANK=rank, ROPE=rope,
            RANK_PAD=max(MIN_DOT, next_pow2(rank)), ROPE_PAD=max(MIN_DOT, next_pow2(rope)),
            BLOCK_H=block_h, BLOCK_N=BLOCK_N, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            DOT_UPCAST=interpreting() and q.dtype == torch.bfloat16,
        )
    return out
