"""Multi-head latent attention over the paged latent cache, in torch (the CPU path, and the GPU path until an
MLA decode kernel exists).

One layer's cache: [num_blocks, block_size, 1, L], L = kv_lora_rank + R, each token's [c_kv | k_pe] (model/
mla_spec.py); slot = block * block_size + offset, as for every cache. With N = qk_nope_head_dim, V = v_head_dim
and kv_b_proj's per-head blocks W_UK [H, N, rank] and W_UV [H, V, rank]:

    naive (prefill chunks)  keys [ctx, H, N + R] = (c_kv W_UK^T | k_pe), values [ctx, H, V] = c_kv W_UV^T, then
                            causal attention as HF computes it (the context's latents up-projected per chunk)
    absorbed (decodes)      q_lat [H, rank] = q_nope W_UK; scores = (q_lat | q_pe) . latent; out = (p . c_kv) W_UV^T:
                            attention in latent space, no per-head keys or values (FLOPs and bytes per context
                            token independent of H x (N + V))

The two forms are the same product regrouped, so they differ by float rounding only (tests/test_mla.py bounds
it; greedy tokens stay HF's on the tiny checkpoints). `absorbed_decode=False` runs decodes the naive way too.
The absorbed form's middle (scores, softmax, p . c_kv over the paged latents) is `latent_attention`: torch here,
the Triton kernel (cbatch.kernels.mla_decode_attention) on the GPU path.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Callable

import torch
import torch.nn.functional as F

from cbatch.model.backend.metadata import AttentionMetadata, MLALayer
from cbatch.model.onednn import linear


def store_latents(cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """latent [T, L] into the layer's cache at `slot_mapping` (-1: not stored)."""
    slots = cache.view(-1, cache.shape[-1])  # [num_slots, L]
    rows = (slot_mapping >= 0).nonzero().squeeze(1)
    slots.index_copy_(0, slot_mapping[rows], latent[rows].to(slots.dtype))


# (absorbed queries [B, H, L], one layer's cache, block_table [B, max_blocks] int32, seq_lens [B] int32, rank, scale)
# -> o_lat [B, H, rank]: each row's softmax(q . latent) . c_kv over its cached context
LatentAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor]


def mla_attend(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, layer: MLALayer, cache: torch.Tensor,
               meta: AttentionMetadata, absorbed_decode: bool = True,
               latent_attention: LatentAttention | None = None) -> torch.Tensor:
    """q_nope [T, H, N], q_pe [T, H, R] and latent [T, L] rotated; stores the latents, then attends every row
    over its context; returns [T, H, V]. `latent_attention`: the decodes' latent-space attention (default: torch)."""
    store_latents(cache, latent, meta.slot_mapping)
    num_tokens, num_heads = q_nope.shape[:2]
    out = q_nope.new_empty(num_tokens, num_heads, layer.v_head_dim)
    starts = [0, *accumulate(meta.query_lens_host)]
    decodes = [b for b, n in enumerate(meta.query_lens_host) if n == 1]
    if absorbed_decode and decodes:
        _attend_absorbed(q_nope, q_pe, layer, cache, meta, decodes, [starts[b] for b in decodes], out,
                         latent_attention or torch_latent_attention)
    for b, q_len in enumerate(meta.query_lens_host):
        if q_len > 1 or (q_len == 1 and not absorbed_decode):
            rows = slice(starts[b], starts[b] + q_len)
            out[rows] = _attend_naive(q_nope[rows], q_pe[rows], layer, _context(cache, meta, b), meta.seq_lens_host[b])
    return out


def _context(cache: torch.Tensor, meta: AttentionMetadata, b: int) -> torch.Tensor:
    """Sequence b's cached latents [ctx, L], in position order."""
    ctx, block_size = meta.seq_lens_host[b], meta.block_size
    pos = torch.arange(ctx, device=cache.device)
    table = meta.block_table[b, : -(-ctx // block_size)].long()
    return cache.view(-1, cache.shape[-1]).index_select(0, table[pos // block_size] * block_size + pos % block_size)


def _attend_naive(q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayer, context: torch.Tensor,
                  ctx: int) -> torch.Tensor:
    """One sequence's n query rows (the last n positions of its ctx) against its context latents [ctx, L]:
    per-head keys and values up-projected from them; returns [n, H, V]."""
    n, heads, rank = q_nope.shape[0], q_nope.shape[1], layer.kv_lora_rank
    kv = linear(context[:, :rank].to(q_nope.dtype), layer.kv_b_proj.weight).view(ctx, heads, -1)  # [ctx, H, N + V]
    k_nope, values = kv.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=-1)
    k_pe = context[:, None, rank:].to(q_nope.dtype).expand(ctx, heads, layer.qk_rope_head_dim)
    keys = torch.cat([k_nope, k_pe], dim=-1)  # [ctx, H, N + R]
    query = torch.cat([q_nope, q_pe], dim=-1)  # [n, H, N + R]
    mask = None
    if n != ctx and n > 1:  # chunk after cached context: query i sits at ctx - n + i
        q_pos = torch.arange(ctx - n, ctx, device=context.device)[:, None]
        mask = torch.arange(ctx, device=context.device)[None, :] <= q_pos  # [n, ctx], True = attend
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),  # [H, n|ctx, D]
        attn_mask=mask, is_causal=n == ctx and n > 1, scale=layer.scale)
    return attended.transpose(0, 1)


def _attend_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, layer: MLALayer, cache: torch.Tensor,
                     meta: AttentionMetadata, batch_rows: list[int], token_rows: list[int], out: torch.Tensor,
                     latent_attention: LatentAttention) -> None:
    """out[token_rows] for single-token rows: queries through W_UK, attention in latent space, output through W_UV."""
    device, rank, heads = q_nope.device, layer.kv_lora_rank, q_nope.shape[1]
    batch_idx = torch.tensor(batch_rows, device=device)
    tokens = torch.tensor(token_rows, device=device)
    w_kv = layer.kv_b_proj.weight.view(heads, layer.qk_nope_head_dim + layer.v_head_dim, rank)
    w_uk, w_uv = w_kv.split([layer.qk_nope_head_dim, layer.v_head_dim], dim=1)  # [H, N, rank], [H, V, rank]
    q_lat = torch.bmm(q_nope[tokens].transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, rank]
    query = torch.cat([q_lat, q_pe[tokens]], dim=-1)  # [B, H, L]
    o_lat = latent_attention(query, cache, meta.block_table[batch_idx], meta.seq_lens[batch_idx], rank, layer.scale)
    out[tokens] = torch.bmm(o_lat.to(q_nope.dtype).transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, V]


def torch_latent_attention(query: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                           rank: int, scale: float) -> torch.Tensor:
    """`LatentAttention` in torch: every row's blocks gathered at once, padded to the longest context and masked."""
    block_size, device = cache.shape[1], query.device
    lens = seq_lens.long()
    num_blocks = -(-int(lens.max()) // block_size)
    blocks = block_table[:, :num_blocks].long()  # [B, nb]
    latents = cache.view(cache.shape[0], block_size, -1)[blocks].flatten(1, 2).to(query.dtype)  # [B, nb * bs, L]
    padding = torch.arange(num_blocks * block_size, device=device)[None, :] >= lens[:, None]
    scores = torch.bmm(query, latents.transpose(1, 2)) * scale  # [B, H, ctx]
    scores.masked_fill_(padding[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.bmm(probs, latents[..., :rank])  # [B, H, rank]
