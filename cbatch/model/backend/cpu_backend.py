"""The CPU path: the plain-torch backend with its decode attention replaced by the compiled kernel
(cpu_kernels.py), which reads each row's K and V once, in place. Prefill chunks, the KV store, the fp8 cache
and every other op stay on the torch path (TorchBackend), which remains the reference it is tested against."""
from __future__ import annotations

import torch

from cbatch.model.backend import cpu_kernels
from cbatch.model.backend.metadata import AttentionMetadata
from cbatch.model.backend.torch_backend import TorchBackend, _CacheReader, _Scoring


class CpuBackend(TorchBackend):
    name = "cpu"

    def attend_decodes(self, q: torch.Tensor, out: torch.Tensor, cache: _CacheReader, scoring: _Scoring,
                       meta: AttentionMetadata) -> None:
        if cache.scaled or not cpu_kernels.supports(q.dtype):  # fp8 cache, float16: the torch path
            super().attend_decodes(q, out, cache, scoring, meta)
            return
        state = meta.backend_state
        if state.decode_rows_i32 is None:  # once per step, shared by every layer
            state.decode_rows_i32 = torch.tensor(state.decode_rows, dtype=torch.int32)
        cpu_kernels.decode_attention(q, cache.kv.k, cache.kv.v, meta.block_table, meta.seq_lens, meta.query_start_loc,
                                     state.decode_rows_i32, out, scoring.scale, scoring.sliding_window, scoring.softcap)
