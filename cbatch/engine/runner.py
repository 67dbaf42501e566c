"""Turns a StepPlan into one model call: builds the flat batch, runs the model, samples.

The runner owns the KV tensors and a persistent block-table buffer: each running sequence has a
row in it, and a step only writes the blocks that were added since the last step (no rebuilding
of whole tables in Python). It never decides who runs: it frees a sequence's row only when a plan
names it preempted or finished.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from cbatch.model.backend import AttentionMetadata, Backend, kv_cache_shape
from cbatch.engine.cpu_memory import keep_freed_memory, lazily_zeroed
from cbatch.engine.sampler import SamplingBatch, sample
from cbatch.engine.scheduler import StepPlan
from cbatch.engine.structured import PendingMasks, TokenMasks
from cbatch.engine.sequence import Sequence
from cbatch.model.llama import ForwardContext, KVCacheView, LlamaForCausalLM


class BlockTableBuffer:
    """Rows of block ids, one row per running sequence, kept up to date incrementally."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int) -> None:
        self.table = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._written: dict[int, int] = {}  # seq_id -> blocks already copied into the row

    def sync(self, seq: Sequence) -> int:
        """Copies `seq`'s new blocks into its row (taking a row on first sight); returns the row."""
        row = self._row_of.get(seq.seq_id)
        if row is None:
            row = self._free_rows.pop()
            self._row_of[seq.seq_id] = row
            self._written[seq.seq_id] = 0
        written = self._written[seq.seq_id]
        blocks = seq.block_ids
        if len(blocks) > written:
            self.table[row, written : len(blocks)] = blocks[written:]
            self._written[seq.seq_id] = len(blocks)
        return row

    def release(self, seq: Sequence) -> None:
        """Frees `seq`'s row (it finished or was preempted: its blocks are gone)."""
        row = self._row_of.pop(seq.seq_id, None)
        if row is not None:
            self._written.pop(seq.seq_id)
            self._free_rows.append(row)


class ModelRunner:
    _block_dim = 2  # the block dimension of `kv_cache`: [layers, K|V, *kv_cache_shape(...)]

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_kv_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        job_seed: int = 0,
        num_host_blocks: int = 0,
    ) -> None:
        spec = model.spec
        self.model = model
        self.device = device
        self.block_size = block_size
        self.job_seed = job_seed
        self.backend: Backend = model.backend
        # One allocation for every layer's K and V
        shape = (spec.num_layers, 2, *kv_cache_shape(num_kv_blocks, block_size, spec.num_kv_heads, spec.head_dim))
        # NOTE: attention reads whole blocks, padding included (masked), so every block a table can name
        # must hold finite values: the pool starts zeroed. On CPU its pages become resident only when
        # written, so memory tracks the KV actually used, not the budget.
        if device.type == "cpu":
            keep_freed_memory()  # activations stay resident between steps (see cpu_memory.py)
            self.kv_cache = lazily_zeroed(shape, dtype)
        else:
            self.kv_cache = torch.zeros(shape, device=device, dtype=dtype)
        self.kv = KVCacheView([self.kv_cache[i, 0] for i in range(spec.num_layers)], [self.kv_cache[i, 1] for i in range(spec.num_layers)])
        self._table_shape = (2 * max_num_seqs, -(-max_model_len // block_size))
        self.reset()
        self.graphs = None  # DecodeGraphs once `capture_decode_graphs` ran (CUDA + Triton backend)
        self.num_host_blocks = num_host_blocks  # swap space in blocks; allocated at the first swap
        self.token_masks = TokenMasks(spec.vocab_size, device)  # structured output
        self._host_kv: torch.Tensor | None = None

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        from cbatch.engine.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self.model, self.backend, self.kv, max_num_seqs, max_model_len, self.block_size, self.device)
        graphs.capture_all()
        self.graphs = graphs

    def reset(self) -> None:
        """Forgets every sequence (a new scheduler starts over); the KV tensors are kept."""
        # rows for 2 x max_num_seqs: static batching keeps finished members in the batch until their group
        # ends, and a finished sequence's row is freed by the next plan
        self.block_tables = BlockTableBuffer(*self._table_shape)
        self.forward_seconds = 0.0  # time inside the model call, for the report

    def idle(self) -> None:
        pass  # nothing to compute (a step waiting for arrivals)

    def execute(self, plan: StepPlan) -> dict[int, int]:
        """Runs one step; returns {seq_id: sampled token} for the sequences whose chunk reached their end."""
        step = self.forward(plan)
        if step is None:
            return {}
        start = time.perf_counter()
        if step.masks is not None:  # structured output: the constrained rows' grammars, before sampling
            step.masks.apply(step.logits)
        tokens = sample(step.logits, step.sampling).tolist()
        self.forward_seconds += time.perf_counter() - start
        return {seq.seq_id: tok for seq, tok in zip(step.seqs, tokens)}

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> "StepLogits | None":
        """Runs the model on the plan's tokens; the logits of the rows that sample (None if none does)."""
        for seq in plan.preempted + plan.finished:
            self.block_tables.release(seq)
        batch = self._build(plan)
        if plan.swap_out or plan.swap_in:  # NOTE: after _build (nothing there may overwrite a swap_in), before the model
            self.swap(plan.swap_out, plan.swap_in)
        masks = self.token_masks.start(batch.sampling_seqs)  # filled while the model runs
        start = time.perf_counter()
        if self.graphs is not None and self.graphs.can_run(batch.meta, batch.input_ids.shape[0]):
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.meta)  # [T, hidden]
        else:
            self.backend.prepare(batch.meta)
            ctx = ForwardContext(self.kv, batch.meta)
            hidden = self.model(batch.input_ids, batch.positions, ctx)  # [T, hidden]
        logits = None
        if batch.sampling_seqs:
            logits = self.model.compute_logits(hidden[batch.logits_indices])  # [N, vocab] float32
        self.forward_seconds += time.perf_counter() - start
        return None if logits is None else StepLogits(batch.sampling_seqs, logits, batch.sampling, masks)

    @torch.inference_mode()
    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copies preempted sequences' KV blocks to host slots (`swap_out`: (device, host) pairs), then
        swapped-back sequences' slots into their new device blocks (`swap_in`: (host, device) pairs).

        The host buffer has the cache's layout with `num_host_blocks` along the block dimension (pinned
        when the cache is on a GPU); it is a separate buffer even on CPU. NOTE: out before in: a block
        swapped out this step may be the target of a swap_in or of this step's new tokens.
        """
        dim = self._block_dim
        if self._host_kv is None:
            shape = list(self.kv_cache.shape)
            shape[dim] = self.num_host_blocks
            self._host_kv = torch.empty(shape, dtype=self.kv_cache.dtype, pin_memory=self.device.type == "cuda")
        if swap_out:
            dev, host = (torch.tensor(ids, dtype=torch.int64) for ids in zip(*swap_out))
            self._host_kv.index_copy_(dim, host, self.kv_cache.index_select(dim, dev.to(self.device)).cpu())
        if swap_in:
            host, dev = (torch.tensor(ids, dtype=torch.int64) for ids in zip(*swap_in))
            blocks = self._host_kv.index_select(dim, host).to(self.device, non_blocking=True)
            self.kv_cache.index_copy_(dim, dev.to(self.device), blocks)

    def _build(self, plan: StepPlan) -> "_Batch":
        n = len(plan.scheduled)
        rows = np.empty(n, dtype=np.int64)
        starts = np.empty(n, dtype=np.int64)  # num_computed before this step
        q_lens = np.empty(n, dtype=np.int64)
        token_ids: list[int] = []
        sampling_seqs: list[Sequence] = []
        logits_idx: list[int] = []
        temps, top_ps, top_ks, seeds, out_pos = [], [], [], [], []
        offset = 0
        for i, (seq, num_new) in enumerate(sorted(plan.scheduled, key=_batch_order)):
            rows[i] = self.block_tables.sync(seq)
            starts[i] = seq.num_computed
            q_lens[i] = num_new
            if num_new == 1:
                token_ids.append(seq.token_at(seq.num_computed))
            else:
                token_ids.extend(seq.tokens(seq.num_computed, seq.num_computed + num_new))
            offset += num_new
            if seq.num_computed + num_new == seq.num_tokens:  # this chunk reaches the end: sample
                sampling_seqs.append(seq)
                logits_idx.append(offset - 1)
                p = seq.params
                temps.append(float(p.temperature))
                top_ps.append(float(p.top_p))
                top_ks.append(int(p.top_k))
                seeds.append(p.seed if p.seed is not None else (self.job_seed << 32) ^ seq.seq_id)
                out_pos.append(len(seq.output_ids))
        num_tokens = offset
        cu_q = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        token_seq = np.repeat(np.arange(n), q_lens)  # [T] batch index of each token
        positions = starts[token_seq] + (np.arange(num_tokens) - cu_q[:-1][token_seq])
        seq_lens = starts + q_lens
        max_seq_len = int(seq_lens.max())
        num_cols = -(-max_seq_len // self.block_size)
        table = self.block_tables.table[rows, :num_cols]  # [B, num_cols]
        slots = table[token_seq, positions // self.block_size].astype(np.int64) * self.block_size + positions % self.block_size

        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(cu_q.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_table=torch.from_numpy(np.ascontiguousarray(table)).to(dev),
            slot_mapping=torch.from_numpy(slots).to(dev),
            max_query_len=int(q_lens.max()),
            max_seq_len=max_seq_len,
            query_lens_host=q_lens.tolist(),
            seq_lens_host=seq_lens.tolist(),
            block_size=self.block_size,
        )
        return _Batch(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=dev),
            positions=torch.from_numpy(positions).to(dev),
            meta=meta,
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64, device=dev),
            sampling_seqs=sampling_seqs,
            sampling=SamplingBatch(temps, top_ps, top_ks, seeds, out_pos),
        )


@dataclass(slots=True)
class StepLogits:
    seqs: list[Sequence]  # the rows that sample, in the order of `logits`
    logits: torch.Tensor  # float32 [N, vocab]
    sampling: SamplingBatch
    masks: PendingMasks | None = None  # structured output: bitmasks of the constrained rows


def _batch_order(item: tuple[Sequence, int]) -> tuple[int, int]:
    """Decodes first, shortest context first, then prefill chunks in plan order. TorchBackend attends
    neighbouring decode rows together, so similar lengths pad less, and its groups become slices of
    the batch. Otherwise the order is free: sampled tokens go back by sequence id."""
    seq, num_new = item
    return (0, seq.num_computed) if num_new == 1 else (1, 0)


class _Batch:
    __slots__ = ("input_ids", "positions", "meta", "logits_indices", "sampling_seqs", "sampling")

    def __init__(self, input_ids, positions, meta, logits_indices, sampling_seqs, sampling) -> None:
        self.input_ids = input_ids  # int64 [T]
        self.positions = positions  # int64 [T]
        self.meta = meta
        self.logits_indices = logits_indices  # int64 [N]: rows of the hidden states that sample
        self.sampling_seqs = sampling_seqs
        self.sampling = sampling
