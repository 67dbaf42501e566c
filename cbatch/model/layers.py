"""Building blocks shared by every family: the modules hold parameters, the backend (cbatch.model.backend)
computes. RMSNorm, the gated MLP's activation and FP8 matmuls call the backend the model was built with;
plain linear layers run on oneDNN on CPU (`Linear`, through cbatch/model/onednn.py), on cuBLAS on a GPU, or in a
decode step's CUDA graph on the Triton GEMM where start-up tuning timed it faster (`Linear.gemm`).
"""
from __future__ import annotations

import torch
from torch import nn

from cbatch.model.backend import Backend
from cbatch.model.onednn import linear, packed_linear, prepack_weight
from cbatch.model.int4 import PackedQuant
from cbatch.model.quant import FP8_DTYPE


class RMSNorm(nn.Module):
    """RMSNorm with HF's numerics (the backend's `rms_norm`). `unit_offset` (Gemma): the scale is
    (1 + weight), applied in float32 before the cast back (Llama casts first, then multiplies by weight)."""

    def __init__(self, size: int, eps: float, backend: Backend, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps, unit_offset=self.unit_offset)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (norm(x + residual), x + residual): the residual add fused with the norm."""
        return self.backend.add_rms_norm(x, residual, self.weight, self.eps, unit_offset=self.unit_offset)


class Linear(nn.Linear):
    """nn.Linear whose forward is `onednn.linear` (same parameters and state-dict names), or oneDNN's
    prepacked matmul once `prepack()` has run."""

    packed: torch.Tensor | None = None
    lora = None  # cbatch.lora.runtime.LoraTarget: the job's adapters add their deltas to the output
    # cbatch.kernels.gemm.DecodeGemm: start-up tuning's Triton GEMM for decode-sized batches where it timed faster
    # than cuBLAS (GPU, `--decode-gemm`; engine/build.py sets it); None: F.linear
    gemm = None

    def prepack(self) -> None:
        """Swaps the weight for its prepacked copy (CPU only; a no-op where unavailable). The plain
        weight is dropped, so the model holds one copy."""
        packed = prepack_weight(self.weight)
        if packed is not None:
            self.packed = packed
            self.weight = None  # nothing may use the plain weight from here on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            out = packed_linear(x, self.packed, self.bias)
        elif self.gemm is not None:
            out = self.gemm(x, self.weight, self.bias)
        else:
            out = linear(x, self.weight, self.bias)
        return out if self.lora is None else self.lora.add(x, out)


class Fp8Linear(nn.Module):
    """A linear layer whose weight stays in FP8 with its scales (the GPU path: half the bytes of bf16); the
    backend's `fp8_linear` dequantizes inside the matmul. Scales: float32 [out] per channel, or
    [ceil(out / bn), ceil(in / bk)] per `block`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int] | None,
                 backend: Backend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        scale_shape = (out_features,) if block is None else (-(-out_features // block[0]), -(-in_features // block[1]))
        self.weight_scale = nn.Parameter(torch.empty(scale_shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.block = block
        self.backend = backend

    lora = None  # as Linear's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.backend.fp8_linear(x, self.weight, self.weight_scale, self.block, self.bias)
        return out if self.lora is None else self.lora.add(x, out)


class Int4Linear(nn.Module):
    """A linear layer whose weight stays packed (the GPU path: a quarter of bf16's bytes at 4 bits): `bits`-bit
    unsigned values, 32/bits per int32 in order along the input dimension (weight int32 [N, K*bits/32]),
    per-group scales float32 [N, G] and zeros uint8 [N, G]; row k is in group k // group_size. Act-order
    checkpoints are held with their input rows sorted by group and `weight_perm` int32 [K] (row k' multiplies
    input perm[k']: int4.sort_by_group). The backend's `int_linear`
    dequantizes inside the matmul: w[n, k] = (q[n, k] - zero[n, g]) x scale[n, g]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: PackedQuant, backend: Backend) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        groups = quant.groups(in_features)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // quant.per_int32, dtype=torch.int32),
                                   requires_grad=False)
        # float32 scales: the checkpoint's fp16/bf16 scales exactly (G / K of the weights: 3% more bytes at group 128)
        self.weight_scale = nn.Parameter(torch.empty(out_features, groups, dtype=torch.float32), requires_grad=False)
        self.weight_zero = nn.Parameter(torch.empty(out_features, groups, dtype=torch.uint8), requires_grad=False)
        self.weight_perm = None
        if quant.act_order:
            self.weight_perm = nn.Parameter(torch.empty(in_features, dtype=torch.int32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group_size = in_features if quant.group_size == -1 else quant.group_size
        self.bits = quant.bits
        self.backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.int_linear(x, self.weight, self.weight_scale, self.weight_zero, self.weight_perm,
                                       self.group_size, self.bits, self.bias)


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)), gate and up packed into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, activation: str, backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        self.activation = activation  # silu | gelu_tanh
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if self.activation == "gelu_tanh":
            return self.down_proj(self.backend.gelu_tanh_and_mul(gate_up))
        return self.down_proj(self.backend.silu_and_mul(gate_up))
