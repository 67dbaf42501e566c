"""The W4A16 GEMM against dequantize-then-matmul on random inputs: every group size (32, 64, 128, per channel),
groups in order and act-order, symmetric and asymmetric zeros, 4 and 8 bits, decode- and prefill-sized M, fp16 /
bf16 (and float32) activations. The reference multiplies the same dequantized weights (rounded to x's dtype, as
the kernel's tensor cores see them) in float64: the kernel may differ by its fp32 summation order and the final
rounding to x's dtype only.

Runs on a GPU when one is present; otherwise through Triton's CPU interpreter (small shapes)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cbatch.kernels import w4a16_linear  # noqa: E402
from cbatch.model.int4 import Unpacked, dequantize_kept, pack_int32, sort_by_group  # noqa: E402
from helpers import TRITON_INTERPRET, kernel_device  # noqa: E402

DEVICE = kernel_device()
EPS = {torch.float16: 2**-11, torch.bfloat16: 2**-8, torch.float32: 2**-24}


def packed_layer(n: int, k: int, group: int, bits: int, act_order: bool, sym: bool, seed: int):
    """(weight int32 [N, K*bits/32], scale float32 [N, G], zero uint8 [N, G], perm int32 [K] | None, group size,
    the float32 weight [N, K] in the inputs' order, computed here from q and the act-order g_idx)."""
    gen = torch.Generator().manual_seed(seed)
    group = k if group == -1 else group
    groups = -(-k // group)
    top = (1 << bits) - 1
    q = torch.randint(0, top + 1, (n, k), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, groups, generator=gen) * 0.02 + 0.005
    zero = torch.full((n, groups), (top + 1) // 2, dtype=torch.uint8) if sym else \
        torch.randint(0, top + 1, (n, groups), generator=gen, dtype=torch.uint8)
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = torch.empty(k, dtype=torch.int64)
        g_idx[torch.randperm(k, generator=gen)] = torch.arange(k) // group
    dense = (q.float() - zero.float()[:, g_idx]) * scale[:, g_idx]  # [N, K]
    if not act_order:
        return pack_int32(q, bits, 1), scale, zero, None, group, dense
    q_sorted, perm = sort_by_group(Unpacked(q, scale, zero, g_idx.to(torch.int32)))
    return pack_int32(q_sorted, bits, 1), scale, zero, perm, group, dense


def check(m: int, n: int, k: int, group: int, bits: int, act_order: bool, sym: bool, dtype: torch.dtype,
          bias: bool = False, seed: int = 0):
    weight, scale, zero, perm, group_size, dense = packed_layer(n, k, group, bits, act_order, sym, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    w = dense.to(dtype)  # [N, K] as the kernel rounds it
    assert torch.equal(dequantize_kept(weight, scale, zero, perm, group_size, bits, dtype), w)  # the torch reference
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    args = [t.to(DEVICE) if t is not None else None for t in (x, weight, scale, zero, perm)]
    out = w4a16_linear(*args, group_size, bits, b.to(DEVICE) if bias else None).cpu()
    assert out.dtype == dtype and out.shape == (m, n)
    # fp32 accumulation over K products, then one rounding to x's dtype: a few ulps of the result's scale
    magnitude = (x.double().abs() @ w.double().abs().t()).clamp_min(1e-3)
    err = ((out.double() - ref).abs() / magnitude).max().item()
    assert err <= 2 * EPS[dtype] + 64 * EPS[torch.float32], f"relative error {err:.2e}"
    return out, ref


@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16_matches_dequantize_then_matmul_for_every_group_size(group, act_order):
    check(m=3, n=48, k=256, group=group, bits=4, act_order=act_order, sym=False, dtype=torch.float16, seed=group)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("m", [1, 80])  # decode tiles, prefill tiles (several row blocks, a partial one)
def test_w4a16_decode_and_prefill_tiles_in_each_dtype(dtype, m):
    check(m=m, n=40, k=128, group=32, bits=4, act_order=False, sym=True, dtype=dtype, bias=True, seed=m)


def test_w8a16_and_a_ragged_group():
    check(m=5, n=24, k=96, group=64, bits=8, act_order=False, sym=False, dtype=torch.bfloat16)  # 64 + 32 rows
    check(m=2, n=16, k=64, group=32, bits=8, act_order=True, sym=True, dtype=torch.float16)


def test_w4a16_a_wrong_weight_would_show():
    """The check is tight enough to catch a nibble-order slip: swapping two values of each word fails it."""
    weight, scale, zero, _, group, _ = packed_layer(16, 64, 32, 4, False, False, seed=9)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).half()
    nib = torch.stack([(weight >> (4 * i)) & 15 for i in range(8)], -1)
    swapped = pack_int32(nib[..., [1, 0, 2, 3, 4, 5, 6, 7]].flatten(-2).to(torch.uint8), 4, 1)
    good = w4a16_linear(*(t.to(DEVICE) for t in (x, weight, scale, zero)), None, group, 4).cpu().double()
    bad = w4a16_linear(*(t.to(DEVICE) for t in (x, swapped, scale, zero)), None, group, 4).cpu().double()
    ref = x.double() @ dequantize_kept(weight, scale, zero, None, group, 4, torch.float16).double().t()
    assert (good - ref).abs().max() < 1e-2 < (bad - ref).abs().max()


def test_w4a16_refuses_mismatched_shapes():
    weight, scale, zero, _, group, _ = packed_layer(16, 64, 32, 4, False, True, seed=0)
    with pytest.raises(ValueError, match="does not fit a 4-bit packed weight"):
        w4a16_linear(torch.zeros(2, 32, dtype=torch.float16, device=DEVICE), weight.to(DEVICE), scale.to(DEVICE),
                     zero.to(DEVICE), None, group, 4)


@pytest.mark.parametrize("variant", ["awq-g32", "awq-g128", "gptq-g64-sym-actorder", "gptq-channel-sym", "gptq-v2-g64",
                                     "ct-w4-g32-asym-actorder", "ct-w4-channel-asym", "ct-w8-g64"])
def test_w4a16_on_each_formats_layout_as_the_loader_repacks_it(variant):
    """From each format's stored tensors (tests/int_checkpoints.py) through `int4.unpack` and the kept layout
    the loader builds, to the kernel: the matmul of the format's dequantized weights."""
    from cbatch.model.quant import parse_quantization
    from cbatch.model.int4 import unpack
    from int_checkpoints import FORMATS, pack, quantization_config, quantize

    v = FORMATS[variant]
    n, k = 48, 256
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(4))
    stored = pack(*quantize(weight, v, seed=2), v)
    packed = parse_quantization(quantization_config(v)).packed
    u = unpack(packed, stored.get, "layer")
    group = k if packed.group_size == -1 else packed.group_size
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(6)).half()
    q, perm = sort_by_group(u) if packed.act_order else (u.q, None)
    out = w4a16_linear(*(t.to(DEVICE) if t is not None else None
                         for t in (x, pack_int32(q, v.bits, 1), u.scales, u.zeros, perm)), group, v.bits).cpu()
    ref = x.double() @ u.dequantize(torch.float16).double().t()
    magnitude = x.double().abs() @ u.dequantize(torch.float16).double().abs().t()
    assert ((out.double() - ref).abs() / magnitude).max() <= 2 * EPS[torch.float16] + 64 * EPS[torch.float32]


@pytest.mark.parametrize("group, bits, dtype", [(32, 4, torch.float16), (-1, 4, torch.bfloat16), (64, 8, torch.float16)])
def test_fused_moe_with_packed_experts_matches_the_dequantized_experts(group, bits, dtype):
    """The grouped GEMM's int mode (MoE experts kept packed) against the same kernel on the experts dequantized
    first (what it must equal up to summation order) and the torch backend's reference loop."""
    from cbatch.kernels import fused_moe
    from cbatch.model.backend.torch_backend import TorchBackend
    from cbatch.model.int4 import IntExperts

    experts, hidden, inter, tokens, top_k = 4, 64, 32, 20, 2
    layers = [[packed_layer(n, k, group, bits, False, False, seed=10 * e + i) for e in range(experts)]
              for i, (n, k) in enumerate(((2 * inter, hidden), (hidden, inter)))]
    w13, w2 = (torch.stack([layer[0] for layer in stack]) for stack in layers)
    s13, s2 = (torch.stack([layer[1] for layer in stack]) for stack in layers)
    z13, z2 = (torch.stack([layer[2] for layer in stack]) for stack in layers)
    packed = IntExperts(z13, z2, group, bits)
    dense = [torch.stack([layer[5].to(dtype) for layer in stack]) for stack in layers]
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1).to(dtype)
    on = lambda t: t.to(DEVICE)  # noqa: E731
    got = fused_moe(on(x), on(w13), on(w2), on(weights), on(ids), "silu", on(s13), on(s2), None,
                    IntExperts(on(z13), on(z2), group, bits)).cpu().double()
    want = fused_moe(on(x), on(dense[0]), on(dense[1]), on(weights), on(ids), "silu").cpu().double()
    reference = TorchBackend().fused_moe(x, w13, w2, weights, ids, "silu", s13, s2, None, packed).double()
    scale = want.abs().max()
    # Triton's interpreter truncates float32 -> bfloat16 casts (the GPU rounds to nearest): under it, bf16
    # weights dequantized in the kernel may sit one ulp off the dense ones, and two MLP stages spread that
    ulps = 16 if TRITON_INTERPRET and dtype == torch.bfloat16 else 4
    assert (got - want).abs().max() <= ulps * EPS[dtype] * scale
    assert (got - reference).abs().max() <= 2 * ulps * EPS[dtype] * scale
    assert got.abs().max() > 0.01 * x.double().abs().max()  # not a zero output passing trivially
