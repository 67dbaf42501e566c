"""Attention over the paged KV cache: the metadata one step shares across layers, and the backends.

The model sees a flat, unpadded batch of T tokens from B sequences; sequence b owns query rows
`query_start_loc[b]:query_start_loc[b+1]` and, after this step's K/V are stored, `seq_lens[b]`
tokens of context. Query row i of sequence b sits at position `seq_lens[b] - q_len_b + i` and
attends causally to every cached token up to it.

Backends: `TorchAttention` (plain torch, the CPU path and the reference) and `TritonAttention`
(`cbatch.kernels`, the GPU path). Both store K/V through `slot_mapping` first.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, max_blocks]
    slot_mapping: torch.Tensor  # int64 [T]; -1 = do not store
    max_query_len: int
    max_seq_len: int
    # host copies for backends that loop over sequences (never synchronise with the device)
    query_lens_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
    block_size: int = 16
    backend_state: object = None  # what a backend prepared once per step, reused by every layer


class TorchAttention:
    """Plain-torch paged attention (the CPU path and the reference).

    Cache layout, per layer: K and V each `[Hkv, num_blocks, block_size, D]` (head-major). Gathering a
    sequence's blocks along dim 1 then yields `[Hkv, L, D]` with L contiguous per head, which is the
    shape batched matmuls and SDPA take without a further copy.

    Rows with one query token (decodes) are batched in groups of similar context length: each group's
    blocks are gathered once per layer into `[Hkv * rows, L, D]` through a block index built once per
    step, and the padding past each row's length is masked by an additive bias (also built once per
    step). Rows with several query tokens (prefill chunks) run one SDPA each; a fresh prefill needs no
    gather at all.
    """

    name = "torch"
    cache_block_dim = 1  # where the block index sits in `cache_shape`

    @staticmethod
    def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_kv_heads, num_blocks, block_size, head_dim)

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.backend_state = _TorchStepState.build(meta)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [Hkv, num_blocks, block_size, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        state: _TorchStepState = meta.backend_state
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_slots = k_cache.view(num_kv_heads, -1, head_dim)  # [Hkv, num_slots, D]
        v_slots = v_cache.view(num_kv_heads, -1, head_dim)
        if state.store_all:
            k_slots.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
            v_slots.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
        else:
            k_slots.index_copy_(1, state.store_slots, k[state.store_rows].transpose(0, 1))
            v_slots.index_copy_(1, state.store_slots, v[state.store_rows].transpose(0, 1))

        out = torch.empty_like(q)
        for group in state.decode_groups:
            group.attend(q, out, k_cache, v_cache, scale, sliding_window)
        for start, q_len, ctx, slots in state.prefills:
            q_seq = q[start : start + q_len].transpose(0, 1)  # [Hq, n, D]
            if slots is None:  # fresh prefill: the context is exactly this chunk
                k_seq = k[start : start + q_len].transpose(0, 1)  # [Hkv, n, D]
                v_seq = v[start : start + q_len].transpose(0, 1)
            else:
                k_seq, v_seq = k_slots[:, slots], v_slots[:, slots]  # [Hkv, ctx, D]
            out[start : start + q_len] = _prefill_attention(q_seq, k_seq, v_seq, ctx, scale, sliding_window)
        return out


# Decode rows per group. Measured on the CPU path (64 rows, contexts 20-400, one thread): one group
# padded to the longest context took 5.7 ms per layer, length-sorted groups of 8 rows 3.4-3.8 ms
# (less padding, and a group's gathered K/V stays in cache between the gather and the two matmuls);
# groups of 2-4 rows lose again to per-op overhead.
DECODE_GROUP_ROWS = 8


@dataclass(slots=True)
class _DecodeGroup:
    """Single-token query rows of similar context length, attended together."""

    rows: torch.Tensor | slice  # flat query rows (int64 [n]), or a slice when they are consecutive
    num_rows: int
    blocks: torch.Tensor  # int64 [n * max_blocks]: each row's block ids, padded to the group's longest
    lens: torch.Tensor  # int64 [n]: context length (incl. this token)
    # additive masks [n, 1, L] (0 where attended, -inf elsewhere), built on first use per
    # (dtype, sliding window) and shared by every layer of the step
    biases: dict = field(default_factory=dict)

    def bias(self, length: int, dtype: torch.dtype, sliding_window: int | None) -> torch.Tensor:
        key = (dtype, sliding_window)
        bias = self.biases.get(key)
        if bias is None:
            pos = torch.arange(length, device=self.lens.device)
            masked = pos[None, :] >= self.lens[:, None]  # [n, L]
            if sliding_window is not None:
                masked |= (self.lens[:, None] - 1 - pos[None, :]) >= sliding_window
            bias = torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill_(masked, float("-inf"))
            bias = self.biases[key] = bias.unsqueeze(1)
        return bias

    def attend(self, q, out, k_cache, v_cache, scale: float, sliding_window: int | None) -> None:
        """out[rows] = attention of q[rows] [n, Hq, D] over the rows' gathered contexts."""
        n = self.num_rows
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[0]
        group = num_heads // num_kv_heads
        # entries past a row's last block are stale or 0: they name zero-initialised or previously
        # written blocks (finite values), and the bias masks them out.
        keys = k_cache.index_select(1, self.blocks).view(num_kv_heads * n, -1, head_dim)  # [Hkv*n, L, D]
        values = v_cache.index_select(1, self.blocks).view(num_kv_heads * n, -1, head_dim)
        length = keys.shape[1]
        # query heads h*G .. h*G+G-1 share KV head h: batch over (KV head, row), the G heads as matrix rows
        q_rows = q[self.rows].reshape(n, num_kv_heads, group, head_dim).transpose(0, 1)
        scores = torch.bmm(q_rows.reshape(num_kv_heads * n, group, head_dim), keys.transpose(1, 2))
        scores = torch.add(self.bias(length, q.dtype, sliding_window), scores.view(num_kv_heads, n, group, length), alpha=scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # [Hkv, n, G, L]
        ctx = torch.bmm(probs.view(num_kv_heads * n, group, length), values)  # [Hkv*n, G, D]
        out[self.rows] = ctx.view(num_kv_heads, n, group, head_dim).transpose(0, 1).reshape(n, num_heads, head_dim)


@dataclass(slots=True)
class _TorchStepState:
    store_all: bool
    store_rows: torch.Tensor | None
    store_slots: torch.Tensor | None
    decode_groups: list[_DecodeGroup]
    prefills: list[tuple[int, int, int, torch.Tensor | None]]  # (first row, q_len, context, slots or None)

    @classmethod
    def build(cls, meta: AttentionMetadata) -> "_TorchStepState":
        device = meta.slot_mapping.device
        valid = meta.slot_mapping >= 0
        store_all = bool(valid.all())
        store_rows = None if store_all else valid.nonzero().squeeze(1)
        store_slots = None if store_all else meta.slot_mapping[store_rows]

        starts = meta.query_start_loc.tolist()
        block_size = meta.block_size
        seq_lens = meta.seq_lens_host
        decode_idx = sorted((b for b, n in enumerate(meta.query_lens_host) if n == 1), key=seq_lens.__getitem__)
        groups = []
        for i in range(0, len(decode_idx), DECODE_GROUP_ROWS):
            members = decode_idx[i : i + DECODE_GROUP_ROWS]
            num_blocks = -(-max(seq_lens[b] for b in members) // block_size)
            idx = torch.tensor(members, device=device)
            rows = [starts[b] for b in members]
            consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
            groups.append(_DecodeGroup(
                rows=slice(rows[0], rows[0] + len(rows)) if consecutive else torch.tensor(rows, device=device),
                num_rows=len(members),
                blocks=meta.block_table[idx, :num_blocks].long().reshape(-1),
                lens=meta.seq_lens[idx].long(),
            ))
        prefills = []
        for b, q_len in enumerate(meta.query_lens_host):
            if q_len == 1:
                continue
            ctx = seq_lens[b]
            slots = None
            if ctx != q_len:
                pos = torch.arange(ctx, device=device)
                table = meta.block_table[b, : -(-ctx // block_size)].long()
                slots = table[pos // block_size] * block_size + pos % block_size
            prefills.append((starts[b], q_len, ctx, slots))
        return cls(store_all, store_rows, store_slots, groups, prefills)


def _prefill_attention(q, k, v, ctx: int, scale: float, sliding_window: int | None):
    """One sequence's chunk: q [Hq, n, D] against its context k, v [Hkv, ctx, D]; returns [n, Hq, D]."""
    q_len = q.shape[1]
    mask = None
    if ctx != q_len or sliding_window is not None:
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device).unsqueeze(1)  # [n, 1]
        k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)  # [1, ctx]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask = mask & (q_pos - k_pos < sliding_window)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0),  # [1, H, n|ctx, D]
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)  # [n, Hq, D]


class TritonAttention:
    """Paged attention and KV store through the Triton kernels of `cbatch.kernels` (GPU path)."""

    name = "triton"
    cache_block_dim = 0

    @staticmethod
    def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, sliding_window: int | None):
        from cbatch.kernels import paged_attention, store_kv

        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        return paged_attention(
            q, k_cache, v_cache, out,
            meta.query_start_loc, meta.seq_lens, meta.block_table,
            scale, meta.max_query_len, meta.max_seq_len, sliding_window=sliding_window,
        )


def make_backend(name: str, device: torch.device):
    """`auto` picks triton on CUDA and torch elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    return TritonAttention() if name == "triton" else TorchAttention()
