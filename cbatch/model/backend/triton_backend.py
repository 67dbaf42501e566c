"""The Triton backend: paged attention, the fused attention prologue (q/k norm + rotary + KV store), RMSNorm
and SiLU-and-mul through `cbatch.kernels` (the GPU path; on CPU tensors only under TRITON_INTERPRET=1, for tests)."""
from __future__ import annotations

import torch

from cbatch.model.backend.metadata import AttentionLayer, AttentionMetadata, KVLayer
from cbatch.model.backend.rotary import RotaryStep


class TritonBackend:
    name = "triton"
    supports_cuda_graphs = True  # no per-step host state: every layer reads the metadata's tensors

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def attention(self, qkv: torch.Tensor, layer: AttentionLayer, rope: RotaryStep, kv: KVLayer,
                  meta: AttentionMetadata) -> torch.Tensor:
        """Two launches per layer: `norm_rope_store` (q rotated in place inside qkv, k/v into the cache) and
        `paged_attention` (reading q strided out of qkv). Returns [T, Hq, D]."""
        from cbatch.kernels import norm_rope_store, paged_attention

        q_norm, k_norm = layer.q_norm, layer.k_norm
        q = norm_rope_store(
            qkv, layer.num_heads, layer.num_kv_heads, rope.positions, rope.cos_sin, kv.k, kv.v, meta.slot_mapping,
            q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 0.0, kv.k_scale, kv.v_scale,
        )  # [T, Hq, D], a view of qkv
        out = torch.empty((qkv.shape[0], layer.num_heads, layer.head_dim), dtype=qkv.dtype, device=qkv.device)
        return paged_attention(
            q, kv.k, kv.v, out,
            meta.query_start_loc, meta.seq_lens, meta.block_table,
            layer.scale, meta.max_query_len, meta.max_seq_len, sliding_window=layer.sliding_window,
            k_scale=kv.k_scale, v_scale=kv.v_scale,
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from cbatch.kernels import rms_norm

        return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    def add_rms_norm(self, x, residual, weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from cbatch.kernels import fused_add_rms_norm

        return fused_add_rms_norm(x, residual, weight, eps)

    def rotary(self, positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        return RotaryStep(positions, cos_sin)  # the kernel reads the float32 table at each position

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        from cbatch.kernels import silu_and_mul

        return silu_and_mul(gate_up)
