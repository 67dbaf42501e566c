"""A row's videos (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): decoded with PyAV (pip install 'cbatch[video]'), frames sampled
and preprocessed as transformers' Qwen2-VL video processor does (Qwen3-VL: its own, below), into a `PromptImage` with
`video` set (engine/images.py).

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

Qwen3-VL (VisionSpec.timestamped_videos; Qwen3VLVideoProcessor and Qwen3VLProcessor): int(seconds x fps) frames
spread from the first to the last (`spread_frame_indices`), all resized to one size that puts the video's pixels
within the bounds (`whole_video_frame_size`), and each temporal patch its own `PromptImage` (the video and its
`crops`) with its time (`patch_seconds`), which io/images.expand_placeholders writes before its run.

Decoded frames (the library's `multi_modal_data={"video": frames}`, vLLM's shape: `VideoFrames`) are taken as the
sampled frames, as transformers' processors take frames with `do_sample_frames` off: no sampling, the same
preprocessing, and their times from the optional metadata (`fps` of the video, `frames_indices` of the frames,
`total_num_frames`), else the frames are taken `fps` a second (the job's --video-fps over the processor's: 2.0).
"""
from __future__ import annotations

import io
import math
import weakref
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from cbatch.engine.images import PromptImage
from cbatch.io.images import (MAX_SOURCE_PIXELS, VIDEO_DIGEST_TAG, ImageError, ImageReader, VideoSource, describe,
                              digest_of, read_source, reread_checked, source_digest)
from cbatch.model.image_processor import video_limits
from cbatch.model.vision_spec import VisionSpec

FRAME_GROUP = 16  # frames preprocessed at once (a multiple of the temporal patch)
VIDEO_EXTRA = "pip install 'cbatch[video]'"


@dataclass(frozen=True, eq=False)
class VideoFrames:
    """A video given as its decoded, already sampled frames: uint8 [T, H, W, 3] (`frames`), frame j taken at index
    indices[j] of a video of `total` frames at `fps` (None: the job's sampling rate, indices 0..T-1)."""

    frames: np.ndarray
    fps: float | None
    indices: np.ndarray  # int64 [T], ascending
    total: int
    digest: str  # of the pixels and the times (the encoder, prefix and result caches' key)

    @classmethod
    def of(cls, value: Any) -> "VideoFrames":
        """vLLM's video item: an array [T, H, W, 3] of uint8, or (that array, metadata {"fps", "frames_indices",
        "total_num_frames"}); a ValueError saying what is wrong."""
        metadata: dict = {}
        if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
            value, metadata = value
        if not (isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.ndim == 4 and value.shape[3] == 3
                and value.shape[0] >= 1 and min(value.shape[1:3]) >= 1):
            got = (f"an array {list(value.shape)} of {value.dtype}" if isinstance(value, np.ndarray)
                   else type(value).__name__)
            raise ValueError(f"frames must be an array [frames, height, width, 3] of uint8 (RGB), got {got}")
        count = value.shape[0]
        fps = float(metadata["fps"]) if metadata.get("fps") else None
        indices = np.asarray(metadata.get("frames_indices", range(count)), dtype=np.int64)
        if len(indices) != count or (count > 1 and bool((np.diff(indices) <= 0).any())) or indices[0] < 0:
            raise ValueError(f"metadata frames_indices must be {count} ascending frame numbers, one per frame")
        total = int(metadata.get("total_num_frames") or indices[-1] + 1)
        if not ((fps is None or fps > 0) and total > indices[-1]):
            raise ValueError("metadata fps must be positive and total_num_frames past the last of frames_indices")
        frames = np.ascontiguousarray(value)
        times = repr((fps, total, indices.tolist(), frames.shape)).encode()
        return cls(frames, fps, indices, total, digest_of(VIDEO_DIGEST_TAG + times + frames.tobytes()))

    def describe(self) -> str:
        """Its name in messages (io/images.describe)."""
        count, height, width = self.frames.shape[:3]
        return f"<{count} decoded frames of {width} x {height}>"

    def images(self) -> Iterator[Any]:
        """The frames as PIL RGB images, one at a time."""
        from PIL import Image

        return (Image.fromarray(frame) for frame in self.frames)


def spread_frame_indices(total: int, video_fps: float, fps: float, min_frames: int, max_frames: int) -> np.ndarray:
    """Qwen3-VL's sampling (Qwen3VLVideoProcessor's `sample_frames` with fps): int(seconds x fps) frames, at least
    `min_frames`, at most `max_frames` and the video's `total`, spread evenly from its first frame to its last (each
    index rounded to the nearest, halves to even)."""
    count = min(max(int(total / video_fps * fps), min_frames), max_frames, total)
    return np.linspace(0, total - 1, count).round().astype(np.int64)


def whole_video_frame_size(frames: int, height: int, width: int, factor: int, temporal: int, min_pixels: int,
                           max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL: the (height, width) every frame of a video of `frames` sampled height x width frames is resized
    to (Qwen3VLVideoProcessor's rule): sides rounded to multiples of `factor` (a side below it scaled up first), then
    if the frames, counted in whole temporal patches, pass `max_pixels` together, scaled down (floored), if they
    stay below `min_pixels`, scaled up (ceiled), by the video's own pixel count. Raises ValueError (a sentence)
    past 200:1 once scaled up."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"has {width} x {height} frames (scaled to the model's {factor}-pixel blocks); the model's "
                         "processor takes aspect ratios up to 200:1")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    total = round(frames / temporal) * temporal * h * w
    if total > max_pixels:
        beta = math.sqrt(frames * height * width / max_pixels)
        return (max(factor, math.floor(height / beta / factor) * factor),
                max(factor, math.floor(width / beta / factor) * factor))
    if total < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        return math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def patch_seconds(indices: np.ndarray, video_fps: float, temporal: int) -> list[float]:
    """Each temporal patch's time in seconds: the mean of its first and last frame's (the last sampled frame
    repeated to fill the last patch), as Qwen3VLProcessor computes the timestamps its prompt writes."""
    padded = [int(i) for i in indices] + [int(indices[-1])] * (-len(indices) % temporal)
    seconds = [i / video_fps for i in padded]
    return [(seconds[k] + seconds[k + temporal - 1]) / 2 for k in range(0, len(seconds), temporal)]


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
                 max_pixels: int | None = None, fps: float | None = None) -> None:
        """`min_pixels` / `max_pixels`: the job's pixel bounds (EngineConfig.video_min_pixels / video_max_pixels),
        `fps` its frames per second (video_fps), over the model's video processor's; None: the model's."""
        self.vision = vision
        # the image processor with the video's settings
        self.frames = ImageReader(model_dir, vision, min_pixels, max_pixels, video=True)
        self.limits = video_limits(model_dir, min_pixels, max_pixels, vision.timestamped_videos, fps)

    @classmethod
    def for_config(cls, model_dir: Path | None, vision: VisionSpec, config: "EngineConfig") -> "VideoReader":
        """The reader of an engine's `config` (an EngineConfig: its video pixel bounds and frame rate)."""
        return cls(model_dir, vision, config.video_min_pixels, config.video_max_pixels, config.video_fps)

    def read(self, source: VideoSource, name: str, decode: bool = True) -> PromptImage:
        """The video `source` (called `name` in messages) read, sampled and preprocessed; raises ImageError naming it.
        `decode=False` (cbatch plan): its grid and tokens from its header (size, frame count and rate), no pixels."""
        try:
            return self._read(source, name, decode)
        except ImageError as exc:
            raise ImageError(f"`{name}` ({describe(source)}) {exc}") from None

    def _read(self, source: VideoSource, name: str, decode: bool) -> PromptImage:
        if isinstance(source.source, VideoFrames):
            return self._given_frames(source.source, name, decode)
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
                _check_frame_pixels(width, height)
                indices, frame_size = self._sampling(total, video_fps, height, width)
                # (decoded while preprocessed, a group of frames at a time: the float32 patches are what is held)
                grid, pixels = (self.patches(_decode(container, stream, indices), len(indices), frame_size)
                                if decode else (None, None))
        except av.error.FFmpegError as exc:  # not a container PyAV knows, broken data
            raise ImageError(f"cannot be decoded as a video ({type(exc).__name__}: {exc})") from None
        digest = source_digest(source, data)
        if grid is None:  # cbatch plan: the grid from the header's size and frame count
            grid = self._grid(len(indices), height, width, frame_size)
        reread = None if pixels is None else partial(self.reread, source, name, digest)
        return self._video(digest, name, grid, pixels, indices, total, video_fps, reread)

    def _given_frames(self, given: VideoFrames, name: str, decode: bool) -> PromptImage:
        """A video given as its sampled frames (`VideoFrames`): preprocessed as a file's sampled frames are."""
        count, height, width = given.frames.shape[:3]
        _check_frame_pixels(width, height)
        frame_size = self._frame_size(count, height, width) if self.vision.timestamped_videos else None
        if decode:
            grid, pixels = self.patches(given.images(), count, frame_size)
            reread = lambda: self.patches(given.images(), count, frame_size)[1]  # noqa: E731 (from the held frames)
        else:  # cbatch plan's engine
            grid, pixels, reread = self._grid(count, height, width, frame_size), None, None
        return self._video(given.digest, name, grid, pixels, given.indices, given.total, given.fps or self.limits.fps,
                           reread)

    def _grid(self, count: int, height: int, width: int, frame_size: tuple[int, int] | None) -> tuple[int, int, int]:
        """The grid (t, h, w) of `count` sampled height x width frames, without preprocessing them (cbatch plan)."""
        if frame_size is None:
            _, h, w = self.frames.grid_for(height, width, self._max_pixels(count))
        else:
            h, w = (side // self.vision.patch_size for side in frame_size)
        return (-(-count // self.vision.temporal_patch_size), h, w)

    def _video(self, digest: str, name: str, grid: tuple[int, int, int], pixels: np.ndarray | None,
               indices: np.ndarray, total: int, video_fps: float, reread: Callable[[], np.ndarray] | None
               ) -> PromptImage:
        """The video's `PromptImage` from its frames' `indices` in a video of `total` frames at `video_fps`."""
        temporal = self.vision.temporal_patch_size
        if self.vision.timestamped_videos:
            return self._timestamped(digest, name, grid, pixels, patch_seconds(indices, video_fps, temporal), reread)
        sampled_fps = len(indices) / total * video_fps
        # Qwen2.5-VL: M-RoPE's temporal step (float32, as transformers multiplies it); Qwen2-VL: one per patch
        interval = (float(np.float32(self.vision.tokens_per_second) * np.float32(temporal / sampled_fps))
                    if self.vision.tokens_per_second else 1.0)
        return PromptImage(digest, grid, self.vision.tokens_for_grid(grid), pixels, name, reread, video=True,
                           time_interval=interval)

    def _sampling(self, total: int, video_fps: float, height: int, width: int
                  ) -> tuple[np.ndarray, tuple[int, int] | None]:
        """(the sampled frames' indices, the (height, width) each is resized to; None: the image processor's own
        resize decides it, per frame) of a video of `total` frames at `video_fps` of height x width."""
        limits, temporal = self.limits, self.vision.temporal_patch_size
        if not self.vision.timestamped_videos:
            return frame_indices(total, video_fps, limits.fps, temporal, limits.min_frames, limits.max_frames), None
        indices = spread_frame_indices(total, video_fps, limits.fps, limits.min_frames, limits.max_frames)
        return indices, self._frame_size(len(indices), height, width)

    def _frame_size(self, count: int, height: int, width: int) -> tuple[int, int]:
        """Qwen3-VL: the (height, width) each of `count` sampled height x width frames is resized to."""
        temporal, limits = self.vision.temporal_patch_size, self.limits
        if count < temporal:
            raise ImageError(f"has {count} frame(s); the model's video processor takes at least {temporal} (give a "
                             "still as an image)")
        factor = self.vision.patch_size * self.vision.merge_size
        try:
            return whole_video_frame_size(count, height, width, factor, temporal, limits.min_pixels,
                                          limits.video_max_pixels(count, factor))
        except ValueError as exc:
            raise ImageError(str(exc)) from None

    def _timestamped(self, digest: str, name: str, grid: tuple[int, int, int], pixels: np.ndarray | None,
                     seconds: list[float], reread: Callable[[], np.ndarray] | None) -> PromptImage:
        """Qwen3-VL: the video as its first temporal patch, its later ones the `crops` (each an image of grid
        (1, h, w) with its own run, M-RoPE place, tower input and encoder-cache entry; known by the video's digest
        and its place), each with its time in `seconds` (the text before its run)."""
        t, h, w = grid
        size = h * w
        shared = None if reread is None else _SharedReread(reread, size)
        parts = []
        for k in range(t):
            key, label = ((digest, name) if k == 0 else
                          (f"{digest}/temporal patch {k} of {t - 1}", f"{name} (temporal patch {k})"))
            part_pixels = None if pixels is None else pixels[k * size : (k + 1) * size]
            part_reread = None if shared is None else partial(shared.part, k)
            parts.append(PromptImage(key, (1, h, w), self.vision.tokens_for_grid((1, h, w)), part_pixels, label,
                                     part_reread, video=True, timestamp=seconds[k]))
        parts[0].crops = tuple(parts[1:])
        return parts[0]

    def patches(self, frames: Iterable[Any], count: int, frame_size: tuple[int, int] | None = None
                ) -> tuple[tuple[int, int, int], np.ndarray]:
        """`count` sampled frames (PIL RGB images of one size) -> (grid (t, h, w), float32 [t * h * w, patch_dim]):
        each frame through the image processor (resized to `frame_size` (height, width) first where given, else by
        the processor with the video's pixel bounds), then consecutive pairs as temporal patches (the last frame
        repeated to fill the last pair). Frames are processed FRAME_GROUP at a time into the output."""
        temporal, patch = self.vision.temporal_patch_size, self.vision.patch_size
        t = -(-count // temporal)
        processor = self.frames.processor
        if frame_size is None:
            options: dict[str, Any] = {"size": {"shortest_edge": self.limits.min_pixels,
                                                "longest_edge": self._max_pixels(count)}}
        else:  # (the resize the processor's own would do to that size: PIL's, with its resample)
            options = {"do_resize": False}
        out: np.ndarray | None = None
        for first, group in _groups(frames, count, temporal):
            if frame_size is not None:
                group = [frame.resize(frame_size[::-1], resample=processor.resample) for frame in group]
            processed = processor(images=group, return_tensors="np", **options)
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
        """The patches of the video `source` read and preprocessed again (a preempted row's: `reread_checked`); a
        timestamped video's, all its temporal patches'."""
        video = reread_checked(self.read, source, name, digest)
        return np.concatenate([part.pixels for part in (video, *video.crops)]) if video.crops else video.pixels


class _SharedReread:
    """A timestamped video's patches read again for its temporal patches (`part`): once while any part still holds
    its slice (a view: the whole array lives as long as one of them, then goes; this keeps only a weak reference),
    so a preempted row's parts read again in one step decode the video once."""

    def __init__(self, reread: Callable[[], np.ndarray], size: int) -> None:
        self.reread, self.size = reread, size  # `size`: a temporal patch's rows
        self.held: weakref.ref | None = None

    def part(self, k: int) -> np.ndarray:
        """Temporal patch k's patches."""
        pixels = self.held() if self.held is not None else None
        if pixels is None:
            pixels = self.reread()
            self.held = weakref.ref(pixels)
        return pixels[k * self.size : (k + 1) * self.size]


def _check_frame_pixels(width: int, height: int) -> None:
    """An ImageError where a video's frames are larger than cbatch decodes."""
    if width * height > MAX_SOURCE_PIXELS:
        raise ImageError(f"has {width} x {height} frames, more than the {MAX_SOURCE_PIXELS:,} pixels cbatch decodes; "
                         "shrink them")


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
