"""gpt-oss (GptOssForCausalLM) against HF transformers, float32, on a tiny random checkpoint
(tiny_models.FAMILIES["gpt_oss"]): attention sinks, alternating sliding (8) / full layers, YaRN, the biased
top-k-then-softmax router and the experts' clamped SwiGLU with biases. Greedy tokens identical alone and in a full
batch (under chunked prefill with prompts longer than the window and preemption, the prefill logits and the Triton
backend: tests/test_model_families.py, which runs every family); the MXFP4 checkpoint layout (`*_blocks` +
`*_scales`) dequantized as transformers' own `convert_moe_packed_tensors` does, and its tokens identical to HF
loading the same checkpoint, chunked and preempted. Under tensor parallelism: tests/test_tp_families.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from cbatch.config import SamplingParams
from cbatch.model.mxfp4 import E2M1_VALUES, dequantize_mxfp4
from cbatch.model.spec import parse_spec, read_config
from helpers import generate, make_engine
from test_model_families import PRESSURE, PROMPTS  # prompts longer than the window (8); chunked, rows not all fitting
from tiny_models import hf_greedy, hf_model

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(family_checkpoint) -> Path:
    return family_checkpoint("gpt_oss")


@pytest.fixture(scope="module")
def reference(checkpoint) -> list[list[int]]:
    model = hf_model(checkpoint)
    return [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]


def test_config_switches(checkpoint):
    spec = parse_spec(read_config(checkpoint))
    assert spec.family == "gpt_oss" and spec.attn_sinks and spec.qkv_bias and spec.o_bias
    assert spec.layer_windows == (8, None)  # sliding first, then full, as HF's layer_types
    moe = spec.moe
    assert (moe.routing, moe.biased, moe.swiglu_limit, moe.swiglu_alpha) == ("topk_softmax", True, 1.5, 1.702)
    assert moe.experts_in_out_interleaved and moe.sparse_layers == (True, True)
    rope = spec.rope[0]
    assert rope.theta == 150000.0 and rope.scaling["rope_type"] == "yarn" and rope.scaling["truncate"] is False


def test_greedy_matches_hf_alone_and_in_a_batch(checkpoint, reference):
    assert all(len(set(r)) > 2 for r in reference)  # decisive: not one repeated token
    params = SamplingParams(max_tokens=NEW_TOKENS)
    engine = make_engine(checkpoint)
    assert [generate(engine, [p], params)[0] for p in PROMPTS] == reference  # alone
    assert generate(engine, PROMPTS, params) == reference  # in one batch


def test_sinks_and_windows_decide_the_tokens(checkpoint, reference):
    """Without its sinks, or without its first layer's window, the model gives other tokens: the parity above
    tests both (a fresh engine each: the prefix cache would keep the other model's KV)."""
    params = SamplingParams(max_tokens=NEW_TOKENS)
    engine = make_engine(checkpoint)
    for layer in engine.runner.model.layers:
        layer.self_attn.sinks = None
    assert generate(engine, PROMPTS, params) != reference
    engine = make_engine(checkpoint)
    engine.runner.model.layers[0].self_attn.sliding_window = None
    assert generate(engine, PROMPTS, params) != reference


# ---- MXFP4 ------------------------------------------------------------------------------------------------------
_MAGNITUDES = torch.tensor(E2M1_VALUES[:8])


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (K a multiple of 32) -> (blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32]): each
    block of 32 scaled so its largest magnitude falls in e2m1's top binade, then rounded to the nearest e2m1."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.floor(torch.log2(groups.abs().amax(-1).clamp(min=2.0**-100))) - 2  # 6 = 1.5 x 2 ** 2
    scaled = groups / torch.exp2(exponent)[..., None]
    nibbles = (scaled.abs()[..., None] - _MAGNITUDES).abs().argmin(-1) | ((scaled < 0).long() << 3)
    nibbles = nibbles.to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4), (exponent + 127).to(torch.uint8)


def write_mxfp4_checkpoint(src: Path, dst: Path) -> Path:
    """`src`'s checkpoint with its experts stored as gpt-oss's hub checkpoints store them: MXFP4 blocks and scales
    of the [E, out, in] weights, and config.json's quantization_config."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # HF holds [E, in, out]
            tensors[name + "_blocks"], tensors[name + "_scales"] = quantize_mxfp4(tensor.transpose(1, 2).contiguous())
        else:
            tensors[name] = tensor
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_mxfp4_dequantization_is_transformers():
    """Every nibble, at scales from 2 ** -127 (subnormal products) to 2 ** 127 (overflow to inf), in float32 and bfloat16."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 3, 16, 16), generator=g, dtype=torch.uint8)
    scales = torch.arange(0, 256, dtype=torch.int32)[:96].reshape(2, 3, 16).to(torch.uint8)
    scales[1] += 159  # up to 254: 2 ** 127 (x 6 overflows to inf; 2 ** 128 would make 0 x inf = nan)
    for dtype in (torch.float32, torch.bfloat16):
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, K, N]
        ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, N, K]
        assert ours.dtype == dtype
        assert torch.equal(ours.transpose(1, 2), theirs)
        assert torch.isinf(ours).any() and (ours[ours.isfinite()] != 0).sum() > 1000


@pytest.fixture(scope="module")
def mxfp4_checkpoint(checkpoint, tmp_path_factory) -> Path:
    return write_mxfp4_checkpoint(checkpoint, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "model")


def test_mxfp4_checkpoint_matches_hf(mxfp4_checkpoint, reference):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from safetensors.torch import load_file

    path = mxfp4_checkpoint
    stored = load_file(path / "model.safetensors")
    engine = make_engine(path, **PRESSURE)
    experts = engine.runner.model.layers[0].mlp.experts
    gate_up = convert_moe_packed_tensors(stored["model.layers.0.mlp.experts.gate_up_proj_blocks"],
                                         stored["model.layers.0.mlp.experts.gate_up_proj_scales"], dtype=torch.float32)
    down = convert_moe_packed_tensors(stored["model.layers.0.mlp.experts.down_proj_blocks"],
                                      stored["model.layers.0.mlp.experts.down_proj_scales"], dtype=torch.float32)
    w13 = gate_up.transpose(1, 2)  # [E, 2I, H], gate and up rows interleaved
    assert torch.equal(experts.w13, torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1))
    assert torch.equal(experts.w2, down.transpose(1, 2))

    model = hf_model(path)
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert expected != reference  # the 4-bit experts change the tokens: they are what runs
    assert generate(engine, PROMPTS, SamplingParams(max_tokens=NEW_TOKENS)) == expected
    assert engine.scheduler.stats.preemptions > 0


def test_mxfp4_experts_stay_mxfp4_on_the_triton_backend(mxfp4_checkpoint):
    """The Triton backend holds the experts as stored (uint8 blocks and scales, gate/up rows de-interleaved) and its
    grouped GEMM decodes them: the tokens of HF loading the same checkpoint, chunked and preempted."""
    from safetensors.torch import load_file

    path = mxfp4_checkpoint
    stored = load_file(path / "model.safetensors")
    engine = make_engine(path, attention_backend="triton", max_num_batched_tokens=16, block_size=4, num_kv_blocks=12)
    experts = engine.runner.model.layers[1].mlp.experts
    blocks = stored["model.layers.1.mlp.experts.gate_up_proj_blocks"]
    assert experts.w13.dtype == experts.w13_scale.dtype == torch.uint8
    assert torch.equal(experts.w13.cpu(), torch.cat([blocks[:, 0::2], blocks[:, 1::2]], dim=1))
    assert torch.equal(experts.w2_scale.cpu(), stored["model.layers.1.mlp.experts.down_proj_scales"])
    model = hf_model(path)
    expected = [hf_greedy(model, p, 3) for p in PROMPTS[:2]]
    assert generate(engine, PROMPTS[:2], SamplingParams(max_tokens=3)) == expected
    assert engine.scheduler.stats.preemptions > 0


def test_plan_counts_mxfp4_experts_at_their_stored_size(mxfp4_checkpoint):
    """4 bits a weight and a scale byte per 32 for the experts (2 layers x (4 x 64 x 64 + 4 x 64 x 32)), the
    compute dtype's bytes for every other matrix (embeddings, lm_head, q/k/v/o, routers, the experts' biases)."""
    from cbatch.model.mxfp4 import stored_bytes_per_weight
    from cbatch.model.weights import TensorIndex

    experts = 2 * (4 * 64 * 64 + 4 * 64 * 32)
    others = 2 * 384 * 64 + 2 * (64 * 64 * 2 + 32 * 64 * 2 + 4 * 64 + 4 * 64 + 4 * 64)
    got = stored_bytes_per_weight(TensorIndex(sorted(mxfp4_checkpoint.glob("*.safetensors"))), 2)
    assert got == pytest.approx((experts * (0.5 + 1 / 32) + others * 2) / (experts + others))
