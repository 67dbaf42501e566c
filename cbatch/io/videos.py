"""A row's videos (Qwen2-VL, Qwen2.5-VL): decoded with PyAV (pip install 'cbatch[video]'), frames sampled and
preprocessed as transformers' Qwen2-VL video processor does, into a `PromptImage` with `video` set (engine/images.py).

Sampling (transformers' `sample_frames` with fps): `fps` frames a second of the video (default 2.0), at least
`min_frames` (4) and at most `max_frames` (768) and the video's own frame count, rounded down to a multiple of the
temporal patch (2); frame i of n at index floor(i * total / n). A video with fewer frames than one temporal patch
keeps them all (its last frame repeats to fill the patch). The settings are the checkpoint's video processor's
as transformers finds them (model/image_processor.video_limits: processor_config.json's video_processor section,
else video_preprocessor_config.json, else preprocessor_config.json), under the job's video pixel bounds
(--video-min-pixels / --video-max-pixels); the job's image pixel bounds never apply.

Preprocessing: every frame goes through the model's image processor with the video processor's pixel bounds (the
same smart_resize, rescale and normalize: all frames have one size, so one grid; with `cap_pixels_per_frame` a
frame's max_pixels is its share of the video's total, from the sampled frame count), then consecutive frame pairs
become temporal patches: patch k of a pair holds frame 2j at temporal index 0 and frame 2j + 1 at index 1, in the
processor's patch order (merge blocks row-major), as transformers' video `patchify`. Qwen2.5-VL's M-RoPE spaces the
temporal patches by tokens_per_second x seconds per temporal patch (temporal_patch_size / the sampled fps).
Frames are decoded and preprocessed FRAME_GROUP at a time into the output: a long clip holds its float32 patches
and one group of frames, never all its decoded frames.
"""
from __future__ import annotations

import io
import math
from functools import partial
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from cbatch.engine.images import PromptImage
from cbatch.io.images import (MAX_SOURCE_PIXELS, ImageError, ImageReader, VideoSource, describe, read_source,
                              reread_checked, source_digest)
from cbatch.model.image_processor import video_limits
from cbatch.model.vision_spec import VisionSpec

FRAME_GROUP = 16  # frames preprocessed at once (a multiple of the temporal patch)
VIDEO_EXTRA = "pip install 'cbatch[video]'"


def frame_indices(total: int, video_fps: float, fps: float, temporal: int, min_frames: int, max_frames: int
                  ) -> np.ndarray:
    """The indices of the frames sampled from a video of `total` frames at `video_fps` (transformers'
    `sample_frames` with fps; a video shorter than one temporal patch keeps all its frames)."""
    import torch

    top = math.floor(min(max_frames, total) / temporal) * temporal
    count = min(max(total / video_fps * fps, min_frames), top, total)
    count = math.floor(count / temporal) * temporal
    if count < 1:
        return np.arange(total)
    return torch.arange(0, total, total / count).int().numpy()  # (torch's float32 steps, as transformers takes them)


class VideoReader:
    """The model's video sampling and its frames' processor: a row's video source -> `PromptImage` (video)."""

    def __init__(self, model_dir: Path | None, vision: VisionSpec, min_pixels: int | None = None,
                 max_pixels: int | None = None) -> None:
        """`min_pixels` / `max_pixels`: the job's per-frame bounds (EngineConfig.video_min_pixels /
        video_max_pixels) over the model's video processor's; None: the model's."""
        self.vision = vision
        # the image processor with the video's settings
        self.frames = ImageReader(model_dir, vision, min_pixels, max_pixels, video=True)
        self.limits = video_limits(model_dir, min_pixels, max_pixels)

    @classmethod
    def for_config(cls, model_dir: Path | None, vision: VisionSpec, config: "EngineConfig") -> "VideoReader":
        """The reader of an engine's `config` (an EngineConfig: its video pixel bounds)."""
        return cls(model_dir, vision, config.video_min_pixels, config.video_max_pixels)

    def read(self, source: VideoSource, name: str, decode: bool = True) -> PromptImage:
        """The video `source` (called `name` in messages) read, sampled and preprocessed; raises ImageError naming it.
        `decode=False` (cbatch plan): its grid and tokens from its header (size, frame count and rate), no pixels."""
        try:
            return self._read(source, name, decode)
        except ImageError as exc:
            raise ImageError(f"`{name}` ({describe(source)}) {exc}") from None

    def _read(self, source: VideoSource, name: str, decode: bool) -> PromptImage:
        data = read_source(source)
        if not data:
            raise ImageError("is empty (0 bytes)")
        av = _pyav()
        try:
            with av.open(io.BytesIO(data)) as container:
                if not container.streams.video:
                    raise ImageError("has no video stream")
                stream = container.streams.video[0]
                total = stream.frames or _count_frames(data)
                video_fps = float(stream.average_rate or stream.guessed_rate or 24)
                width, height = stream.codec_context.width, stream.codec_context.height
                if total < 1 or min(width, height) < 1:
                    raise ImageError("has no frames")
                if width * height > MAX_SOURCE_PIXELS:
                    raise ImageError(f"has {width} x {height} frames, more than the {MAX_SOURCE_PIXELS:,} pixels "
                                     "cbatch decodes; shrink it")
                limits = self.limits
                indices = frame_indices(total, video_fps, limits.fps, self.vision.temporal_patch_size,
                                        limits.min_frames, limits.max_frames)
                # (decoded while preprocessed, a group of frames at a time: the float32 patches are what is held)
                grid, pixels = (self.patches(_decode(container, stream, indices), len(indices)) if decode
                                else (None, None))
        except av.error.FFmpegError as exc:  # not a container PyAV knows, broken data
            raise ImageError(f"cannot be decoded as a video ({type(exc).__name__}: {exc})") from None
        temporal = self.vision.temporal_patch_size
        sampled_fps = len(indices) / total * video_fps
        # Qwen2.5-VL: M-RoPE's temporal step (float32, as transformers multiplies it); Qwen2-VL: one per patch
        interval = (float(np.float32(self.vision.tokens_per_second) * np.float32(temporal / sampled_fps))
                    if self.vision.tokens_per_second else 1.0)
        digest = source_digest(source, data)
        if grid is None:  # cbatch plan: the grid from the header's size and frame count
            _, h, w = self.frames.grid_for(height, width, self._max_pixels(len(indices)))
            grid = (-(-len(indices) // temporal), h, w)
            return PromptImage(digest, grid, self.vision.tokens_for_grid(grid), None, name, video=True,
                               time_interval=interval)
        return PromptImage(digest, grid, self.vision.tokens_for_grid(grid), pixels, name,
                           partial(self.reread, source, name, digest), video=True, time_interval=interval)

    def patches(self, frames: Iterable[Any], count: int) -> tuple[tuple[int, int, int], np.ndarray]:
        """`count` sampled frames (PIL RGB images of one size) -> (grid (t, h, w), float32 [t * h * w, patch_dim]):
        each frame through the image processor, then consecutive pairs as temporal patches (the last frame repeated
        to fill the last pair). Frames are processed FRAME_GROUP at a time into the output."""
        temporal, patch = self.vision.temporal_patch_size, self.vision.patch_size
        t = -(-count // temporal)
        size = {"shortest_edge": self.limits.min_pixels, "longest_edge": self._max_pixels(count)}
        out: np.ndarray | None = None
        for first, group in _groups(frames, count, temporal):
            processed = self.frames.processor(images=group, size=size, return_tensors="np")
            _, h, w = (int(x) for x in processed["image_grid_thw"][0])
            # the image processor repeats each frame over the temporal patch: keep temporal index 0 of each
            per_frame = processed["pixel_values"].reshape(len(group), h * w, -1, temporal, patch * patch)[:, :, :, 0]
            # [pairs, temporal, h * w, C, P * P] -> [pairs, h * w, C, temporal, P * P]: a patch's values by channel,
            # then frame
            pairs = per_frame.reshape(-1, temporal, h * w, per_frame.shape[2], patch * patch).transpose(0, 2, 3, 1, 4)
            if out is None:
                out = np.empty((t * h * w, pairs[0].size // (h * w)), dtype=np.float32)
            start = first // temporal * h * w
            out[start : start + pairs.shape[0] * h * w] = pairs.reshape(pairs.shape[0] * h * w, -1)
        return (t, h, w), out

    def _max_pixels(self, frames: int) -> int:
        """Each frame's max_pixels in a video of `frames` sampled frames (the video processor's: `VideoLimits`)."""
        vision = self.vision
        return self.limits.frame_max_pixels(frames, vision.patch_size * vision.merge_size, vision.temporal_patch_size)

    def reread(self, source: VideoSource, name: str, digest: str) -> np.ndarray:
        """The patches of the video `source` read and preprocessed again (a preempted row's: `reread_checked`)."""
        return reread_checked(self.read, source, name, digest).pixels


def _pyav():
    try:
        import av
    except ImportError:
        raise ImageError(f"is a video, which needs PyAV: {VIDEO_EXTRA}") from None
    return av


def _count_frames(data: bytes) -> int:
    """A video's frames where its header does not say: its video packets counted (demuxed, not decoded)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return sum(1 for packet in container.demux(container.streams.video[0]) if packet.size)


def _groups(frames: Iterable[Any], count: int, temporal: int) -> Iterator[tuple[int, list[Any]]]:
    """(index of the group's first frame, FRAME_GROUP frames) of `count` frames, the last group filled to a whole
    temporal patch by repeating the last frame."""
    group: list[Any] = []
    first = 0
    for frame in frames:
        group.append(frame)
        if len(group) == FRAME_GROUP:
            yield first, group
            first, group = first + FRAME_GROUP, []
    if group:
        yield first, group + [group[-1]] * (-len(group) % temporal)


def _decode(container: Any, stream: Any, indices: np.ndarray) -> Iterator[Any]:
    """The frames at `indices` (ascending, distinct) as PIL RGB images, decoding no further than the last one;
    raises ImageError if the stream ends first."""
    wanted = {int(i) for i in indices}
    last, found = int(indices[-1]), 0
    for number, frame in enumerate(container.decode(stream)):
        if number in wanted:
            found += 1
            yield frame.to_image().convert("RGB")
        if number >= last:
            break
    if found < len(wanted):
        raise ImageError(f"has fewer frames than its header says ({found} of the {len(wanted)} sampled were found)")
