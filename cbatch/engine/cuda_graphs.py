"""CUDA graphs for decode steps: one captured forward per bucketed batch size, replayed with static buffers.

A decode-only step of T sequences (every row one query token) runs the graph of the smallest bucket
>= T; rows T..bucket are padding (slot -1: nothing stored; context length 1: attention stays finite;
outputs discarded). Steps with prefill chunks, or larger than the biggest bucket, run eagerly.

Requires the Triton attention backend: the torch backend prepares per-step host state, which a
graph cannot capture. Graphs share one memory pool; the biggest bucket is captured first so the
smaller ones fit in its allocations.
"""
from __future__ import annotations

import torch

from cbatch.model.backend import AttentionMetadata
from cbatch.model.llama import ForwardContext, KVCacheView, LlamaForCausalLM


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (and max_num_seqs itself)."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return sorted(set(small + list(range(16, max_num_seqs + 1, 16)) + [max_num_seqs]))


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend,
        kv: KVCacheView,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv = kv
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.buckets = decode_buckets(max_num_seqs)
        max_bs = self.buckets[-1]
        max_blocks = -(-max_model_len // block_size)
        # Static input buffers: graphs read these addresses on every replay.
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_bs, max_blocks, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def capture_all(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.buckets):
            self._capture(bs)
        torch.cuda.synchronize()

    def _meta(self, bs: int) -> AttentionMetadata:
        # max_seq_len is the model's limit: the kernels size their grid from it, so one graph
        # serves every context length (the real lengths come from seq_lens at replay).
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs],
            slot_mapping=self.slot_mapping[:bs],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_lens_host=[1] * bs,
            seq_lens_host=[1] * bs,
            block_size=self.block_size,
        )

    @torch.inference_mode()
    def _capture(self, bs: int) -> None:
        meta = self._meta(bs)
        ctx = ForwardContext(self.kv, meta)
        self.backend.prepare(meta)
        for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
            self.model(self.input_ids[:bs], self.positions[:bs], ctx)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.model(self.input_ids[:bs], self.positions[:bs], ctx)
        self.graphs[bs] = (graph, out)

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return meta.max_query_len == 1 and num_tokens <= self.max_batch and bool(self.graphs)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replays the smallest fitting graph; returns hidden states [T, hidden] (a view of its output)."""
        num = input_ids.shape[0]
        bs = next(b for b in self.buckets if b >= num)
        self.input_ids[:num].copy_(input_ids)
        self.positions[:num].copy_(positions)
        self.slot_mapping[:num].copy_(meta.slot_mapping)
        self.slot_mapping[num:bs].fill_(-1)
        self.seq_lens[:num].copy_(meta.seq_lens)
        self.seq_lens[num:bs].fill_(1)
        cols = meta.block_table.shape[1]
        self.block_table[:num, :cols].copy_(meta.block_table)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:num]
