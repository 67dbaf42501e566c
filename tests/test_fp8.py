"""FP8 checkpoints: a tiny Qwen3-MoE quantized here (per-tensor, per-channel, per-block; HF's `fp8` and
compressed-tensors layouts) gives the greedy tokens HF gives with the same dequantized weights; with the
Triton backend the weights stay FP8; layouts cbatch does not read are refused by name."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from cbatch.config import SamplingParams
from cbatch.model.layers import Linear
from cbatch.model.quant import FP8_DTYPE
from cbatch.model.spec import UnsupportedModelError, parse_spec
from helpers import generate, make_engine, random_prompts
from fp8_models import LAYOUTS, write_fp8_checkpoint
from tiny_models import hf_greedy, hf_model

PROMPTS = random_prompts(2, vocab=384, seed=7, min_len=10, max_len=30)


@pytest.fixture(scope="module")
def fp8_checkpoints(family_checkpoint, tmp_path_factory):
    """layout -> (the quantized checkpoint, a float checkpoint of its dequantized weights: HF's reference)."""
    src = family_checkpoint("qwen3_moe")
    root = tmp_path_factory.mktemp("fp8")
    return {layout: write_fp8_checkpoint(src, root / layout, *LAYOUTS[layout]) for layout in LAYOUTS}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_fp8_greedy_matches_hf_on_the_dequantized_weights(layout, fp8_checkpoints):
    quant, dequant = fp8_checkpoints[layout]
    reference = [hf_greedy(hf_model(dequant), p, 6) for p in PROMPTS]
    engine = make_engine(quant)  # CPU, torch backend: dequantized at load
    assert all(p.dtype != FP8_DTYPE for p in engine.runner.model.parameters())
    assert generate(engine, PROMPTS, SamplingParams(max_tokens=6)) == reference


@pytest.mark.parametrize("layout", ["fp8-tensor", "fp8-block"])
def test_fp8_weights_stay_fp8_with_the_triton_backend(layout, fp8_checkpoints):
    """The GPU path: qkv/o projections and the experts held in FP8 (q/k/v per-tensor scales packed per
    channel), dequantized inside the kernels; same tokens."""
    quant, dequant = fp8_checkpoints[layout]
    engine = make_engine(quant, attention_backend="triton")
    model = engine.runner.model
    fp8 = {name for name, p in model.named_parameters() if p.dtype == FP8_DTYPE}
    assert {"layers.0.self_attn.qkv_proj.weight", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.experts.w13",
            "layers.0.mlp.experts.w2"} <= fp8
    assert type(model.layers[0].mlp.gate) is Linear  # the router was not quantized
    reference = [hf_greedy(hf_model(dequant), PROMPTS[0], 3)]
    assert generate(engine, PROMPTS[:1], SamplingParams(max_tokens=3)) == reference


_SHAPE = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "hidden_size": 64, "vocab_size": 10,
          "intermediate_size": 8, "num_hidden_layers": 1}


@pytest.mark.parametrize("qconfig, message", [
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization 'bitsandbytes' is not supported; cbatch loads fp8"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "fp8 scale_fmt 'ue8m0'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}, "pack-quantized with 0 different weight layouts"),
    ({"quant_method": "compressed-tensors", "format": "naive-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}, "8-bit int weights"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128}}}}, "strategy 'group'"),
])
def test_unknown_quantization_layouts_are_refused_by_name(qconfig, message):
    with pytest.raises(UnsupportedModelError, match=message):
        parse_spec({**_SHAPE, "quantization_config": qconfig})


def test_fp8_tensors_the_config_does_not_announce_are_refused(fp8_checkpoints, tmp_path):
    from cbatch.model.loader import ModelLoadError

    quant, _ = fp8_checkpoints["fp8-tensor"]
    bare = Path(shutil.copytree(quant, tmp_path / "bare"))
    config = json.loads((bare / "config.json").read_text())
    config.pop("quantization_config")
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="is FP8 but config.json has no quantization_config"):
        make_engine(bare)
    e5m2 = Path(shutil.copytree(quant, tmp_path / "e5m2"))
    tensors = load_file(str(e5m2 / "model.safetensors"))
    tensors = {n: t.float().to(torch.float8_e5m2) if t.dtype == FP8_DTYPE else t for n, t in tensors.items()}
    save_file(tensors, str(e5m2 / "model.safetensors"))
    with pytest.raises(UnsupportedModelError, match="F8_E5M2; cbatch reads float8_e4m3fn"):
        make_engine(e5m2)
