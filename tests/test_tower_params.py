"""A vision-language model's image encoder counted from its spec alone (VisionSpec / SiglipSpec.num_params), and the
plan's weights per rank holding it whole on rank 0."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from cbatch.config import EngineConfig
from cbatch.engine.resolve import ResolvedModel
from cbatch.model.backend import TorchBackend
from cbatch.model.siglip import SiglipTower
from cbatch.model.spec import parse_spec
from cbatch.model.vision import VisionTower
from cbatch.model.vision_qwen3 import Qwen3VisionTower
from cbatch.plan.devices import gpu_kind
from gemma3_vision_models import GEMMA_3_4B_CONFIG, gemma3_model
from test_encoder_memory import QWEN2_5_VL_7B, text_config_of
from vision_models import vl_model

TOWERS = {"qwen2": VisionTower, "qwen3": Qwen3VisionTower, "siglip": SiglipTower}


def hf_encoder(kind: str) -> tuple[dict, int]:
    """(config.json, parameters of the image encoder the loader keeps) of transformers' tiny `kind` model: Qwen-VL's
    `visual` (tower and mergers); Gemma 3's SigLIP tower and multi-modal projector, its pooling head left out (the
    loader drops `head.*`)."""
    if kind == "gemma3":
        model = gemma3_model()
        kept = [p for name, p in model.model.vision_tower.named_parameters() if not name.startswith("head.")]
        kept += list(model.model.multi_modal_projector.parameters())
    else:
        model = vl_model(kind)
        kept = list(model.model.visual.parameters())
    return model.config.to_dict(), sum(p.numel() for p in kept)


@pytest.mark.parametrize("kind", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma3"])
def test_the_towers_count_is_transformers_and_ours(kind):
    config, hf_params = hf_encoder(kind)
    vision = parse_spec(config).vision
    ours = TOWERS[vision.tower](vision, TorchBackend())
    assert vision.num_params() == hf_params == sum(p.numel() for p in ours.parameters())
    assert parse_spec(config).tower_params() == hf_params


def test_published_towers():
    # Qwen2.5-VL-7B: 8.29 B published = 7.07 B decoder (lm_head in) + 0.55 B embedding + 0.68 B tower
    qwen = parse_spec(QWEN2_5_VL_7B)
    assert (qwen.tower_params(), qwen.num_params()) == (676_550_144, 7_070_285_824)
    # gemma-3-4b: SigLIP so400m without its pooling head (27 x 1152 wide blocks), 4,096 positions, the projector
    assert parse_spec(GEMMA_3_4B_CONFIG).tower_params() == 419_816_304
    assert parse_spec(text_config_of(QWEN2_5_VL_7B)).tower_params() == 0


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize("fp8", [False, True])
def test_the_plans_weights_hold_the_tower_on_rank_0(ranks, fp8):
    """Qwen2.5-VL-7B against its decoder alone: rank 0's weights grow by the tower whole (under -tp too) at two bytes
    a weight, an FP8 checkpoint's too (its tower stays bf16)."""
    quant = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}} if fp8 else {}
    vl = parse_spec({**QWEN2_5_VL_7B, **quant})
    text = replace(vl, vision=None)  # the same decoder, counted alone
    cuda = torch.device("cuda")
    config = EngineConfig(max_model_len=32768, tensor_parallel_size=ranks)
    h100 = gpu_kind("H100")
    grown = (h100.weight_bytes_per_rank(config, ResolvedModel(vl, cuda, torch.bfloat16, 32768))
             - h100.weight_bytes_per_rank(config, ResolvedModel(text, cuda, torch.bfloat16, 32768)))
    assert grown == 676_550_144 * 2


def test_an_fp8_checkpoints_bytes_per_weight_are_its_decoders(tmp_path):
    """A Qwen2.5-VL FP8 checkpoint (decoder matmuls in FP8, the tower bf16 as published ones leave it): the plan's
    bytes per decoder weight, from the safetensors headers, are the same without the tower's tensors, so the
    tower's bf16 is not spread over the decoder (it is counted apart at 2 bytes a weight)."""
    import json

    from safetensors.torch import load_file, save_file

    from cbatch.model.backend.triton_backend import TritonBackend
    from cbatch.model.loader import load_model, read_checkpoint
    from cbatch.observe.roofline import stored_bytes_per_weight
    from cbatch.plan.devices import gpu_bytes_per_weight
    from fp8_models import fp8_config, quantize_fp8
    from vision_models import make_vl_checkpoint

    src = make_vl_checkpoint("qwen2_5_vl", tmp_path / "float")
    tensors = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if name.startswith("model.layers.") and name.endswith("proj.weight"):  # (transformers 5 saves the hub's names)
            tensors[name], tensors[name.removesuffix("weight") + "weight_scale_inv"] = quantize_fp8(tensor, None, True)
        else:
            tensors[name] = tensor.to(torch.bfloat16)
    config = {**json.loads((src / "config.json").read_text()), "quantization_config": fp8_config(None)}
    planned = []
    for folder, kept in ((tmp_path / "vl", tensors),
                         (tmp_path / "decoder", {k: v for k, v in tensors.items() if not k.startswith("visual.")})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        save_file(kept, str(folder / "model.safetensors"))
        ckpt = read_checkpoint(folder)
        planned.append(gpu_bytes_per_weight(ResolvedModel(ckpt.spec, torch.device("cuda"), torch.bfloat16, 64, ckpt)))
    assert planned[0] == planned[1] < 2.0
    # the loaded GPU-path model's (FP8 kept) decoder matrices store the same bytes per weight, its tower aside
    vl = read_checkpoint(tmp_path / "vl")
    model = load_model(vl, 64, torch.device("cpu"), torch.bfloat16, TritonBackend())
    assert model.visual is not None and stored_bytes_per_weight(model) == pytest.approx(planned[0], rel=1e-9)
