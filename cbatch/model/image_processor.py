"""The model's own Hugging Face image processor (the PIL one: no torchvision), made from its checkpoint's
preprocessor_config.json with a job's pixel bounds on top, and what its size rule implies without an image: the
pixel bounds and the most placeholder tokens one image can get. The row reader (io/images.py) preprocesses with it;
the GPU memory reserve for images (engine/encoder_memory.py) sizes its largest image from it. Gemma 3's
pan-and-scan (`PanAndScan`: where an image's extra crops are cut, from its size alone) is cbatch's own rule."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbatch.model.siglip_spec import SiglipSpec
from cbatch.model.vision_spec import VisionSpec


IMAGE_CONFIG = "preprocessor_config.json"
# a video's: transformers' video processor reads this file where the checkpoint has it, else the image one
VIDEO_CONFIGS = ("video_preprocessor_config.json", IMAGE_CONFIG)
# the video processor's pixel bounds where its file has none (transformers' Qwen2VLVideoProcessor's defaults)
VIDEO_PIXELS = (128 * 28 * 28, 768 * 28 * 28)


def image_processor(model_dir: Path | None, vision: VisionSpec | SiglipSpec, min_pixels: int | None = None,
                    max_pixels: int | None = None, video: bool = False):
    """The processor of a model of `vision` in `model_dir`; `min_pixels` / `max_pixels`: a job's bounds over the
    model's (None: the model's; Gemma 3's processor resizes to its square whatever they are). `video`: the one a
    video's frames go through (Qwen: the image processor with the video processor's config: VIDEO_CONFIGS)."""
    if isinstance(vision, SiglipSpec):
        return _siglip_processor(model_dir, vision)
    bounds = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    if not video:
        return _processor(vision, bounds, read_config(model_dir, (IMAGE_CONFIG,)))
    given = read_config(model_dir, VIDEO_CONFIGS)
    size = given.get("size") or {}
    for (key, edge), default in zip((("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")), VIDEO_PIXELS):
        given[key] = given.get(key) or size.get(edge) or default
    return _processor(vision, bounds, given)


def read_config(model_dir: Path | None, names: tuple[str, ...]) -> dict[str, Any]:
    """The first of the checkpoint's processor config files `names` it has, read ({} where none)."""
    for name in names:
        path = model_dir / name if model_dir is not None else None
        if path is not None and path.is_file():
            return json.loads(path.read_text())
    return {}


def pixel_range(processor) -> tuple[int, int]:
    """A Qwen-style processor's (min_pixels, max_pixels)."""
    size = processor.size
    return int(size["shortest_edge"]), int(size["longest_edge"])


def max_image_tokens(processor, vision: VisionSpec | SiglipSpec) -> int:
    """The most placeholder tokens one image gets: the processor's max_pixels in merged patches (Gemma 3: its one
    square's)."""
    if isinstance(vision, SiglipSpec):
        return vision.mm_tokens_per_image
    side = int(processor.patch_size) * int(processor.merge_size)
    return pixel_range(processor)[1] // side**2


_PROCESSOR_KEYS = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean",
                   "image_std", "do_resize", "do_rescale", "rescale_factor", "do_normalize", "do_convert_rgb", "size")


def _processor(vision: VisionSpec, bounds: dict[str, int | None], given: dict[str, Any]):
    """transformers' PIL image processor for Qwen2-VL (no torchvision needed) from the checkpoint's processor
    config `given` (preprocessor_config.json's), the vision spec's patch sizes where it has none, the job's pixel
    `bounds` on top ({"min_pixels", "max_pixels"}: None where the model's hold)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil as Processor
    except ImportError:  # transformers before the PIL/torchvision split: the slow processor is the PIL one
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor as Processor
    kwargs: dict[str, Any] = dict(patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
                                  merge_size=vision.merge_size)
    kwargs.update({k: v for k, v in given.items() if k in _PROCESSOR_KEYS})
    size = dict(kwargs.pop("size", None) or {})
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        value = bounds[key]
        if value is not None:
            kwargs[key] = value
        elif key not in kwargs and edge in size:
            kwargs[key] = size[edge]
    return Processor(**kwargs)


def _siglip_processor(model_dir: Path | None, vision: SiglipSpec):
    """transformers' PIL image processor for Gemma 3 (no torchvision needed) from the checkpoint's
    preprocessor_config.json, resizing to the tower's square whatever the file says (its positions fix the size).
    It never cuts pan-and-scan crops itself: the reader cuts them (`PanAndScan`) and hands them over as images."""
    try:
        from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil as Processor
    except ImportError:  # transformers before the PIL/torchvision split: the slow processor is the PIL one
        from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor as Processor
    given = read_config(model_dir, (IMAGE_CONFIG,))
    kwargs = {k: v for k, v in given.items() if k in _PROCESSOR_KEYS + ("resample",) and v is not None}
    kwargs["size"] = {"height": vision.image_size, "width": vision.image_size}
    return Processor(**kwargs, do_pan_and_scan=False)


@dataclass(frozen=True, slots=True)
class PanAndScan:
    """Gemma 3's pan-and-scan: an image at least `min_ratio` times wider than tall (or taller than wide) also goes
    to the tower as 2 to `max_crops` equal slices along its long side, each at least `min_crop` pixels both ways
    (none where they would be smaller); each slice is an image of its own (resized to the tower's square, 256
    tokens). Defaults: transformers' Gemma3Processor's, where preprocessor_config.json says null."""

    min_crop: int = 256
    max_crops: int = 4
    min_ratio: float = 1.2

    def boxes(self, height: int, width: int) -> list[tuple[int, int, int, int]]:
        """The crops of a height x width image as PIL boxes (left, top, right, bottom), left to right or top to
        bottom; [] where the image gets none. Its size alone decides them (cbatch plan counts them from a header)."""
        long, short = max(height, width), min(height, width)
        if long / short < self.min_ratio:
            return []
        count = min(int(math.floor(long / short + 0.5)), long // self.min_crop)  # slices near square, not too small
        count = min(self.max_crops, max(2, count))
        step = -(-long // count)  # ceil: the last slice may be narrower
        if min(step, short) < self.min_crop:
            return []
        spans = [(start, min(start + step, long)) for start in range(0, long, step)]  # (count of them)
        if width >= height:  # (a square image only where min_ratio <= 1: cut across, as a wide one)
            return [(lo, 0, hi, height) for lo, hi in spans]
        return [(0, lo, width, hi) for lo, hi in spans]


def pan_and_scan_for(model_dir: Path | None, vision: VisionSpec | SiglipSpec, job: bool | None = None) -> PanAndScan | None:
    """The pan-and-scan a Gemma 3 reader applies: the job's choice (`job`: EngineConfig.image_pan_and_scan), else
    the checkpoint's `do_pan_and_scan` (null: off), with its `pan_and_scan_*` settings; None where off or for a model
    without it (Qwen)."""
    if not isinstance(vision, SiglipSpec):
        return None
    given = read_config(model_dir, (IMAGE_CONFIG,))
    if not (job if job is not None else bool(given.get("do_pan_and_scan"))):
        return None
    settings = {name: given[key] for name, key in (("min_crop", "pan_and_scan_min_crop_size"),
                                                   ("max_crops", "pan_and_scan_max_num_crops"),
                                                   ("min_ratio", "pan_and_scan_min_ratio_to_activate"))
                if given.get(key) is not None}
    return PanAndScan(**settings)
