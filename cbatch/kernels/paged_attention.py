"""Paged attention over the block-table KV cache: decode rows and chunked-prefill rows in one launch.

Layout (per layer):
    q, out               [num_tokens, num_q_heads, head_dim]      flat, unpadded batch of B sequences
    k_cache, v_cache     [num_blocks, block_size, num_kv_heads, head_dim]
    query_start_loc      [B + 1] int32   sequence b owns q rows query_start_loc[b]:query_start_loc[b+1]
    seq_lens             [B] int32       context length of b INCLUDING this step's tokens (already in the cache)
    block_table          [B, max_blocks_per_seq] int32   logical block -> physical block

Query row i of sequence b (0-based among its q_len rows) sits at absolute position
p = seq_len - q_len + i and sees keys j <= p (and p - j < sliding_window when a window is set); with `key_ends`
(Gemma 3's image runs, int32 [num_tokens]) keys j < key_ends[row] instead, which lies past p for an image's tokens.
Attention sinks (gpt-oss; `sinks` [num_q_heads]): head h's sink logit joins every softmax's denominator and
contributes no value, i.e. the online softmax starts from (max = sink, sum = 1, acc = 0) instead of
(-inf, 0, 0); with split-KV only the first segment starts so, and the merge weighs it in.

Work decomposition (ideas after vLLM's unified Triton attention; this is an independent implementation):
  * grid = (query blocks, kv heads[, kv splits]). A program owns BLOCK_Q consecutive query tokens of one
    sequence and ONE kv head; the GROUP query heads that share that kv head are packed into the M dimension
    of the tile (row r <-> token r // GROUP, head r % GROUP), so each K/V tile is read once per group.
  * Programs find their sequence by binary search over query_start_loc (no host sync, no per-step
    metadata). Query blocks are numbered so that sequence b's first block is
    query_start_loc[b] // BLOCK_Q + b, which over-allocates at most one block per sequence; surplus
    programs return at once. A decode-only batch (max_query_len == 1) skips the search: program = sequence.
  * Keys are walked in tiles of TILE_N positions. The tile size is independent of the cache block size:
    each key looks up its own physical block in the block table (a gather of TILE_N small ints that hit
    L1), so any block size works and tiles may straddle blocks.
  * Online softmax in fp32 in the log2 domain (scores pre-multiplied by scale * log2(e), exp2).
  * Split-KV (flash-decoding): with few (sequence x kv head) programs and long contexts, a third grid
    axis cuts each sequence's key tiles into num_splits segments; each writes its normalised partial
    output and log2-sum-exp, and a second small kernel merges them. A sequence of c keys uses only
    min(num_splits, c // split_min_keys) of the segments (at least one); the others only mark themselves
    empty (log2-sum-exp -inf, no partial output, which the merge then does not read): a CUDA graph captured
    for the longest context splits each replay's sequences by their own length (`SplitRule`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._utils import check_kv_cache_dtype, check_launchable, interpreting, next_pow2, on_device, sm_count
from .activation import tanh

# Split-KV policy (decode-only batches): the default SplitRule. See auto_num_splits.
SPLIT_BELOW_PROGRAMS_PER_SM = 6  # fewer (sequence x kv head) programs per SM than this: cut the keys into segments
_MIN_KEYS_PER_SPLIT = 512  # below this a segment's fixed cost (q load, partial write, merge) starts to show
_MAX_SPLITS = 16  # a power of 2 (the merge kernel's tile)


@triton.jit
def _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest b in [0, num_seqs) whose first query block, query_start_loc[b] // BLOCK_Q + b, is <= q_block.

    first(b) is strictly increasing in b and first(0) == 0, so the answer exists and is unique.
    """
    lo = tl.zeros((), dtype=tl.int32)  # invariant: first(lo) <= q_block
    hi = num_seqs + lo                 # invariant: first(b) > q_block for every b >= hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """tl.dot with an fp32 accumulator. UPCAST (set only under TRITON_INTERPRET) converts the operands to
    fp32 first: Triton's interpreter keeps bf16 as raw uint16 bits and hands those to np.matmul, which
    yields garbage. bf16 values are exact in fp32 and the GPU accumulates in fp32, so numerics match."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PRECISION)


# Runtime sizes that change from step to step are never specialised on (Triton would otherwise compile a new
# variant whenever one happens to be 1 or a multiple of 16): see cbatch/kernels/jit_stats.py.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "split_min_keys", "stride_bt"])
def _paged_attention_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    out_ptr,  # not SPLIT: out [num_tokens, num_q_heads, head_dim]
    #           SPLIT:     partial out, fp32 [num_tokens, num_q_heads, num_splits, HEAD_DIM_PAD]
    lse_ptr,  # SPLIT: fp32 [num_tokens, num_q_heads, num_splits] (log2-sum-exp); unused otherwise
    query_start_loc_ptr,  # [B + 1]
    seq_lens_ptr,  # [B]
    block_table_ptr,  # [B, max_blocks_per_seq]
    k_scale_ptr,  # KV_SCALED: fp32 [num_kv_heads], cache value x scale = key; unused otherwise
    v_scale_ptr,  # KV_SCALED: fp32 [num_kv_heads]
    sinks_ptr,  # HAS_SINKS: [num_q_heads] each head's sink logit (natural-log domain, like scale * q.k)
    key_ends_ptr,  # HAS_KEY_ENDS: int32 [num_tokens] the position before which each row's keys end
    scale_log2,  # softmax scale * log2(e)
    num_seqs,
    num_splits,  # key segments per (sequence, kv head); 1 unless SPLIT
    split_min_keys,  # SPLIT: a sequence of c keys fills min(num_splits, c // split_min_keys) segments (at least 1)
    num_q_heads,
    sliding_window,  # only read when USE_WINDOW
    softcap_log2,  # only read when SOFTCAP: attention-logit soft-cap * log2(e)
    stride_qt, stride_qh,
    stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of 2 >= HEAD_DIM (tile width; extra lanes masked)
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    GROUP: tl.constexpr,  # query heads per kv head
    BLOCK_M: tl.constexpr,  # tile rows = (query token, group head) pairs
    BLOCK_Q: tl.constexpr,  # query tokens per program = BLOCK_M // GROUP
    TILE_N: tl.constexpr,  # keys per inner iteration
    SPLIT: tl.constexpr,  # split-KV: a third grid axis of num_splits key segments, merged by _merge_splits_kernel
    DECODE_ONLY: tl.constexpr,  # every sequence has q_len <= 1: program_id(0) is the sequence
    USE_WINDOW: tl.constexpr,
    KV_SCALED: tl.constexpr,  # the cache holds scaled low-precision values (fp8): dequantise with k/v_scale
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,  # Gemma 2: score = cap * tanh(score / cap), here in the log2 domain
    HAS_KEY_ENDS: tl.constexpr,  # Gemma 3's images: each row's key end from key_ends_ptr (else its position + 1)
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 inputs (tf32 would cost ~1e-3 accuracy), else "tf32" (ignored for 16-bit)
    DOT_UPCAST: tl.constexpr,  # interpreter only: do bf16 dots in fp32 (see _dot)
    F16_DOTS: tl.constexpr,  # fp8 cache, bf16 q: both dots in fp16 (see paged_attention)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE_ONLY:
        seq = q_block
        q_block_local = 0
    else:
        seq = _find_sequence(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
        q_block_local = q_block - (tl.load(query_start_loc_ptr + seq).to(tl.int32) // BLOCK_Q + seq)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int32) - q_start
    if q_block_local * BLOCK_Q >= q_len:
        return  # surplus program of the over-allocated grid (or an empty sequence)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    ctx_len = seq_len - q_len  # keys cached before this step's tokens

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, TILE_N)
    tok = q_block_local * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] token index within the sequence's q rows
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head of each row
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)  # [BLOCK_M]
    d_ok = offs_d < HEAD_DIM  # [HEAD_DIM_PAD]
    q_pos = ctx_len + tok  # [BLOCK_M] absolute position of each row's token
    row = (q_start + tok).to(tl.int64)  # [BLOCK_M] row in q / out

    # Key range this program needs: [key_lo, key_hi). Causality bounds it by the block's last token (key_ends: by
    # the largest end among its rows); the window by its first token.
    if HAS_KEY_ENDS:
        key_end = tl.load(key_ends_ptr + row, mask=row_ok, other=0)  # [BLOCK_M]
        key_hi = tl.max(key_end, 0)
    else:
        key_end = q_pos + 1
        last_tok = tl.minimum(q_block_local * BLOCK_Q + BLOCK_Q, q_len) - 1
        key_hi = ctx_len + last_tok + 1
    tile_lo = 0
    if USE_WINDOW:
        first_pos = ctx_len + q_block_local * BLOCK_Q
        tile_lo = tl.maximum(first_pos - sliding_window + 1, 0) // TILE_N
    tile_hi = tl.cdiv(key_hi, TILE_N)
    if SPLIT:
        # Segments cut the sequence's whole key range, so every query block of a sequence sees the same cuts.
        segments = tl.minimum(num_splits, tl.maximum(seq_len // split_min_keys, 1))  # SplitRule.segments
        if split >= segments:  # a segment this sequence does not fill: marked empty for the merge, nothing read
            part = (row * num_q_heads + head) * num_splits + split  # [BLOCK_M]
            tl.store(lse_ptr + part, tl.full([BLOCK_M], float("-inf"), tl.float32), mask=row_ok)
            return
        tiles_per_split = tl.cdiv(tl.cdiv(seq_len, TILE_N), segments)
        tile_lo = tl.maximum(tile_lo, split * tiles_per_split)
        tile_hi = tl.minimum(tile_hi, (split + 1) * tiles_per_split)

    q = tl.load(
        q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    if F16_DOTS:  # the K/V tiles convert to q's dtype: e4m3 -> fp16 is one packed instruction
        q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)  # [BLOCK_M, HEAD_DIM_PAD]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)
    if HAS_SINKS:  # the sink is one more score of weight exp2(sink - m) and no value: the first segment's start
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634  # log2(e)
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)  # running unnormalised output
    score_scale = scale_log2
    if KV_SCALED:  # q.(k_scale * k) = k_scale * (q.k): one multiply per score, none per key element
        score_scale = scale_log2 * tl.load(k_scale_ptr + kv_head)
    block_table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    k_head_ptr = k_cache_ptr + kv_head * stride_kh
    v_head_ptr = v_cache_ptr + kv_head * stride_vh

    for tile in range(tile_lo, tile_hi):
        key = tile * TILE_N + offs_n  # [TILE_N] absolute key positions
        key_ok = key < seq_len
        phys = tl.load(block_table_row + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)  # [TILE_N]
        in_block = key % BLOCK_SIZE
        kv_mask = key_ok[None, :] & d_ok[:, None]  # [HEAD_DIM_PAD, TILE_N]
        k = tl.load(
            k_head_ptr + phys[None, :] * stride_kb + in_block[None, :] * stride_kt + offs_d[:, None],
            mask=kv_mask,
            other=0.0,
        )  # [HEAD_DIM_PAD, TILE_N]
        v = tl.load(
            v_head_ptr + phys[:, None] * stride_vb + in_block[:, None] * stride_vt + offs_d[None, :],
            mask=key_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(q.dtype)  # [TILE_N, HEAD_DIM_PAD]; fp8 -> q's dtype is exact

        s = _dot(q, k.to(q.dtype), None, DOT_PRECISION, DOT_UPCAST) * score_scale  # [BLOCK_M, TILE_N]
        if SOFTCAP:
            s = softcap_log2 * tanh(s / softcap_log2)
        visible = key_ok[None, :] & (key[None, :] < key_end[:, None])
        if USE_WINDOW:
            visible = visible & (q_pos[:, None] - key[None, :] < sliding_window)
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 instead so exp2 gives 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])  # [BLOCK_M, TILE_N]
        alpha = tl.exp2(m_i - m_ref)  # [BLOCK_M] rescale of what was accumulated so far
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
        m_i = m_new

    # Every real row sees at least its own key, so l_i > 0 there; the guard only keeps masked rows finite
    # (and, with splits, segments that hold no visible key).
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_safe[:, None]  # [BLOCK_M, HEAD_DIM_PAD]
    if KV_SCALED:  # P.(v_scale * v) = v_scale * (P.v)
        o = o * tl.load(v_scale_ptr + kv_head)
    if not SPLIT:
        tl.store(
            out_ptr + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )
    else:
        part = (row * num_q_heads + head) * num_splits + split  # [BLOCK_M] index into [T, Hq, num_splits]
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(lse_ptr + part, lse, mask=row_ok)
        tl.store(out_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], o, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_seqs", "num_splits"])
def _merge_splits_kernel(
    part_out_ptr,  # fp32 [num_tokens, num_q_heads, num_splits, HEAD_DIM_PAD]
    lse_ptr,  # fp32 [num_tokens, num_q_heads, num_splits]
    out_ptr,  # [num_tokens, num_q_heads, head_dim]
    query_start_loc_ptr,  # [B + 1]; rows at or past query_start_loc[B] are padding nobody wrote
    num_seqs,
    num_splits,
    num_q_heads,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,  # a power of 2 >= num_splits (one value for every launch: no recompiles)
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if row >= tl.load(query_start_loc_ptr + num_seqs):
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_ok = offs_s < num_splits
    base = (row * num_q_heads + head) * num_splits
    lse = tl.load(lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))  # [SPLITS_PAD]
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # cannot happen for a real row; keeps the guard NaN-free
    w = tl.exp2(lse - m)  # [SPLITS_PAD] weight of each segment; 0 for empty segments
    parts = tl.load(
        part_out_ptr + (base + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
        mask=(s_ok & (lse > float("-inf")))[:, None],  # an empty segment wrote no partial output (unset memory)
        other=0.0,
    )  # [SPLITS_PAD, HEAD_DIM_PAD]
    total = tl.sum(w, 0)
    total = tl.where(total > 0.0, total, 1.0)
    o = tl.sum(parts * w[:, None], 0) / total  # [HEAD_DIM_PAD]
    tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@dataclass(frozen=True)
class DecodeTiles:
    """How a decode-only launch walks the keys: TILE_N keys per iteration, warps per program, pipeline stages.
    The tile rows (the GQA group padded to 16) are not a choice. `kernels/tuning.py` picks one per engine."""

    tile_n: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.tile_n} keys x {self.num_warps} warps x {self.num_stages} stages"


def decode_tile_candidates(head_dim: int, kv_scaled: bool) -> list[DecodeTiles]:
    """What start-up tuning times for decode attention, the policy's own choice first: 32/64/128-key tiles at
    4 warps and 2 or 3 stages, and the policy's tile at 8 warps (the H200 sweep of 2026-11-26 in
    benchmarks/RESULTS.md: 4 warps within ~3% of one another at batch 256, 8 warps 10-50% slower there, kept
    once for GPUs and shapes where fewer, longer programs run). Each is a kernel variant to compile (~1 s), so
    the list stays short. head_dim 256 keeps tiles <= 64 keys (registers)."""
    _, tile_n, num_warps, num_stages = _select_tiles(max(16, next_pow2(head_dim)), 1, 1, False, kv_scaled)
    own = DecodeTiles(tile_n, num_warps, num_stages)
    others = [DecodeTiles(t, 4, st) for t in (64, 128, 32) for st in (3, 2)] + [DecodeTiles(tile_n, 8, num_stages)]
    if head_dim > 128:
        others = [c for c in others if c.tile_n <= 64]
    return [own] + [c for c in dict.fromkeys(others) if c != own]


def _select_tiles(head_dim_pad: int, group: int, max_query_len: int, is_fp32: bool = False,
                  kv_scaled: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE_N, num_warps, num_stages) for a launch (num_stages: Triton's software-pipelining depth
    of the key loop; 3 is Triton's own default on CUDA).

    Decode (max_query_len <= 1): a tile's rows are just the GROUP query heads of one kv head. tl.dot needs
    at least 16 rows on the tensor cores, so the group is padded to 16 rows (GROUP > 16 uses next_pow2).
    For GROUP = 2 that wastes 14 of 16 rows of MMA work, which does not matter: decode is bound by
    streaming K/V from HBM (2 * TILE_N * head_dim * 2 bytes per tile against 2 * 16 * TILE_N * head_dim
    FLOPs, ~4 FLOP/byte, far below the ~300 FLOP/byte the tensor cores could absorb).
    TILE_N = 64 keys: a K plus a V tile is 64 * 128 * 2 * 2 B = 32 KiB in bf16, enough bytes in flight per
    iteration to keep a few resident programs per SM streaming, with 2-3 pipeline stages fitting in shared
    memory; ctx 2048 is 32 iterations.

    Prefill: 64 rows (64 // GROUP tokens) per program: larger M raises arithmetic intensity (each K/V tile
    is reused by 64 rows) while keeping the fp32 accumulator at 64 x 128 (32 KiB of registers per program,
    fine for 4 warps). Small chunks shrink M to the rows they actually have.
    head_dim 256 halves TILE_N to keep the K/V tiles and the score tile in registers.
    An fp8 cache (kv_scaled) decodes in 128-key tiles: the same bytes per iteration as bf16's 64, and fewer
    iterations for the per-tile conversions and softmax (H200, batch 256 x ctx 2048: 501 us against 558 for
    64-key tiles; benchmarks/RESULTS.md).

    fp32 (tests only: exact "ieee" dots run on FMA units, not tensor cores) uses at most 32 x 32 tiles;
    at 64 x 64 the sm_90 build spills ~8 KB per thread (see benchmarks/compile_check.py).
    """
    tile_n = 64 if head_dim_pad <= 128 else 32
    if max_query_len <= 1:
        block_m = max(16, next_pow2(group))
        if kv_scaled and head_dim_pad <= 128:
            tile_n = 128
    else:
        block_m = max(64, next_pow2(group))
        block_m = min(block_m, max(16, next_pow2(max_query_len * group)))
    if is_fp32:
        tile_n = 32
        block_m = max(min(block_m, 32), next_pow2(group))
    return block_m, tile_n, 4, 3


@dataclass(frozen=True)
class SplitRule:
    """When a decode-only launch cuts each sequence's keys into segments, and into how many: below
    `programs_per_sm` (sequence x kv head) programs per SM, enough segments to reach that many, none shorter
    than `min_keys` keys, at most _MAX_SPLITS. The default is the policy's; `kernels/tuning.py` picks one per
    engine from `split_rule_candidates` by timing them on the device.

    The segment floor holds twice: on the host (a launch for contexts up to C has at most C // min_keys
    segments) and in the kernel (a sequence of c keys fills min(segments, max(c // min_keys, 1)) of them). So a
    decode CUDA graph, captured once for the longest context, gives each replay's sequence the rule's split for
    its own length: num_splits(B, H, C) capped that way is num_splits(B, H, c), since the programs-per-SM part
    does not depend on the context (tests/test_kernels_attention.py holds every rule to this)."""

    programs_per_sm: int = SPLIT_BELOW_PROGRAMS_PER_SM
    min_keys: int = _MIN_KEYS_PER_SPLIT

    def __post_init__(self) -> None:
        if self.programs_per_sm < 1 or self.min_keys < 1:
            raise ValueError(f"SplitRule needs programs_per_sm and min_keys >= 1, got {self}")

    def __str__(self) -> str:
        return f"split below {self.programs_per_sm} programs/SM into segments of >= {self.min_keys} keys"

    def num_splits(self, batch: int, num_kv_heads: int, context: int, num_sms: int) -> int:
        """Key segments per (sequence, kv head) for `batch` sequences of up to `context` keys on `num_sms` SMs."""
        programs = max(1, batch * num_kv_heads)
        if programs >= self.programs_per_sm * num_sms:
            return 1
        want = -(-self.programs_per_sm * num_sms // programs)
        splits = min(want, context // self.min_keys, _MAX_SPLITS)
        return splits if splits >= 2 else 1

    def segments(self, launch_splits: int, context: int) -> int:
        """The segments a sequence of `context` keys fills in a launch of `launch_splits` (the kernel's rule:
        min(launch_splits, context // min_keys), at least one)."""
        return min(launch_splits, max(context // self.min_keys, 1))


DEFAULT_SPLIT_RULE = SplitRule()


def split_rule_candidates() -> list[SplitRule]:
    """What start-up tuning weighs for split-KV, the policy's rule first: programs-per-SM targets around the
    default's 6 and segment floors of 256 to 1024 keys (a segment's fixed cost against the parallelism it buys
    differs by GPU and by head size)."""
    rules = [SplitRule(p, k) for p in (2, 4, 6, 8, 12) for k in (256, 512, 1024)]
    return [DEFAULT_SPLIT_RULE] + [r for r in rules if r != DEFAULT_SPLIT_RULE]


def auto_num_splits(batch: int, num_kv_heads: int, context: int, num_sms: int,
                    rule: SplitRule = DEFAULT_SPLIT_RULE) -> int:
    """Key segments per (sequence, kv head) of a decode-only launch of `batch` sequences at up to `context` keys
    on a GPU with `num_sms` SMs (a pure function: tests and benchmarks ask it about any GPU).

    A decode launch has batch * num_kv_heads programs (the GQA group's query heads share one program: they are
    the rows of its tile), each streaming one sequence's K/V for one head. A program keeps a bounded number of
    loads in flight, so with fewer than SPLIT_BELOW_PROGRAMS_PER_SM programs per SM the HBM pipe is not kept
    full (the issue's "fewer than about 6"; Qwen3-0.6B's 8 kv heads on 132 SMs: below 99 sequences). Then each
    sequence's keys are cut into enough segments to reach that many programs per SM, but never segments shorter
    than _MIN_KEYS_PER_SPLIT keys (per-segment overhead: reading q, writing HEAD_DIM+1 fp32 per row, the merge
    kernel) and never more than _MAX_SPLITS. Those are the default `rule`'s numbers; start-up tuning may pick
    another.
    """
    return rule.num_splits(batch, num_kv_heads, context, num_sms)


def _auto_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                     device: torch.device, rule: SplitRule = DEFAULT_SPLIT_RULE) -> int:
    """auto_num_splits for a launch on `device`; batches with prefill rows never split (they have many query
    blocks, and their time is prefill compute). Host integers only (no device sync)."""
    if max_query_len > 1:
        return 1
    return auto_num_splits(num_seqs, num_kv_heads, max_seq_len, sm_count(device), rule)


def _check_inputs(q, k_cache, v_cache, out, k_scale, v_scale) -> bool:
    """Shapes, dtypes and strides of a launch; True for an fp8 cache (with its scales)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, kv_head_dim = k_cache.shape[2], k_cache.shape[3]
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if kv_head_dim != head_dim or out.shape != q.shape:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, out {tuple(out.shape)}, cache {tuple(k_cache.shape)}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    for name, t in (("q", q), ("out", out), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    return check_kv_cache_dtype(q.dtype, k_cache, v_cache, k_scale, v_scale)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    sliding_window: int | None = None,
    num_splits: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
    decode_tiles: DecodeTiles | None = None,
    split_rule: SplitRule | None = None,
    sinks: torch.Tensor | None = None,
    key_ends: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of the flat batch `q` against the paged KV cache; writes and returns `out`.

    max_query_len / max_seq_len are host-side upper bounds of the per-sequence q_len / seq_len (they pick
    tile shapes and the split count; nothing is read back from the device). num_splits forces the
    split-KV factor (1 = no split); None chooses by `split_rule` (default: the policy's, DEFAULT_SPLIT_RULE).
    The rule's segment floor also holds inside the kernel, per sequence; with num_splits forced and no rule,
    every sequence of at least num_splits keys fills every segment.
    An fp8 cache (float8_e4m3fn) needs k_scale / v_scale, fp32 [num_kv_heads]: key = cache value x k_scale.
    softcap (Gemma 2): scores are soft-capped, cap * tanh(scale * q.k / cap), before the mask.
    sinks (gpt-oss): [num_q_heads], contiguous, any float dtype: head h's logit sinks[h] joins each softmax's
    denominator (HF's GptOssAttention: a score column with no value).
    With an fp8 cache and bf16 q both dots run in fp16: e4m3 -> fp16 is one packed conversion where e4m3 -> bf16
    takes a second, scalar one per element, and the conversions, not the bytes, bound the fp8 kernel (SASS of
    the sm_90 build: 256 F2F.BF16.F16 per thread per 128-key tile). fp16 holds every e4m3 value exactly and
    bf16 q to more bits wherever |q| >= 2^-14 (q is clamped to fp16's range); p in [0, 1] gains bits too.
    decode_tiles: a decode-only launch's tiles, warps and stages (start-up tuning's choice), instead of the
    policy's; ignored for batches with prefill rows.
    key_ends (Gemma 3's image runs): int32 [num_tokens] on q's device, the position before which each row's keys end
    (`metadata.image_key_ends`: past the row's own for its image's later tokens; a window still bounds the earlier
    side); None: causal.
    Rows of `out` past query_start_loc[-1] (padding) are left untouched.
    """
    num_tokens, num_q_heads, head_dim = q.shape  # q: [num_tokens, num_q_heads, head_dim]
    num_blocks, block_size, num_kv_heads, kv_head_dim = k_cache.shape
    kv_scaled = _check_inputs(q, k_cache, v_cache, out, k_scale, v_scale)
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    device = check_launchable(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table)

    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // num_kv_heads
    head_dim_pad = max(16, next_pow2(head_dim))
    block_m, tile_n, num_warps, num_stages = _select_tiles(head_dim_pad, group, max_query_len,
                                                           q.dtype == torch.float32, kv_scaled)
    decode_only = max_query_len <= 1
    if decode_only and decode_tiles is not None:
        tile_n, num_warps, num_stages = decode_tiles.tile_n, decode_tiles.num_warps, decode_tiles.num_stages
    block_q = block_m // group
    # Not `sliding_window < max_seq_len`: that would flip as contexts grow and compile a new variant mid-run.
    use_window = sliding_window is not None
    if sinks is not None and (sinks.shape != (num_q_heads,) or not sinks.is_contiguous() or sinks.device != q.device):
        raise ValueError(f"sinks must be a contiguous [{num_q_heads}] tensor on {q.device}, got {tuple(sinks.shape)}")
    if key_ends is not None and (key_ends.dtype != torch.int32 or key_ends.dim() != 1 or not key_ends.is_contiguous()
                                 or key_ends.device != q.device):  # (it covers the real rows: rows past them go unread)
        raise ValueError(f"key_ends must be a contiguous int32 [num_tokens] tensor on {q.device}, "
                         f"got {key_ends.dtype} {tuple(key_ends.shape)}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if num_splits is None:
        rule = split_rule or DEFAULT_SPLIT_RULE
        num_splits = _auto_num_splits(num_seqs, num_kv_heads, max_query_len, max_seq_len, device, rule)
        split_min_keys = rule.min_keys
    else:  # forced: with a rule, its segment floor (what a graph sized for longer contexts runs); else none
        split_min_keys = split_rule.min_keys if split_rule is not None else 1
    if not 1 <= num_splits <= _MAX_SPLITS:
        raise ValueError(f"num_splits must be in 1..{_MAX_SPLITS}, got {num_splits}")

    dot_upcast = interpreting() and q.dtype == torch.bfloat16
    num_q_blocks = num_seqs if decode_only else num_tokens // block_q + num_seqs
    grid = (num_q_blocks, num_kv_heads, num_splits)
    if num_splits == 1:
        target, lse = out, out  # lse_ptr is never read without SPLIT
    else:
        target = torch.empty((num_tokens, num_q_heads, num_splits, head_dim_pad), dtype=torch.float32, device=device)
        lse = torch.empty((num_tokens, num_q_heads, num_splits), dtype=torch.float32, device=device)

    with on_device(device):
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, target, lse,
            query_start_loc, seq_lens, block_table,
            k_scale if kv_scaled else seq_lens, v_scale if kv_scaled else seq_lens,  # never read unless KV_SCALED
            sinks if sinks is not None else seq_lens,  # never read unless HAS_SINKS
            key_ends if key_ends is not None else seq_lens,  # never read unless HAS_KEY_ENDS
            float(scale) * math.log2(math.e),
            num_seqs,
            num_splits,
            split_min_keys,
            num_q_heads,
            int(sliding_window) if use_window else 0,
            float(softcap or 1.0) * math.log2(math.e),
            q.stride(0), q.stride(1),
            out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_table.stride(0),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            BLOCK_SIZE=block_size,
            GROUP=group,
            BLOCK_M=block_m,
            BLOCK_Q=block_q,
            TILE_N=tile_n,
            SPLIT=num_splits > 1,
            DECODE_ONLY=decode_only,
            USE_WINDOW=use_window,
            KV_SCALED=kv_scaled,
            SOFTCAP=softcap is not None,
            HAS_SINKS=sinks is not None,
            HAS_KEY_ENDS=key_ends is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            DOT_UPCAST=dot_upcast,
            F16_DOTS=kv_scaled and q.dtype == torch.bfloat16,
            num_warps=num_warps,
            num_stages=num_stages,
        )
        if num_splits > 1:
            _merge_splits_kernel[(num_tokens, num_q_heads)](
                target, lse, out, query_start_loc,
                num_seqs,
                num_splits,
                num_q_heads,
                out.stride(0), out.stride(1),
                HEAD_DIM=head_dim,
                HEAD_DIM_PAD=head_dim_pad,
                SPLITS_PAD=_MAX_SPLITS,
                num_warps=4,
            )
    return out
