"""The CPU path: the plain-torch backend with its decode attention, prefill chunks' causal attention (sliding
windows, soft-caps, gpt-oss's sinks and Gemma 3's bidirectional image runs too), RMSNorm (with the residual add),
rotary, SiLU-and-multiply and the KV store replaced by the compiled kernels (cpu_kernels.py); the attention kernels
read K and V in place, and rotary and the per-head q/k norms read the packed projection in place too. Partial
rotary, the fp8 cache and every other op stay on the torch path (TorchBackend), which remains the reference the
kernels are tested against; so does any input whose dtype or layout a kernel does not take."""
from __future__ import annotations

import torch

from cbatch.model.backend import cpu_kernels
from cbatch.model.backend.metadata import AttentionMetadata
from cbatch.model.backend.registry import register
from cbatch.model.backend.rotary import RotaryStep
from cbatch.model.backend.torch_backend import TorchBackend, _CacheReader, _Scoring, _TorchStepState


class CpuBackend(TorchBackend):
    name = "cpu"
    groups_decodes = False  # the compiled kernel attends each decode row on its own (the torch fallback sorts)

    def attend_decodes(self, q: torch.Tensor, out: torch.Tensor, cache: _CacheReader, scoring: _Scoring,
                       meta: AttentionMetadata) -> None:
        if cache.scaled or not cpu_kernels.supports(q.dtype) or q.shape[-1] > cpu_kernels.MAX_HEAD_DIM:
            # fp8 cache, float16, heads the kernel's buffers do not hold: the torch path
            super().attend_decodes(q, out, cache, scoring, meta)
            return
        state = meta.backend_state
        if state.decode_rows_i32 is None:  # once per step, shared by every layer
            state.decode_rows_i32 = torch.tensor(state.decode_rows, dtype=torch.int32)
        cpu_kernels.decode_attention(q, cache.kv.k, cache.kv.v, meta.block_table, meta.seq_lens, meta.query_start_loc,
                                     state.decode_rows_i32, out, scoring.scale, scoring.sliding_window, scoring.softcap,
                                     _float32(scoring.sinks))

    def store_kv(self, stored_k: torch.Tensor, stored_v: torch.Tensor, cache: _CacheReader,
                 meta: AttentionMetadata) -> None:
        if cache.scaled or not cpu_kernels.store_kv(stored_k, stored_v, cache.kv.k, cache.kv.v, meta.slot_mapping):
            super().store_kv(stored_k, stored_v, cache, meta)  # the fp8 cache, or a layout the kernel does not take

    def attend_prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        cache: _CacheReader, scoring: _Scoring, meta: AttentionMetadata) -> None:
        """Every prefill chunk of the step, fresh or after cached context, with Gemma 3's images or without, in one
        call of the compiled kernel, whatever their lengths; what the kernel does not take on the torch path."""
        if cache.scaled or not cpu_kernels.supports(q.dtype) or meta.block_table.dtype != torch.int32:
            super().attend_prefills(q, k, v, out, cache, scoring, meta)
            return
        state: _TorchStepState = meta.backend_state
        if state.chunks_i32 is None:  # once per step, shared by every layer
            chunks = [c for group in state.fresh_groups for c in group.chunks] + state.prefills + state.image_chunks
            state.chunks_i32 = torch.tensor([[c.start for c in chunks], [c.q_len for c in chunks],
                                             [c.ctx - c.q_len for c in chunks], [c.seq_row for c in chunks]],
                                            dtype=torch.int32).reshape(4, len(chunks))
        if state.chunks_i32.shape[1]:
            cpu_kernels.prefill_attention(q, k, v, out, state.chunks_i32, scoring.scale, cache.kv.k, cache.kv.v,
                                          meta.block_table, scoring.sliding_window, scoring.softcap,
                                          _float32(scoring.sinks), meta.key_ends)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
        fused = cpu_kernels.rms_norm(x, weight, eps, unit_offset)
        return fused[0] if fused is not None else super().rms_norm(x, weight, eps, unit_offset)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        fused = cpu_kernels.rms_norm(x, weight, eps, unit_offset, residual)
        return fused if fused is not None else super().add_rms_norm(x, residual, weight, eps, unit_offset)

    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, rope: RotaryStep) -> tuple[torch.Tensor, torch.Tensor]:
        if rope.cos.shape[-1] == q.shape[-1]:  # full rotary (partial rotary keeps the torch path)
            q_rotated, k_rotated = cpu_kernels.rotary(q, rope.cos, rope.sin), cpu_kernels.rotary(k, rope.cos, rope.sin)
            if q_rotated is not None and k_rotated is not None:
                return q_rotated, k_rotated
        return super().apply_rotary(q, k, rope)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        fused = cpu_kernels.silu_and_mul(gate_up)
        return fused if fused is not None else super().silu_and_mul(gate_up)


def _float32(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """gpt-oss's sinks [Hq] as the kernels take them (float32, contiguous); the model's dtype may be 16-bit."""
    return None if sinks is None else sinks.float().contiguous()


def _unavailable(device: torch.device) -> str | None:
    if device.type != "cpu":
        return "cpu runs on the CPU only; use triton (or auto) on a GPU"
    if (reason := cpu_kernels.available()) is not None:
        return f"its kernel could not be built: {reason}; use torch"
    return None


def _passed_over() -> str:
    return (f"the compiled CPU kernels are not available ({cpu_kernels.available()}); "
            "running the plain-torch path, which is slower")


register("cpu", CpuBackend, devices=("cpu",), unavailable=_unavailable, passed_over=_passed_over)
