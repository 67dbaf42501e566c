"""The runner's KV storage: every layer's K and V in one allocation (with an fp8 cache's per-head scales), the
host buffer swaps copy to, and the persistent block-table rows the steps' inputs read.

The scheduler's `KVManager` decides which blocks a sequence holds; this module only holds their contents and
copies them where a plan says (forks' copies, swaps). A block id indexes the block dimension of every layer.
"""
from __future__ import annotations

import numpy as np
import torch

from cbatch.engine.cpu_memory import lazily_zeroed
from cbatch.engine.sequence import Sequence
from cbatch.model.backend import kv_cache_shape
from cbatch.model.decoder import KVCacheView
from cbatch.model.spec import ModelSpec


class KVCache:
    """The KV tensors: `tensor` [layers, 2 (K|V), num_blocks, block_size, num_kv_heads, head_dim] and `view`, what
    the model's attention layers read and write (per-layer K and V, the fp8 scales). MLA (`spec.kv_cache_parts` 1):
    [layers, 1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim], one latent per token, as K and V."""

    block_dim = 2  # the block dimension of `tensor`: [layers, K|V, *kv_cache_shape(...)]

    def __init__(self, spec: ModelSpec, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 kv_dtype: torch.dtype, num_host_blocks: int = 0) -> None:
        self.device = device
        parts = spec.kv_cache_parts
        shape = (spec.num_layers, parts, *kv_cache_shape(num_blocks, block_size, spec.num_kv_heads, spec.head_dim))
        # NOTE: attention reads whole blocks, padding included (masked), so every block a table can name
        # must hold finite values: the pool starts zeroed. On CPU its pages become resident only when
        # written, so memory tracks the KV actually used, not the budget.
        if device.type == "cpu":
            self.tensor = lazily_zeroed(shape, kv_dtype)
        else:
            self.tensor = torch.zeros(shape, device=device, dtype=kv_dtype)
        # fp8: one scale per (layer, K|V, kv head); 1.0 = the values as they are (saturated at +-448)
        scales = None
        if kv_dtype != dtype:
            scales = torch.ones(spec.num_layers, 2, spec.num_kv_heads, dtype=torch.float32, device=device)
        self.view = KVCacheView([self.tensor[i, 0] for i in range(spec.num_layers)],
                                [self.tensor[i, parts - 1] for i in range(spec.num_layers)], scales)
        self.num_host_blocks = num_host_blocks  # swap space in blocks; allocated at the first swap
        self._host: torch.Tensor | None = None  # uint8, the cache's layout with `num_host_blocks` blocks

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[self.block_dim]

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copies whole KV blocks (every layer, K and V): (source, destination) pairs; byte copies, as swaps."""
        cache = self.tensor.view(torch.uint8)  # index ops do not take every dtype (fp8)
        src, dst = (torch.tensor(ids, dtype=torch.int64, device=self.device) for ids in zip(*copies))
        cache.index_copy_(self.block_dim, dst, cache.index_select(self.block_dim, src))

    @torch.inference_mode()
    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copies preempted sequences' KV blocks to host slots (`swap_out`: (device, host) pairs), then
        swapped-back sequences' slots into their new device blocks (`swap_in`: (host, device) pairs).

        The host buffer has the cache's layout with `num_host_blocks` along the block dimension (pinned
        when the cache is on a GPU); it is a separate buffer even on CPU. NOTE: out before in: a block
        swapped out this step may be the target of a swap_in or of this step's new tokens.
        """
        dim = self.block_dim
        cache = self.tensor.view(torch.uint8)  # byte copies: index ops do not take every dtype (fp8)
        if self._host is None:
            shape = list(cache.shape)
            shape[dim] = self.num_host_blocks
            self._host = torch.empty(shape, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        if swap_out:
            dev, host = (torch.tensor(ids, dtype=torch.int64) for ids in zip(*swap_out))
            self._host.index_copy_(dim, host, cache.index_select(dim, dev.to(self.device)).cpu())
        if swap_in:
            host, dev = (torch.tensor(ids, dtype=torch.int64) for ids in zip(*swap_in))
            blocks = self._host.index_select(dim, host).to(self.device, non_blocking=True)
            cache.index_copy_(dim, dev.to(self.device), blocks)


class BlockTableBuffer:
    """Rows of block ids, one row per running sequence, kept up to date incrementally: a step only writes the
    blocks added since the last step (no rebuilding of whole tables in Python)."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int) -> None:
        self.table = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._written = [0] * num_rows  # row -> blocks already copied into it

    def sync(self, seqs: list[Sequence]) -> np.ndarray:
        """Copies the sequences' new blocks into their rows (taking a row, in order, for each one seen for the
        first time); returns their rows, int64 [len(seqs)]. Only rows whose sequence gained blocks are written."""
        row_of, written = self._row_of, self._written
        rows = [row_of.get(s.seq_id) for s in seqs]
        if None in rows:
            rows = [self._take(s.seq_id) if r is None else r for s, r in zip(seqs, rows)]
        for seq, row in [(s, r) for s, r in zip(seqs, rows) if len(s.block_ids) > written[r]]:
            blocks = seq.block_ids
            self.table[row, written[row] : len(blocks)] = blocks[written[row]:]
            written[row] = len(blocks)
        return np.array(rows, dtype=np.int64)

    def _take(self, seq_id: int) -> int:
        row = self._row_of[seq_id] = self._free_rows.pop()
        self._written[row] = 0
        return row

    def truncate(self, seq: Sequence, num_blocks: int) -> None:
        """`seq` gave back its blocks from `num_blocks` on (rejected drafts'): those columns are written again when
        it grows (with whatever blocks it gets then)."""
        row = self._row_of.get(seq.seq_id)
        if row is not None:
            self._written[row] = min(self._written[row], num_blocks)

    def release(self, seq: Sequence) -> None:
        """Frees `seq`'s row (it finished or was preempted: its blocks are gone)."""
        row = self._row_of.pop(seq.seq_id, None)
        if row is not None:
            self._free_rows.append(row)
