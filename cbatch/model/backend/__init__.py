"""Compute backends: the attention over the paged KV cache and the model's small ops, as one object.

An engine picks its backend once (`make_backend`) and builds its model with it; nothing is global, so
engines with different backends coexist in one process.

    CpuBackend     the CPU path: TorchBackend with compiled decode attention, RMSNorm and SiLU-and-mul (built on first use)
    TorchBackend   plain torch: the reference, and the CPU path where no C++ compiler is found
    TritonBackend  `cbatch.kernels`: the GPU path (CPU tensors only under TRITON_INTERPRET=1)
"""
from __future__ import annotations

import os
from typing import Protocol

import torch

from cbatch.model.backend import cpu_kernels
from cbatch.model.backend.cpu_backend import CpuBackend
from cbatch.fp8_kv import FP8_KV_DTYPE
from cbatch.model.backend.metadata import AttentionLayer, AttentionMetadata, KVLayer, kv_cache_shape
from cbatch.model.backend.rotary import RotaryStep
from cbatch.model.backend.torch_backend import TorchBackend
from cbatch.model.backend.triton_backend import TritonBackend


class Backend(Protocol):
    name: str
    supports_cuda_graphs: bool
    groups_decodes: bool  # attends neighbouring decode rows together: the runner orders them by context length
    supports_tuning: bool  # has `tune(shape: kernels.tuning.DecodeShape, device) -> TuningResult` (start-up tuning)

    def prepare(self, meta: AttentionMetadata) -> None: ...
    def attention(self, qkv: torch.Tensor, layer: AttentionLayer, rope: RotaryStep, kv: KVLayer,
                  meta: AttentionMetadata) -> torch.Tensor: ...  # norms, rotary, KV store, attention (soft-capped)
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor: ...
    def add_rms_norm(self, x, residual, weight, eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]: ...
    def rotary(self, positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype) -> RotaryStep: ...
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def fp8_linear(self, x, weight, scale, block: tuple[int, int] | None, bias) -> torch.Tensor: ...
    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, activation: str, w13_scale=None, w2_scale=None,
                  block: tuple[int, int] | None = None) -> torch.Tensor: ...


class BackendUnavailable(ValueError):
    """The backend cannot run on this device; the message says what to use instead."""


def backend_name(name: str, device: torch.device) -> str:
    """`auto` is triton on CUDA, elsewhere cpu where its kernel builds (else torch: `cpu_kernels.available()`
    says why not)."""
    if name == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpu" if cpu_kernels.available() is None else "torch"
    return name


def make_backend(name: str, device: torch.device) -> Backend:
    name = backend_name(name, device)
    if name == "torch":
        return TorchBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise BackendUnavailable("cpu runs on the CPU only; use triton (or auto) on a GPU")
        if (reason := cpu_kernels.available()) is not None:
            raise BackendUnavailable(f"its kernel could not be built: {reason}; use torch")
        return CpuBackend()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise BackendUnavailable(
            "triton runs on a CPU only under the Triton interpreter (TRITON_INTERPRET=1, for testing); use cpu or torch"
        )
    return TritonBackend()


__all__ = [
    "AttentionLayer", "AttentionMetadata", "Backend", "BackendUnavailable", "CpuBackend", "FP8_KV_DTYPE", "KVLayer",
    "RotaryStep", "TorchBackend", "TritonBackend", "backend_name", "kv_cache_shape", "make_backend",
]
