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
    """Plain-torch paged attention.

    Rows with one query token (decodes) are batched: their context is gathered once per layer
    through a [B_decode, max_context] slot index that is built once per step. Rows with several
    query tokens (prefill chunks) run one SDPA each; a fresh prefill needs no gather at all.
    """

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.backend_state = _TorchStepState.build(meta)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        state: _TorchStepState = meta.backend_state
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        v_flat = v_cache.view(-1, num_kv_heads, head_dim)
        if state.store_all:
            k_flat.index_copy_(0, meta.slot_mapping, k)
            v_flat.index_copy_(0, meta.slot_mapping, v)
        else:
            k_flat.index_copy_(0, state.store_slots, k[state.store_rows])
            v_flat.index_copy_(0, state.store_slots, v[state.store_rows])

        out = torch.empty_like(q)
        if state.decode_rows is not None:
            out[state.decode_rows] = _decode_attention(
                q[state.decode_rows], k_flat, v_flat, state, scale, sliding_window
            )
        for start, q_len, ctx, slots in state.prefills:
            q_seq = q[start : start + q_len]
            if slots is None:  # fresh prefill: the context is exactly this chunk
                k_seq, v_seq = k[start : start + q_len], v[start : start + q_len]
            else:
                k_seq, v_seq = k_flat[slots], v_flat[slots]
            out[start : start + q_len] = _prefill_attention(q_seq, k_seq, v_seq, ctx, scale, sliding_window)
        return out


@dataclass(slots=True)
class _TorchStepState:
    store_all: bool
    store_rows: torch.Tensor | None
    store_slots: torch.Tensor | None
    decode_rows: torch.Tensor | None  # int64 [B_decode]: flat rows of single-token queries
    decode_slots: torch.Tensor | None  # int64 [B_decode, max_ctx]: cache slot of each context token
    decode_mask: torch.Tensor | None  # bool [B_decode, 1, 1, max_ctx]: True where the slot is real
    decode_positions: torch.Tensor | None  # int64 [B_decode]
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
        decode_idx = [b for b, n in enumerate(meta.query_lens_host) if n == 1]
        decode_rows = decode_slots = decode_mask = decode_positions = None
        if decode_idx:
            idx = torch.tensor(decode_idx, device=device)
            lens = meta.seq_lens[idx].long()  # [Bd]
            max_ctx = int(max(meta.seq_lens_host[b] for b in decode_idx))
            pos = torch.arange(max_ctx, device=device)  # [L]
            tables = meta.block_table[idx].long()  # [Bd, max_blocks]
            block_of = tables.gather(1, (pos // block_size).clamp(max=tables.shape[1] - 1).expand(len(decode_idx), -1))
            mask = pos.unsqueeze(0) < lens.unsqueeze(1)  # [Bd, L]
            decode_slots = torch.where(mask, block_of * block_size + pos % block_size, 0)
            decode_mask = mask[:, None, None, :]
            decode_rows = torch.tensor([starts[b] for b in decode_idx], device=device)
            decode_positions = lens - 1
        prefills = []
        for b, q_len in enumerate(meta.query_lens_host):
            if q_len == 1:
                continue
            ctx = meta.seq_lens_host[b]
            slots = None
            if ctx != q_len:
                pos = torch.arange(ctx, device=device)
                table = meta.block_table[b, : -(-ctx // block_size)].long()
                slots = table[pos // block_size] * block_size + pos % block_size
            prefills.append((starts[b], q_len, ctx, slots))
        return cls(store_all, store_rows, store_slots, decode_rows, decode_slots, decode_mask, decode_positions, prefills)


def _decode_attention(q, k_flat, v_flat, state: _TorchStepState, scale: float, sliding_window: int | None):
    """q [Bd, Hq, D] against the gathered context [Bd, L, Hkv, D]."""
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = k_flat.shape[1]
    group = num_heads // num_kv_heads
    keys = k_flat[state.decode_slots].permute(0, 2, 3, 1)  # [Bd, Hkv, D, L]
    values = v_flat[state.decode_slots].transpose(1, 2)  # [Bd, Hkv, L, D]
    scores = torch.matmul(q.view(num_rows, num_kv_heads, group, head_dim), keys) * scale  # [Bd, Hkv, G, L]
    mask = state.decode_mask
    if sliding_window is not None:
        pos = torch.arange(mask.shape[-1], device=q.device)
        mask = mask & (state.decode_positions[:, None, None, None] - pos < sliding_window)
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, values).view(num_rows, num_heads, head_dim)


def _prefill_attention(q, k, v, ctx: int, scale: float, sliding_window: int | None):
    """One sequence's chunk: q [n, Hq, D] against its context k, v [ctx, Hkv, D]."""
    q_len = q.shape[0]
    mask = None
    if ctx != q_len or sliding_window is not None:
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device).unsqueeze(1)  # [n, 1]
        k_pos = torch.arange(ctx, device=q.device).unsqueeze(0)  # [1, ctx]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask = mask & (q_pos - k_pos < sliding_window)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, Hq, n, D]
        k.transpose(0, 1).unsqueeze(0),  # [1, Hkv, ctx, D]
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)  # [n, Hq, D]


class TritonAttention:
    """Paged attention and KV store through the Triton kernels of `cbatch.kernels` (GPU path)."""

    name = "triton"

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
