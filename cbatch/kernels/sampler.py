"""Greedy and temperature sampling in one pass over the logits (the GPU path's sampler).

The same tokens as `cbatch.engine.sampler.sample` for rows without top-k/top-p (which stay with the torch
sampler): a random row draws argmax(p / E) with p = softmax(logits / T) and E ~ Exp(1) from the same
counter-based hash of (seed, output position, vocab id). Since softmax is monotone and its normaliser is
one number per row, argmax(p / E) = argmax(logits / T - log E): no max, no sum, no softmax pass, and no
[N, vocab] intermediate. Greedy rows (T = 0) take argmax(logits). Ties go to the lowest vocab id, as
torch.argmax's. The two formulas round differently, so a row can differ from the torch sampler only when
two candidates are within a float32 rounding of each other.

One program per row, walking the vocabulary in BLOCK-wide tiles; everything is a tensor argument, so a
CUDA graph can hold it (the decode graphs sample inside the graph).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_launchable, on_device

_BLOCK = 2048  # vocab ids per tile: 8 KiB of fp32 logits


@triton.jit
def _hash32(x):
    """cbatch.engine.sampler._hash32 on uint32: the products there are masked to 32 bits, here they wrap."""
    x = ((x >> 16) ^ x) * 0x45D9F3B
    x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _fused_sample_kernel(
    logits_ptr,  # fp32 [N, vocab]
    temperatures_ptr,  # fp32 [N]; 0 = greedy
    seeds_ptr,  # int64 [N]
    positions_ptr,  # int64 [N]: index of the token being sampled within the completion
    out_ptr,  # int64 [N]
    vocab,
    stride_l,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    temp = tl.load(temperatures_ptr + r)
    random_row = temp > 0.0
    inv_temp = 1.0 / tl.where(random_row, temp, 1.0)
    # row key: exponential_noise's `row`, from the seed's two 32-bit halves and the position
    seed = tl.load(seeds_ptr + r)
    lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    pos = (tl.load(positions_ptr + r) & 0xFFFFFFFF).to(tl.uint32)
    row_key = _hash32(_hash32(_hash32(lo) ^ hi) ^ (pos * 0x61C88647))

    best = tl.full((), float("-inf"), tl.float32)
    best_id = tl.zeros((), tl.int64)
    for start in range(0, vocab, BLOCK):
        ids = start + tl.arange(0, BLOCK)
        ok = ids < vocab
        x = tl.load(logits_ptr + r * stride_l + ids, mask=ok, other=float("-inf"))
        if random_row:
            col = _hash32(ids.to(tl.uint32) * 0x27D4EB2D)
            bits = _hash32(row_key ^ col)
            # E = -log(u), u = (bits + 0.5) / 2**32 in float64, rounded to float32: exponential_noise's value
            u = (bits.to(tl.float64) + 0.5) / 4294967296.0
            noise = (-tl.log(u)).to(tl.float32)
            x = tl.where(ok, x * inv_temp - tl.log(noise), float("-inf"))
        tile_best = tl.max(x, 0)
        tile_id = start + tl.argmax(x, 0)  # first maximum within the tile
        better = tile_best > best  # strictly: an earlier tile keeps a tie
        best_id = tl.where(better, tile_id.to(tl.int64), best_id)
        best = tl.where(better, tile_best, best)
    tl.store(out_ptr + r, best_id)


def fused_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids int64 [N] for float32 logits [N, vocab]: argmax where temperatures[i] == 0, else the seeded
    exponential race at temperatures[i] (seeds int64 [N], positions int64 [N]). Writes `out` if given."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be float32 [N, vocab] with a contiguous last dim, got {tuple(logits.shape)} {logits.dtype}")
    num_rows, vocab = logits.shape
    for name, t, dtype in (("temperatures", temperatures, torch.float32), ("seeds", seeds, torch.int64),
                           ("positions", positions, torch.int64)):
        if t.shape != (num_rows,) or t.dtype != dtype:
            raise ValueError(f"{name} must be {dtype} [{num_rows}], got {t.dtype} {tuple(t.shape)}")
    device = check_launchable(logits, temperatures, seeds, positions)
    if out is None:
        out = torch.empty(num_rows, dtype=torch.int64, device=device)
    if num_rows == 0:
        return out
    with on_device(device):
        _fused_sample_kernel[(num_rows,)](
            logits, temperatures, seeds, positions, out, vocab, logits.stride(0),
            BLOCK=_BLOCK,
            num_warps=8,
        )
    return out
