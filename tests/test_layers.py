"""The plain-torch building blocks against transformers' own functions (the CPU path's numerics)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from cbatch.model.backend import TorchBackend
from cbatch.model.layers import Linear, prepack_weight
from cbatch.model.rope import RopeSpec, rope_table


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_is_bitwise_hf(dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    T, HQ, HKV, D = 11, 6, 2, 32
    qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=gen).to(dtype)
    q = qkv[:, : HQ * D].view(T, HQ, D)  # strided views of one projection, as in the model
    k = qkv[:, HQ * D : (HQ + HKV) * D].view(T, HKV, D)
    positions = torch.randint(0, 500, (T,), generator=gen)
    table = rope_table(RopeSpec(10000.0, D, None), 512)
    backend = TorchBackend()
    got_q, got_k = backend.apply_rotary(q, k, backend.rotary(positions, table, dtype))

    cos, sin = table[positions].chunk(2, dim=-1)  # HF: cos/sin in float32, cast to the activations' dtype
    cos, sin = torch.cat([cos, cos], -1).to(dtype), torch.cat([sin, sin], -1).to(dtype)
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))
    assert not torch.equal(got_q, q)  # it did rotate


def test_float32_prepacks_where_bfloat16_cannot(monkeypatch) -> None:
    """On an AVX2-only CPU oneDNN refuses to prepack bfloat16 weights; float32 weights must still be prepacked
    (they once were not: the bfloat16 refusal turned prepacking off for both, about 1.9x slower decode GEMMs)."""
    from cbatch.model import onednn

    if not onednn._onednn_linear_works():
        pytest.skip("this torch build has no oneDNN linear op: nothing is prepacked")
    real = torch.ops.mkldnn._reorder_linear_weight

    class Ops:  # torch.ops.mkldnn as an AVX2 CPU shows it
        _linear_pointwise = torch.ops.mkldnn._linear_pointwise

        @staticmethod
        def _reorder_linear_weight(w, *args):
            if w.dtype == torch.bfloat16:
                raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert")
            return real(w, *args)

    monkeypatch.setattr(torch.ops, "mkldnn", Ops)
    assert onednn._onednn_prepack_dtypes.__wrapped__() == {torch.float32}  # (the probe itself, not its cached answer)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_linear_matches_plain(dtype) -> None:
    torch.manual_seed(0)
    layer = Linear(48, 40, bias=True).to(dtype)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.prepack()
    if prepack_weight(weight) is None:
        pytest.skip(f"oneDNN does not prepack {dtype} weights on this CPU (bfloat16 needs AVX-512 or AVX-NE-CONVERT)")
    assert layer.weight is None and layer.packed is not None  # one copy of the weight remains
    for rows in (1, 7, 300):
        x = torch.randn(rows, 48).to(dtype)
        want = F.linear(x.float(), weight.float(), bias.float())
        tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(layer(x).float(), want, **tol)
