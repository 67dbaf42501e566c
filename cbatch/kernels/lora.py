"""LoRA deltas of many adapters in one batch (Punica / S-LoRA's segmented GEMMs): a shrink and an expand.

The step's adapted tokens are sorted by adapter slot (`sorted_tokens`, with `slot_counts` / `slot_starts`
per slot); program (m, n, slot) takes the m-th tile of that slot's tokens, so every tile multiplies one
adapter's factors:
    lora_shrink   y[tokens] = x[tokens] @ a[slot].T          a [S, N, in] -> y float32 [T, N]
    lora_expand   out[tokens] += y[tokens] @ b[slot].T        b [S, out, N] (added in out's dtype, in place)
Base-model tokens are in no slot and are never touched. A token belongs to one slot: no two programs write
the same output element. Grids depend on the step's largest slot (`max_count`), never on a compiled size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_launchable, interpreting, next_pow2, on_device

_BM = 16  # tokens per tile (tl.dot needs 16 or more)


@triton.jit
def _lora_gemm_kernel(
    x_ptr,  # [T, K]: the input rows (shrink: x; expand: y)
    w_ptr,  # [S, N, K]: the slots' factors (shrink: a; expand: b)
    out_ptr,  # [T, N]: written (shrink) or added to (expand)
    tok_ptr,  # int32 [T']: adapted tokens' rows, by slot
    count_ptr,  # int32 [S]
    start_ptr,  # int32 [S]
    n_size, k_size,
    stride_x, stride_ws, stride_wn, stride_out,
    ACCUMULATE: tl.constexpr,  # expand: out += result (in out's dtype); shrink: out = result (float32)
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # interpreter only: 16-bit dots in fp32 (numpy has no bf16 matmul)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.program_id(2)
    count = tl.load(count_ptr + slot)
    if pid_m * BM < count:
        start = tl.load(start_ptr + slot)
        offs_m = pid_m * BM + tl.arange(0, BM)
        m_ok = offs_m < count
        rows = tl.load(tok_ptr + start + offs_m, mask=m_ok, other=0).to(tl.int64)
        offs_n = pid_n * BN + tl.arange(0, BN)
        n_ok = offs_n < n_size
        w_base = w_ptr + slot.to(tl.int64) * stride_ws
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, k_size, BK):
            offs_k = k0 + tl.arange(0, BK)
            k_ok = offs_k < k_size
            x = tl.load(x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + offs_n[None, :] * stride_wn + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                        other=0.0)  # [BK, BN]
            if DOT_UPCAST:
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(x.to(w.dtype), w, acc, input_precision=DOT_PRECISION)
        out_ptrs = out_ptr + rows[:, None] * stride_out + offs_n[None, :]
        mask = m_ok[:, None] & n_ok[None, :]
        if ACCUMULATE:
            base = tl.load(out_ptrs, mask=mask, other=0.0)
            tl.store(out_ptrs, (base.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptrs, acc, mask=mask)


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_tokens: torch.Tensor,
            slot_counts: torch.Tensor, slot_starts: torch.Tensor, max_count: int, accumulate: bool) -> None:
    device = check_launchable(x, w, out, sorted_tokens)
    num_slots, n_size, k_size = w.shape
    if max_count == 0 or n_size == 0:
        return
    block_n = max(16, min(64, next_pow2(n_size)))
    block_k = max(16, min(64, next_pow2(k_size)))
    grid = (triton.cdiv(max_count, _BM), triton.cdiv(n_size, block_n), num_slots)
    with on_device(device):
        _lora_gemm_kernel[grid](
            x, w, out, sorted_tokens, slot_counts, slot_starts, n_size, k_size,
            x.stride(0), w.stride(0), w.stride(1), out.stride(0),
            ACCUMULATE=accumulate, BM=_BM, BN=block_n, BK=block_k,
            DOT_PRECISION="ieee" if w.dtype == torch.float32 else "tf32",
            DOT_UPCAST=interpreting() and w.dtype != torch.float32,
            num_warps=4,
        )


def lora_shrink(x: torch.Tensor, a: torch.Tensor, sorted_tokens: torch.Tensor, slot_counts: torch.Tensor,
                slot_starts: torch.Tensor, max_count: int) -> torch.Tensor:
    """x [T, in], a [S, N, in] -> float32 [T, N]: each adapted token's x @ a[its slot].T (other rows: zeros)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    y = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    _launch(x, a, y, sorted_tokens, slot_counts, slot_starts, max_count, accumulate=False)
    return y


def lora_expand(y: torch.Tensor, b: torch.Tensor, out: torch.Tensor, sorted_tokens: torch.Tensor,
                slot_counts: torch.Tensor, slot_starts: torch.Tensor, max_count: int) -> torch.Tensor:
    """out [T, out] += y @ b[slot].T for each adapted token (in place); y float32 [T, N], b [S, out, N]."""
    if out.stride(-1) != 1:
        raise ValueError("lora_expand adds into a row-contiguous output")
    _launch(y, b, out, sorted_tokens, slot_counts, slot_starts, max_count, accumulate=True)
    return out
