"""A vision-language model's image encoder counted from its spec alone (VisionSpec / SiglipSpec.num_params), and the
plan's weights per rank holding it whole on rank 0."""
from __future__ import annotations

import pytest
import torch

from cbatch.model.backend import TorchBackend
from cbatch.model.siglip import SiglipTower
from cbatch.model.spec import parse_spec
from cbatch.model.vision import VisionTower
from cbatch.model.vision_qwen3 import Qwen3VisionTower
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
