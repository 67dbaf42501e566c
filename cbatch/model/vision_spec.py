"""A vision-language checkpoint's image side, from config.json: the vision tower's shapes (`VisionSpec`), the image
placeholder token, and M-RoPE's sections. Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`,
`Qwen2_5_VLForConditionalGeneration`): their text decoder is a Qwen2 decoder whose rotary position is 3-D
(temporal, height, width; model/mrope.py). Qwen3-VL (`Qwen3VLForConditionalGeneration`): a Qwen3 decoder, M-RoPE's
sections interleaved, and its own tower (model/vision_qwen3.py: learned positions, deepstack); Qwen3-VL-MoE
(`Qwen3VLMoeForConditionalGeneration`): the same tower and M-RoPE with a Qwen3-MoE decoder.

Both spellings are read: transformers 5's (`text_config`, `vision_config`, `rope_parameters.mrope_section`) and the
hub's older one (the text decoder's fields at the top level, `rope_scaling: {"type": "mrope", "mrope_section"}`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cbatch.model.errors import UnsupportedModelError

QWEN3_VL_ARCHITECTURES = ("Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration")  # one tower
VISION_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                        *QWEN3_VL_ARCHITECTURES)
_VISION_ACTIVATIONS = ("quick_gelu", "silu", "gelu", "gelu_pytorch_tanh")


@dataclass(frozen=True, slots=True)
class VisionSpec:
    """The vision tower (a ViT over 14 x 14 patches, 2-frame temporal patches) and its patch merger, which turns each
    `merge_size` x `merge_size` block of patches into one language-model token."""

    depth: int
    hidden_size: int  # the tower's width (Qwen2-VL's embed_dim)
    num_heads: int
    intermediate_size: int  # its MLP's
    activation: str  # quick_gelu (Qwen2-VL) | silu (Qwen2.5-VL) | gelu | gelu_pytorch_tanh
    gated_mlp: bool  # Qwen2.5-VL: down(act(gate(x)) * up(x)); Qwen2-VL: fc2(act(fc1(x)))
    rms_norm: bool  # Qwen2.5-VL: RMSNorm (no bias); Qwen2-VL: LayerNorm
    out_hidden_size: int  # the language model's hidden size (the merger's output)
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int  # spatial_merge_size
    rope_theta: float
    window_size: int  # Qwen2.5-VL: windowed attention over window_size x window_size pixels; 0: full attention
    full_attention_blocks: tuple[int, ...]  # Qwen2.5-VL: the blocks that attend over the whole image
    image_token_id: int  # the placeholder token, one per merged patch
    vision_start_token_id: int | None
    mrope_section: tuple[int, ...]  # rotary frequency pairs per axis (temporal, height, width), summing to head_dim / 2
    # Qwen3-VL (tower "qwen3": model/vision_qwen3.py): a learned position table of this many entries (a square grid,
    # resampled to each image's), the blocks whose output a deepstack merger turns into features added to the
    # decoder's first layers, and M-RoPE's axes interleaved (column c turned by axis c % 3) instead of in sections
    tower: str = "qwen2"  # qwen2 (Qwen2-VL, Qwen2.5-VL: model/vision.py) | qwen3
    num_position_embeddings: int = 0
    deepstack_layers: tuple[int, ...] = ()
    mrope_interleaved: bool = False
    # videos: the placeholder token of a video's merged patches (None: the model takes no videos), and Qwen2.5-VL's
    # M-RoPE temporal positions per second of video (0: one position per temporal patch); Qwen3-VL writes each
    # temporal patch as its own run between vision start and end tokens (`timestamped_videos`)
    video_token_id: int | None = None
    tokens_per_second: float = 0.0
    vision_end_token_id: int | None = None

    @property
    def timestamped_videos(self) -> bool:
        """Qwen3-VL: a video's temporal patches are runs of their own, each after its time as text ("<1.2 seconds>")
        between vision start and end tokens, placed by M-RoPE as images; the video processor's pixel bounds hold
        for the whole video's frames (io/videos.py)."""
        return self.tower == "qwen3"

    @property
    def patch_dim(self) -> int:
        """Values per flattened patch: channels x temporal x patch x patch (the image processor's rows)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def tokens_for_grid(self, grid: tuple[int, int, int]) -> int:
        """Language-model tokens of an image whose patch grid is (t, h, w)."""
        t, h, w = grid
        return t * h * w // self.merge_size**2

    def num_params(self) -> int:
        """Parameters of the tower and its merger(s) as a run holds them (model/vision.py, vision_qwen3.py): what
        rank 0 keeps beside the decoder's `ModelSpec.num_params()`."""
        return _qwen3_tower_params(self) if self.tower == "qwen3" else _qwen2_tower_params(self)


def linear_params(fan_in: int, fan_out: int) -> int:
    """A biased Linear's: weight [fan_out, fan_in] and bias [fan_out]."""
    return fan_in * fan_out + fan_out


def vit_block_params(width: int, intermediate: int, norm: int, gated: bool = False) -> int:
    """One pre-norm ViT block: two norms of `norm` parameters each, biased q, k, v and output projections, and a
    biased MLP (fc1, fc2; `gated`: gate, up, down)."""
    mlp = (2 if gated else 1) * linear_params(width, intermediate) + linear_params(intermediate, width)
    return 2 * norm + 4 * linear_params(width, width) + mlp


def _merger_params(vs: VisionSpec, norm: int) -> int:
    """A patch merger: its norm (of `norm` parameters), Linear(W, W), Linear(W, out), W = merge^2 patches' width."""
    width = vs.hidden_size * vs.merge_size**2
    return norm + linear_params(width, width) + linear_params(width, vs.out_hidden_size)


def _qwen2_tower_params(vs: VisionSpec) -> int:
    """Qwen2-VL / Qwen2.5-VL: the patch embedding (no bias), the blocks (LayerNorm: weight and bias; Qwen2.5-VL's
    RMSNorm: weight), the merger."""
    norm = vs.hidden_size * (1 if vs.rms_norm else 2)
    blocks = vs.depth * vit_block_params(vs.hidden_size, vs.intermediate_size, norm, vs.gated_mlp)
    return vs.hidden_size * vs.patch_dim + blocks + _merger_params(vs, norm)


def _qwen3_tower_params(vs: VisionSpec) -> int:
    """Qwen3-VL: the patch embedding (biased), the learned positions, LayerNorm blocks, the merger (LayerNorm over
    each patch) and a deepstack merger per deepstack layer (LayerNorm over the merged patches)."""
    embed = linear_params(vs.patch_dim, vs.hidden_size) + vs.num_position_embeddings * vs.hidden_size
    blocks = vs.depth * vit_block_params(vs.hidden_size, vs.intermediate_size, 2 * vs.hidden_size)
    deepstack = len(vs.deepstack_layers) * _merger_params(vs, 2 * vs.hidden_size * vs.merge_size**2)
    return embed + blocks + _merger_params(vs, 2 * vs.hidden_size) + deepstack


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text decoder's config of a vision-language checkpoint: the top level (older checkpoints keep the decoder's
    fields there) under `text_config`, the rope's mrope_section taken out (model/mrope.py applies it)."""
    top = {k: v for k, v in cfg.items() if k not in ("text_config", "vision_config")}
    text = {**top, **(cfg.get("text_config") or {})}
    for key in ("rope_parameters", "rope_scaling"):
        params = text.get(key)
        if isinstance(params, dict):
            params = {k: v for k, v in params.items() if k != "mrope_section"}
            if params.get("type") == "mrope" or params.get("rope_type") == "mrope":
                params.pop("type", None)
                params["rope_type"] = "default"
            text[key] = params
    text["torch_dtype"] = cfg.get("torch_dtype") or cfg.get("dtype") or text.get("torch_dtype")
    return text


def _mrope_section(cfg: dict[str, Any]) -> tuple[int, ...]:
    text = {**cfg, **(cfg.get("text_config") or {})}
    for key in ("rope_parameters", "rope_scaling"):
        params = text.get(key)
        if isinstance(params, dict) and params.get("mrope_section"):
            return tuple(int(s) for s in params["mrope_section"])
    raise UnsupportedModelError("config.json of a Qwen2-VL model lacks rope mrope_section; the checkpoint looks incomplete")


def parse_vision(cfg: dict[str, Any], arch: str) -> VisionSpec:
    """The vision side of a VISION_ARCHITECTURES checkpoint's config.json."""
    vision = cfg.get("vision_config")
    if not isinstance(vision, dict):
        raise UnsupportedModelError(f"config.json of a {arch} has no vision_config; the checkpoint looks incomplete")
    if arch in QWEN3_VL_ARCHITECTURES:
        return _parse_qwen3_vision(cfg, vision, arch)
    qwen25 = arch == "Qwen2_5_VLForConditionalGeneration"
    activation = _activation(vision, "silu" if qwen25 else "quick_gelu")
    rope = vision.get("rope_parameters") or {}
    if qwen25:
        hidden = int(vision.get("hidden_size", 1280))
        intermediate = int(vision.get("intermediate_size", 3420))
        out_hidden = int(vision.get("out_hidden_size", 3584))
    else:
        hidden = int(vision.get("embed_dim", 1280))
        intermediate = int(hidden * float(vision.get("mlp_ratio", 4)))
        out_hidden = int(vision.get("hidden_size", 3584))
    return VisionSpec(
        depth=int(vision.get("depth", 32)),
        hidden_size=hidden,
        num_heads=int(vision.get("num_heads", 16)),
        intermediate_size=intermediate,
        activation=activation,
        gated_mlp=qwen25,
        rms_norm=qwen25,
        out_hidden_size=out_hidden,
        in_channels=int(vision.get("in_channels", vision.get("in_chans", 3))),
        patch_size=int(vision.get("patch_size", vision.get("spatial_patch_size", 14))),
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        merge_size=int(vision.get("spatial_merge_size", 2)),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        window_size=int(vision.get("window_size", 112)) if qwen25 else 0,
        full_attention_blocks=tuple(int(i) for i in vision.get("fullatt_block_indexes", (7, 15, 23, 31))) if qwen25 else (),
        image_token_id=_image_token(cfg, arch),
        vision_start_token_id=cfg.get("vision_start_token_id"),
        mrope_section=_mrope_section(cfg),
        video_token_id=_token(cfg, "video_token_id"),
        tokens_per_second=float(vision.get("tokens_per_second", 4)) if qwen25 else 0.0,
        vision_end_token_id=_token(cfg, "vision_end_token_id"),
    )


def takes_videos(vision: Any) -> bool:
    """Whether a model of `vision` (a VisionSpec, Gemma 3's SiglipSpec, or None for text) reads videos: Qwen2-VL,
    Qwen2.5-VL and Qwen3-VL, whose VisionSpec has a video placeholder token."""
    return getattr(vision, "video_token_id", None) is not None


def _token(cfg: dict[str, Any], key: str) -> int | None:
    """The special token `key` of the config (top level, else its text_config); None where neither has it."""
    token = cfg.get(key, (cfg.get("text_config") or {}).get(key))
    return None if token is None else int(token)


def _activation(vision: dict[str, Any], default: str) -> str:
    activation = vision.get("hidden_act", default)
    if activation not in _VISION_ACTIVATIONS:
        raise UnsupportedModelError(f"vision hidden_act {activation!r} is not supported; supported: "
                                    f"{', '.join(_VISION_ACTIVATIONS)}")
    return activation


def _image_token(cfg: dict[str, Any], arch: str) -> int:
    image_token = _token(cfg, "image_token_id")
    if image_token is None:
        raise UnsupportedModelError(f"config.json of a {arch} has no image_token_id; the checkpoint looks incomplete")
    return image_token


def _parse_qwen3_vision(cfg: dict[str, Any], vision: dict[str, Any], arch: str) -> VisionSpec:
    """Qwen3-VL's tower (transformers' Qwen3VLVisionConfig defaults): LayerNorm blocks with a GELU MLP, 16-pixel
    patches, learned positions, deepstack mergers; its text decoder's M-RoPE interleaved."""
    activation = _activation(vision, "gelu_pytorch_tanh")
    depth = int(vision.get("depth", 27))
    deepstack = tuple(int(i) for i in vision.get("deepstack_visual_indexes", (8, 16, 24)))
    if any(not 0 <= i < depth for i in deepstack):
        raise UnsupportedModelError(f"vision deepstack_visual_indexes {list(deepstack)} name blocks outside the "
                                    f"tower's {depth}; the checkpoint's config.json looks broken")
    return VisionSpec(
        depth=depth,
        hidden_size=int(vision.get("hidden_size", 1152)),
        num_heads=int(vision.get("num_heads", 16)),
        intermediate_size=int(vision.get("intermediate_size", 4304)),
        activation=activation,
        gated_mlp=False,
        rms_norm=False,
        out_hidden_size=int(vision.get("out_hidden_size", 3584)),
        in_channels=int(vision.get("in_channels", 3)),
        patch_size=int(vision.get("patch_size", 16)),
        temporal_patch_size=int(vision.get("temporal_patch_size", 2)),
        merge_size=int(vision.get("spatial_merge_size", 2)),
        rope_theta=float((vision.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        window_size=0,
        full_attention_blocks=(),
        image_token_id=_image_token(cfg, arch),
        vision_start_token_id=cfg.get("vision_start_token_id"),
        mrope_section=_mrope_section(cfg),
        tower="qwen3",
        num_position_embeddings=int(vision.get("num_position_embeddings", 2304)),
        deepstack_layers=deepstack,
        mrope_interleaved=True,  # transformers' Qwen3-VL interleaves whatever its config's mrope_interleaved says
        # (a video's runs sit between vision start and end tokens: without them in the config, no videos)
        video_token_id=(_token(cfg, "video_token_id") if None not in (cfg.get("vision_start_token_id"),
                                                                       _token(cfg, "vision_end_token_id")) else None),
        vision_end_token_id=_token(cfg, "vision_end_token_id"),
    )
