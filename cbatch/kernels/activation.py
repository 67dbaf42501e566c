"""Gated activations: out = act(gate) * up, gate and up side by side in one [T, 2 * I] tensor.

    silu_and_mul        SwiGLU (Llama, Qwen, Mistral, Phi-3, the MoE experts)
    gelu_tanh_and_mul   GELU with the tanh approximation (Gemma's gelu_pytorch_tanh)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_launchable, next_pow2, on_device

_BLOCK = 1024  # columns per program: 2 KiB of bf16 output, 4 KiB of input per program


@triton.jit
def tanh(x):
    """tanh in fp32 from exp, stable for any |x|: sign(x) * (1 - e^(-2|x|)) / (1 + e^(-2|x|))."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _gated_kernel(
    x_ptr,  # [num_tokens, 2 * inter]: gate = x[:, :inter], up = x[:, inter:]
    out_ptr,  # [num_tokens, inter]
    stride_x, stride_o,
    inter,
    BLOCK: tl.constexpr,
    GELU_TANH: tl.constexpr,  # gelu(gate, approximate="tanh") instead of silu(gate)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0)
    dt = gate.dtype
    g = gate.to(tl.float32)
    # torch computes the activation in fp32 and rounds to the input dtype; the product is then rounded again
    if GELU_TANH:
        act = (0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))).to(dt)  # sqrt(2 / pi)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(dt)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(dt), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * I] -> [num_tokens, I] = silu(x[:, :I]) * x[:, I:] in x's dtype."""
    return _gated(x, gelu_tanh=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * I] -> [num_tokens, I] = gelu_tanh(x[:, :I]) * x[:, I:] in x's dtype."""
    return _gated(x, gelu_tanh=True)


def _gated(x: torch.Tensor, gelu_tanh: bool) -> torch.Tensor:
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
        _gated_kernel[(num_tokens, triton.cdiv(inter, block))](
            x, out, x.stride(0), out.stride(0), inter,
            BLOCK=block,
            GELU_TANH=gelu_tanh,
            num_warps=4,
        )
    return out
