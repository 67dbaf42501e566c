"""Gemma 3's image side (`Gemma3ForConditionalGeneration`), from config.json: its SigLIP vision tower's shapes, the
multi-modal projector's pooling, and the image tokens.

Unlike Qwen2-VL (vision_spec.py) every image is resized to one square (`image_size`), so every image gives the same
`mm_tokens_per_image` language-model tokens; rotary positions stay 1-D (`mrope_section` is empty), and the language
model attends bidirectionally among the tokens of one image (`bidirectional_images`: engine/images.py,
model/backend/).

A chat template writes one `<start_of_image>` (boi) per image; the processor turns it into
"\\n\\n<start_of_image>" + mm_tokens_per_image x `<image_soft_token>` + "<end_of_image>\\n\\n" (io/images.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from cbatch.model.errors import UnsupportedModelError
from cbatch.model.vision_spec import linear_params, vit_block_params

# transformers' SiglipVisionConfig defaults (a hub config states only what differs)
_SIGLIP_DEFAULTS: dict[str, Any] = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                        num_attention_heads=12, num_channels=3, image_size=224, patch_size=16,
                                        layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")


@dataclass(frozen=True, slots=True)
class SiglipSpec:
    """The SigLIP tower (a ViT over patch_size x patch_size patches of an image_size square, learned positions; its
    pooling head, if any, unused) and Gemma 3's projector (average pool to mm_tokens_per_image, RMSNorm, one
    projection)."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    in_channels: int
    image_size: int
    patch_size: int
    layer_norm_eps: float
    activation: str  # gelu_pytorch_tanh (Gemma 3) | gelu
    out_hidden_size: int  # the language model's hidden size
    mm_tokens_per_image: int
    image_token_id: int  # `<image_soft_token>`: one per language-model token of an image
    boi_token_id: int  # `<start_of_image>`: what a chat template writes per image
    eoi_token_id: int

    # what code reading a Qwen VisionSpec asks of any tower: 1-D rotary positions (no M-RoPE sections), no deepstack
    tower: ClassVar[str] = "siglip"
    mrope_section: ClassVar[tuple[int, ...]] = ()
    mrope_interleaved: ClassVar[bool] = False
    deepstack_layers: ClassVar[tuple[int, ...]] = ()
    bidirectional_images: ClassVar[bool] = True  # an image's tokens attend to each other both ways

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: channels x patch x patch (io/images.py's rows)."""
        return self.in_channels * self.patch_size**2

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def pool(self) -> int:
        """The average pool's kernel (= stride): patches per language-model token along each side."""
        return self.patches_per_side // int(round(self.mm_tokens_per_image**0.5))

    def tokens_for_grid(self, grid: tuple[int, int, int]) -> int:
        """Language-model tokens of an image (whatever its grid: every image is resized to one square)."""
        return self.mm_tokens_per_image

    def num_params(self) -> int:
        """Parameters of the tower and the projector as a run holds them (model/siglip.py; the pooling head is not
        loaded): the patch embedding (biased), the learned positions, LayerNorm blocks, the final LayerNorm, the
        projector's RMSNorm (weight) and projection [E, text hidden]."""
        e = self.hidden_size
        embed = linear_params(self.patch_dim, e) + self.patches_per_side**2 * e
        blocks = self.depth * vit_block_params(e, self.intermediate_size, 2 * e)
        return embed + blocks + 2 * e + e + e * self.out_hidden_size


def parse_siglip(cfg: dict[str, Any], text_hidden_size: int) -> SiglipSpec:
    """The image side of a Gemma3ForConditionalGeneration's config.json."""
    vision = cfg.get("vision_config")
    if not isinstance(vision, dict):
        raise UnsupportedModelError("config.json of a Gemma3ForConditionalGeneration has no vision_config; "
                                    "the checkpoint looks incomplete")
    vision = {**_SIGLIP_DEFAULTS, **vision}
    if vision["hidden_act"] not in ("gelu_pytorch_tanh", "gelu"):
        raise UnsupportedModelError(f"vision hidden_act {vision['hidden_act']!r} is not supported; supported: "
                                    "gelu_pytorch_tanh, gelu")
    tokens = int(cfg.get("mm_tokens_per_image", 256))
    spec = SiglipSpec(
        depth=int(vision["num_hidden_layers"]),
        hidden_size=int(vision["hidden_size"]),
        num_heads=int(vision["num_attention_heads"]),
        intermediate_size=int(vision["intermediate_size"]),
        in_channels=int(vision["num_channels"]),
        image_size=int(vision["image_size"]),
        patch_size=int(vision["patch_size"]),
        layer_norm_eps=float(vision["layer_norm_eps"]),
        activation=vision["hidden_act"],
        out_hidden_size=text_hidden_size,
        mm_tokens_per_image=tokens,
        image_token_id=int(cfg.get("image_token_index", cfg.get("image_token_id", 262_144))),
        boi_token_id=int(cfg.get("boi_token_index", cfg.get("boi_token_id", 255_999))),
        eoi_token_id=int(cfg.get("eoi_token_index", cfg.get("eoi_token_id", 256_000))),
    )
    side = int(round(tokens**0.5))
    if side * side != tokens or spec.patches_per_side % side:
        raise UnsupportedModelError(f"mm_tokens_per_image {tokens} does not pool a {spec.patches_per_side} x "
                                    f"{spec.patches_per_side} patch grid evenly; the checkpoint looks inconsistent")
    return spec
