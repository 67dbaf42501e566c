"""FP8 checkpoints quantized in the tests from a tiny float one: per tensor, per channel or per block, in HF's
`fp8` or compressed-tensors layout, with a float copy of the dequantized weights beside (HF's reference)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from cbatch.model.quant import FP8_DTYPE, dequantize

_WEIGHTS_8BIT_FLOAT = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}


def fp8_config(block: list[int] | None) -> dict:
    """HF's FineGrainedFP8 config: per-tensor scales (block None) or [bn, bk] blocks."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}


LAYOUTS = {
    # name: (quantization_config, block or None, per-tensor scale?)
    "fp8-tensor": (fp8_config(None), None, True),
    "fp8-block": (fp8_config([16, 16]), (16, 16), False),
    "ct-tensor": ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                   "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**_WEIGHTS_8BIT_FLOAT, "strategy": "tensor"},
                                                 "input_activations": {**_WEIGHTS_8BIT_FLOAT, "strategy": "tensor"}}}},
                  None, True),
    "ct-channel": ({"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**_WEIGHTS_8BIT_FLOAT, "strategy": "channel"},
                                                  "input_activations": None}}}, None, False),
}


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] | None, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale) with weight ~ fp8 x scale: [] per tensor, [N, 1] per channel,
    [N/bn, K/bk] per block."""
    if per_tensor:
        scale = weight.abs().max() / 448.0
        return (weight / scale).to(FP8_DTYPE), scale
    if block is None:
        scale = weight.abs().amax(1, keepdim=True) / 448.0
        return (weight / scale).to(FP8_DTYPE), scale
    tiles = weight.unflatten(1, (-1, block[1])).unflatten(0, (-1, block[0]))  # [N/bn, bn, K/bk, bk]
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (weight / full).to(FP8_DTYPE), scale


def fp8_tensors(name: str, tensor: torch.Tensor, block: tuple[int, int] | None, per_tensor: bool,
                suffix: str = "weight_scale_inv") -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Float weight `name` quantized: ({name: FP8 weight, its scale's name (`suffix`): scale}, the dequantized float32
    weight that HF's reference loads)."""
    weight, scale = quantize_fp8(tensor, block, per_tensor)
    flat_scale = scale.reshape(-1) if block is None else scale
    dequantized = dequantize(weight, flat_scale if not per_tensor else flat_scale.expand(weight.shape[0]), block,
                             torch.float32)
    return {name: weight, name.removesuffix("weight") + suffix: scale}, dequantized


def _quantized(name: str) -> bool:
    """The decoder matmuls (attention, experts); not the router, norms, embeddings or lm_head."""
    return name.startswith("model.layers.") and name.endswith("proj.weight")


def write_fp8_checkpoint(src: Path, dst: Path, qconfig: dict, block: tuple[int, int] | None,
                         per_tensor: bool) -> tuple[Path, Path]:
    """The float checkpoint `src` quantized into dst/quant, and its dequantized weights into dst/dequant."""
    tensors = load_file(str(src / "model.safetensors"))
    quant, dequant = {}, {}
    for name, tensor in tensors.items():
        quant[name] = dequant[name] = tensor
        if _quantized(name):
            suffix = "weight_scale_inv" if qconfig["quant_method"] == "fp8" else "weight_scale"
            stored, dequant[name] = fp8_tensors(name, tensor, block, per_tensor, suffix)
            quant |= stored
            if "input_activations" in qconfig.get("config_groups", {}).get("group_0", {}):
                quant[name.removesuffix("weight") + "input_scale"] = torch.ones(1)  # unused (weight-only)
    for kind, state in (("quant", quant), ("dequant", dequant)):
        shutil.copytree(src, dst / kind)
        save_file(state, str(dst / kind / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (dst / "quant" / "config.json").write_text(json.dumps({**config, "quantization_config": qconfig}))
    return dst / "quant", dst / "dequant"
