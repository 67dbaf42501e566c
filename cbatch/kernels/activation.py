"""SwiGLU activation: out = silu(gate) * up, gate and up side by side in one [T, 2 * I] tensor."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_launchable, next_pow2, on_device

_BLOCK = 1024  # columns per program: 2 KiB of bf16 output, 4 KiB of input per program


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * inter]: gate = x[:, :inter], up = x[:, inter:]
    out_ptr,  # [num_tokens, inter]
    stride_x, stride_o,
    inter,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    dt = gate.dtype
    g = gate.to(tl.float32)
    # F.silu computes in fp32 and rounds to the input dtype; the product is then rounded again (eager: two ops)
    silu = (g / (1.0 + tl.exp(-g))).to(dt)
    out = silu.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * I] -> [num_tokens, I] = silu(x[:, :I]) * x[:, I:] in x's dtype."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [num_tokens, 2 * I], got {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    device = check_launchable(x)
    num_tokens, two_inter = x.shape
    inter = two_inter // 2
    out = torch.empty((num_tokens, inter), dtype=x.dtype, device=device)
    if num_tokens == 0 or inter == 0:
        return out
    block = min(_BLOCK, next_pow2(inter))
    with on_device(device):
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), inter,
            BLOCK=block,
            num_warps=4,
        )
    return out
