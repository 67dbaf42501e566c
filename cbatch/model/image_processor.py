"""The model's own Hugging Face image processor (the PIL one: no torchvision), made from its checkpoint's processor
settings (`processor_config`: where transformers reads them) with a job's pixel bounds on top; a Qwen2-VL video
processor's settings (`VideoLimits`: frame sampling, per-frame pixel bounds); and what the size rule implies without
an image: the pixel bounds and the most placeholder tokens one image can get. The row readers (io/images.py,
io/videos.py) preprocess with it; the GPU memory reserve for images (engine/encoder_memory.py) sizes its largest
image and video from it. Gemma 3's pan-and-scan (`PanAndScan`: where an image's extra crops are cut, from its size
alone) is cbatch's own rule."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbatch.model.siglip_spec import SiglipSpec
from cbatch.model.vision_spec import VisionSpec


IMAGE_CONFIG = "preprocessor_config.json"
VIDEO_CONFIG = "video_preprocessor_config.json"
PROCESSOR_CONFIG = "processor_config.json"  # transformers 5 saves a processor's parts in it, a section each


def image_processor(model_dir: Path | None, vision: VisionSpec | SiglipSpec, min_pixels: int | None = None,
                    max_pixels: int | None = None, video: bool = False):
    """The processor of a model of `vision` in `model_dir`; `min_pixels` / `max_pixels`: a job's bounds over the
    model's (None: the model's; Gemma 3's processor resizes to its square whatever they are). `video`: the one a
    video's frames go through (Qwen: the image processor with the video processor's settings: `video_limits`)."""
    if isinstance(vision, SiglipSpec):
        return _siglip_processor(model_dir, vision)
    bounds = {"min_pixels": min_pixels, "max_pixels": max_pixels}
    if not video:
        return _processor(vision, bounds, processor_config(model_dir))
    given = processor_config(model_dir, video=True)
    limits = video_limits(model_dir, min_pixels, max_pixels, vision.timestamped_videos)
    given.update(min_pixels=limits.min_pixels, max_pixels=limits.max_pixels)
    if vision.timestamped_videos:  # Qwen3VLVideoProcessor's class defaults (ImageNet's standard mean and std)
        given.setdefault("image_mean", [0.5, 0.5, 0.5])
        given.setdefault("image_std", [0.5, 0.5, 0.5])
    return _processor(vision, {"min_pixels": None, "max_pixels": None}, given)


def processor_config(model_dir: Path | None, video: bool = False) -> dict[str, Any]:
    """The checkpoint's image (`video`: video) processor settings where transformers looks for them:
    processor_config.json's "image_processor" / "video_processor" section, else preprocessor_config.json (a video's:
    video_preprocessor_config.json first); {} where none."""
    nested = (_read_json(model_dir, PROCESSOR_CONFIG) or {}).get("video_processor" if video else "image_processor")
    if isinstance(nested, dict):
        return dict(nested)
    for name in (VIDEO_CONFIG, IMAGE_CONFIG) if video else (IMAGE_CONFIG,):
        if (given := _read_json(model_dir, name)) is not None:
            return given
    return {}


def _read_json(model_dir: Path | None, name: str) -> dict[str, Any] | None:
    """The checkpoint's file `name` read (None where it has none)."""
    path = model_dir / name if model_dir is not None else None
    return json.loads(path.read_text()) if path is not None and path.is_file() else None


@dataclass(frozen=True, slots=True)
class VideoLimits:
    """A Qwen video processor's frame sampling and pixel bounds, as transformers' Qwen2VLVideoProcessor (per frame)
    or Qwen3VLVideoProcessor (`whole_video`: the bounds hold for all the video's frames together) sets them from a
    checkpoint (`video_limits`). Its defaults are Qwen2VLVideoProcessor's (cbatch samples at `fps` always)."""

    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    fps: float = 2.0  # frames sampled per second of video
    min_frames: int = 4
    max_frames: int = 768
    # qwen-vl-utils' bound (transformers' `cap_pixels_per_frame`, off unless the checkpoint sets it). Qwen2-VL: a
    # frame gets at most its share of `max_video_tokens` x 0.9 tokens' pixels; Qwen3-VL: at most `max_video_tokens`
    # tokens' pixels and its share of max_pixels; both never below 1.05 x min_pixels
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 128000
    whole_video: bool = False  # Qwen3-VL: min_pixels / max_pixels bound the sampled frames' pixels together

    def frame_max_pixels(self, frames: int, factor: int, temporal: int) -> int:
        """The max_pixels of each frame of a video of `frames` sampled frames (`factor`: patch x merge pixels)."""
        if not self.cap_pixels_per_frame:
            return self.max_pixels
        total = int(self.max_video_tokens * factor * factor * 0.9)
        return max(min(self.max_pixels, total * temporal // max(frames, 1)), int(self.min_pixels * 1.05))

    def video_max_pixels(self, frames: int, factor: int) -> int:
        """`whole_video`: the max_pixels of all `frames` sampled frames together (Qwen3VLVideoProcessor's resize)."""
        if not self.cap_pixels_per_frame:
            return self.max_pixels
        per_frame = min(self.max_video_tokens * factor * factor, self.max_pixels // max(frames, 1))
        return max(per_frame, int(self.min_pixels * 1.05)) * frames

    def largest_frame_pixels(self, factor: int) -> int:
        """At least the most pixels a frame of any video gets (`factor`: patch x merge pixels). Per frame: max_pixels
        (the cap's floor may pass it). A whole video's frames (at least one temporal patch of 2, within the bounds
        together; at most 200:1): half of max_pixels; with the cap 5 / 4 of its floor (5 frames are counted as 4);
        a narrow video scaled down with its short side kept at one factor: the factor x its long side (under
        sqrt(200 x the frame's share)); a small video scaled up to min_pixels: half of that, each side then rounded
        up to a factor (the sides of half of min_pixels at 200:1 sum to under 15 x its square root)."""
        if not self.whole_video:
            return max(self.max_pixels, int(self.min_pixels * 1.05)) if self.cap_pixels_per_frame else self.max_pixels
        floor = -(-int(self.min_pixels * 1.05) * 5 // 4) if self.cap_pixels_per_frame else 0
        narrow = factor * (math.isqrt(100 * self.max_pixels + 210 * self.min_pixels) + 1)
        half = self.min_pixels // 2
        scaled_up = half + factor * (15 * (math.isqrt(half) + 1) + factor)
        return max(self.max_pixels // 2, floor, narrow, scaled_up)

    def max_temporal_patches(self, temporal: int) -> int:
        """The most temporal patches a video samples (max_frames rounded down to whole patches, Qwen3-VL's up: it
        fills the last patch; at least one)."""
        return max(1, -(-self.max_frames // temporal) if self.whole_video else self.max_frames // temporal)


# Qwen3VLVideoProcessor's class defaults: its pixel bounds are for a whole video
QWEN3_VIDEO_LIMITS = VideoLimits(min_pixels=128 * 32 * 32, max_pixels=768 * 32 * 32, max_video_tokens=768,
                                 whole_video=True)


def video_limits(model_dir: Path | None, min_pixels: int | None = None, max_pixels: int | None = None,
                 whole_video: bool = False, fps: float | None = None) -> VideoLimits:
    """The video processor's settings in `model_dir` (`processor_config(video=True)`), read as
    Qwen2VLVideoProcessor's constructor reads them: the file's `size` {shortest_edge, longest_edge} replaces the
    class's, and its `min_pixels` / `max_pixels` override that (a checkpoint with a preprocessor_config.json alone
    gives its videos the images' bounds, as transformers does). `whole_video` (Qwen3-VL): Qwen3VLVideoProcessor's,
    which reads the file's `size` alone. `min_pixels` / `max_pixels` / `fps`: a job's bounds and frame rate over the
    file's (EngineConfig.video_min_pixels / video_max_pixels / video_fps; None: the file's), as from_pretrained's
    kwargs."""
    given = processor_config(model_dir, video=True)
    if whole_video:
        given = {k: v for k, v in given.items() if k not in ("min_pixels", "max_pixels")}
    given.update({k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels), ("fps", fps))
                  if v is not None})
    default = QWEN3_VIDEO_LIMITS if whole_video else VideoLimits()
    size = given.get("size") or {"shortest_edge": default.min_pixels, "longest_edge": default.max_pixels}
    low = given.get("min_pixels") or size.get("shortest_edge") or default.min_pixels
    high = given.get("max_pixels") or size.get("longest_edge") or default.max_pixels
    return VideoLimits(int(low), int(high), float(given.get("fps") or default.fps),
                       int(given.get("min_frames") or default.min_frames),
                       int(given.get("max_frames") or default.max_frames),
                       bool(given.get("cap_pixels_per_frame")),
                       int(given.get("max_video_tokens") or default.max_video_tokens), whole_video)


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
    given = processor_config(model_dir)
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
    given = processor_config(model_dir)
    if not (job if job is not None else bool(given.get("do_pan_and_scan"))):
        return None
    settings = {name: given[key] for name, key in (("min_crop", "pan_and_scan_min_crop_size"),
                                                   ("max_crops", "pan_and_scan_max_num_crops"),
                                                   ("min_ratio", "pan_and_scan_min_ratio_to_activate"))
                if given.get(key) is not None}
    return PanAndScan(**settings)
