"""A request's images as the engine sees them: each image's preprocessed patches and the run of placeholder tokens it
fills in the prompt (`PromptImage`, made by the row reader: cbatch/io/images.py), and a sequence's view of them
(`SeqImages`): where each run starts, the prompt's M-RoPE positions (model/mrope.py) and the prefix cache's salt.

NOTE: placeholder tokens are ordinary prompt tokens for the scheduler (budget, chunking, admission); only the
runner's image rows (engine/image_rows.py) and the prefix cache's block keys look at the images behind them, and,
for a model whose image tokens attend to each other both ways (Gemma 3: `bidirectional`), the scheduler's chunk
sizes (`whole_images`): a chunk never ends inside an image's run, so the run's queries see all of its keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from cbatch.model.mrope import mrope_positions
from cbatch.model.siglip_spec import SiglipSpec
from cbatch.model.vision_spec import VisionSpec, takes_videos


@dataclass(slots=True, eq=False)
class PromptImage:
    """One image of a prompt, preprocessed by the model's image processor.

    Its pixels are needed only until the vision tower has encoded it: the runner `release`s them once a step has
    read the image (its embedding is then in the encoder cache until the row's prefill has consumed it). A row
    preempted after the cache dropped that embedding gets the pixels again from `reread` (the image's source and
    the reader that made them, cheap to keep), so a row in the engine holds float32 patches only until encoded."""

    digest: str  # hash of the image's bytes: the encoder cache's and the prefix cache's key
    grid: tuple[int, int, int]  # patch grid (t, h, w)
    num_tokens: int  # its placeholder tokens: t * h * w / merge^2
    # float32 [t * h * w, patch_dim]: the processor's flattened patches; None once released, and for an image
    # counted from its header alone (cbatch plan: the grid and token count, never encoded)
    pixels: np.ndarray | None
    name: str = ""  # how the row gave it (for messages)
    # the patches read and preprocessed again from the image's source (io/images.ImageReader.reread: raises
    # ImageError if the source is gone or has other bytes); None: nothing to read again
    reread: Callable[[], np.ndarray] | None = None
    # parts of this image that are images of their own, each with its own run after this one's in the prompt
    # (io/images.expand_placeholders): Gemma 3's pan-and-scan crops (model/image_processor.PanAndScan), a Qwen3-VL
    # video's later temporal patches (io/videos.py); the engine places them as images (`with_crops`), the row's
    # record, the result cache and a resume know the image by its own digest alone
    crops: tuple["PromptImage", ...] = ()
    # a video (io/videos.py): its frames in temporal patches (grid t > 1 for more than one pair), its placeholder
    # the model's video token, and M-RoPE's temporal step per temporal patch (model/mrope.py); Qwen3-VL's: one
    # temporal patch each (the video and its crops), `timestamp` its time in seconds, written before its run
    video: bool = False
    time_interval: float = 1.0
    timestamp: float | None = None

    def token(self, vision: VisionSpec | SiglipSpec) -> int:
        """The placeholder token of its run: the model's video token for a video, else its image token."""
        return vision.video_token_id if self.video else vision.image_token_id

    def patches(self) -> np.ndarray:
        """The image's patches for the vision tower: the ones held, else read again from its source."""
        if self.pixels is not None:
            return self.pixels
        if self.reread is None:
            raise ValueError(f"image {self.name!r} holds no pixels and has no source to read them from again")
        return self.reread()

    def release(self) -> None:
        """Drops the held patches (the encoder cache has the image's embedding; `patches` reads them again)."""
        self.pixels = None


@dataclass(slots=True)
class SeqImages:
    """A sequence's images: `runs` [(first placeholder index, image)] in prompt order, the prompt's M-RoPE positions
    int64 [3, prompt_len] and `delta` (every token past the prompt sits at its index + delta on all three axes);
    a model without M-RoPE (Gemma 3): its 1-D positions [1, prompt_len] and delta 0."""

    runs: list[tuple[int, PromptImage]]
    positions: np.ndarray
    delta: int
    bidirectional: bool = False  # Gemma 3: an image's tokens attend to each other both ways (whole in one chunk)

    @property
    def prompt_len(self) -> int:
        return self.positions.shape[1]

    def overlapping(self, start: int, end: int) -> list[tuple[int, PromptImage, int, int]]:
        """The images whose placeholders meet tokens [start, end): (run start, image, first, end) with [first, end)
        the part of the image's embedding rows inside."""
        out = []
        for run, image in self.runs:
            lo, hi = max(start, run), min(end, run + image.num_tokens)
            if lo < hi:
                out.append((run, image, lo - run, hi - run))
        return out

    def chunk_tokens(self, start: int, num_new: int) -> int:
        """The tokens of a chunk [start, start + num_new) that keep every image whole (`bidirectional`): a chunk
        that would end inside an image's run stops before it (0 when it starts at or inside that run: the row waits
        for a step with budget for the whole run)."""
        end = start + num_new
        if self.bidirectional:
            for run, image in self.runs:
                if run < end < run + image.num_tokens:
                    return max(0, run - start)
        return num_new

    def salt(self, start: int, end: int) -> tuple[str, ...]:
        """The digests of the images whose placeholders meet tokens [start, end): a prefix-cache block holding them
        is keyed by its tokens and these (rows with the same placeholders but other images never share KV)."""
        return tuple(image.digest for _, image, _, _ in self.overlapping(start, end))


def whole_images(seq, num_new: int) -> int:
    """`num_new` tokens for sequence `seq`'s next chunk, cut so that no image of a bidirectional model is split
    (`SeqImages.chunk_tokens`); the scheduler's every chunk size goes through it."""
    images = seq.images
    return num_new if images is None else images.chunk_tokens(seq.num_computed, num_new)


def with_crops(images: Sequence[PromptImage]) -> list[PromptImage]:
    """A prompt's images as the vision tower and the prompt's runs take them: each image, then its pan-and-scan
    crops."""
    return [part for image in images for part in (image, *image.crops)]


def seq_images(prompt_ids: list[int], images: list[PromptImage], vision: VisionSpec | SiglipSpec) -> SeqImages | str:
    """The sequence's view of `images` (images and videos, in prompt order; each image's pan-and-scan crops after
    it: runs of their own) in `prompt_ids`, or why they do not fit its placeholders (one sentence)."""
    images = with_crops(images)
    ids = np.asarray(prompt_ids, dtype=np.int64)
    where = np.flatnonzero(np.isin(ids, placeholder_tokens(vision)))
    runs, cursor = [], 0  # `cursor`: index into `where`
    for number, image in enumerate(images, start=1):
        kind = "video" if image.video else "image"
        if cursor + image.num_tokens > len(where):
            return (f"the prompt has {len(where)} image/video placeholder tokens, too few for its {len(images)} "
                    f"image(s) and video(s) ({kind} {number} needs {image.num_tokens}); was the prompt cut "
                    "(truncate_prompt_tokens)?")
        start = int(where[cursor])
        run = ids[where[cursor : cursor + image.num_tokens]]
        contiguous = int(where[cursor + image.num_tokens - 1]) == start + image.num_tokens - 1
        if not contiguous or (run != image.token(vision)).any():
            return (f"{kind} {number}'s placeholder run in the prompt is {_run_length(ids, where, cursor)} "
                    f"{kind} tokens, it needs {image.num_tokens}")
        runs.append((start, image))
        cursor += image.num_tokens
    if cursor != len(where):
        return (f"the prompt has {len(where) - cursor} image/video placeholder tokens no image or video fills; give "
                f"one per placeholder (the chat template puts one where a message has an image or video part)")
    if runs and ids.size and ids[-1] in placeholder_tokens(vision):
        return "the prompt ends with an image or video; add text after it"
    if not vision.mrope_section:  # 1-D positions: the token's index
        return SeqImages(runs, np.arange(len(prompt_ids), dtype=np.int64)[None], 0, vision.bidirectional_images)
    extents = [(start, image.grid, image.time_interval) for start, image in runs]
    positions, delta = mrope_positions(len(prompt_ids), extents, vision.merge_size)
    return SeqImages(runs, positions, delta)


def placeholder_tokens(vision: VisionSpec | SiglipSpec) -> list[int]:
    """The tokens an image's or a video's run is made of (the video token where the model takes videos)."""
    return [vision.image_token_id] + ([vision.video_token_id] if takes_videos(vision) else [])


def _run_length(ids: np.ndarray, where: np.ndarray, cursor: int) -> int:
    """The length of the run of one placeholder token starting at where[cursor]."""
    rest = where[cursor:]
    breaks = np.flatnonzero((np.diff(rest) != 1) | (ids[rest[1:]] != ids[rest[0]]))
    return int(breaks[0]) + 1 if breaks.size else len(rest)
