"""What one step's attention needs besides activations, shared by every layer and every backend.

The model sees a flat, unpadded batch of T tokens from B sequences; sequence b owns query rows
`query_start_loc[b]:query_start_loc[b+1]` and, after this step's K/V are stored, `seq_lens[b]`
tokens of context. Query row i of sequence b sits at position `seq_lens[b] - q_len_b + i` and
attends causally to every cached token up to it (Gemma 3's image tokens to their whole image too: `key_ends`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np
import torch


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
    # Gemma 3's images: a prefill chunk's first flat query row -> [(first, end)) context positions of the image runs
    # in it, whose tokens attend to each other both ways (a later one too; a sliding window still bounds the
    # earlier side). A run is whole in its chunk, or its earlier part cached (engine/images.py). None: all causal
    image_spans: dict[int, list[tuple[int, int]]] | None = None
    # the same runs as every backend's mask reads them: int32 [T] on the step's device, where each query row's keys
    # end (`image_key_ends`); None without image runs. Built from image_spans when not given (StepInputs.to_device
    # builds it through the pinned staging, so a GPU step does not wait for the one in flight)
    key_ends: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.image_spans and self.key_ends is None:
            ends = image_key_ends(self.query_lens_host, self.seq_lens_host, self.image_spans)
            self.key_ends = torch.from_numpy(ends).to(self.slot_mapping.device)


def image_key_ends(query_lens: Sequence[int], seq_lens: Sequence[int],
                   image_spans: dict[int, list[tuple[int, int]]]) -> np.ndarray:
    """int32 [T]: the context position before which each flat query row's keys end (exclusive). A row at position
    p sees keys j < end (and, under a sliding window w, p - j < w): end = p + 1 (causal), or, for a row inside one
    of Gemma 3's image runs [first, end), the run's end, so its image's later tokens are visible too (HF's
    Gemma 3 mask: OR(causal, same image), then AND(window) on local layers)."""
    q_lens = np.asarray(query_lens, dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(q_lens)])
    first_pos = np.asarray(seq_lens, dtype=np.int64) - q_lens  # each chunk's first position
    ends = np.arange(starts[-1]) + np.repeat(first_pos - starts[:-1], q_lens) + 1  # [T] position + 1
    for row0, runs in image_spans.items():  # row0: a chunk's first flat row, at position ends[row0] - 1
        chunk_first = int(ends[row0]) - 1
        for first, end in runs:  # the run's rows in the chunk (its earlier part may be cached)
            ends[row0 + max(first - chunk_first, 0) : row0 + end - chunk_first] = end
    return ends.astype(np.int32)


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """One layer's K (or V) cache, for every backend: slot = block * block_size + offset."""
    return (num_blocks, block_size, num_kv_heads, head_dim)


@dataclass(slots=True)
class KVLayer:
    """One layer's paged K and V caches (`kv_cache_shape` each). An fp8 cache (--kv-cache-dtype fp8, cbatch/fp8_kv.py) holds
    key / k_scale per kv head: k_scale, v_scale are float32 [num_kv_heads]; None for a cache in the
    activations' dtype."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class NormWeight(Protocol):
    weight: torch.Tensor
    eps: float
    unit_offset: bool  # Gemma: the scale is (1 + weight)


class AttentionLayer(Protocol):
    """What a backend needs to know of an attention layer (the model's `Attention` module is one)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    softcap: float | None  # Gemma 2: scores = softcap * tanh(scale * q.k / softcap) before the mask
    sliding_window: int | None
    sinks: torch.Tensor | None  # gpt-oss: [Hq] a logit per query head that joins each softmax's denominator only
    q_norm: NormWeight | None  # per-head RMSNorm on q and k, before rotary (Qwen3, Gemma 3)
    k_norm: NormWeight | None


class LatentProjection(Protocol):
    weight: torch.Tensor  # kv_b_proj [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank], in the activations' dtype


class MLALayer(Protocol):
    """What a backend needs to know of a multi-head latent attention layer (model/mla.py's `MLAAttention`)."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    scale: float
    kv_b_proj: LatentProjection  # per head: W_UK (its first qk_nope_head_dim rows), then W_UV (v_head_dim rows)
