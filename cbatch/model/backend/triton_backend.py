"""The Triton backend: paged attention, the fused attention prologue (q/k norm + rotary + KV store), RMSNorm,
gated activations, fused MoE and FP8 matmuls through `cbatch.kernels` (the GPU path; on CPU tensors only
under TRITON_INTERPRET=1, for tests)."""
from __future__ import annotations

import os

import torch

from cbatch.model.backend.metadata import AttentionLayer, AttentionMetadata, KVLayer, MLALayer
from cbatch.model.backend.registry import register
from cbatch.model.backend.rotary import RotaryStep


def _fused_prologue_covers(layer: AttentionLayer, rope: RotaryStep) -> bool:
    """norm_rope_store rotates whole heads and applies HF Llama/Qwen3 RMSNorm weights (not Gemma's 1 + w)."""
    full_rotary = rope.cos_sin.shape[-1] == layer.head_dim
    return full_rotary and (layer.q_norm is None or not layer.q_norm.unit_offset)


class TritonBackend:
    name = "triton"
    supports_cuda_graphs = True  # no per-step host state: every layer reads the metadata's tensors
    groups_decodes = False  # one program per (row, head group): any row order
    split_kv = True  # paged_attention's auto_num_splits (off: EngineConfig.split_kv, set by engine_backend)
    supports_tuning = True  # `tune` / `tune_linears`: decode attention's tiles, the decode GEMMs, timed at start-up
    needs_warmup = True  # Triton compiles a kernel variant per shape class on its first launch
    fused_sampling = True  # the one-pass sampling kernel runs where these kernels do
    keeps_fp8_weights = True  # fp8_linear and fused_moe dequantize FP8 weights tile by tile
    keeps_int_weights = True  # int_linear (the W4A16 GEMM) unpacks int4/int8 weights in registers
    keeps_mxfp4_weights = True  # fused_moe's grouped GEMM decodes MXFP4 experts in registers

    def __init__(self) -> None:
        self.decode_tiles = None  # DecodeTiles once `tune` ran; None: the kernel's own policy
        self.split_rule = None  # paged_attention.SplitRule once `tune` ran (with split_kv); None: the policy's

    def tune(self, shape, device: torch.device, max_context: int):
        """Times decode attention's candidate tiles on `shape` (a `kernels.tuning.DecodeShape`) on `device`, then
        (split_kv) the split-KV rules with the winning tiles at contexts up to `max_context`, and keeps both for
        every later launch; returns the `TuningResult`. Before any CUDA graph is captured."""
        from cbatch.kernels.tuning import tune_decode_attention, tune_decode_splits

        result = tune_decode_attention(shape, device)
        self.decode_tiles = result.tiles
        if self.split_kv:
            result.splits = tune_decode_splits(shape, result.tiles, device, max_context)
            self.split_rule = result.splits.rule
        return result

    def tune_linears(self, linears, device: torch.device, buckets: tuple[int, ...]):
        """Times cuBLAS against the Triton decode GEMM's candidates for these `layers.Linear` modules' shapes at
        decode batch sizes up to each of `buckets` on `device`; each layer whose shape Triton won at some batch
        size gets its `DecodeGemm` (used inside the decode CUDA graphs). Returns the `GemmTuningResult`. Before
        any capture."""
        from cbatch.kernels.tuning import tune_decode_gemms

        result = tune_decode_gemms([(m.weight, m.bias) for m in linears], device, buckets=buckets)
        for m in linears:
            m.gemm = result.gemm_for(m.weight, m.bias)
        return result

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def attention(self, qkv: torch.Tensor, layer: AttentionLayer, rope: RotaryStep, kv: KVLayer,
                  meta: AttentionMetadata) -> torch.Tensor:
        """Two launches per layer: `norm_rope_store` (q rotated in place inside qkv, k/v into the cache) and
        `paged_attention` (reading q strided out of qkv, soft-capped for Gemma 2, with gpt-oss's sinks, Gemma 3's image
        tokens seeing their whole image: `meta.key_ends`). Layers the
        fused prologue does not cover (partial rotary, Gemma's (1 + w) q/k norms) take the separate kernels.
        Returns [T, Hq, D]."""
        from cbatch.kernels import paged_attention

        q = self._prologue(qkv, layer, rope, kv, meta) if _fused_prologue_covers(layer, rope) else \
            self._unfused_prologue(qkv, layer, rope, kv, meta)
        out = torch.empty((qkv.shape[0], layer.num_heads, layer.head_dim), dtype=qkv.dtype, device=qkv.device)
        paged_attention(
            q, kv.k, kv.v, out,
            meta.query_start_loc, meta.seq_lens, meta.block_table,
            layer.scale, meta.max_query_len, meta.max_seq_len, sliding_window=layer.sliding_window,
            softcap=layer.softcap, k_scale=kv.k_scale, v_scale=kv.v_scale, decode_tiles=self.decode_tiles,
            num_splits=None if self.split_kv else 1, split_rule=self.split_rule, sinks=getattr(layer, "sinks", None),
            key_ends=meta.key_ends,
        )
        return out

    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                      layer: MLALayer, rope: RotaryStep, kv: KVLayer, meta: AttentionMetadata) -> torch.Tensor:
        """Multi-head latent attention: rotary by the Triton kernel, the latent store and the prefills' naive form in
        torch (backend/mla.py), the decodes' latent-space attention by `mla_decode_attention`. The torch parts keep
        per-step host state, so MLA models run without decode CUDA graphs (engine/build.py). Returns [T, H, V]."""
        from cbatch.kernels import apply_rotary, mla_decode_attention
        from cbatch.model.backend.mla import mla_attend

        q_pe, k_pe = q_pe.contiguous(), k_pe.unsqueeze(1).contiguous()
        apply_rotary(q_pe, k_pe, rope.positions, rope.cos_sin)  # in place
        latent = torch.cat([c_kv, k_pe.squeeze(1)], dim=-1)
        return mla_attend(q_nope, q_pe, latent, layer, kv.k, meta, latent_attention=mla_decode_attention)

    def _prologue(self, qkv: torch.Tensor, layer: AttentionLayer, rope: RotaryStep, kv: KVLayer,
                  meta: AttentionMetadata) -> torch.Tensor:
        """q/k norm + rotary + KV store in one launch; q [T, Hq, D] as a view of qkv."""
        from cbatch.kernels import norm_rope_store

        q_norm, k_norm = layer.q_norm, layer.k_norm
        return norm_rope_store(
            qkv, layer.num_heads, layer.num_kv_heads, rope.positions, rope.cos_sin, kv.k, kv.v, meta.slot_mapping,
            q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 0.0, kv.k_scale, kv.v_scale,
        )

    def _unfused_prologue(self, qkv: torch.Tensor, layer: AttentionLayer, rope: RotaryStep, kv: KVLayer,
                          meta: AttentionMetadata) -> torch.Tensor:
        """The same steps as separate kernels: q/k norms, rotary (in place), store_kv; q [T, Hq, D]."""
        from cbatch.kernels import apply_rotary, store_kv

        num_tokens, heads, kv_heads, head_dim = qkv.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = q.view(num_tokens, heads, head_dim)
        k = k.view(num_tokens, kv_heads, head_dim)
        if layer.q_norm is not None:
            q = self.rms_norm(q, layer.q_norm.weight, layer.q_norm.eps, layer.q_norm.unit_offset)
            k = self.rms_norm(k, layer.k_norm.weight, layer.k_norm.eps, layer.k_norm.unit_offset)
        apply_rotary(q, k, rope.positions, rope.cos_sin)  # in place
        store_kv(k, v.view(num_tokens, kv_heads, head_dim), kv.k, kv.v, meta.slot_mapping, kv.k_scale, kv.v_scale)
        return q

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
        from cbatch.kernels import rms_norm

        # the kernel takes [rows, hidden]; per-head q/k norms come as [T, heads, head_dim]
        return rms_norm(x.reshape(-1, x.shape[-1]), weight, eps, unit_offset=unit_offset).view(x.shape)

    def add_rms_norm(self, x, residual, weight, eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        from cbatch.kernels import fused_add_rms_norm

        return fused_add_rms_norm(x, residual, weight, eps, unit_offset=unit_offset)

    def rotary(self, positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        return RotaryStep(positions, cos_sin)  # the kernel reads the float32 table at each position

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        from cbatch.kernels import silu_and_mul

        return silu_and_mul(gate_up)

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        from cbatch.kernels import gelu_tanh_and_mul

        return gelu_tanh_and_mul(gate_up)

    def fp8_linear(self, x, weight, scale, block: tuple[int, int] | None, bias) -> torch.Tensor:
        from cbatch.kernels import fp8_linear

        return fp8_linear(x, weight, scale, block, bias)

    def int_linear(self, x, weight, scale, zero, perm, group_size: int, bits: int, bias) -> torch.Tensor:
        from cbatch.kernels import w4a16_linear

        return w4a16_linear(x, weight, scale, zero, perm, group_size, bits, bias)

    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, activation, w13_scale=None, w2_scale=None,
                  block: tuple[int, int] | None = None, int_experts=None, w13_bias=None, w2_bias=None) -> torch.Tensor:
        from cbatch.kernels import fused_moe

        return fused_moe(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block, int_experts,
                         w13_bias=w13_bias, w2_bias=w2_bias)

    def fused_moe_slots(self, x, w13, w2, topk_weights, topk_ids, activation, w13_scale=None, w2_scale=None,
                        block: tuple[int, int] | None = None, int_experts=None, first_expert: int = 0,
                        w13_bias=None, w2_bias=None) -> torch.Tensor:
        from cbatch.kernels.grouped_gemm import fused_moe_slots

        return fused_moe_slots(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block, int_experts,
                               first_expert, w13_bias, w2_bias)


def _unavailable(device: torch.device) -> str | None:
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "triton runs on a CPU only under the Triton interpreter (TRITON_INTERPRET=1, for testing); use cpu or torch"
    return None


register("triton", TritonBackend, devices=("cuda",), unavailable=_unavailable)
