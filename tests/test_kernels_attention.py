"""Paged attention and KV-cache store kernels against float64 PyTorch references.

Runs on a GPU when one is present; otherwise through Triton's CPU interpreter (conftest.py sets
TRITON_INTERPRET=1 before anything imports triton when there is no GPU). Shapes are kept small on purpose: the
interpreter executes every program in numpy.
"""

import importlib

import pytest
import torch

pytest.importorskip("triton")

from cbatch.kernels import paged_attention, store_kv  # noqa: E402
from cbatch.model.backend.metadata import image_key_ends  # noqa: E402
from helpers import kernel_device  # noqa: E402

# the submodule, not the function of the same name that the package exports
pa_mod = importlib.import_module("cbatch.kernels.paged_attention")
DEVICE = kernel_device()

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


# ----------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------


def make_batch(spec, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=0, q_padding=0):
    """A flat batch from spec = [(q_len, seq_len), ...] with a randomly permuted, non-contiguous block table.

    The whole cache (also slots past each seq_len and unused blocks) holds random data, and unused
    block-table entries point at random blocks, so reading anything outside the visible context shows up
    in the result. q gets `q_padding` extra rows past query_start_loc[-1].
    """
    g = torch.Generator().manual_seed(seed)
    q_lens = [ql for ql, _ in spec]
    seq_lens = [sl for _, sl in spec]
    assert all(0 <= ql <= sl for ql, sl in spec)
    blocks_per_seq = [-(-sl // block_size) for sl in seq_lens]
    max_blocks = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g)
    block_table = torch.randint(0, num_blocks, (len(spec), max_blocks), generator=g, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    num_tokens = sum(q_lens) + q_padding
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=g).to(dtype)
    query_start_loc = torch.zeros(len(spec) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(q_lens).cumsum(0)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return dict(
        q=to(q),
        k_cache=to(k_cache),
        v_cache=to(v_cache),
        query_start_loc=to(query_start_loc),
        seq_lens=to(torch.tensor(seq_lens, dtype=torch.int32)),
        block_table=to(block_table),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )


def reference_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_table, scale, sliding_window=None,
                        sinks=None, images=None):
    """Per-sequence float64 attention; returns [num_tokens, num_q_heads, head_dim] (padding rows zero). `sinks`
    [Hq]: each head's logit joins the softmax as one more column (HF's gpt-oss), whose weight is dropped. `images`:
    sequence -> Gemma 3's image runs [first, end) (positions), whose tokens see each other both ways (HF's mask:
    OR(causal, same image), then AND(window))."""
    q, k_cache, v_cache = q.cpu().double(), k_cache.cpu().double(), v_cache.cpu().double()
    query_start_loc, seq_lens, block_table = query_start_loc.cpu(), seq_lens.cpu(), block_table.cpu()
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    for b in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        seq_len, q_len = int(seq_lens[b]), end - start
        if q_len == 0:
            continue
        j = torch.arange(seq_len)
        phys = block_table[b, j // block_size].long()
        k = k_cache[phys, j % block_size].repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
        v = v_cache[phys, j % block_size].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * scale  # [Hq, q_len, seq_len]
        pos = (seq_len - q_len + torch.arange(q_len))[:, None]  # [q_len, 1] absolute positions
        visible = j[None, :] <= pos
        for first, stop in (images or {}).get(b, ()):
            visible |= (pos >= first) & (pos < stop) & (j[None, :] >= first) & (j[None, :] < stop)
        if sliding_window is not None:
            visible &= (pos - j[None, :]) < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = scores.softmax(-1)
        else:
            sink = sinks.cpu().double()[:, None, None].expand(-1, q_len, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def rel_err(out, ref):
    return ((out.cpu().double() - ref).norm() / ref.norm()).item()


def run_and_check(batch, dtype, sliding_window=None, num_splits=None, out=None, sinks=None):
    q = batch["q"]
    scale = q.shape[-1] ** -0.5
    if out is None:
        out = torch.full_like(q, float("nan"))  # poison: every real row must be written
    ret = paged_attention(
        q, batch["k_cache"], batch["v_cache"], out, batch["query_start_loc"], batch["seq_lens"],
        batch["block_table"], scale, batch["max_query_len"], batch["max_seq_len"],
        sliding_window=sliding_window, num_splits=num_splits, sinks=sinks,
    )
    assert ret is out
    ref = reference_attention(q, batch["k_cache"], batch["v_cache"], batch["query_start_loc"],
                              batch["seq_lens"], batch["block_table"], scale, sliding_window, sinks)
    n_real = int(batch["query_start_loc"][-1])
    assert torch.isfinite(out[:n_real]).all(), "NaN/inf (or unwritten rows) in the output"
    err = rel_err(out[:n_real], ref[:n_real])
    assert err < TOL[dtype], f"relative error {err:.3e} >= {TOL[dtype]:.0e}"
    return out


# Decode rows (q_len 1) at contexts 1, 15, 17, 100; a chunked-prefill row with a cached prefix
# (16 new tokens after 17 cached: crosses the 16/32 block boundaries); fresh prefills of 15 and 33.
MIXED = [(1, 1), (1, 15), (1, 17), (1, 100), (16, 33), (15, 15), (33, 33)]
# The same kinds of rows in fewer tokens, for split-KV cases: the interpreter runs the merge kernel as
# one program per (token, head), which dominates their run time.
MIXED_SMALL = [(1, 1), (1, 17), (1, 100), (16, 33), (15, 15)]


# ----------------------------------------------------------------------------------------------------
# paged_attention
# ----------------------------------------------------------------------------------------------------


# every pair of (block size, head dim, group) once: the tiles follow the head dim and the group, the block
# size only the addressing
@pytest.mark.parametrize("block_size,head_dim,group", [(16, 64, 1), (32, 128, 1), (16, 128, 4), (32, 64, 4),
                                                       (32, 64, 8), (16, 128, 8)])
def test_mixed_batch_fp32(block_size, head_dim, group):
    num_kv_heads = 2
    batch = make_batch(MIXED, group * num_kv_heads, num_kv_heads, head_dim, block_size, torch.float32,
                       seed=block_size + head_dim + group)
    run_and_check(batch, torch.float32, num_splits=None)  # a batch with prefill rows: auto = no split


@pytest.mark.parametrize(
    "block_size,head_dim,group,num_splits",
    [(16, 64, 1, 2), (32, 128, 4, 3), (16, 128, 8, 5)],
)
def test_mixed_batch_forced_split(block_size, head_dim, group, num_splits):
    """Split-KV on a batch with prefill rows; 5 splits of contexts only 1-4 key tiles long leave segments empty."""
    batch = make_batch(MIXED_SMALL, group * 2, 2, head_dim, block_size, torch.float32, seed=7 + num_splits)
    run_and_check(batch, torch.float32, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_long_context_auto_split(num_splits):
    """Decode-only batch with few programs and long contexts: the heuristic must choose split-KV;
    forcing num_splits=1 runs the 2-D path on the same shapes."""
    spec = [(1, 1), (1, 17), (1, 600), (1, 1500)]
    num_kv_heads, group = 2, 4
    auto = pa_mod._auto_num_splits(len(spec), num_kv_heads, 1, 1500, torch.device(DEVICE))
    if DEVICE == "cpu":  # the CPU path assumes an H100's 132 SMs
        assert auto == 1500 // pa_mod._MIN_KEYS_PER_SPLIT
    batch = make_batch(spec, group * num_kv_heads, num_kv_heads, 128, 16, torch.float32, seed=3)
    run_and_check(batch, torch.float32, num_splits=num_splits)


def test_auto_split_policy():
    """Split-KV below SPLIT_BELOW_PROGRAMS_PER_SM (6) programs per SM (issue 40: "fewer than about 6"; it was 2):
    one program per (sequence, kv head) keeps too few loads in flight to fill HBM, so a decode batch of Qwen3's
    8 kv heads splits below 99 sequences on 132 SMs, into enough segments for 6 programs per SM (>= 512 keys
    each, at most 16)."""
    assert pa_mod.SPLIT_BELOW_PROGRAMS_PER_SM == 6
    split = pa_mod.auto_num_splits
    assert split(8, 8, 8192, 132) == 13  # 64 programs -> ceil(792 / 64)
    assert split(8, 8, 2048, 132) == 4  # capped by 2048 // 512 keys per split
    assert split(64, 8, 8192, 132) == 2  # 512 programs = 3.9 per SM: split (the old rule, < 2 per SM, did not)
    assert split(98, 8, 2048, 132) == 2  # 784 programs, just below 6 per SM
    assert split(99, 8, 2048, 132) == 1  # 792 = 6 per SM: no split
    assert split(256, 8, 8192, 132) == 1  # 2048 programs fill the GPU
    assert split(8, 8, 700, 132) == 1  # context too short to be worth it
    assert split(1, 8, 1 << 20, 132) == 16  # never more than _MAX_SPLITS
    assert split(64, 8, 8192, 78) == 1  # a GPU with fewer SMs: 512 programs are 6.6 per SM
    dev = torch.device("cpu")  # the launch's wrapper: 132 SMs assumed off a GPU
    assert pa_mod._auto_num_splits(8, 8, 1, 8192, dev) == 13
    assert pa_mod._auto_num_splits(8, 8, 16, 8192, dev) == 1  # batches with prefill rows never split


@pytest.mark.parametrize("rule", [pa_mod.SplitRule(6, 64), pa_mod.SplitRule(2, 128)])  # each field moved
def test_a_graph_launch_splits_each_sequence_by_its_own_length(rule):
    """A decode graph is captured for the longest context (max_seq_len = the model's limit) and replayed at any
    lengths: the rule's segment floor, held in the kernel too, gives each sequence the split count the rule gives
    its own length (the segments it does not fill only mark themselves empty). So the graph's launch (more
    segments on the host) and an eager launch sized for these contexts cut every sequence alike: bitwise the
    same output, and the reference's."""
    spec = [(1, 1), (1, 40), (1, 100), (1, 333), (1, 610)]
    batch = make_batch(spec, 4, 2, 64, 16, torch.float32, seed=61)
    dev = torch.device(DEVICE)
    assert pa_mod._auto_num_splits(5, 2, 1, 2048, dev, rule) > pa_mod._auto_num_splits(5, 2, 1, 610, dev, rule) > 1
    outs = []
    for max_seq_len in (2048, 610):
        out = torch.full_like(batch["q"], float("nan"))
        paged_attention(batch["q"], batch["k_cache"], batch["v_cache"], out, batch["query_start_loc"],
                        batch["seq_lens"], batch["block_table"], 64 ** -0.5, 1, max_seq_len, split_rule=rule)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])
    ref = reference_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["query_start_loc"],
                              batch["seq_lens"], batch["block_table"], 64 ** -0.5)
    assert rel_err(outs[0], ref) < 1e-5


def test_every_candidate_rule_splits_a_shorter_context_as_its_own():
    """The invariant behind the graph launch above, for every rule start-up tuning may pick: the segments a
    sequence of c keys fills in a launch split for the longest context C (`SplitRule.segments`, the kernel's
    formula) are the rule's split count for c."""
    for rule in pa_mod.split_rule_candidates():
        for batch in (1, 3, 8, 20, 64, 128, 256):
            for num_sms in (78, 132):
                longest = rule.num_splits(batch, 8, 32768, num_sms)
                for context in (1, 255, 256, 511, 512, 700, 1024, 2047, 2048, 5000, 8192, 32768):
                    filled = rule.segments(longest, context) if longest > 1 else 1
                    assert filled == rule.num_splits(batch, 8, context, num_sms), (rule, batch, context)
    with pytest.raises(ValueError, match="min_keys"):
        pa_mod.SplitRule(6, 0)


# what the policy picks at decode shapes of a 132-SM GPU with Qwen3's 8 kv heads (batch, context): 2, 4, 7, 13
POLICY_SPLITS = sorted({pa_mod.auto_num_splits(b, 8, ctx, 132) for b, ctx in ((64, 8192), (32, 8192), (16, 8192),
                                                                               (8, 8192))})


@pytest.mark.parametrize("num_splits", POLICY_SPLITS)
def test_decode_split_counts_the_policy_picks(num_splits):
    """The split path at each count the policy picks on a GPU (forced here: small shapes, so the interpreter stays
    quick), against the reference: contexts of 1 to ~20 key tiles, so at 7 and 13 splits short sequences leave
    segments empty and long ones cut mid-block; GQA 2 as Qwen3-0.6B (16 q / 8 kv heads, scaled down)."""
    assert num_splits >= 2
    spec = [(1, 1), (1, 40), (1, 333), (1, 610)]
    batch = make_batch(spec, 4, 2, 64, 16, torch.float32, seed=40 + num_splits)
    run_and_check(batch, torch.float32, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_batch_half_precision(dtype, num_splits):
    batch = make_batch(MIXED if num_splits == 1 else MIXED_SMALL, 4, 2, 128, 16, dtype, seed=11)
    run_and_check(batch, dtype, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_sliding_window(num_splits):
    # window 24: decode rows at 100 and 70 see only their last 24 keys; the prefill rows with prefix
    # (q 16 of 60, q 40 of 40) have windows that start mid-tile and mid-block.
    spec = [(1, 100), (1, 70), (16, 60), (40, 40), (1, 5)]
    batch = make_batch(spec, 4, 2, 64, 16, torch.float32, seed=5)
    run_and_check(batch, torch.float32, sliding_window=24, num_splits=num_splits)


@pytest.mark.parametrize("window, num_splits", [(None, 1), (24, 1), (24, 3)])
def test_attention_sinks(window, num_splits):
    """gpt-oss's sinks: each head's logit in every softmax's denominator, with and without a window, split or not
    (split 3 at window 24: the decode row at 100 has no visible key in its first segment, which holds the sink)."""
    spec = [(1, 100), (1, 70), (16, 60), (40, 40), (1, 5)]
    batch = make_batch(spec, 4, 2, 64, 16, torch.float32, seed=6)
    sinks = (torch.randn(4, generator=torch.Generator().manual_seed(3)) * 2 + 1).to(DEVICE)
    out = run_and_check(batch, torch.float32, sliding_window=window, num_splits=num_splits, sinks=sinks)
    without = reference_attention(batch["q"], batch["k_cache"], batch["v_cache"], batch["query_start_loc"],
                                  batch["seq_lens"], batch["block_table"], 64**-0.5, window)
    assert rel_err(out, without) > 0.05  # the sinks change the result: the check above can fail


def test_attention_sinks_half_precision():
    batch = make_batch(MIXED_SMALL, 8, 2, 64, 16, torch.bfloat16, seed=8)
    sinks = torch.linspace(-1.0, 3.0, 8).to(torch.bfloat16).to(DEVICE)
    run_and_check(batch, torch.bfloat16, sliding_window=24, sinks=sinks)


@pytest.mark.parametrize("head_dim", [80, 96])
def test_non_pow2_head_dim(head_dim):
    batch = make_batch(MIXED, 4, 2, head_dim, 16, torch.float32, seed=head_dim)
    run_and_check(batch, torch.float32)


def test_non_pow2_group():
    """GQA 7 (e.g. 28 q / 4 kv heads): 16-row tiles hold 2 tokens x 7 heads, the last 2 rows are padding."""
    batch = make_batch(MIXED, 14, 2, 64, 16, torch.float32, seed=77)
    run_and_check(batch, torch.float32)


def test_small_tiles_many_q_blocks(monkeypatch):
    """16-row / 16-key tiles: with GQA 4 a program holds 4 tokens, so prefill rows span many query
    blocks (exercising the binary search and the surplus-program exit) and contexts span many key tiles
    inside 32-slot blocks; sliding windows then start at many different offsets within a tile. Also: q is a strided view of a packed qkv tensor, and out has padding rows
    past query_start_loc[-1] that must stay untouched."""
    monkeypatch.setattr(pa_mod, "_select_tiles", lambda *args: (16, 16, 4, 2))
    spec = [(1, 40), (33, 70), (1, 1), (9, 9), (2, 34)]
    num_q_heads, num_kv_heads, head_dim = 4, 1, 64  # GQA 4 over one kv head (several kv heads: the tests above)
    batch = make_batch(spec, num_q_heads, num_kv_heads, head_dim, 32, torch.float32, seed=13, q_padding=3)
    num_tokens = batch["q"].shape[0]
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    q_view = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    q_view.copy_(batch["q"])
    batch["q"] = q_view
    assert not q_view.is_contiguous()
    out = torch.full((num_tokens, num_q_heads, head_dim), float("nan"), device=DEVICE)
    n_real = int(batch["query_start_loc"][-1])
    out[n_real:] = 123.0
    # windows 5 and 19 put the first needed key of some query blocks on the last key of a 16-key tile
    for num_splits, window in ((1, None), (3, 19), (2, 5)):
        out[:n_real] = float("nan")
        run_and_check(batch, torch.float32, sliding_window=window, num_splits=num_splits, out=out)
        assert (out[n_real:] == 123.0).all(), "padding rows were written"


@pytest.mark.parametrize("window", [None, 7])
def test_image_runs_see_their_whole_image(monkeypatch, window):
    """Gemma 3's bidirectional image runs (`key_ends`) against the float64 reference's mask: runs at a prompt's start
    and end, mid-chunk after cached context, one whose earlier part is cached, beside a decode and a causal chunk;
    16-row / 16-key tiles (4 tokens a program), so a run crosses query blocks and a block's key range must reach
    its rows' largest key end."""
    monkeypatch.setattr(pa_mod, "_select_tiles", lambda *args: (16, 16, 4, 2))
    spec = [(1, 17), (24, 24), (16, 33), (12, 40), (9, 9)]
    runs = {1: [(0, 5), (15, 24)], 2: [(20, 29)], 3: [(25, 35)]}
    batch = make_batch(spec, 4, 1, 32, 8, torch.float32, seed=5)
    q_lens = [n for n, _ in spec]
    spans = {sum(q_lens[:b]): r for b, r in runs.items()}
    key_ends = torch.from_numpy(image_key_ends(q_lens, [c for _, c in spec], spans)).to(DEVICE)
    q, scale = batch["q"], 32**-0.5
    out = torch.full_like(q, float("nan"))
    paged_attention(q, batch["k_cache"], batch["v_cache"], out, batch["query_start_loc"], batch["seq_lens"],
                    batch["block_table"], scale, batch["max_query_len"], batch["max_seq_len"], sliding_window=window,
                    key_ends=key_ends)
    args = (q, batch["k_cache"], batch["v_cache"], batch["query_start_loc"], batch["seq_lens"], batch["block_table"],
            scale, window)
    ref, causal = reference_attention(*args, images=runs), reference_attention(*args)
    assert (ref - causal).abs().max() > 0.1  # the runs change the result
    assert rel_err(out, ref) < TOL[torch.float32]


def test_store_then_attend():
    """Prefill 20 tokens through store_kv, then a decode step: the engine's real call order."""
    num_q_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    g = torch.Generator().manual_seed(21)
    num_blocks = 6
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(DEVICE)
    block_table = torch.tensor([[4, 1, 3]], dtype=torch.int32, device=DEVICE)
    for start, q_len in ((0, 20), (20, 1)):
        pos = torch.arange(start, start + q_len)
        slots = (block_table[0].cpu()[pos // block_size].long() * block_size + pos % block_size).to(DEVICE)
        key = torch.randn(q_len, num_kv_heads, head_dim, generator=g).to(DEVICE)
        value = torch.randn(q_len, num_kv_heads, head_dim, generator=g).to(DEVICE)
        store_kv(key, value, k_cache, v_cache, slots)
        batch = dict(
            q=torch.randn(q_len, num_q_heads, head_dim, generator=g).to(DEVICE),
            k_cache=k_cache, v_cache=v_cache,
            query_start_loc=torch.tensor([0, q_len], dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor([start + q_len], dtype=torch.int32, device=DEVICE),
            block_table=block_table, max_query_len=q_len, max_seq_len=start + q_len,
        )
        run_and_check(batch, torch.float32)


# ----------------------------------------------------------------------------------------------------
# store_kv
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv(dtype, block_size, head_dim):
    g = torch.Generator().manual_seed(block_size + head_dim)
    num_tokens, num_q_heads, num_kv_heads, num_blocks = 11, 4, 2, 4
    # key/value as strided views of a packed qkv projection, like the model produces them
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=g).to(dtype).to(DEVICE)
    kv = qkv[:, num_q_heads * head_dim :].view(num_tokens, 2 * num_kv_heads, head_dim)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:]
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[2, 5, 6]] = -1  # padding tokens
    slot_mapping = slots.to(DEVICE)

    store_kv(key, value, k_cache, v_cache, slot_mapping)

    k_expect, v_expect = k_before.clone(), v_before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            k_expect[s // block_size, s % block_size] = key[t]
            v_expect[s // block_size, s % block_size] = value[t]
    assert torch.equal(k_cache, k_expect)  # written slots exact, every other slot untouched
    assert torch.equal(v_cache, v_expect)


# ----------------------------------------------------------------------------------------------------
# fp8 (e4m3) KV cache: per-head scales, saturating store, attention dequantises
# ----------------------------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn


def quantize(x, scale):
    """What the cache holds for x [..., Hkv, D] (the torch backend's store, the kernels' reference)."""
    return (x.cpu().float() / scale.cpu()[:, None]).clamp(-448, 448).to(FP8)


def dequantize(x, scale):
    return x.cpu().float() * scale.cpu()[:, None]


def test_store_kv_fp8():
    """Stored bytes equal the torch quantisation (round to nearest even, also under the interpreter, whose own
    fp8 cast is wrong when a mantissa rounds up), out-of-range values saturate, and the other slots stay
    untouched."""
    g = torch.Generator().manual_seed(40)
    num_tokens, num_kv_heads, head_dim, block_size = 9, 2, 64, 8
    key = (torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)
           * torch.logspace(-3, 2, head_dim)).to(DEVICE)  # e4m3's subnormals up to its top binade
    key[0, 0, :3] = torch.tensor([1e4, -1e4, 500.0])  # beyond e4m3's 448 after scaling
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(DEVICE)
    k_scale = torch.tensor([0.5, 2.0], device=DEVICE)
    v_scale = torch.tensor([0.25, 1.5], device=DEVICE)
    k_cache = torch.randn(4, block_size, num_kv_heads, head_dim, generator=g).to(FP8).to(DEVICE)
    v_cache = torch.randn(4, block_size, num_kv_heads, head_dim, generator=g).to(FP8).to(DEVICE)
    before = k_cache.cpu().float().clone()
    slots = torch.randperm(4 * block_size, generator=g)[:num_tokens]
    slots[4] = -1
    store_kv(key, value, k_cache, v_cache, slots.to(DEVICE), k_scale, v_scale)
    written = slots >= 0
    flat_k = k_cache.cpu().float().view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.cpu().float().view(-1, num_kv_heads, head_dim)
    for got, want in ((flat_k[slots[written]], quantize(key, k_scale).float()[written]),
                      (flat_v[slots[written]], quantize(value, v_scale).float()[written])):
        assert torch.isfinite(got).all()
        assert torch.equal(got, want)
    assert flat_k[slots[0], 0, :3].tolist() == [448.0, -448.0, 448.0]  # saturated, not NaN
    untouched = torch.ones(4 * block_size, dtype=torch.bool)
    untouched[slots[written]] = False
    assert torch.equal(flat_k[untouched], before.view(-1, num_kv_heads, head_dim)[untouched])


@pytest.mark.parametrize("dtype, num_splits", [(torch.float32, 1), (torch.bfloat16, 3)])  # each q dtype, each path
def test_attention_fp8_cache(dtype, num_splits):
    """Attention over an fp8 cache with per-head scales equals float64 attention over the dequantised cache."""
    batch = make_batch(MIXED_SMALL, 8, 2, 64, 16, torch.float32, seed=41)
    g = torch.Generator().manual_seed(42)
    k_scale = (torch.rand(2, generator=g) + 0.25).to(DEVICE)
    v_scale = (torch.rand(2, generator=g) + 0.25).to(DEVICE)
    k8, v8 = quantize(batch["k_cache"], k_scale).to(DEVICE), quantize(batch["v_cache"], v_scale).to(DEVICE)
    q = batch["q"].to(dtype)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k8, v8, out, batch["query_start_loc"], batch["seq_lens"], batch["block_table"],
                    64**-0.5, batch["max_query_len"], batch["max_seq_len"], num_splits=num_splits,
                    k_scale=k_scale, v_scale=v_scale)
    ref = reference_attention(q, dequantize(k8, k_scale), dequantize(v8, v_scale), batch["query_start_loc"],
                              batch["seq_lens"], batch["block_table"], 64**-0.5)
    n_real = int(batch["query_start_loc"][-1])
    assert torch.isfinite(out[:n_real]).all()
    err = rel_err(out[:n_real], ref[:n_real])
    assert err < TOL[dtype], f"relative error {err:.3e}"


def test_fp8_cache_needs_its_scales():
    batch = make_batch([(1, 5)], 4, 2, 32, 8, torch.float32)
    k8 = batch["k_cache"].to(FP8)
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention(batch["q"], k8, k8, torch.empty_like(batch["q"]), batch["query_start_loc"], batch["seq_lens"],
                        batch["block_table"], 0.1, 1, 5)


def test_fp8_cache_attention_with_q_beyond_fp16_range():
    """With an fp8 cache the dots run in fp16 (bf16 q converted once): q elements past fp16's range are clamped
    to it, not turned into inf (which would make the row NaN); the result is attention with the clamped q."""
    batch = make_batch(MIXED_SMALL, 8, 2, 64, 16, torch.float32, seed=43)
    scale = torch.ones(2, device=DEVICE)
    k8, v8 = quantize(batch["k_cache"], scale).to(DEVICE), quantize(batch["v_cache"], scale).to(DEVICE)
    q = (batch["q"] * 0.05).to(torch.bfloat16)
    q[0, 0, 0], q[-1, 3, 5] = 3.0e5, -1.0e6  # past fp16's 65504
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k8, v8, out, batch["query_start_loc"], batch["seq_lens"], batch["block_table"],
                    64**-0.5, batch["max_query_len"], batch["max_seq_len"], k_scale=scale, v_scale=scale)
    ref = reference_attention(q.float().clamp(-65504, 65504), dequantize(k8, scale), dequantize(v8, scale),
                              batch["query_start_loc"], batch["seq_lens"], batch["block_table"], 64**-0.5)
    n_real = int(batch["query_start_loc"][-1])
    assert torch.isfinite(out[:n_real]).all()
    assert rel_err(out[:n_real], ref[:n_real]) < TOL[torch.bfloat16]
