"""A tiny random Gemma 3 with its SigLIP tower (`Gemma3ForConditionalGeneration`, written by transformers itself), the
PIL image processor's preprocessor_config.json, and HF `generate` on the same prompt and images as the reference.

Shapes: images resized to 42 x 42 pixels, 6 x 6 patches of 7, pooled 2 x 2 into 9 image tokens; a sliding window of
6 tokens on two of the three text layers, shorter than an image's run (so the window and the image's bidirectional
attention meet)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

PAD, EOS, BOS = 0, 1, 2
BOI, EOI, IMAGE = 6, 7, 8  # <start_of_image>, <end_of_image>, <image_soft_token>
TOKENS_PER_IMAGE = 9
IMAGE_SIZE, PATCH = 42, 7
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=1024,
            rms_norm_eps=1e-6, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, image_size=IMAGE_SIZE,
              patch_size=PATCH)


# gemma-3-4b-it's config.json as published: a text_config stating only what differs from Gemma3TextConfig's defaults
GEMMA_3_4B_CONFIG = {
    "architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106], "torch_dtype": "bfloat16",
    "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                    "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                    "sliding_window": 1024},
    "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                      "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
    "mm_tokens_per_image": 256, "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144}


def gemma3_model():
    """transformers' tiny Gemma3ForConditionalGeneration at its own random init."""
    import transformers

    config = transformers.Gemma3Config(text_config=dict(TEXT), vision_config=dict(VISION), mm_tokens_per_image=TOKENS_PER_IMAGE,
                                       boi_token_index=BOI, eoi_token_index=EOI, image_token_index=IMAGE,
                                       eos_token_id=EOS, architectures=["Gemma3ForConditionalGeneration"])
    return transformers.Gemma3ForConditionalGeneration(config).eval()


def with_pan_and_scan(path: Path, target: Path, do_pan_and_scan: bool | None) -> Path:
    """The checkpoint at `path` copied to `target`, its preprocessor_config.json saying `do_pan_and_scan` with
    crops of at least 8 pixels (the tiny images get some; the other pan_and_scan_* settings left null)."""
    import shutil

    shutil.copytree(path, target)
    config = json.loads((target / "preprocessor_config.json").read_text())
    config.update(do_pan_and_scan=do_pan_and_scan, pan_and_scan_min_crop_size=8, pan_and_scan_max_num_crops=None,
                  pan_and_scan_min_ratio_to_activate=None)
    (target / "preprocessor_config.json").write_text(json.dumps(config))
    return target


def hf_gemma3_processor(path: Path):
    """transformers' Gemma3Processor of the checkpoint at `path` (its tokenizer: vision_models.make_tokenizer's)."""
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    names = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tokenizer = PreTrainedTokenizerFast.from_pretrained(path, extra_special_tokens=names)
    return Gemma3Processor(Gemma3ImageProcessorPil.from_pretrained(path), tokenizer, image_seq_length=TOKENS_PER_IMAGE)


def make_gemma3_checkpoint(path: Path, seed: int = 0) -> Path:
    """Decisive: a wide init of every matrix, RMSNorm weights randomised (HF zeroes Gemma's), the text embeddings
    shrunk (Gemma multiplies them by sqrt(hidden)) and the projector's weight (zero at HF's init) drawn narrow, so
    that neither the image's tokens nor the text's swamp the other: the image and its bidirectional attention
    change the greedy tokens (tests/test_gemma3_vision.py checks both)."""
    torch.manual_seed(seed)
    model = gemma3_model()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
            elif param.dim() >= 2:
                param.normal_(0.0, 0.3)
        model.get_input_embeddings().weight.mul_(0.1)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.05)
    model.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS, "bos_token_id": BOS}))
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2, "do_pan_and_scan": None}))
    return path


SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
            "<end_of_image>", "<image_soft_token>"]  # ids as PAD, EOS, BOS, BOI, EOI, IMAGE above
# Gemma's template in short: one <start_of_image> where a message has an image part (vision_models.make_tokenizer)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} "
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }} {% else %}<start_of_image> {% endif %}"
    "{% endfor %}{% endif %}<end_of_turn> {% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn> model {% endif %}"
)


def pixel_values(images) -> torch.Tensor:
    """The images' patches (PromptImage.pixels [36, 3 * 7 * 7] each) back in the processor's [B, 3, 42, 42]."""
    side = IMAGE_SIZE // PATCH
    return torch.from_numpy(np.stack([im.patches().reshape(side, side, 3, PATCH, PATCH).transpose(2, 0, 3, 1, 4)
                                      .reshape(3, IMAGE_SIZE, IMAGE_SIZE) for im in images]))


_HF: dict[Path, object] = {}


def hf_gemma3(path: Path):
    import transformers

    if path not in _HF:
        _HF[path] = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return _HF[path]


def hf_gemma3_greedy(path: Path, prompt_ids: list[int], images, max_new_tokens: int, bidirectional: bool = True) -> list[int]:
    """HF `generate`, greedy, on the same prompt ids (runs expanded) and images; `bidirectional` False: without the
    token types, every token causal (what a missing image mask would give)."""
    ids = torch.tensor([prompt_ids])
    kwargs = {}
    if images:
        kwargs["pixel_values"] = pixel_values(images)
        if bidirectional:
            kwargs["token_type_ids"] = (ids == IMAGE).long()
    with torch.no_grad():
        out = hf_gemma3(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                       do_sample=False, pad_token_id=PAD, **kwargs)
    return out[0, len(prompt_ids):].tolist()
