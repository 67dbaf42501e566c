"""The CPU backend's compiled kernels (cbatch/model/backend/cpu_kernels.cpp) against the plain-torch path they
replace (TorchBackend, the reference), on random inputs: decode attention, fresh prompts' causal attention,
RMSNorm with and without the residual add (Gemma's unit offset too), rotary, SiLU-and-multiply, in float32 and bfloat16, with strided inputs; inputs a kernel
does not take fall back to the torch ops. The model-level greedy parity with HF runs through this backend too
(auto on CPU): tests/test_model_parity.py, test_model_families.py, test_smollm2.py."""
from __future__ import annotations

import pytest
import torch

from cbatch.model.backend import AttentionMetadata, CpuBackend, KVLayer, TorchBackend, cpu_kernels, kv_cache_shape

pytestmark = pytest.mark.skipif(cpu_kernels.available() is not None,
                                reason=f"the compiled CPU kernels are not available here: {cpu_kernels.available()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 1, 128), (4, 4, 80)])  # 80: the generic loop
@pytest.mark.parametrize("window, softcap", [(None, None), (37, None), (None, 20.0)])
def test_compiled_decode_kernel_matches_the_torch_path(dtype, heads, kv_heads, head_dim, window, softcap):
    """CpuBackend's kernel against TorchBackend's decode groups: many rows, contexts over many shuffled blocks
    (a partial last block, stale entries past it), q a strided view of the packed projection."""
    want, got = _decode_through_both(dtype, heads, kv_heads, head_dim, window, softcap)
    assert want.abs().mean() > 0.05  # real values, not zeros
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)


def test_heads_larger_than_the_decode_kernel_takes_fall_back_to_torch():
    """The kernel's per-head buffers hold MAX_HEAD_DIM floats: a larger head runs the torch path (it used to
    stop the run with the kernel's "bad arguments")."""
    want, got = _decode_through_both(torch.float32, 2, 1, cpu_kernels.MAX_HEAD_DIM + 64, None, None)
    assert want.abs().mean() > 0.01  # real values, not zeros
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _decode_through_both(dtype, heads, kv_heads, head_dim, window, softcap, sinks=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(TorchBackend's, CpuBackend's) decode attention of the same rows, as float32."""
    gen = torch.Generator().manual_seed(head_dim + (window or 0))
    block_size, num_blocks = 16, 256
    ctxs = [1, 2, 15, 16, 17, 64, 100, 203, 311, 5]
    cols = -(-max(ctxs) // block_size) + 2
    table = torch.randperm(num_blocks, generator=gen)[: len(ctxs) * cols].view(len(ctxs), cols).int()
    kv = KVLayer(*(torch.randn(kv_cache_shape(num_blocks, block_size, kv_heads, head_dim), generator=gen).to(dtype)
                   for _ in range(2)))
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(len(ctxs), width, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(len(ctxs), heads, head_dim)  # rows `width` apart
    k_new, v_new = (qkv[:, s : s + kv_heads * head_dim].reshape(len(ctxs), kv_heads, head_dim)
                    for s in (heads * head_dim, (heads + kv_heads) * head_dim))
    slots = torch.tensor([int(table[b, (c - 1) // block_size]) * block_size + (c - 1) % block_size
                          for b, c in enumerate(ctxs)])
    outs = []
    for backend in (TorchBackend(), CpuBackend()):
        meta = AttentionMetadata(
            query_start_loc=torch.arange(len(ctxs) + 1, dtype=torch.int32), seq_lens=torch.tensor(ctxs, dtype=torch.int32),
            block_table=table, slot_mapping=slots, max_query_len=1, max_seq_len=max(ctxs),
            query_lens_host=[1] * len(ctxs), seq_lens_host=ctxs, block_size=block_size)
        backend.prepare(meta)
        outs.append(backend.attend(q, k_new, v_new, kv, meta, head_dim**-0.5, window, softcap, sinks).float())
    return outs[0], outs[1]


def _prefill_step(backend, dtype, heads, kv_heads, head_dim, lens, cached, window=None, seed=0, softcap=None,
                  sinks=None, images=None):
    """One step's attention through `backend` in `dtype`: fresh prompts of `lens` tokens (flat, one after another)
    and, for each entry of `cached`, a chunk of `cached[i][0]` tokens after `cached[i][1]` tokens already in the
    cache; q a strided view of the packed projection; `images`: chunk index (in that order) -> Gemma 3's image
    runs [first, end) in its context positions. Every input holds bfloat16 values whatever `dtype` (so a
    float32 run is the exact reference of a bfloat16 one). Returns out [T, Hq, D] as float32."""
    gen = torch.Generator().manual_seed(seed)
    block_size = 8
    chunks = [(n, 0) for n in lens] + list(cached)  # (query tokens, cached context)
    cols = max(-(-(q + c) // block_size) for q, c in chunks)
    table = torch.arange(len(chunks) * cols, dtype=torch.int32).view(len(chunks), cols)
    kv = KVLayer(*(torch.randn(kv_cache_shape(len(chunks) * cols, block_size, kv_heads, head_dim), generator=gen)
                   .bfloat16().to(dtype) for _ in range(2)))
    num_tokens = sum(q for q, _ in chunks)
    width = (heads + 2 * kv_heads) * head_dim
    # each chunk's rows drawn from its own seed: a prompt's inputs do not depend on the others in the step
    qkv = torch.cat([torch.randn(n, width, generator=torch.Generator().manual_seed(seed * 1000 + b)) * 2
                     for b, (n, _) in enumerate(chunks)]).bfloat16().to(dtype)  # peaked softmaxes and flat ones
    q = qkv[:, : heads * head_dim].view(num_tokens, heads, head_dim)
    k_new, v_new = (qkv[:, s : s + kv_heads * head_dim].reshape(num_tokens, kv_heads, head_dim)
                    for s in (heads * head_dim, (heads + kv_heads) * head_dim))
    positions = [torch.arange(c, c + n) for n, c in chunks]  # the cache positions this step writes
    slots = torch.cat([table[b].long()[pos // block_size] * block_size + pos % block_size
                       for b, pos in enumerate(positions)])
    query_lens = [n for n, _ in chunks]
    seq_lens = [n + c for n, c in chunks]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=table, slot_mapping=slots,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens), query_lens_host=query_lens, seq_lens_host=seq_lens,
        block_size=block_size,
        image_spans={sum(query_lens[:b]): runs for b, runs in images.items()} if images else None)
    backend.prepare(meta)
    return backend.attend(q, k_new, v_new, kv, meta, head_dim**-0.5, window, softcap, sinks).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(8, 2, 32), (4, 4, 64), (6, 2, 80), (2, 1, 128)])
def test_compiled_prefill_kernel_matches_the_torch_path(dtype, heads, kv_heads, head_dim):
    """Fresh prompts of many lengths (two of one length: the torch path's batched SDPA call; past the kernel's
    128-token tasks and 32-key tiles; 80: a head that is not whole vectors) beside chunks after cached context
    in one step: CpuBackend's compiled causal kernel against TorchBackend."""
    lens, cached = [2, 5, 33, 33, 140, 300], [(7, 9), (20, 40)]
    got = _prefill_step(CpuBackend(), dtype, heads, kv_heads, head_dim, lens, cached)
    # bfloat16: the kernel computes in float32 and rounds once, so the reference is the float32 torch path on the
    # same values (the bfloat16 torch path rounds its scores and probabilities too: further from both)
    want = _prefill_step(TorchBackend(), torch.float32, heads, kv_heads, head_dim, lens, cached)
    assert want.abs().mean() > 0.05  # real values, not zeros
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-5)  # one rounding
    torch.testing.assert_close(got, want, **tol)


def test_a_fresh_prompts_attention_is_the_same_bits_alone_and_among_others():
    """Batch invariance of the compiled prefill kernel: a prompt's rows do not depend on the other prompts of
    the step (their number, lengths, or its place among them)."""
    alone = _prefill_step(CpuBackend(), torch.float32, 8, 2, 32, [150], [], seed=3)
    among = _prefill_step(CpuBackend(), torch.float32, 8, 2, 32, [150, 7, 150, 300], [], seed=3)
    assert alone.abs().mean() > 0.05
    assert torch.equal(among[:150], alone)


def test_a_prompts_attention_is_the_same_bits_in_one_chunk_or_after_cached_context():
    """Chunking invariance of the compiled prefill kernel: a 300-token prompt attended whole, and its last 110
    tokens attended as a chunk after the first 190 read back from the cache, give the same bits for those rows
    (every row's sums run over key panels counted from the sequence's first token)."""
    heads, kv_heads, head_dim = 4, 1, 64  # one KV head: a tile mixes tokens, which must not matter either
    whole, cached = _prompt_twice(heads, kv_heads, head_dim, 300, 190)
    assert whole.abs().mean() > 0.05
    assert torch.equal(cached, whole[190:])


def _prompt_twice(heads, kv_heads, head_dim, length, split, window=None):
    """(rows of one prompt attended whole, rows split.. of it attended as a chunk after `split` cached tokens)."""
    gen = torch.Generator().manual_seed(11)
    block_size, cols = 16, -(-length // 16)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(length, width, generator=gen) * 2
    q = qkv[:, : heads * head_dim].view(length, heads, head_dim)
    k, v = (qkv[:, s : s + kv_heads * head_dim].reshape(length, kv_heads, head_dim)
            for s in (heads * head_dim, (heads + kv_heads) * head_dim))
    table = torch.randperm(cols, generator=gen).int().view(1, cols)  # the blocks in a shuffled order
    outs = []
    for first in (0, split):
        kv = KVLayer(*(torch.zeros(kv_cache_shape(cols, block_size, kv_heads, head_dim)) for _ in range(2)))
        pos = torch.arange(length)
        slots = table[0].long()[pos // block_size] * block_size + pos % block_size
        kv.k.view(-1, kv_heads, head_dim)[slots[:first]] = k[:first]  # the context a previous step stored
        kv.v.view(-1, kv_heads, head_dim)[slots[:first]] = v[:first]
        n = length - first
        meta = AttentionMetadata(
            query_start_loc=torch.tensor([0, n], dtype=torch.int32), seq_lens=torch.tensor([length], dtype=torch.int32),
            block_table=table, slot_mapping=slots[first:], max_query_len=n, max_seq_len=length, query_lens_host=[n],
            seq_lens_host=[length], block_size=block_size)
        backend = CpuBackend()
        backend.prepare(meta)
        outs.append(backend.attend(q[first:], k[first:], v[first:], kv, meta, head_dim**-0.5, window, None))
    return outs[0], outs[1]


@pytest.mark.parametrize("window, softcap", [(16, None), (None, 20.0), (40, 5.0)])
def test_windowed_and_soft_capped_prefill_match_the_torch_path(window, softcap):
    """Gemma 2/3, Mistral, Phi-3: a sliding window (a query sees its last `window` keys: across key panels and
    tasks, and past cached context) and Gemma 2's soft-capped scores, fresh prompts and chunks after context."""
    lens, cached = [3, 40, 150], [(20, 90), (9, 12)]
    backends = (TorchBackend(), CpuBackend())
    want, got = (_prefill_step(b, torch.float32, 4, 2, 64, lens, cached, window=window, softcap=softcap, seed=4)
                 for b in backends)
    assert want.abs().mean() > 0.05
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("window", [None, 16])
def test_attention_sinks_match_the_torch_path(window):
    """gpt-oss's sinks (a logit per query head in each softmax's denominator), with and without its window: the
    decode kernel and the prefill kernel (fresh prompts and chunks after context) against TorchBackend."""
    sinks = torch.linspace(-2.0, 4.0, 8)
    want, got = _decode_through_both(torch.float32, 8, 2, 64, window, None, sinks)
    without, _ = _decode_through_both(torch.float32, 8, 2, 64, window, None)
    assert (want - without).abs().max() > 0.05  # the sinks change the result
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)
    lens, cached = [3, 40, 150], [(20, 90), (9, 12)]
    want, got = (_prefill_step(b, torch.float32, 8, 2, 64, lens, cached, window=window, seed=5, sinks=sinks)
                 for b in (TorchBackend(), CpuBackend()))
    without = _prefill_step(TorchBackend(), torch.float32, 8, 2, 64, lens, cached, window=window, seed=5)
    assert (want - without).abs().max() > 0.05
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


def test_a_windowed_prompt_is_the_same_bits_in_one_chunk_or_after_cached_context():
    whole, cached = _prompt_twice(4, 2, 64, 300, 170, window=50)
    assert whole.abs().mean() > 0.05
    assert torch.equal(cached, whole[170:])


# Gemma 3's image runs by chunk (lens 6, 70, 150, 40, then 30 after 50 cached, 20 after 40): a whole prompt; one at
# a prompt's start and one mid-prompt; one across the kernel's 32-key panels and one at a prompt's end across its
# 128-token tasks; none (a causal chunk beside them); mid-chunk after cached context; one whose earlier part is cached
IMAGE_LENS, IMAGE_CACHED = [6, 70, 150, 40], [(30, 50), (20, 40)]
IMAGE_RUNS = {0: [(0, 6)], 1: [(0, 10), (40, 64)], 2: [(5, 40), (100, 150)], 4: [(55, 75)], 5: [(30, 45)]}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 16])
def test_image_runs_match_the_torch_path_and_leave_other_rows_bit_for_bit(dtype, window):
    """Gemma 3's bidirectional image runs in the compiled prefill kernel (each row's key end): against TorchBackend's
    masked attention, with and without a sliding window; a row outside every run keeps the causal kernel's bits."""
    step = lambda backend, dt, images: _prefill_step(backend, dt, 4, 2, 64, IMAGE_LENS, IMAGE_CACHED,  # noqa: E731
                                                     window=window, seed=6, images=images)
    got = step(CpuBackend(), dtype, IMAGE_RUNS)
    want = step(TorchBackend(), torch.float32, IMAGE_RUNS)
    tol = dict(rtol=1e-5, atol=2e-6) if dtype == torch.float32 else dict(rtol=2**-8, atol=1e-5)
    torch.testing.assert_close(got, want, **tol)
    causal = step(CpuBackend(), dtype, None)
    sees_later = torch.zeros(len(got), dtype=torch.bool)  # the rows of a run but its last: they see later keys
    chunks = [(n, 0) for n in IMAGE_LENS] + IMAGE_CACHED
    for b, runs in IMAGE_RUNS.items():
        row0, first_pos = sum(n for n, _ in chunks[:b]), chunks[b][1]
        for first, end in runs:
            sees_later[row0 + max(first - first_pos, 0) : row0 + end - 1 - first_pos] = True
    assert torch.equal(got[~sees_later], causal[~sees_later])
    changed = (got != causal).any(dim=2).any(dim=1)
    assert (got - causal).abs().max() > 0.1
    assert torch.equal(changed, sees_later), (changed ^ sees_later).nonzero()


def test_a_key_end_past_its_chunk_is_refused():
    """The prefill kernel reads keys up to each row's end: an end past the chunk's last token (or not past the row's
    own position) is refused before anything is read."""
    q = torch.randn(4, 2, 32)
    k, v = torch.randn(4, 1, 32), torch.randn(4, 1, 32)
    chunks = torch.tensor([[0], [4], [0], [0]], dtype=torch.int32)
    for ends in ([4, 4, 4, 5], [2, 2, 2, 4]):
        with pytest.raises(ValueError, match="status 3"):
            cpu_kernels.prefill_attention(q, k, v, torch.empty_like(q), chunks, 0.2,
                                          key_ends=torch.tensor(ends, dtype=torch.int32))


def _tolerance(dtype):
    """float32: the sum of squares runs in another order than torch's mean (an ulp or two of the result);
    bfloat16: that can move a value across a rounding boundary (one bfloat16 ulp, 2^-7 relative)."""
    return dict(rtol=2e-6, atol=2e-6) if dtype == torch.float32 else dict(rtol=2**-7, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("hidden", [576, 64, 33])
def test_rms_norm_and_residual_add_match_the_torch_path(dtype, unit_offset, hidden):
    gen = torch.Generator().manual_seed(hidden)
    wide = torch.randn(41, hidden + 7, generator=gen).to(dtype)
    x = wide[:, 3 : 3 + hidden]  # a strided view: rows hidden + 7 apart
    residual = torch.randn(41, hidden, generator=gen).to(dtype)
    weight = (torch.randn(hidden, generator=gen) * 0.3 + 1).to(dtype)
    fused, torch_path = CpuBackend(), TorchBackend()
    got, want = fused.rms_norm(x, weight, 1e-6, unit_offset), torch_path.rms_norm(x, weight, 1e-6, unit_offset)
    assert want.abs().mean() > 0.3
    tol = _tolerance(dtype)
    torch.testing.assert_close(got, want, **tol)
    (got, got_sum), (want, want_sum) = (b.add_rms_norm(x, residual, weight, 1e-6, unit_offset) for b in (fused, torch_path))
    torch.testing.assert_close(got_sum, want_sum, rtol=0, atol=0)  # the residual sum is one rounding either way
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_torch_path(dtype):
    gen = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(3, 70, 2 * 1536, generator=gen) * 4).to(dtype)  # gates far into both tails
    gate_up[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])  # gates: NaN stays NaN
    gate_up[0, 0, 1536 + 3] = float("nan")  # an up
    got, want = CpuBackend().silu_and_mul(gate_up), TorchBackend().silu_and_mul(gate_up)
    assert got.shape == (3, 70, 1536) and want[want.isfinite()].abs().mean() > 0.5
    assert torch.isnan(got[0, 0, [0, 2, 3]]).all() and torch.isnan(want[0, 0, [0, 2, 3]]).all()
    # float32: our exp and torch's differ by an ulp at most; bfloat16 rounds that away
    tol = dict(rtol=4e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=0, atol=0)
    torch.testing.assert_close(got, want, equal_nan=True, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_head_norms_and_rotary_read_the_packed_projection_in_place(dtype):
    """Qwen3's q/k norms and the rotary on per-head views of the packed projection (heads D apart, tokens a
    projection row apart): the norm within the RMSNorm tolerance, the rotary the torch path's bits."""
    gen = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, head_dim = 37, 8, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    weight = (torch.randn(head_dim, generator=gen) * 0.3 + 1).to(dtype)
    assert cpu_kernels.rms_norm(q, weight, 1e-6, False) is not None  # the kernel takes the view
    torch.testing.assert_close(CpuBackend().rms_norm(q, weight, 1e-6), TorchBackend().rms_norm(q, weight, 1e-6),
                               **_tolerance(dtype))
    table = torch.randn(100, head_dim, generator=gen)  # the model's (cos | sin) angles table
    rope = TorchBackend().rotary(torch.randint(0, 100, (tokens,), generator=gen), table, dtype)
    (q_want, k_want), (q_got, k_got) = (b.apply_rotary(q, k, rope) for b in (TorchBackend(), CpuBackend()))
    assert q_want.abs().mean() > 0.3
    assert torch.equal(q_got, q_want) and torch.equal(k_got, k_want)
    assert cpu_kernels.rotary(q, rope.cos, rope.sin) is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_store_writes_what_index_copy_writes(dtype):
    """k and v as strided views of the packed projection, slots out of order and a padded row (slot -1): the
    caches equal the torch path's bit for bit, every other slot untouched; a layout the kernel does not take
    (heads not contiguous) is left to torch."""
    gen = torch.Generator().manual_seed(6)
    tokens, heads, kv_heads, head_dim, blocks, block_size = 300, 6, 2, 64, 40, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    slots[7] = -1
    caches = [[torch.randn(kv_cache_shape(blocks, block_size, kv_heads, head_dim), generator=gen).to(dtype)
               for _ in range(2)]]
    caches.append([c.clone() for c in caches[0]])
    assert cpu_kernels.store_kv(k, v, *caches[0], slots)
    for cache, x in zip(caches[1], (k, v)):  # the reference: index_copy_ of the stored rows
        cache.view(-1, kv_heads, head_dim).index_copy_(0, slots[slots >= 0], x[slots >= 0])
    assert all(torch.equal(got, want) for got, want in zip(caches[0], caches[1]))
    assert not cpu_kernels.store_kv(k.transpose(1, 2).contiguous().transpose(1, 2), v, *caches[0], slots)


def test_inputs_the_kernels_do_not_take_fall_back_to_torch():
    """float16, rows that are not one uniform run of groups, partial rotary: the torch ops, same results."""
    gen = torch.Generator().manual_seed(1)
    x16 = torch.randn(5, 64, generator=gen).half()
    w16 = torch.ones(64, dtype=torch.float16)
    assert cpu_kernels.rms_norm(x16, w16, 1e-6, False) is None
    torch.testing.assert_close(CpuBackend().rms_norm(x16, w16, 1e-6), TorchBackend().rms_norm(x16, w16, 1e-6))
    x = torch.randn(3, 6, 4, 16, generator=gen)[:, ::2]  # groups of 4 rows, but the groups are not evenly spaced
    assert cpu_kernels.rms_norm(x.transpose(0, 1), torch.ones(16), 1e-6, False) is None
    torch.testing.assert_close(CpuBackend().rms_norm(x.transpose(0, 1), torch.ones(16), 1e-6),
                               TorchBackend().rms_norm(x.transpose(0, 1), torch.ones(16), 1e-6))
    assert cpu_kernels.silu_and_mul(torch.randn(4, 10, generator=gen).t()) is None  # columns: no unit stride
    q, k = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 2, 16, generator=gen)
    rope = TorchBackend().rotary(torch.arange(5), torch.randn(10, 8, generator=gen), torch.float32)  # 8 of 16 dims
    (q_want, k_want), (q_got, k_got) = (b.apply_rotary(q, k, rope) for b in (TorchBackend(), CpuBackend()))
    assert torch.equal(q_got, q_want) and torch.equal(k_got, k_want)


def test_without_a_compiler_auto_keeps_the_torch_path_and_says_so_once(tmp_path, monkeypatch, capsys):
    """No cached build and a compiler that cannot run: auto picks torch (one note), an explicit --attention-backend
    cpu is a ConfigError naming why, and the failed build is not retried by each caller."""
    from cbatch.config import ConfigError, EngineConfig
    from cbatch.engine.resolve import engine_backend
    from cbatch.model.backend import backend_name

    monkeypatch.setenv("CBATCH_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    runs = []
    compile_once = cpu_kernels._compile
    monkeypatch.setattr(cpu_kernels, "_compile", lambda *a: runs.append(1) or compile_once(*a))
    for cached in (cpu_kernels._library, cpu_kernels.available):
        cached.cache_clear()
    try:
        cpu = torch.device("cpu")
        assert backend_name("auto", cpu) == "torch"
        assert engine_backend(EngineConfig(device="cpu"), cpu).name == "torch"
        assert "compiled CPU kernels are not available" in capsys.readouterr().err
        with pytest.raises(ConfigError, match="no-such-compiler"):
            engine_backend(EngineConfig(device="cpu", attention_backend="cpu"), cpu)
        assert len(runs) == 1
    finally:
        for cached in (cpu_kernels._library, cpu_kernels.available):
            cached.cache_clear()


def test_vision_rotary_in_bfloat16_takes_the_float32_math_of_transformers():
    """The towers' rotary (vision.rotate) with bfloat16 q/k and float32 angles: x taken to float32, rotated, rounded
    back once, as transformers' apply_rotary_pos_emb_vision; the kernel gives the torch ops' bits."""
    from cbatch.model import vision

    gen = torch.Generator().manual_seed(11)
    tokens, heads, head_dim = 300, 6, 64
    qkv = torch.randn(tokens, 3 * heads * head_dim, generator=gen).to(torch.bfloat16)
    q = qkv.view(tokens, 3, heads, head_dim)[:, 0]  # a strided per-head view, as the tower's unbind gives
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 40
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    got = cpu_kernels.rotary(q, cos, sin)
    assert got is not None and got.dtype == torch.bfloat16
    qf = q.float()
    want = (qf * cos).add_(qf.unflatten(-1, (2, -1)).flip(-2).flatten(-2).mul_(sin)).to(torch.bfloat16)
    assert torch.equal(got, want) and not torch.equal(got, q)
    assert torch.equal(vision.rotate(q, cos, sin), want)
    # rounding each product to bfloat16 (the decoder's rule) would differ somewhere
    q16, c16, s16 = q, cos.to(torch.bfloat16), sin.to(torch.bfloat16)
    per_op = q16 * c16 + q16.unflatten(-1, (2, -1)).flip(-2).flatten(-2) * s16
    assert not torch.equal(per_op, want)
