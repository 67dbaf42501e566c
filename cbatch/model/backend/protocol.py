"""What every compute backend is: the `Backend` protocol. The engine and the model ask a backend what it can do
through its capability flags, never which backend it is (tests/test_registries.py holds every registered
backend to every member, and the code outside cbatch/model/backend/ to comparing no backend's name)."""
from __future__ import annotations

from typing import Protocol

import torch

from cbatch.model.backend.metadata import AttentionLayer, AttentionMetadata, KVLayer, MLALayer
from cbatch.model.backend.rotary import RotaryStep


class Backend(Protocol):
    name: str  # its --attention-backend name: for reports and fingerprints, never for decisions
    supports_cuda_graphs: bool  # no per-step host state: decode steps may run as captured CUDA graphs
    groups_decodes: bool  # attends neighbouring decode rows together: the runner orders them by context length
    # decode attention may cut a sequence's keys across programs when a step has few (split-KV); the engine sets it
    # False for --no-split-kv (EngineConfig.split_kv). False where attention never splits.
    split_kv: bool
    # has `tune(shape: kernels.tuning.DecodeShape, device, max_context) -> TuningResult` and `tune_linears(linears,
    # device, buckets) -> GemmTuningResult` (start-up tuning: decode attention's tiles and split-KV rule; cuBLAS or a
    # Triton GEMM per decode layer shape)
    supports_tuning: bool
    needs_warmup: bool  # compiles a kernel variant per step shape on first launch: a GPU engine runs them all first
    fused_sampling: bool  # runs where the Triton kernels run: the runner may sample with the one-pass kernel
    keeps_fp8_weights: bool  # fp8_linear / fused_moe take FP8 weights and scales as stored (else dequantized at load)
    keeps_int_weights: bool  # int_linear takes packed 4/8-bit weights (layers.Int4Linear; else dequantized at load)
    # fused_moe takes MXFP4 experts as gpt-oss checkpoints store them (uint8 e2m1 pairs + e8m0 scales; else
    # dequantized at load)
    keeps_mxfp4_weights: bool

    def prepare(self, meta: AttentionMetadata) -> None: ...
    def attention(self, qkv: torch.Tensor, layer: AttentionLayer, rope: RotaryStep, kv: KVLayer,
                  meta: AttentionMetadata) -> torch.Tensor: ...  # norms, rotary, KV store, attention (soft-capped)
    # multi-head latent attention: q_nope [T, H, N], q_pe [T, H, R], c_kv [T, rank] (normalised), k_pe [T, R] (both
    # halves of each pair of rotary dimensions as halves); rotary on q_pe and k_pe, [c_kv | k_pe] stored at
    # slot_mapping in kv.k (one latent per token), attention; returns [T, H, V]
    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                      layer: MLALayer, rope: RotaryStep, kv: KVLayer, meta: AttentionMetadata) -> torch.Tensor: ...
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor: ...
    def add_rms_norm(self, x, residual, weight, eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]: ...
    def rotary(self, positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype) -> RotaryStep: ...
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...
    def fp8_linear(self, x, weight, scale, block: tuple[int, int] | None, bias) -> torch.Tensor: ...
    def int_linear(self, x, weight, scale, zero, perm, group_size: int, bits: int, bias) -> torch.Tensor: ...
    # activation: silu | gelu_tanh | a ClampedSwiGLU (gpt-oss, with per-expert biases w13_bias [E, 2I], w2_bias [E, H])
    def fused_moe(self, x, w13, w2, topk_weights, topk_ids, activation, w13_scale=None, w2_scale=None,
                  block: tuple[int, int] | None = None, int_experts=None, w13_bias=None,
                  w2_bias=None) -> torch.Tensor: ...  # int4.IntExperts
    # expert parallelism: [T, k, H], each token's slots in ascending expert order, those of experts
    # [first_expert, first_expert + E) computed (w13 / w2 hold those E), the others zero; fused_moe = its sum(dim=1)
    def fused_moe_slots(self, x, w13, w2, topk_weights, topk_ids, activation, w13_scale=None, w2_scale=None,
                        block: tuple[int, int] | None = None, int_experts=None, first_expert: int = 0,
                        w13_bias=None, w2_bias=None) -> torch.Tensor: ...
