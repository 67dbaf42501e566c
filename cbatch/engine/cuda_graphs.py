"""CUDA graphs for decode steps: one captured forward per bucketed batch size, replayed with static buffers.

A decode-only step of T sequences (every row one query token) runs the graph of the smallest bucket
>= T; rows T..bucket are padding (slot -1: nothing stored; context length 1: attention stays finite;
outputs discarded). Steps with prefill chunks, or larger than the biggest bucket, run eagerly.
In a decode step every row samples, so the graph also holds (`sample_in_graph`) the lm_head and the
one-pass sampler over static per-row temperatures, seeds and positions: a replay leaves the hidden states
and the tokens in static buffers (the runner uses the tokens when the kernel covers the batch, else
computes the logits from the hidden states and samples them eagerly). The logits stay inside the graph's
pool, which every bucket shares: one bucket's worth ([bucket, vocab] float32) at a time, never one per bucket.

Requires the Triton attention backend: the torch backend prepares per-step host state, which a
graph cannot capture. Graphs share one memory pool; the biggest bucket is captured first so the
smaller ones fit in its allocations.
"""
from __future__ import annotations

import torch

from cbatch.engine.sampler_choice import kernel_inputs
from cbatch.engine.sampler import SamplingBatch
from cbatch.model.backend import AttentionMetadata
from cbatch.model.decoder import ForwardContext, KVCacheView, LlamaForCausalLM


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (and max_num_seqs itself)."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return sorted(set(small + list(range(16, max_num_seqs + 1, 16)) + [max_num_seqs]))


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend,
        kv_view: KVCacheView,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        sample_in_graph: bool = True,
        sample_splits: int | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_view = kv_view
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
        self.sample_in_graph = sample_in_graph
        self.sample_splits = sample_splits  # fused_sample's num_splits (None: from the bucket's size and the SMs)
        self.temperatures = torch.zeros(max_bs, dtype=torch.float32, device=device)  # padding rows: greedy
        self.seeds = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.out_positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        # Static outputs, outside the graphs' pool: what a replay leaves for the runner
        self.hidden = torch.zeros(max_bs, model.spec.hidden_size, dtype=model.embed_tokens.weight.dtype, device=device)
        self.tokens = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
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
        ctx = ForwardContext(self.kv_view, meta)
        self.backend.prepare(meta)
        from cbatch.kernels.gemm import graph_warmup

        with graph_warmup():  # Triton compiles, autotunes and loads every module the capture records, outside it
            for _ in range(2):
                self._step(bs, ctx)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._step(bs, ctx)
        self.graphs[bs] = graph

    def _step(self, bs: int, ctx: ForwardContext) -> None:
        """What a graph holds: the forward into `hidden`, then the logits and the sampled `tokens`."""
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], ctx)  # [bs, hidden]
        self.hidden[:bs].copy_(hidden)
        if self.sample_in_graph:
            from cbatch.kernels import fused_sample

            logits = self.model.compute_logits(hidden)  # [bs, vocab] float32, freed into the pool
            fused_sample(logits, self.temperatures[:bs], self.seeds[:bs], self.out_positions[:bs], out=self.tokens[:bs],
                         num_splits=self.sample_splits)

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return meta.max_query_len == 1 and num_tokens <= self.max_batch and bool(self.graphs)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            sampling: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replays the smallest fitting graph; returns (hidden states [T, hidden], tokens [T] or None), views of
        the static outputs (valid until the next replay)."""
        num = input_ids.shape[0]
        if self.sample_in_graph:
            temperatures, seeds, out_positions = kernel_inputs(sampling, input_ids.device)
            self.temperatures[:num].copy_(temperatures)
            self.seeds[:num].copy_(seeds)
            self.out_positions[:num].copy_(out_positions)
        bs = next(b for b in self.buckets if b >= num)
        self.input_ids[:num].copy_(input_ids)
        self.positions[:num].copy_(positions)
        self.slot_mapping[:num].copy_(meta.slot_mapping)
        self.slot_mapping[num:bs].fill_(-1)
        self.seq_lens[:num].copy_(meta.seq_lens)
        self.seq_lens[num:bs].fill_(1)
        cols = meta.block_table.shape[1]
        self.block_table[:num, :cols].copy_(meta.block_table)
        self.graphs[bs].replay()
        return self.hidden[:num], self.tokens[:num] if self.sample_in_graph else None
