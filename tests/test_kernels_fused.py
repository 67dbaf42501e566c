"""RMSNorm (+ residual), rotary embedding and SwiGLU kernels against float64 references and HF eager math.

Runs on a GPU when one is present; otherwise through Triton's CPU interpreter (conftest.py sets
TRITON_INTERPRET=1 before anything imports triton when there is no GPU).
"""

import importlib
import pkgutil

import pytest
import torch

pytest.importorskip("triton")

from cbatch.kernels import apply_rotary, fused_add_rms_norm, rms_norm, silu_and_mul  # noqa: E402
from helpers import TRITON_INTERPRET, kernel_device  # noqa: E402

DEVICE = kernel_device()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


def check(out, ref, dtype, roundings=1):
    """Relative error to the float64 reference within the dtype's tolerance per rounding step in series."""
    assert torch.isfinite(out).all(), "NaN/inf in the output"
    ref = ref.cpu().double()
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert err < roundings * TOL[dtype], f"relative error {err:.3e} >= {roundings * TOL[dtype]:.0e}"


def assert_close_to_eager(out, eager, scale=None):
    """Same-dtype eager torch (the HF code path) should agree to ~1 rounding step of the dtype.

    `scale` (default |eager|): the magnitude a rounding step is relative to. For a sum of rounded terms it is the
    sum of the terms' magnitudes, not the result's: where the terms cancel, one rounding step of a term is many
    of the result (rotary: x1 * cos - x2 * sin).

    The kernels round every intermediate where eager torch does, so on a GPU they match eager to the last
    bit or two. Triton's interpreter (3.9) converts fp32 -> bf16 by truncation, not round-to-nearest-even
    as the GPU does, so under the interpreter the bf16 comparison is skipped (the float64 check stays)."""
    if TRITON_INTERPRET and eager.dtype == torch.bfloat16:
        return
    # 16-bit: two rounding steps of the dtype. fp32: 1e-5, since there the GPU may contract a multiply and
    # an add into one FMA and its rsqrt/exp differ from torch's by an ulp or two (accuracy is covered by
    # the float64 check; this comparison is about matching eager's 16-bit rounding).
    rtol = 1e-5 if eager.dtype == torch.float32 else 2 * torch.finfo(eager.dtype).eps
    diff = (out.cpu().double() - eager.cpu().double()).abs()
    scale = eager.cpu().double().abs() if scale is None else scale.cpu().double()
    assert (diff <= rtol * scale + 1e-6).all(), f"max diff {diff.max().item():.3e}"


def test_kernels_are_interpreted_exactly_when_triton_interpret_is_set():
    """conftest.py sets TRITON_INTERPRET=1 before triton's first import in a process without a GPU, so
    every kernel is an interpreted function there (one compiled for the absent GPU fails at launch);
    with TRITON_INTERPRET unset they are compiled ones."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    import cbatch.kernels

    names = [m.name for m in pkgutil.iter_modules(cbatch.kernels.__path__) if not m.name.startswith("_")]
    kernels = {f"{name}.{attr}": value for name in names
               for attr, value in vars(importlib.import_module(f"cbatch.kernels.{name}")).items()
               if isinstance(value, (InterpretedFunction, JITFunction))}
    assert {"rmsnorm._rms_norm_kernel", "paged_attention._paged_attention_kernel"} <= set(kernels)
    kind = InterpretedFunction if TRITON_INTERPRET else JITFunction
    assert [name for name, value in kernels.items() if not isinstance(value, kind)] == []


# ----------------------------------------------------------------------------------------------------
# RMSNorm
# ----------------------------------------------------------------------------------------------------


def hf_rms_norm(x, weight, eps):
    """transformers' LlamaRMSNorm.forward, in the input dtype."""
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(x.dtype)


def ref_rms_norm(x, weight, eps):
    h = x.cpu().double()
    return weight.cpu().double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("hidden", [64, 1000, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype, hidden):
    eps = 1e-6
    x = randn(7, hidden, dtype=dtype, seed=hidden)
    weight = (1.0 + 0.1 * randn(hidden, dtype=torch.float32, seed=1)).to(dtype)
    out = rms_norm(x, weight, eps)
    assert out.dtype == dtype and out.shape == x.shape
    check(out, ref_rms_norm(x, weight, eps), dtype)
    assert_close_to_eager(out, hf_rms_norm(x, weight, eps))


@pytest.mark.parametrize("hidden", [64, 1000, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype, hidden):
    eps = 1e-5
    x = randn(5, hidden, dtype=dtype, seed=hidden)
    residual = randn(5, hidden, dtype=dtype, seed=hidden + 1)
    weight = (1.0 + 0.1 * randn(hidden, dtype=torch.float32, seed=2)).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, weight, eps)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs were modified"
    summed = x + residual  # eager: the sum is rounded to the activation dtype
    if TRITON_INTERPRET and dtype == torch.bfloat16:  # interpreter truncates fp32 -> bf16: within one ulp
        diff = (new_residual.double() - summed.double()).abs()
        assert (diff <= torch.finfo(dtype).eps * summed.double().abs()).all()
    else:
        assert torch.equal(new_residual, summed)
    check(out, ref_rms_norm(summed, weight, eps), dtype)
    assert_close_to_eager(out, hf_rms_norm(summed, weight, eps))


def test_rms_norm_strided_rows():
    """Rows of a wider tensor (stride 2 * hidden) are read through the row stride."""
    wide = randn(6, 2 * 256, dtype=torch.float32, seed=9)
    x = wide[:, :256]
    weight = randn(256, dtype=torch.float32, seed=10)
    check(rms_norm(x, weight, 1e-6), ref_rms_norm(x, weight, 1e-6), torch.float32)


# ----------------------------------------------------------------------------------------------------
# Rotary
# ----------------------------------------------------------------------------------------------------


def make_cos_sin_cache(max_pos, head_dim, base=10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)  # [max_pos, head_dim / 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)  # [max_pos, head_dim]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_rotary(x, positions, cache):
    """transformers' apply_rotary_pos_emb: cos/sin cast to x's dtype, math in x's dtype."""
    half = x.shape[-1] // 2
    c, s = cache[positions, :half], cache[positions, half:]
    cos = torch.cat([c, c], -1).to(x.dtype)[:, None, :]
    sin = torch.cat([s, s], -1).to(x.dtype)[:, None, :]
    return x * cos + rotate_half(x) * sin


def rotary_terms_magnitude(x, positions, cache):
    """|x * cos| + |rotate_half(x) * sin|, float64: the size of the two terms the rotation adds (see
    assert_close_to_eager: on a GPU the kernel and eager bf16 differed by one ulp of a term in [2, 4) where
    the terms cancelled, 1.6e-2 against a result near 0.5; the old check, relative to the result, failed it)."""
    half = x.shape[-1] // 2
    c, s = cache.cpu().double()[positions.cpu(), :half], cache.cpu().double()[positions.cpu(), half:]
    cos, sin = torch.cat([c, c], -1)[:, None, :], torch.cat([s, s], -1)[:, None, :]
    x = x.cpu().double()
    return (x * cos).abs() + (rotate_half(x) * sin).abs()


def ref_rotary(x, positions, cache):
    half = x.shape[-1] // 2
    c, s = cache.cpu().double()[positions.cpu(), :half], cache.cpu().double()[positions.cpu(), half:]
    cos, sin = torch.cat([c, c], -1)[:, None, :], torch.cat([s, s], -1)[:, None, :]
    x = x.cpu().double()
    return x * cos + rotate_half(x) * sin


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary(dtype, head_dim, heads):
    num_q_heads, num_kv_heads = heads
    num_tokens, max_pos = 9, 4096
    cache = make_cos_sin_cache(max_pos, head_dim)
    g = torch.Generator().manual_seed(head_dim)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g, dtype=torch.int64)
    positions[:3] = torch.tensor([0, 1, max_pos - 1])
    positions = positions.to(DEVICE)
    # q and k as strided views of a packed qkv projection: the kernel must go through the strides
    qkv = randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=head_dim + num_q_heads)
    qkv_before = qkv.clone()
    q = qkv[:, : num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    q0, k0 = q.clone(), k.clone()

    apply_rotary(q, k, positions, cache)

    check(q, ref_rotary(q0, positions, cache), dtype)
    check(k, ref_rotary(k0, positions, cache), dtype)
    assert_close_to_eager(q, hf_rotary(q0, positions, cache), rotary_terms_magnitude(q0, positions, cache))
    assert_close_to_eager(k, hf_rotary(k0, positions, cache), rotary_terms_magnitude(k0, positions, cache))
    v_start = (num_q_heads + num_kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], qkv_before[:, v_start:]), "v columns were touched"


# ----------------------------------------------------------------------------------------------------
# SwiGLU
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("inter", [300, 2500])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype, inter):
    x = randn(6, 2 * inter, dtype=dtype, seed=inter)
    out = silu_and_mul(x)
    assert out.dtype == dtype and out.shape == (6, inter)
    xd = x.cpu().double()
    ref = torch.nn.functional.silu(xd[:, :inter]) * xd[:, inter:]
    check(out, ref, dtype)
    assert_close_to_eager(out, torch.nn.functional.silu(x[:, :inter]) * x[:, inter:])


# ----------------------------------------------------------------------------------------------------
# norm_rope_store: per-head q/k RMSNorm + rotary + K/V store, on the packed qkv in place
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("heads,head_dim", [((4, 2), 64), ((16, 8), 128), ((6, 1), 32)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_rope_store(dtype, heads, head_dim, qk_norm):
    """Against the unfused references: HF's RMSNorm per head (float64 and eager), then rotary, then the store;
    q is rotated inside qkv, v is stored as is, padding slots store nothing."""
    from cbatch.kernels import norm_rope_store

    num_q_heads, num_kv_heads = heads
    num_tokens, block_size, num_blocks, max_pos = 7, 8, 4, 512
    cache = make_cos_sin_cache(max_pos, head_dim)
    g = torch.Generator().manual_seed(head_dim + num_q_heads)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=g).to(DEVICE)
    qkv = randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=head_dim) * 3
    q_w = randn(head_dim, dtype=dtype, seed=1) if qk_norm else None
    k_w = randn(head_dim, dtype=dtype, seed=2) if qk_norm else None
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[3] = -1
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    before = qkv.clone()
    q0, k0, v0 = before.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
    q0 = q0.reshape(num_tokens, num_q_heads, head_dim)
    k0 = k0.reshape(num_tokens, num_kv_heads, head_dim)
    v0 = v0.reshape(num_tokens, num_kv_heads, head_dim)

    q = norm_rope_store(qkv, num_q_heads, num_kv_heads, positions, cache, k_cache, v_cache, slots.to(DEVICE),
                        q_w, k_w, 1e-6)

    assert q.data_ptr() == qkv.data_ptr() and q.shape == (num_tokens, num_q_heads, head_dim)
    ref_q, ref_k = (ref_rms_norm(q0, q_w, 1e-6), ref_rms_norm(k0, k_w, 1e-6)) if qk_norm else (q0.cpu().double(), k0.cpu().double())
    eager_q, eager_k = (hf_rms_norm(q0, q_w, 1e-6), hf_rms_norm(k0, k_w, 1e-6)) if qk_norm else (q0, k0)
    written = slots >= 0
    stored_k = k_cache.view(-1, num_kv_heads, head_dim)[slots[written]]
    stored_v = v_cache.view(-1, num_kv_heads, head_dim)[slots[written]]
    # 16-bit: the norm rounds twice (normalised value, weight product) before rotary rounds again, as HF does
    check(q, ref_rotary(ref_q, positions, cache), dtype, roundings=3)
    check(stored_k, ref_rotary(ref_k, positions, cache)[written], dtype, roundings=3)
    assert_close_to_eager(q, hf_rotary(eager_q, positions, cache), rotary_terms_magnitude(eager_q, positions, cache))
    assert_close_to_eager(stored_k, hf_rotary(eager_k, positions, cache)[written.to(DEVICE)],
                          rotary_terms_magnitude(eager_k, positions, cache)[written])
    assert torch.equal(stored_v, v0[written.to(DEVICE)])
    assert torch.equal(qkv[:, num_q_heads * head_dim :], before[:, num_q_heads * head_dim :]), "k/v columns were touched"
    assert int((k_cache != 0).any(-1).any(-1).sum()) == int(written.sum())  # one cache row per stored token


# ----------------------------------------------------------------------------------------------------
# fused_sample: the torch sampler's tokens in one pass (greedy and temperature rows)
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [1000, 5003])
def test_fused_sample_matches_the_torch_sampler(vocab):
    from cbatch.engine.sampler import SamplingBatch, sample
    from cbatch.kernels import fused_sample

    num_rows = 24
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(num_rows, vocab, generator=g) * 4
    logits[3, 7] = logits[3, 900] = logits[3].max() + 1  # a tie in a greedy row: both take the lower id
    temps = [0.0 if i % 3 == 0 else (0.3, 0.7, 1.0, 1.6)[i % 4] for i in range(num_rows)]
    seeds = [i * 7919 - (2**40 if i % 5 == 0 else 0) for i in range(num_rows)]  # negative and > 32-bit seeds
    positions = [int(x) for x in torch.randint(0, 3000, (num_rows,), generator=g)]
    expected = sample(logits, SamplingBatch(temps, [1.0] * num_rows, [0] * num_rows, seeds, positions))
    got = fused_sample(logits.to(DEVICE), torch.tensor(temps, device=DEVICE), torch.tensor(seeds, device=DEVICE),
                       torch.tensor(positions, device=DEVICE))
    assert got.tolist() == expected.tolist()
    assert got[3].item() == 7
    random_rows = [i for i, t in enumerate(temps) if t > 0]
    assert any(got[i] != logits[i].argmax() for i in random_rows)  # sampling, not argmax
