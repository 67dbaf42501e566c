"""The CPU path's attention (TorchBackend, and CpuBackend with its compiled decode kernel) against a dense
per-sequence reference, on a shuffled paged cache.

Mixed steps (decodes, a fresh prefill, a chunk with cached context, chunks holding Gemma 3's image runs) with
blocks in random order, stale table entries past each row's end, and sliding windows: the paged result must match
plain causal attention over each sequence's own keys (an image's tokens seeing their whole image).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import cbatch.model.backend.torch_backend as torch_backend
from cbatch.model.backend import FP8_KV_DTYPE, AttentionMetadata, CpuBackend, KVLayer, TorchBackend, cpu_kernels, kv_cache_shape
from cbatch.model.backend.metadata import image_key_ends

HQ, HKV, D, BS = 6, 2, 16, 4


def _reference(q, keys, values, ctx, window, images=()):
    """q [n, Hq, D] at positions ctx-n..ctx-1 against keys/values [ctx, Hkv, D]; `images`: Gemma 3's image runs
    [first, end), whose tokens see each other both ways (HF's mask: OR(causal, same image), then AND(window))."""
    n = q.shape[0]
    k = keys.repeat_interleave(HQ // HKV, dim=1)
    v = values.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), k.double()) / math.sqrt(D)
    q_pos = torch.arange(ctx - n, ctx)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    ok = k_pos <= q_pos
    for first, end in images:
        ok |= (q_pos >= first) & (q_pos < end) & (k_pos >= first) & (k_pos < end)
    if window is not None:
        ok &= q_pos - k_pos < window
    probs = scores.masked_fill(~ok, float("-inf")).softmax(-1)
    return torch.einsum("hnc,chd->nhd", probs, v.double()).float()


def _backend(name: str):
    if name == "cpu" and (reason := cpu_kernels.available()) is not None:
        pytest.skip(f"the compiled CPU kernel is not available here: {reason}")
    return CpuBackend() if name == "cpu" else TorchBackend()


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("group_rows", [2, 8])  # decodes split across groups, or one group
@pytest.mark.parametrize(
    "dtype, matmul_prefill_pairs",
    [
        (torch.float32, 512 * 512),  # prefill chunks through SDPA (float32 always does)
        (torch.bfloat16, 512 * 512),  # prefill chunks through matmuls and an explicit softmax
        (torch.bfloat16, 0),  # bfloat16 chunks too long for the matmul path: SDPA
        (torch.float32, "fp8"),  # an fp8 cache with per-head scales, read back in float32
        (torch.bfloat16, "fp8"),
    ],
)
def test_paged_matches_dense(backend_name: str, seed: int, window: int | None, group_rows: int, dtype,
                             matmul_prefill_pairs, monkeypatch) -> None:
    fp8 = matmul_prefill_pairs == "fp8"
    if fp8:
        matmul_prefill_pairs = 512 * 512
    monkeypatch.setattr(torch_backend, "DECODE_GROUP_ROWS", group_rows)
    monkeypatch.setattr(torch_backend, "MATMUL_PREFILL_MAX_PAIRS", matmul_prefill_pairs)
    gen = torch.Generator().manual_seed(seed)
    # (context after this step, query tokens): decodes first, like the scheduler's plans; the last two hold Gemma 3's
    # image runs (a fresh prompt's; a chunk's after cached context whose run began in the cache)
    rows = [(13, 1), (1, 1), (30, 1), (17, 1), (9, 9), (21, 6), (12, 12), (30, 10)]
    images = {6: [(2, 7)], 7: [(18, 26)]}
    num_blocks = 96
    backend = _backend(backend_name)
    k_cache = torch.randn(kv_cache_shape(num_blocks, BS, HKV, D), generator=gen)  # stale, finite data
    v_cache = torch.randn(kv_cache_shape(num_blocks, BS, HKV, D), generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-ctx // BS) for ctx, _ in rows) + 1
    table = torch.tensor(order[: len(rows) * max_blocks]).view(len(rows), max_blocks).int()  # stale entries past the end

    keys = [torch.randn(ctx, HKV, D, generator=gen) for ctx, _ in rows]
    values = [torch.randn(ctx, HKV, D, generator=gen) for ctx, _ in rows]

    def slot(b: int, pos: int) -> int:
        return int(table[b, pos // BS]) * BS + pos % BS

    # the context before this step is already in the cache ([num_blocks, BS, Hkv, D]: slot = block * BS + offset)
    for b, (ctx, n) in enumerate(rows):
        for pos in range(ctx - n):
            k_cache.view(-1, HKV, D)[slot(b, pos)] = keys[b][pos]
            v_cache.view(-1, HKV, D)[slot(b, pos)] = values[b][pos]
    if fp8:  # the cache holds x / scale in e4m3 (one scale per kv head); the reference sees the stored values
        k_scale = torch.rand(HKV, generator=gen) + 0.5
        v_scale = torch.rand(HKV, generator=gen) + 0.5
        k_cache = (k_cache / k_scale[:, None]).to(FP8_KV_DTYPE)
        v_cache = (v_cache / v_scale[:, None]).to(FP8_KV_DTYPE)
        keys = [((x / k_scale[:, None]).to(FP8_KV_DTYPE).float() * k_scale[:, None]).to(dtype).float() for x in keys]
        values = [((x / v_scale[:, None]).to(FP8_KV_DTYPE).float() * v_scale[:, None]).to(dtype).float() for x in values]
        kv = KVLayer(k_cache, v_cache, k_scale, v_scale)
    else:
        k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
        keys = [x.to(dtype).float() for x in keys]  # the reference sees exactly the values the cache holds
        values = [x.to(dtype).float() for x in values]
        kv = KVLayer(k_cache, v_cache)
    q = torch.randn(sum(n for _, n in rows), HQ, D, generator=gen)
    k_new = torch.cat([keys[b][ctx - n :] for b, (ctx, n) in enumerate(rows)])
    v_new = torch.cat([values[b][ctx - n :] for b, (ctx, n) in enumerate(rows)])
    slots = torch.tensor([slot(b, pos) for b, (ctx, n) in enumerate(rows) for pos in range(ctx - n, ctx)])
    q_lens = [n for _, n in rows]
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([ctx for ctx, _ in rows], dtype=torch.int32),
        block_table=table,
        slot_mapping=slots,
        max_query_len=max(q_lens),
        max_seq_len=max(ctx for ctx, _ in rows),
        query_lens_host=q_lens,
        seq_lens_host=[ctx for ctx, _ in rows],
        block_size=BS,
        image_spans={starts[b]: runs for b, runs in images.items()},
    )
    backend.prepare(meta)
    q, k_new, v_new = q.to(dtype), k_new.to(dtype), v_new.to(dtype)
    out = backend.attend(q, k_new, v_new, kv, meta, D**-0.5, window)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for b, (ctx, n) in enumerate(rows):
        want = _reference(q[starts[b] : starts[b + 1]].float(), keys[b], values[b], ctx, window, images.get(b, ()))
        torch.testing.assert_close(out[starts[b] : starts[b + 1]].float(), want, **tol)
    # this step's K/V landed in the cache at their slots
    for i, s in enumerate(slots.tolist()):
        stored = k_cache.view(-1, HKV, D)[s]
        if fp8:
            stored = (stored.float() * kv.k_scale[:, None]).to(dtype)
        torch.testing.assert_close(stored.float(), k_new[i].float(), **({} if not fp8 else dict(rtol=0, atol=0)))



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompts_of_one_length_batched_equal_each_alone(dtype) -> None:
    """A step of many fresh prompts: those of one length attend in one batched SDPA call; each prompt's result is
    bitwise what it gets alone in a step (batch invariance), beside a decode and a lone prompt."""
    gen = torch.Generator().manual_seed(3)
    q_lens = [7, 7, 300, 3, 300, 7, 12, 1]  # the last: a decode over a cached context of 9
    ctxs = q_lens[:-1] + [9]
    num_blocks = 1024
    k_cache = torch.randn(kv_cache_shape(num_blocks, BS, HKV, D), generator=gen).to(dtype)
    v_cache = torch.randn(kv_cache_shape(num_blocks, BS, HKV, D), generator=gen).to(dtype)
    max_blocks = -(-max(ctxs) // BS)
    table = torch.randperm(num_blocks, generator=gen)[: len(q_lens) * max_blocks].view(len(q_lens), max_blocks).int()
    q = torch.randn(sum(q_lens), HQ, D, generator=gen).to(dtype)
    k = torch.randn(sum(q_lens), HKV, D, generator=gen).to(dtype)
    v = torch.randn(sum(q_lens), HKV, D, generator=gen).to(dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)

    def step(members: list[int]) -> torch.Tensor:
        """The rows `members` as one step: their attention outputs, concatenated."""
        lens = [q_lens[b] for b in members]
        loc = [0]
        for n in lens:
            loc.append(loc[-1] + n)
        slots = torch.cat([table[b, (pos := torch.arange(ctxs[b] - q_lens[b], ctxs[b])) // BS].long() * BS + pos % BS
                           for b in members])
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(loc, dtype=torch.int32), seq_lens=torch.tensor([ctxs[b] for b in members]).int(),
            block_table=table[members], slot_mapping=slots, max_query_len=max(lens), max_seq_len=max(ctxs[b] for b in members),
            query_lens_host=lens, seq_lens_host=[ctxs[b] for b in members], block_size=BS)
        backend = TorchBackend()
        backend.prepare(meta)
        if len(members) > 1:  # the two 300s and the three 7s go as groups
            assert sorted(len(g.chunks) for g in meta.backend_state.fresh_groups) == [2, 3]
        rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in members])
        return backend.attend(q[rows], k[rows], v[rows], KVLayer(k_cache.clone(), v_cache.clone()), meta, D**-0.5, None)

    together = step(list(range(len(q_lens))))
    for b in range(len(q_lens)):
        alone = step([b])
        assert torch.equal(together[starts[b] : starts[b + 1]], alone), b


def test_image_key_ends_give_each_row_its_runs_end():
    """A decode, a fresh prompt with a run at its start, a chunk after 7 cached tokens holding the end of a run that
    began in the cache, a chunk with a run in its middle: each row's key end is its position + 1 outside a run, the
    run's end inside it."""
    ends = image_key_ends([1, 6, 5, 6], [9, 6, 12, 20], {1: [(0, 3)], 7: [(5, 9)], 12: [(16, 19)]})
    assert ends.tolist() == [9, 3, 3, 3, 4, 5, 6, 9, 9, 10, 11, 12, 15, 16, 19, 19, 19, 20]
    assert ends.dtype == np.int32
