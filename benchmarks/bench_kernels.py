"""Benchmark cbatch's Triton kernels on a CUDA GPU (written for H100/H200, torch 2.11, triton 3.6).

    python benchmarks/bench_kernels.py [--out PATH] [--quick] [--sweep-decode-tiles]

Prints (and with --out writes) tables of
  (a) decode paged attention: achieved bandwidth = (K/V bytes read + q/out/metadata bytes) / time, as a
      fraction of the device-to-device copy bandwidth measured here (torch copy_ of a 2 GiB buffer,
      bytes read + written); batch 64/256 x context 512/2048/8192, bf16, Qwen3-0.6B attention shape
      (16 q heads, 8 kv heads, head_dim 128), block size 16, randomly permuted block tables;
      plus a few small-batch long-context rows where split-KV applies (auto vs forced off);
      the same with an fp8 (e4m3) KV cache (half the bytes; per-head scales);
  (b) each fused kernel against the eager PyTorch code it replaces (HF Llama's RMSNorm with residual add,
      rotary embedding, SwiGLU, and the attention prologue: Qwen3's per-head q/k RMSNorm + rotary + KV store
      against both eager torch and the unfused kernels), T = 256 / 4096 tokens, hidden 1024 (Qwen3-0.6B
      shapes) / 4096 (Llama-3-8B shapes), with the speedup;
  (c) sampling 256 and 32 rows x 151,936 vocab (Qwen3): the kernel with the vocabulary split across programs
      (auto, what the engine runs) and with one program per row (--no-split-sampler), against the torch
      sampler, greedy and temperature 0.6; logits bytes / time as a fraction of the copy bandwidth.
Timing: CUDA events around replays of a CUDA graph holding `inner` back-to-back calls (GPU time, no launch
overhead; --no-graphs times plain launches), after warm-up; the median over repeats, per call.
Before timing, decode attention is checked against a float32 PyTorch reference (a wrong kernel is not timed).

Benchmarks this checkout's kernels/ (loaded as `cbatch.kernels`; no install needed).
--cpu-smoke runs every code path on tiny shapes through the Triton interpreter, to check the script itself.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def import_kernels():
    """This checkout's `cbatch.kernels` (the script puts the checkout first on sys.path)."""
    sys.path.insert(0, str(ROOT))
    return importlib.import_module("cbatch.kernels")


# ----------------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------------


USE_GRAPHS = True  # --no-graphs turns this off
DEVICE = "cuda"  # "cpu" only for --cpu-smoke (Triton interpreter, tiny shapes, wall-clock timing)


def time_ms(fn, warmup: int = 5, repeats: int = 30, inner: int = 1, graphs: bool = True) -> float:
    """Median milliseconds per call of fn().

    `inner` back-to-back calls are captured in one CUDA graph and its replays are timed with CUDA events,
    so the numbers are GPU time without Python/launch overhead (what a graph-captured engine step sees;
    eager PyTorch's many small launches would otherwise be charged CPU time). Falls back to timing plain
    calls if capture fails or --no-graphs is given.
    """
    if DEVICE == "cpu":  # --cpu-smoke: plumbing check only, the numbers mean nothing
        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(warmup):  # compiles the Triton kernels outside the capture
        fn()
    torch.cuda.synchronize()
    run = None
    if USE_GRAPHS and graphs:
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(inner):
                    fn()
            run = graph.replay
            run()
        except Exception as err:  # noqa: BLE001 - any capture problem: time eagerly instead
            print(f"  (graph capture failed: {type(err).__name__}: {err}; timing plain launches)", flush=True)
            torch.cuda.synchronize()
            run = None
    if run is None:
        def run():
            for _ in range(inner):
                fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


def inner_for(est_bytes: int, copy_bw: float) -> int:
    """Enough back-to-back calls that one timed region lasts >= ~0.5 ms (launch jitter stays small)."""
    est_ms = est_bytes / copy_bw * 1e3
    return max(1, min(200, math.ceil(0.5 / max(est_ms, 1e-4))))


def copy_bandwidth(gib: float = 2.0) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    if DEVICE == "cpu":
        gib = 1 / 64
    n = int(gib * 2**30) // 4
    src = torch.randn(n, device=DEVICE)
    dst = torch.empty_like(src)
    # plain launches: inside a CUDA graph the copy becomes a memcpy node run by the copy engines (2.7 TB/s on an
    # H200 against 4.2 for the eager copy's kernel), which is not the rate a kernel can stream at
    ms = time_ms(lambda: dst.copy_(src), warmup=3, repeats=20, graphs=False)
    return 2 * n * 4 / (ms * 1e-3)  # the buffers are freed on return


# ----------------------------------------------------------------------------------------------------
# (a) decode paged attention
# ----------------------------------------------------------------------------------------------------

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 16, 8, 128, 16  # Qwen3-0.6B attention


def make_decode_batch(batch: int, ctx: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = batch * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype, generator=g)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(num_blocks, device=DEVICE, generator=g).to(torch.int32)
    block_table = perm.view(batch, blocks_per_seq).contiguous()  # non-contiguous physical placement
    q = torch.randn(batch, NUM_Q_HEADS, HEAD_DIM, device=DEVICE, dtype=dtype, generator=g)
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, out=torch.empty_like(q),
        query_start_loc=torch.arange(batch + 1, device=DEVICE, dtype=torch.int32),
        seq_lens=torch.full((batch,), ctx, device=DEVICE, dtype=torch.int32),
        block_table=block_table, scale=HEAD_DIM ** -0.5, max_query_len=1, max_seq_len=ctx,
    )


def to_fp8(b) -> dict:
    """The batch with its caches in e4m3 and per-head scales (1 byte per K/V element)."""
    scale = (torch.rand(NUM_KV_HEADS, device=DEVICE) + 0.5)
    return dict(b, k_cache=(b["k_cache"].float() / scale[:, None]).to(torch.float8_e4m3fn),
                v_cache=(b["v_cache"].float() / scale[:, None]).to(torch.float8_e4m3fn), k_scale=scale, v_scale=scale)


def decode_bytes(batch: int, ctx: int, elem: int = 2, kv_elem: int | None = None) -> int:
    kv = 2 * batch * ctx * NUM_KV_HEADS * HEAD_DIM * (kv_elem or elem)  # every K and V element read once
    q_out = 2 * batch * NUM_Q_HEADS * HEAD_DIM * elem
    meta = batch * (-(-ctx // BLOCK_SIZE)) * 4 + batch * 4 * 2  # block table, seq_lens, query_start_loc
    return kv + q_out + meta


def reference_decode(b) -> torch.Tensor:
    """float32 PyTorch decode attention over the paged cache (gathers each sequence's blocks)."""
    batch = b["q"].shape[0]
    group = NUM_Q_HEADS // NUM_KV_HEADS
    out = torch.empty(batch, NUM_Q_HEADS, HEAD_DIM, device=DEVICE, dtype=torch.float32)
    for i in range(batch):
        ctx = int(b["seq_lens"][i])
        blocks = b["block_table"][i, : -(-ctx // BLOCK_SIZE)].long()
        k_scale = b.get("k_scale", torch.ones(NUM_KV_HEADS, device=DEVICE))[:, None]
        v_scale = b.get("v_scale", torch.ones(NUM_KV_HEADS, device=DEVICE))[:, None]
        k = (b["k_cache"][blocks].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:ctx].float() * k_scale).repeat_interleave(group, 1)
        v = (b["v_cache"][blocks].reshape(-1, NUM_KV_HEADS, HEAD_DIM)[:ctx].float() * v_scale).repeat_interleave(group, 1)
        s = torch.einsum("hd,khd->hk", b["q"][i].float(), k) * b["scale"]
        out[i] = torch.einsum("hk,khd->hd", s.softmax(-1), v)
    return out


def run_attention(kernels, b, num_splits=None):
    return kernels.paged_attention(
        b["q"], b["k_cache"], b["v_cache"], b["out"], b["query_start_loc"], b["seq_lens"], b["block_table"],
        b["scale"], b["max_query_len"], b["max_seq_len"], num_splits=num_splits,
        k_scale=b.get("k_scale"), v_scale=b.get("v_scale"),
    )


def check_decode(kernels):
    cases = ((4, 1000, None, False), (4, 1000, 1, True), (4, 1000, 3, False), (3, 37, None, True), (4, 1000, 3, True))
    for batch, ctx, splits, fp8 in cases[: 2 if DEVICE == "cpu" else len(cases)]:
        b = make_decode_batch(batch, ctx, seed=batch + ctx)
        if fp8:
            b = to_fp8(b)
        b["seq_lens"] = torch.randint(1, ctx + 1, (batch,), device=DEVICE, dtype=torch.int32)
        b["out"].fill_(float("nan"))
        out = run_attention(kernels, b, splits).float()
        ref = reference_decode(b)
        err = ((out - ref).norm() / ref.norm()).item()
        if not torch.isfinite(out).all() or err > 1e-2:
            raise SystemExit(f"decode attention is wrong (batch {batch}, ctx {ctx}, splits {splits}, fp8 {fp8}): "
                             f"rel err {err:.3e}; not timing it")


def bench_decode(kernels, copy_bw, configs, rows, kv_elem: int = 2):
    pa_mod = importlib.import_module("cbatch.kernels.paged_attention")
    dev = torch.device(DEVICE)

    def timed(batch, ctx, splits):  # own scope, so each configuration's cache is freed before the next
        b = make_decode_batch(batch, ctx)
        if kv_elem == 1:
            b = to_fp8(b)
        return time_ms(lambda: run_attention(kernels, b, splits), inner=inner_for(decode_bytes(batch, ctx), copy_bw))

    for batch, ctx, splits in configs:
        nbytes = decode_bytes(batch, ctx, kv_elem=kv_elem)
        ms = timed(batch, ctx, splits)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        used = splits if splits is not None else pa_mod._auto_num_splits(batch, NUM_KV_HEADS, 1, ctx, dev)
        bw = nbytes / (ms * 1e-3)
        rows.append([f"{batch}", f"{ctx}", f"{used}{'' if splits is None else ' (forced)'}",
                     f"{nbytes / 1e6:.1f}", f"{ms * 1e3:.1f}", f"{nbytes / copy_bw * 1e6:.1f}",
                     f"{bw / 1e12:.2f}", f"{bw / copy_bw:.2f}"])


def sweep_decode_tiles(kernels, copy_bw, rows, shapes=((256, 2048, 2), (256, 2048, 1), (64, 1024, 2)),
                       tiles=(32, 64, 128), warps=(4, 8), stages=(2, 3, 4)):
    """Other (TILE_N, num_warps, num_stages) for decode, by overriding the tile policy; (batch, ctx, KV bytes
    per element) per shape. The policy's own choice is marked '*'."""
    pa_mod = importlib.import_module("cbatch.kernels.paged_attention")
    original = pa_mod._select_tiles
    try:
        for batch, ctx, kv_elem in shapes:
            b = make_decode_batch(batch, ctx)
            if kv_elem == 1:
                b = to_fp8(b)
            nbytes = decode_bytes(batch, ctx, kv_elem=kv_elem)
            _, own_tile, own_warps, own_stages = original(128, NUM_Q_HEADS // NUM_KV_HEADS, 1, False, kv_elem == 1)
            for tile_n in tiles:
                for num_warps in warps:
                    for num_stages in stages:
                        def policy(head_dim_pad, group, max_query_len, is_fp32=False, kv_scaled=False, tile_n=tile_n,
                                   num_warps=num_warps, num_stages=num_stages):
                            block_m = original(head_dim_pad, group, max_query_len, is_fp32, kv_scaled)[0]
                            return block_m, tile_n, num_warps, num_stages
                        pa_mod._select_tiles = policy
                        mark = "*" if (tile_n, num_warps, num_stages) == (own_tile, own_warps, own_stages) else ""
                        shape = [f"{batch}", f"{ctx}", "fp8" if kv_elem == 1 else "bf16", f"{tile_n}{mark}",
                                 f"{num_warps}", f"{num_stages}"]
                        try:
                            ms = time_ms(lambda: run_attention(kernels, b), inner=inner_for(nbytes, copy_bw))
                        except Exception as err:  # e.g. out of shared memory for a large tile
                            rows.append(shape + ["failed", type(err).__name__, ""])
                            continue
                        bw = nbytes / (ms * 1e-3)
                        rows.append(shape + [f"{ms * 1e3:.1f}", f"{bw / 1e12:.2f}", f"{bw / copy_bw:.2f}"])
            del b
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    finally:
        pa_mod._select_tiles = original


# ----------------------------------------------------------------------------------------------------
# (b) fused kernels vs eager
# ----------------------------------------------------------------------------------------------------

# hidden -> (num_q_heads, num_kv_heads, head_dim, intermediate): Qwen3-0.6B and Llama-3-8B
MODEL_SHAPES = {1024: (16, 8, 128, 3072), 4096: (32, 8, 128, 14336)}


def eager_add_rms_norm(x, residual, weight, eps):
    """HF: hidden = residual + hidden; LlamaRMSNorm(hidden)."""
    h = x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * hf.to(x.dtype), h


def eager_rotary(q, k, cos, sin):
    """HF apply_rotary_pos_emb with cos/sin already gathered per token and cast (the model does that
    once per forward, not per layer); returns new q, k like HF does."""
    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def eager_silu_and_mul(x):
    inter = x.shape[-1] // 2
    return torch.nn.functional.silu(x[:, :inter]) * x[:, inter:]


def bench_fused(kernels, copy_bw, token_counts, hiddens, rows):
    dtype, eps, elem = torch.bfloat16, 1e-6, 2
    for hidden in hiddens:
        num_q_heads, num_kv_heads, head_dim, inter = MODEL_SHAPES[hidden]
        for tokens in token_counts:
            g = torch.Generator(device=DEVICE).manual_seed(tokens + hidden)
            rnd = lambda *shape: torch.randn(*shape, device=DEVICE, dtype=dtype, generator=g)  # noqa: E731

            # RMSNorm + residual: read x, residual, weight; write out, new residual
            x, res, w = rnd(tokens, hidden), rnd(tokens, hidden), rnd(hidden)
            nbytes = (4 * tokens * hidden + hidden) * elem
            k_out, k_res = kernels.fused_add_rms_norm(x, res, w, eps)
            e_out, e_res = eager_add_rms_norm(x, res, w, eps)
            check_close("add+rms_norm out", k_out, e_out)
            check_close("add+rms_norm residual", k_res, e_res)
            add_row(rows, "add+rms_norm", tokens, hidden, nbytes, copy_bw,
                    lambda: kernels.fused_add_rms_norm(x, res, w, eps),
                    lambda: eager_add_rms_norm(x, res, w, eps))

            # rotary on q and k, views of a packed qkv projection (in place; the eager version allocates)
            qkv = rnd(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim)
            q = qkv[:, : num_q_heads * head_dim].view(tokens, num_q_heads, head_dim)
            k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
            positions = torch.randint(0, 8192, (tokens,), device=DEVICE, generator=g)
            inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
            freqs = torch.outer(torch.arange(8192, device=DEVICE).float(), inv_freq)
            cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)  # [max_pos, head_dim] fp32
            half = head_dim // 2
            cos = cos_sin[positions, :half].repeat(1, 2).to(dtype)[:, None, :]
            sin = cos_sin[positions, half:].repeat(1, 2).to(dtype)[:, None, :]
            nbytes = 2 * tokens * (num_q_heads + num_kv_heads) * head_dim * elem + tokens * (8 + head_dim * 4)
            q_ref, k_ref = eager_rotary(q, k, cos, sin)
            kernels.apply_rotary(q, k, positions, cos_sin)  # in place; the timed calls keep rotating
            check_close("rotary q", q, q_ref)
            check_close("rotary k", k, k_ref)
            add_row(rows, "rotary q+k", tokens, hidden, nbytes, copy_bw,
                    lambda: kernels.apply_rotary(q, k, positions, cos_sin),
                    lambda: eager_rotary(q, k, cos, sin))

            # SwiGLU: read [T, 2I], write [T, I]
            xg = rnd(tokens, 2 * inter)
            nbytes = 3 * tokens * inter * elem
            check_close("silu_and_mul", kernels.silu_and_mul(xg), eager_silu_and_mul(xg))
            add_row(rows, f"silu_and_mul (I={inter})", tokens, hidden, nbytes, copy_bw,
                    lambda: kernels.silu_and_mul(xg), lambda: eager_silu_and_mul(xg))


def eager_prologue(qkv, heads, q_w, k_w, cos, sin, k_cache, v_cache, slots, eps):
    """The attention prologue as eager torch runs it: split, per-head RMSNorm on q and k (Qwen3), rotary,
    the K/V store (index_copy_ into the paged cache)."""
    num_q_heads, num_kv_heads, head_dim = heads
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q = eager_add_rms_norm(q.reshape(-1, num_q_heads, head_dim), 0, q_w, eps)[0]
    k = eager_add_rms_norm(k.reshape(-1, num_kv_heads, head_dim), 0, k_w, eps)[0]
    q, k = eager_rotary(q, k, cos, sin)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v.reshape(-1, num_kv_heads, head_dim))
    return q


def unfused_prologue(kernels, qkv, heads, q_w, k_w, positions, cos_sin, k_cache, v_cache, slots, eps):
    """The same through the unfused kernels: rms_norm on q, on k (copies: strided heads), rotary, store_kv."""
    num_q_heads, num_kv_heads, head_dim = heads
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q = kernels.rms_norm(q.reshape(-1, head_dim), q_w, eps).view(-1, num_q_heads, head_dim)
    k = kernels.rms_norm(k.reshape(-1, head_dim), k_w, eps).view(-1, num_kv_heads, head_dim)
    kernels.apply_rotary(q, k, positions, cos_sin)
    kernels.store_kv(k, v.view(-1, num_kv_heads, head_dim), k_cache, v_cache, slots)
    return q


def bench_prologue(kernels, copy_bw, token_counts, rows):
    """Qwen3-0.6B's attention prologue: fused kernel vs the unfused kernels vs eager torch."""
    dtype, eps = torch.bfloat16, 1e-6
    num_q_heads, num_kv_heads, head_dim, _ = MODEL_SHAPES[1024]
    heads = (num_q_heads, num_kv_heads, head_dim)
    for tokens in token_counts:
        g = torch.Generator(device=DEVICE).manual_seed(tokens)
        qkv = torch.randn(tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, device=DEVICE, dtype=dtype, generator=g)
        q_w, k_w = (torch.rand(head_dim, device=DEVICE, generator=g).to(dtype) + 0.5 for _ in range(2))
        cache_blocks = -(-tokens // BLOCK_SIZE) + 1
        k_cache = torch.zeros(cache_blocks, BLOCK_SIZE, num_kv_heads, head_dim, device=DEVICE, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        slots = torch.randperm(cache_blocks * BLOCK_SIZE, device=DEVICE, generator=g)[:tokens]
        positions = torch.randint(0, 8192, (tokens,), device=DEVICE, generator=g)
        inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
        freqs = torch.outer(torch.arange(8192, device=DEVICE).float(), inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], -1)
        half = head_dim // 2
        cos = cos_sin[positions, :half].repeat(1, 2).to(dtype)[:, None, :]
        sin = cos_sin[positions, half:].repeat(1, 2).to(dtype)[:, None, :]
        fused = lambda: kernels.norm_rope_store(qkv, num_q_heads, num_kv_heads, positions,  # noqa: E731
                                                cos_sin, k_cache, v_cache, slots, q_w, k_w, eps)
        check_close("norm_rope_store q", kernels.norm_rope_store(qkv.clone(), num_q_heads, num_kv_heads, positions,
                                                                 cos_sin, k_cache, v_cache, slots, q_w, k_w, eps),
                    eager_prologue(qkv.clone(), heads, q_w, k_w, cos, sin, k_cache.clone(), v_cache.clone(), slots, eps),
                    tol=3e-2)  # three bf16 roundings in series (norm, weight, rotary); ~1e-3 on a GPU
        # reads qkv once, writes q back and k, v into the cache
        nbytes = tokens * ((num_q_heads + 2 * num_kv_heads) * head_dim * 2 + (num_q_heads + 2 * num_kv_heads) * head_dim * 2)
        unfused = lambda: unfused_prologue(kernels, qkv, heads, q_w, k_w, positions, cos_sin, k_cache, v_cache, slots, eps)  # noqa: E731
        eager = lambda: eager_prologue(qkv, heads, q_w, k_w, cos, sin, k_cache, v_cache, slots, eps)  # noqa: E731
        add_row(rows, "q/k norm+rotary+store vs eager", tokens, 1024, nbytes, copy_bw, fused, eager)
        add_row(rows, "  ... vs unfused kernels", tokens, 1024, nbytes, copy_bw, fused, unfused)


def bench_sampling(kernels, rows, copy_bw: float, batches: tuple[int, ...], vocab: int):
    """The sampling kernel with each row's vocabulary split across programs (auto: ~4 programs per SM; what the
    engine runs) and with one program per row (--no-split-sampler), against the torch sampler (greedy argmax /
    temperature 0.6 with the seeded noise). The split and unsplit tokens must be identical."""
    from cbatch.engine.sampler import SamplingBatch, sample
    from cbatch.kernels.sampler import auto_num_splits

    g = torch.Generator(device=DEVICE).manual_seed(1)
    for num_rows in batches:
        logits = torch.randn(num_rows, vocab, device=DEVICE, generator=g) * 3
        splits = auto_num_splits(num_rows, vocab, logits.device)
        for label, temp in (("greedy", 0.0), ("temperature 0.6", 0.6)):
            batch = SamplingBatch([temp] * num_rows, [1.0] * num_rows, [0] * num_rows, list(range(num_rows)), [5] * num_rows)
            temps = torch.full((num_rows,), temp, device=DEVICE)
            seeds = torch.arange(num_rows, device=DEVICE)
            positions = torch.full((num_rows,), 5, device=DEVICE, dtype=torch.int64)
            got = kernels.fused_sample(logits, temps, seeds, positions)
            unsplit = kernels.fused_sample(logits, temps, seeds, positions, num_splits=1)
            if not torch.equal(got, unsplit):
                raise SystemExit(f"sampler ({label}, {num_rows} rows): {splits} splits and one program per row differ")
            want = sample(logits, batch)
            same = (got == want).float().mean().item()
            if same < 0.99:
                raise SystemExit(f"fused sampler ({label}) agrees with the torch sampler on only {same:.1%} of rows")
            t_split = time_ms(lambda: kernels.fused_sample(logits, temps, seeds, positions))
            t_one = time_ms(lambda: kernels.fused_sample(logits, temps, seeds, positions, num_splits=1))
            t_torch = (time_ms(lambda: sample(logits, batch)) if temp == 0 or DEVICE == "cpu"
                       else _time_eager(lambda: sample(logits, batch)))
            nbytes = num_rows * vocab * 4
            rows.append([label, f"{num_rows}", f"{vocab}", f"{splits}", f"{nbytes / 1e6:.1f}", f"{t_torch * 1e3:.1f}",
                         f"{t_one * 1e3:.1f}", f"{t_split * 1e3:.1f}", f"{t_one / t_split:.2f}x",
                         f"{nbytes / (t_split * 1e-3) / copy_bw:.0%}", f"{t_torch / t_split:.2f}x", f"{same:.1%}"])


def _time_eager(fn, repeats: int = 10) -> float:
    """ms per call of code that cannot be graph-captured (the torch sampler builds tensors from host lists)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def check_close(what, out, ref, tol=1e-2):
    """Refuse to time a kernel whose output is not the eager one (relative L2 error, no NaN)."""
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    if not torch.isfinite(out).all() or err > tol:
        raise SystemExit(f"{what}: kernel output differs from eager PyTorch (rel err {err:.3e}); not timing it")


def add_row(rows, name, tokens, hidden, nbytes, copy_bw, fused, eager):
    inner = inner_for(nbytes, copy_bw)
    t_fused = time_ms(fused, inner=inner)
    t_eager = time_ms(eager, inner=inner)
    rows.append([name, f"{tokens}", f"{hidden}", f"{nbytes / 1e6:.2f}", f"{t_eager * 1e3:.1f}", f"{t_fused * 1e3:.1f}",
                 f"{t_eager / t_fused:.2f}x", f"{nbytes / (t_fused * 1e-3) / copy_bw:.2f}"])


# ----------------------------------------------------------------------------------------------------


def format_table(title, header, rows):
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([title, line(header), line(["-" * w for w in widths]), *map(line, rows), ""])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    parser.add_argument("--quick", action="store_true", help="fewer configurations (smoke run)")
    parser.add_argument("--no-graphs", action="store_true",
                        help="time plain launches instead of CUDA-graph replays (includes launch overhead)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run tiny shapes on the CPU through the Triton interpreter (checks the script only)")
    parser.add_argument("--no-fused", action="store_true", help="skip table (b), the fused kernels against eager")
    parser.add_argument("--sweep-decode-tiles", action="store_true",
                        help="also time decode at batch 256 / ctx 2048 for other TILE_N / num_warps")
    return parser


def main() -> int:
    args = _parser().parse_args()

    global DEVICE, USE_GRAPHS
    USE_GRAPHS = not args.no_graphs
    if args.cpu_smoke:
        # Exercise every code path of this script on tiny shapes through Triton's interpreter, so the
        # script's own bugs surface before a GPU lease is spent on it.
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU: torch.cuda.is_available() is False on this machine. "
              "(For CPU correctness runs use the tests under TRITON_INTERPRET=1, or --cpu-smoke to check "
              "this script's plumbing.)", file=sys.stderr)
        return 2

    kernels = import_kernels()
    import triton

    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        dev_desc = f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
    else:
        dev_desc = "CPU through the Triton interpreter (--cpu-smoke: timings are meaningless)"
    timing_desc = "wall clock" if DEVICE == "cpu" else ("CUDA-graph replays" if USE_GRAPHS else "plain launches")
    head = (f"device: {dev_desc}; torch {torch.__version__}, triton {triton.__version__}; "
            f"times: median per call, {timing_desc}; "
            f"kernels from {Path(kernels.__file__).parent}")
    print(head, flush=True)
    copy_bw = copy_bandwidth()
    head += f"\ndevice-to-device copy bandwidth (read + write): {copy_bw / 1e12:.2f} TB/s\n"
    print(head.splitlines()[-1], flush=True)

    check_decode(kernels)
    print("decode attention matches the float32 reference; timing", flush=True)

    out = [head]
    rows = []
    if args.cpu_smoke:
        configs = [(2, 40, None), (2, 1100, None), (2, 1100, 1)]
    elif args.quick:
        # 64 x 8192 split (policy: 2 segments, 3.9 programs per SM) and forced unsplit: the split policy's gain
        configs = [(64, 512, None), (256, 2048, None), (64, 8192, None), (64, 8192, 1), (8, 8192, None), (8, 8192, 1)]
    else:
        configs = [(bs, ctx, None) for bs in (64, 256) for ctx in (512, 2048, 8192)]
        configs += [(64, 8192, 1), (8, 8192, None), (8, 8192, 1), (16, 4096, None), (16, 4096, 1)]
    bench_decode(kernels, copy_bw, configs, rows)
    out.append(format_table(
        f"(a) decode paged attention, bf16, {NUM_Q_HEADS} q / {NUM_KV_HEADS} kv heads x {HEAD_DIM}, block {BLOCK_SIZE}",
        ["batch", "ctx", "splits", "MB moved", "time us", "floor us", "TB/s", "of copy BW"], rows))
    print(out[-1], flush=True)
    rows = []
    fp8_configs = configs[:2] if args.cpu_smoke else [(256, 2048, None), (64, 8192, None), (256, 8192, None)]
    bench_decode(kernels, copy_bw, fp8_configs, rows, kv_elem=1)
    out.append(format_table("(a') decode paged attention, bf16 q, fp8 (e4m3) KV cache with per-head scales",
                            ["batch", "ctx", "splits", "MB moved", "time us", "floor us", "TB/s", "of copy BW"], rows))
    print(out[-1], flush=True)

    if args.sweep_decode_tiles:
        rows = []
        if args.cpu_smoke:
            sweep_decode_tiles(kernels, copy_bw, rows, shapes=((2, 40, 2), (2, 40, 1)), tiles=(16,), warps=(4,),
                               stages=(2, 3))
        else:
            sweep_decode_tiles(kernels, copy_bw, rows)
        out.append(format_table("decode tile sweep (* = the policy's choice)",
                                ["batch", "ctx", "KV", "TILE_N", "warps", "stages", "time us", "TB/s", "of copy BW"],
                                rows))
        print(out[-1], flush=True)

    if not args.no_fused:
        rows = []
        if args.cpu_smoke:
            bench_fused(kernels, copy_bw, (3,), (1024,), rows)
        else:
            bench_fused(kernels, copy_bw, (256,) if args.quick else (256, 4096), (1024, 4096), rows)
        bench_prologue(kernels, copy_bw, (3,) if args.cpu_smoke else (256, 1024, 4096), rows)
        out.append(format_table(
            "(b) fused kernels vs eager PyTorch, bf16 (MB = minimal bytes the fused kernel must move)",
            ["kernel", "tokens", "hidden", "MB", "eager us", "fused us", "speedup", "fused of copy BW"], rows))
        print(out[-1], flush=True)
    rows = []
    bench_sampling(kernels, rows, copy_bw, *(((4,), 3000) if args.cpu_smoke else ((256, 32), 151936)))
    out.append(format_table("(c) sampling kernel (float32 logits): vocabulary split across programs (auto) vs one "
                            "program per row (--no-split-sampler) vs the torch sampler",
                            ["mode", "rows", "vocab", "splits", "MB logits", "torch us", "1 prog/row us", "split us",
                             "split gain", "split of copy BW", "vs torch", "same as torch"], rows))
    print(out[-1], flush=True)

    write_tables(args.out, out)
    return 0


def write_tables(path: Path | None, tables: list[str]) -> None:
    """The printed tables, also into `path` (--out), if given."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(tables))
        print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
