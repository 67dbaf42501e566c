"""The Triton backend: paged attention, KV store, RMSNorm, rotary, gated activations, fused MoE and FP8
matmuls through `cbatch.kernels` (the GPU path; on CPU tensors only under TRITON_INTERPRET=1, for tests)."""
from __future__ import annotations

import torch

from cbatch.model.backend.metadata import AttentionMetadata
from cbatch.model.backend.rotary import RotaryStep


class TritonBackend:
    name = "triton"
    supports_cuda_graphs = True  # no per-step host state: every layer reads the metadata's tensors

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def attention(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                  sliding_window: int | None, softcap: float | None = None) -> torch.Tensor:
        from cbatch.kernels import paged_attention, store_kv

        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        return paged_attention(
            q, k_cache, v_cache, out,
            meta.query_start_loc, meta.seq_lens, meta.block_table,
            scale, meta.max_query_len, meta.max_seq_len, sliding_window=sliding_window, softcap=softcap,
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
        from cbatch.kernels import rms_norm

        # the kernel takes [rows, hidden]; Qwen3's per-head q/k norms come as [T, heads, head_dim]
        return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, unit_offset=unit_offset).view(x.shape)

    def add_rms_norm(self, x, residual, weight, eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        from cbatch.kernels import fused_add_rms_norm

        return fused_add_rms_norm(x, residual, weight, eps, unit_offset=unit_offset)

    def rotary(self, positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        return RotaryStep(positions, cos_sin)  # the kernel reads the float32 table at each position

    def apply_rotary(self, q, k, rope: RotaryStep) -> tuple[torch.Tensor, torch.Tensor]:
        from cbatch.kernels import apply_rotary

        apply_rotary(q, k, rope.positions, rope.cos_sin)  # in place
        return q, k

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        from cbatch.kernels import silu_and_mul

        return silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        from cbatch.kernels import gelu_tanh_and_mul

        return gelu_tanh_and_mul(gate_up)

    def fp8_linear(self, x, weight, scale, block: tuple[int, int] | None, bias) -> torch.Tensor:
        from cbatch.kernels import fp8_linear

        return fp8_linear(x, weight, scale, block, bias)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, activation: str, w13_scale=None, w2_scale=None,
                  block: tuple[int, int] | None = None) -> torch.Tensor:
        from cbatch.kernels import fused_moe

        return fused_moe(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block)
