"""The kernels the newer families need, against float64 references on random inputs: the fused-MoE
grouped GEMMs (8/64 experts, top-1/2/8, experts without tokens, FP8 experts, gpt-oss's MXFP4 experts), FP8 weight-only matmul
(per-channel and block scales), Gemma's (1 + w) RMSNorm and GELU-tanh, partial rotary, attention
soft-capping. Under Triton's interpreter when there is no GPU."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from cbatch.kernels import apply_rotary, fp8_linear, fused_add_rms_norm, fused_moe, gelu_tanh_and_mul, rms_norm  # noqa: E402
from cbatch.kernels.grouped_gemm import sort_by_expert  # noqa: E402
from cbatch.model.backend import TorchBackend  # noqa: E402
from cbatch.model.quant import FP8_DTYPE, dequantize  # noqa: E402

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "cuda"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def rel_err(out, ref) -> float:
    ref = ref.cpu().double()
    return ((out.cpu().double() - ref).norm() / ref.norm()).item()


def quantize(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (fp8, float32 scales [..., N] per channel or [..., N/bn, K/bk] per block)."""
    if block is None:
        scale = w.abs().amax(-1) / 448.0
        return (w / scale[..., None]).to(FP8_DTYPE), scale
    bn, bk = block
    n, k = w.shape[-2:]
    padded = torch.nn.functional.pad(w.abs(), (0, -k % bk, 0, -n % bn))
    tiles = padded.unflatten(-1, (-1, bk)).unflatten(-3, (-1, bn))  # [..., N/bn, bn, K/bk, bk]
    scale = tiles.amax(dim=(-3, -1)) / 448.0
    full = scale.repeat_interleave(bn, -2)[..., :n, :].repeat_interleave(bk, -1)[..., :k]
    return (w / full).to(FP8_DTYPE), scale


def moe_reference(x, w13, w2, weights, ids, activation="silu"):
    """float64: out[t] = sum_j weights[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)), e = ids[t, j]."""
    x, w13, w2, weights = (t.cpu().double() for t in (x, w13, w2, weights))
    inter = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate_up = w13[e] @ x[t]
            gate, up = gate_up[:inter], gate_up[inter:]
            act = torch.nn.functional.silu(gate) if activation == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
            out[t] += weights[t, j] * (w2[e] @ (act * up))
    return out


def route(num_tokens, num_experts, top_k, seed, unused=()):
    logits = randn(num_tokens, num_experts, seed=seed)
    logits[:, list(unused)] = -1e9  # experts no token picks
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    return weights, ids


@pytest.mark.parametrize("num_experts, top_k, num_tokens, dtype", [
    (8, 1, 7, torch.float32), (8, 1, 7, torch.bfloat16), (8, 2, 40, torch.float32), (8, 2, 40, torch.bfloat16),
    (64, 8, 5, torch.float32), (64, 8, 5, torch.bfloat16),
    (8, 2, 260, torch.float32),  # over 64 rows per expert: the 64-row blocks
])
def test_fused_moe_matches_float64(num_experts, top_k, num_tokens, dtype):
    hidden, inter = 48, 40  # not powers of two: masked tiles
    x = randn(num_tokens, hidden, dtype=dtype, seed=1)
    w13 = randn(num_experts, 2 * inter, hidden, dtype=dtype, seed=2, scale=0.2)
    w2 = randn(num_experts, hidden, inter, dtype=dtype, seed=3, scale=0.2)
    weights, ids = route(num_tokens, num_experts, top_k, seed=4, unused=(3,))
    counts = torch.bincount(ids.flatten(), minlength=num_experts)
    assert counts[3] == 0 and (counts == 0).sum() >= 1  # some experts get no token
    activation = "gelu_tanh" if top_k == 2 else "silu"
    out = fused_moe(x, w13, w2, weights, ids, activation)
    assert out.dtype == dtype and out.shape == x.shape
    assert rel_err(out, moe_reference(x, w13, w2, weights, ids, activation)) < TOL[dtype]


@pytest.mark.parametrize("block", [None, (16, 32)])
def test_fused_moe_fp8_experts(block):
    """FP8 experts (per channel, or per 16 x 32 block with partial blocks) equal the float64 MoE of
    their dequantized weights, and the torch backend's grouped path agrees."""
    num_experts, top_k, hidden, inter = 8, 2, 48, 40
    x = randn(9, hidden, seed=5)
    w13, s13 = quantize(randn(num_experts, 2 * inter, hidden, seed=6, scale=0.2), block)
    w2, s2 = quantize(randn(num_experts, hidden, inter, seed=7, scale=0.2), block)
    weights, ids = route(9, num_experts, top_k, seed=8)
    out = fused_moe(x, w13, w2, weights, ids, "silu", s13, s2, block)
    ref = moe_reference(x, dequantize(w13, s13, block, torch.float64), dequantize(w2, s2, block, torch.float64), weights, ids)
    assert rel_err(out, ref) < 1e-5
    torch_out = TorchBackend().fused_moe(x.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu(), "silu", s13.cpu(), s2.cpu(), block)
    assert rel_err(torch_out, ref) < 1e-5


def test_fused_moe_mxfp4_experts():
    """gpt-oss's experts as its checkpoints store them: MXFP4 (e2m1 pairs + e8m0 scales, decoded in the GEMM's
    registers), per-expert biases and the clamped SwiGLU, against the torch backend on the dequantized weights."""
    from cbatch.model.backend.clamped_swiglu import ClampedSwiGLU
    from cbatch.model.mxfp4 import dequantize_mxfp4

    num_experts, top_k, hidden, inter = 8, 2, 64, 32
    g = torch.Generator().manual_seed(9)

    def mxfp4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # scales 2 ** -6 .. 2 ** -2: values <= 1.5
        return (torch.randint(0, 256, (num_experts, n, k // 32, 16), generator=g, dtype=torch.uint8),
                torch.randint(121, 126, (num_experts, n, k // 32), generator=g, dtype=torch.uint8))

    (w13, s13), (w2, s2) = mxfp4(2 * inter, hidden), mxfp4(hidden, inter)
    b13, b2 = randn(num_experts, 2 * inter, seed=10, scale=0.3), randn(num_experts, hidden, seed=11, scale=0.3)
    x = randn(11, hidden, seed=12)
    weights, ids = route(11, num_experts, top_k, seed=13, unused=(4,))
    act = ClampedSwiGLU(alpha=1.702, limit=1.5)
    on = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    out = fused_moe(x, *on(w13, w2), weights, ids, act, *on(s13, s2), w13_bias=b13, w2_bias=b2)
    dense13, dense2 = dequantize_mxfp4(w13, s13), dequantize_mxfp4(w2, s2)
    ref = TorchBackend().fused_moe(x.cpu(), dense13, dense2, weights.cpu(), ids.cpu(), act, w13_bias=b13.cpu(),
                                   w2_bias=b2.cpu())
    assert ref.abs().mean() > 0.1 and (dense13 != 0).float().mean() > 0.8
    assert rel_err(out, ref) < 1e-5
    kept = TorchBackend().fused_moe(x.cpu(), w13, w2, weights.cpu(), ids.cpu(), act, s13, s2, w13_bias=b13.cpu(),
                                    w2_bias=b2.cpu())
    assert torch.equal(kept, ref)  # the torch reference dequantizes MXFP4 experts the same way


@pytest.mark.parametrize("ranks", [2, 4])
def test_expert_parallel_slots_of_each_ranks_experts_add_up_to_fused_moe(ranks):
    """--expert-parallel: each rank's `fused_moe_slots` over its experts alone (the other slots zero, never
    computed) summed over the ranks, then over a token's slots, is bitwise the one-rank fused MoE, in the Triton
    kernels and in the torch backend."""
    from cbatch.kernels.grouped_gemm import fused_moe_slots

    num_experts, top_k, hidden, inter = 8, 2, 48, 40
    x = randn(11, hidden, seed=9)
    w13, w2 = randn(num_experts, 2 * inter, hidden, seed=10, scale=0.2), randn(num_experts, hidden, inter, seed=11, scale=0.2)
    weights, ids = route(11, num_experts, top_k, seed=12, unused=(6,))
    per = num_experts // ranks
    for moe, slots_of, args in ((fused_moe, fused_moe_slots, (x, w13, w2, weights, ids)),
                                (TorchBackend().fused_moe, TorchBackend().fused_moe_slots,
                                 tuple(t.cpu() for t in (x, w13, w2, weights, ids)))):
        xs, w13s, w2s, ws, ids_ = args
        shares = [slots_of(xs, w13s[r * per : (r + 1) * per], w2s[r * per : (r + 1) * per], ws, ids_, "silu",
                           first_expert=r * per) for r in range(ranks)]
        assert all(bool((share != 0).any()) for share in shares)  # every rank computes some slots
        assert all(int(((share != 0).any(-1)).sum()) < ids.numel() for share in shares)  # and not all of them
        assert torch.equal(sum(shares).sum(dim=1), moe(xs, w13s, w2s, ws, ids_, "silu"))


def test_sort_by_expert_groups_every_assignment_once():
    ids = torch.tensor([[5, 0], [5, 2], [0, 5], [7, 2]], device=DEVICE)
    sorted_ids, block_expert, used = sort_by_expert(ids, num_experts=8, block_m=4)
    flat = ids.flatten().cpu()
    sorted_ids, block_expert = sorted_ids.cpu(), block_expert.cpu()
    assert int(used) == 16  # experts 0, 2, 5, 7: one padded block of 4 rows each
    real = sorted_ids[:16][sorted_ids[:16] < 8]
    assert sorted(real.tolist()) == list(range(8))
    for b in range(4):
        rows = sorted_ids[4 * b : 4 * b + 4]
        rows = rows[rows < 8]
        assert len(rows) > 0 and (flat[rows] == block_expert[b]).all()
    assert block_expert[:4].tolist() == [0, 2, 5, 7]


@pytest.mark.parametrize("block", [None, (16, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_float64(block, dtype):
    weight, scale = quantize(randn(72, 80, seed=9), block)  # 72 x 80: partial 16 x 32 blocks
    x = randn(11, 80, dtype=dtype, seed=10)
    bias = randn(72, dtype=dtype, seed=11)
    out = fp8_linear(x, weight, scale, block, bias)
    ref = x.cpu().double() @ dequantize(weight, scale, block, torch.float64).cpu().T + bias.cpu().double()
    assert out.dtype == dtype and rel_err(out, ref) < TOL[dtype]
    assert rel_err(TorchBackend().fp8_linear(x.cpu(), weight.cpu(), scale.cpu(), block, bias.cpu()), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unit_offset_rms_norm(dtype):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), in float32, rounded once; fused with the residual add too."""
    x, residual = randn(5, 96, dtype=dtype, seed=12), randn(5, 96, dtype=dtype, seed=13)
    weight = randn(96, dtype=dtype, seed=14, scale=0.5)

    def ref(h):
        h = h.cpu().double()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + weight.cpu().double())

    out = rms_norm(x, weight, 1e-6, unit_offset=True)
    assert out.dtype == dtype and rel_err(out, ref(x)) < TOL[dtype] / 2
    fused, summed = fused_add_rms_norm(x, residual, weight, 1e-6, unit_offset=True)
    assert rel_err(fused, ref(summed)) < TOL[dtype] / 2 and rel_err(summed, x.double() + residual.double()) < TOL[dtype]
    assert rel_err(TorchBackend().rms_norm(x.cpu(), weight.cpu(), 1e-6, unit_offset=True), ref(x)) < TOL[dtype] / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul(dtype):
    x = randn(6, 2 * 300, dtype=dtype, seed=15, scale=3.0)  # wide range: both tails of tanh
    out = gelu_tanh_and_mul(x)
    xd = x.cpu().double()
    ref = torch.nn.functional.gelu(xd[:, :300], approximate="tanh") * xd[:, 300:]
    assert out.shape == (6, 300) and rel_err(out, ref) < TOL[dtype]


def test_partial_rotary_turns_only_the_leading_dimensions():
    """A table of R < head_dim columns rotates the first R dimensions as HF's Phi-3 does; the rest stay."""
    num_tokens, head_dim, rotary_dim = 7, 32, 16
    q, k = randn(num_tokens, 4, head_dim, seed=16), randn(num_tokens, 2, head_dim, seed=17)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    table = torch.cat([freqs.cos(), freqs.sin()], -1).to(DEVICE)  # [64, R]
    positions = torch.tensor([0, 3, 9, 17, 33, 50, 63], device=DEVICE)
    backend = TorchBackend()
    want_q, want_k = backend.apply_rotary(q.cpu(), k.cpu(), backend.rotary(positions.cpu(), table.cpu(), q.dtype))
    got_q, got_k = q.clone(), k.clone()
    apply_rotary(got_q, got_k, positions, table)
    torch.testing.assert_close(got_q.cpu(), want_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_k.cpu(), want_k, rtol=1e-6, atol=1e-6)
    assert torch.equal(got_q[..., rotary_dim:], q[..., rotary_dim:]) and not torch.equal(got_q[..., :rotary_dim], q[..., :rotary_dim])


@pytest.mark.parametrize("window", [None, 12])
def test_attention_soft_capping_matches_the_torch_backend(window):
    """Gemma 2's cap * tanh(score / cap), with decode and chunked-prefill rows in one launch."""
    from cbatch.kernels import paged_attention
    from cbatch.model.backend import AttentionMetadata, KVLayer

    block, kv_heads, heads, dim = 8, 2, 4, 32
    seq_lens, query_lens = [5, 30, 21], [1, 10, 6]  # a decode row and two prefill chunks after cached context
    k_cache, v_cache = randn(16, block, kv_heads, dim, seed=18, scale=2.0), randn(16, block, kv_heads, dim, seed=19)
    table = torch.randperm(16, generator=torch.Generator().manual_seed(0))[:12].view(3, 4).to(torch.int32).to(DEVICE)
    q = randn(sum(query_lens), heads, dim, seed=20, scale=2.0)
    qsl = torch.tensor([0, 1, 11, 17], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    meta = AttentionMetadata(qsl, lens, table, torch.full((17,), -1, device=DEVICE), max(query_lens), max(seq_lens),
                             query_lens, seq_lens, block)
    backend = TorchBackend()
    backend.prepare(meta)
    k_now = v_now = torch.zeros(17, kv_heads, dim, device=DEVICE)  # nothing to store (slots -1): all in the cache
    want = backend.attend(q.cpu(), k_now.cpu(), v_now.cpu(), KVLayer(k_cache.cpu(), v_cache.cpu()), meta, 0.3, window,
                          softcap=5.0)
    got = paged_attention(q, k_cache, v_cache, torch.empty_like(q), qsl, lens, table, 0.3, max(query_lens),
                          max(seq_lens), sliding_window=window, softcap=5.0)
    uncapped = paged_attention(q, k_cache, v_cache, torch.empty_like(q), qsl, lens, table, 0.3, max(query_lens),
                               max(seq_lens), sliding_window=window)
    assert rel_err(got, want) < 1e-5
    assert rel_err(uncapped, want) > 1e-2  # the cap matters at these score magnitudes
