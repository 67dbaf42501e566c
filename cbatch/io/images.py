"""A row's images: where each comes from (an OpenAI `image_url` part, a row's `images` entry, a Parquet image column as
Hugging Face datasets store it), its bytes, and its preprocessing by the model's own image processor into a
`PromptImage` (engine/images.py).

Sources: a `data:` URI (base64), a local path, `file://`, any fsspec URL (`s3://...`, `hf://...`), raw bytes
(a Parquet binary column), a datasets Image struct `{"bytes", "path"}`, or a PIL image (the library's). An image is
read when its row's requests are made (the rows the engine is about to queue), never at the job's start; its
pixels go once the vision tower has encoded it, and a preempted row whose embedding the encoder cache dropped reads
it again (`ImageReader.reread`: the source is kept, never the float32 patches). Anything wrong with one image is
a RowError naming it (`ImageError`): the row becomes an error row and the job goes on (an image that cannot be read
again for its running row stops the job with that one line).

Preprocessing: transformers' PIL image processor of the model (`Qwen2VLImageProcessorPil`: resize so that both sides
are multiples of patch x merge with the pixel count inside [min_pixels, max_pixels], rescale, normalize, patchify),
settable per job (EngineConfig's image_min_pixels / image_max_pixels: --image-min-pixels / --image-max-pixels);
Gemma 3's (`Gemma3ImageProcessorPil`: resize to the tower's square, rescale, normalize), its patches cut here; with
pan-and-scan (EngineConfig.image_pan_and_scan: --image-pan-and-scan, else the checkpoint's do_pan_and_scan) a wide
or tall image's crops are cut here too (model/image_processor.PanAndScan) and preprocessed beside it, each its own
`PromptImage` in the image's `crops`.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from cbatch.engine.images import PromptImage, placeholder_tokens
from cbatch.io.row_fields import RowError, VideoSource
from cbatch.model.image_processor import image_processor, pan_and_scan_for, pixel_range
from cbatch.model.siglip_spec import SiglipSpec
from cbatch.model.vision_spec import VisionSpec

if TYPE_CHECKING:
    from cbatch.config import EngineConfig

MAX_SOURCE_PIXELS = 1 << 27  # a decoded image past this (134 M pixels, e.g. 11,585 x 11,585) is refused, not decoded


_POOL: ThreadPoolExecutor | None = None


def image_pool() -> ThreadPoolExecutor:
    """The worker threads rows' images are read and preprocessed on (PIL and numpy release the GIL while they work),
    made at the first image."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1), thread_name_prefix="cbatch-images")
    return _POOL


class ImageError(RowError):
    """An image of a row that cannot be read or used; the message names the row's image and the problem."""


def is_image_source(value: Any) -> bool:
    """A value that names an image (its checks come when it is read); a PIL image (the library's) is one too."""
    return (isinstance(value, (str, bytes, bytearray)) or is_pil_image(value)
            or (isinstance(value, dict) and ("bytes" in value or "path" in value)))


def is_pil_image(value: Any) -> bool:
    """A PIL image object (the library's `multi_modal_data`), without importing PIL for the rows that have none."""
    return any(cls.__module__.startswith("PIL.") and cls.__name__ == "Image" for cls in type(value).__mro__)


def describe(source: Any) -> str:
    """A short name of an image source for messages (a data URI or bytes by their size, a path or URL as given)."""
    if is_pil_image(source):
        return f"<PIL image {source.size[0]} x {source.size[1]}>"
    if isinstance(source, VideoSource):
        source = source.source
    if hasattr(source, "describe"):  # decoded frames (io/videos.VideoFrames)
        return source.describe()
    if isinstance(source, dict):
        source = source.get("path") or source.get("bytes")
    if isinstance(source, (bytes, bytearray)):
        return f"<{len(source)} bytes>"
    if isinstance(source, str) and source.startswith("data:"):
        return f"<data URI of {len(source)} characters>"
    return repr(source) if isinstance(source, str) and len(source) <= 200 else repr(str(source)[:200] + "...")


def read_source(source: Any) -> bytes:
    """The image's (or video's) bytes; raises ImageError (without the image's name: the caller adds it)."""
    if isinstance(source, VideoSource):
        source = source.source
    if isinstance(source, dict):  # a datasets Image struct: its bytes, else its path
        data = source.get("bytes")
        source = data if data is not None else source.get("path")
        if source is None:
            raise ImageError("has neither `bytes` nor `path`")
    if isinstance(source, (bytes, bytearray)):
        return bytes(source)
    if not isinstance(source, str) or not source:
        raise ImageError(f"must be a URL, a path, a data: URI or bytes, got {type(source).__name__}")
    if source.startswith("data:"):
        header, sep, payload = source.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ImageError("is a data: URI without base64 data (data:image/png;base64,...)")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("is a data: URI whose base64 data does not decode") from None
    if source.startswith(("http://", "https://")) or ("://" in source and not source.startswith("file://")):
        return _read_url(source)
    path = Path(source.removeprefix("file://")).expanduser()
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise ImageError("names a file that does not exist") from None
    except IsADirectoryError:
        raise ImageError("names a folder, not an image file") from None
    except OSError as exc:
        raise ImageError(f"cannot be read ({exc.strerror or exc})") from None


def _read_url(url: str) -> bytes:
    try:
        import fsspec
    except ImportError:
        raise ImageError("is a URL, which needs fsspec (and its backend, e.g. s3fs): pip install 'cbatch[remote]'") from None
    try:
        with fsspec.open(url, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ImageError("names a file that does not exist") from None
    except Exception as exc:  # network, credentials, an unknown protocol: the backend's own words
        raise ImageError(f"cannot be read ({type(exc).__name__}: {exc})") from None


def digest_of(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


VIDEO_DIGEST_TAG = b"cbatch video\0"


def source_digest(source: Any, data: bytes) -> str:
    """The digest a source with bytes `data` is known by (encoder cache, prefix cache, result cache, resume): of its
    bytes, a video's tagged (the same bytes read as an image and as a video are other embeddings). A video's
    sampling settings are the model's processor files (io/videos.py), which a resumed job's fingerprint
    (run/preflight.job_fingerprint) and the result cache's model digest hold."""
    return digest_of(VIDEO_DIGEST_TAG + data if isinstance(source, VideoSource) else data)


class ImageReader:
    """The model's image processor with the job's pixel bounds: a row's image source -> `PromptImage`."""

    def __init__(self, model_dir: Path | None, vision: VisionSpec | SiglipSpec, min_pixels: int | None = None,
                 max_pixels: int | None = None, pan_and_scan: bool | None = None, video: bool = False) -> None:
        """`min_pixels` / `max_pixels` / `pan_and_scan`: the job's (EngineConfig.image_min_pixels /
        image_max_pixels / image_pan_and_scan) over the model's preprocessor_config.json; None: the model's.
        `video`: the reader of a video's frames (the video processor's config: io/videos.py; no crops)."""
        self.vision = vision
        self.processor = image_processor(model_dir, vision, min_pixels, max_pixels, video)
        self.pan_and_scan = None if video else pan_and_scan_for(model_dir, vision, pan_and_scan)  # Gemma 3's crops

    @classmethod
    def for_config(cls, model_dir: Path | None, vision: VisionSpec | SiglipSpec, config: "EngineConfig") -> "ImageReader":
        """The reader of an engine's `config` (an EngineConfig: its image pixel bounds and pan-and-scan)."""
        return cls(model_dir, vision, config.image_min_pixels, config.image_max_pixels, config.image_pan_and_scan)

    @property
    def pixel_range(self) -> tuple[int, int]:
        return pixel_range(self.processor)

    def grid_for(self, height: int, width: int, max_pixels: int | None = None) -> tuple[int, int, int]:
        """The patch grid (t, h, w) the processor makes of a height x width image, from its size alone: the
        processor's own resize rule (both sides multiples of patch x merge, the pixel count in its bounds, or up to
        `max_pixels` where given: a video's capped frames; Gemma 3: one square whatever the size)."""
        import importlib

        if isinstance(self.vision, SiglipSpec):
            return 1, self.vision.patches_per_side, self.vision.patches_per_side
        processor = self.processor
        smart_resize = importlib.import_module(type(processor).__module__).smart_resize
        low, high = self.pixel_range
        high = high if max_pixels is None else max_pixels
        patch = int(processor.patch_size)
        if getattr(processor, "do_resize", True):
            height, width = smart_resize(height, width, factor=patch * int(processor.merge_size), min_pixels=low,
                                         max_pixels=high)
        return 1, height // patch, width // patch

    def read(self, source: Any, name: str, decode: bool = True) -> PromptImage:
        """The image `source` (called `name` in messages, e.g. "messages[0].content[1]") read and preprocessed;
        raises ImageError naming it. `decode=False` (cbatch plan): its header's size alone gives its grid and
        tokens (the processor's resize depends on nothing else), no pixels are decoded (`pixels` None), and data
        broken past the header is not noticed."""
        try:
            return self._read(source, name, decode)
        except ImageError as exc:
            raise ImageError(f"`{name}` ({describe(source)}) {exc}") from None

    def _read(self, source: Any, name: str, decode: bool) -> PromptImage:
        image, digest = (source, _pil_digest(source)) if is_pil_image(source) else _open(source)
        width, height = image.size
        if width * height > MAX_SOURCE_PIXELS:
            raise ImageError(f"is {width} x {height} pixels, more than the {MAX_SOURCE_PIXELS:,} cbatch decodes; shrink it")
        if min(width, height) < 1 or max(width, height) / min(width, height) > 200:
            raise ImageError(f"is {width} x {height} pixels; the model's processor takes aspect ratios up to 200:1")
        boxes = self.pan_and_scan.boxes(height, width) if self.pan_and_scan is not None else []
        if not decode:
            grid = self.grid_for(height, width)
            return self._image(digest, name, None, [(grid, None)] * (1 + len(boxes)))
        try:
            image.load()
            rgb = image.convert("RGB")
        except Exception as exc:  # truncated or corrupt data past the header
            raise ImageError(f"cannot be decoded ({type(exc).__name__}: {exc})") from None
        out = self.processor(images=[rgb, *(rgb.crop(box) for box in boxes)], return_tensors="np")
        if isinstance(self.vision, SiglipSpec):  # the image, then its crops: each [C, S, S]
            parts = [_square_patches(square, self.vision.patch_size) for square in out["pixel_values"]]
        else:
            parts = [(tuple(int(x) for x in out["image_grid_thw"][0]), out["pixel_values"].astype("float32", copy=False))]
        return self._image(digest, name, source, parts)

    def _image(self, digest: str, name: str, source: Any, parts: list[tuple[tuple[int, int, int], Any]]) -> PromptImage:
        """The `PromptImage` of an image whose bytes hash to `digest` from its `parts` [(grid, patches or None)]:
        the whole image, then its pan-and-scan crops (each known by the image's digest and its place among them).
        `source` None: nothing to read again (counted from its header)."""
        made = []
        for k, (grid, pixels) in enumerate(parts):
            key, label = (digest, name) if k == 0 else (f"{digest}/crop {k} of {len(parts) - 1}", f"{name} (crop {k})")
            reread = partial(self.reread, source, name, digest, k) if source is not None else None
            made.append(PromptImage(key, grid, self.vision.tokens_for_grid(grid), pixels, label, reread))
        made[0].crops = tuple(made[1:])
        return made[0]

    def reread(self, source: Any, name: str, digest: str, part: int = 0) -> Any:
        """The patches of the image `source` (read before as `name`, its bytes hashing to `digest`; `part` k > 0:
        its k-th pan-and-scan crop) read and preprocessed again: a preempted row's image whose embedding the encoder
        cache dropped after its pixels were released (`reread_checked`)."""
        image = reread_checked(self.read, source, name, digest)
        return (image, *image.crops)[part].pixels


def reread_checked(read: Callable[[Any, str], PromptImage], source: Any, name: str, digest: str) -> PromptImage:
    """What `read(source, name)` gives again (an image or a video); raises ImageError if the source is gone or its
    bytes changed since (the prefix cache and the row's record know it by `digest`)."""
    keep = "keep a job's images and videos in place and unchanged until it finishes"
    try:
        image = read(source, name)
    except ImageError as exc:
        raise ImageError(f"{exc}, read again for its preempted row; {keep}") from None
    if image.digest != digest:
        raise ImageError(f"`{name}` ({describe(source)}) has other bytes than when its row was queued; {keep}")
    return image


def _open(source: Any):
    """(the PIL image of a source's bytes, not decoded yet, the digest of the bytes); raises ImageError."""
    from PIL import Image, UnidentifiedImageError

    data = read_source(source)
    if not data:
        raise ImageError("is empty (0 bytes)")
    try:
        with warnings.catch_warnings():  # (PIL's size warning: MAX_SOURCE_PIXELS is checked by the caller)
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data)), digest_of(data)
    except UnidentifiedImageError:
        raise ImageError("is not an image PIL can read (unknown or unsupported format)") from None
    except Exception as exc:  # a decompression bomb, a broken header
        raise ImageError(f"cannot be opened ({type(exc).__name__}: {exc})") from None


def _pil_digest(image) -> str:
    """A PIL image's digest: of its mode, size and pixel bytes (it has no file bytes)."""
    digest = hashlib.blake2b(f"{image.mode} {image.size}".encode(), digest_size=16)
    digest.update(image.tobytes())
    return digest.hexdigest()


def _square_patches(image: Any, patch: int) -> tuple[tuple[int, int, int], Any]:
    """A processed image [C, S, S] -> (grid (1, S / P, S / P), float32 [(S / P)^2, C * P * P]: its patches row-major,
    each channel-major as the patch convolution's weight reads them)."""
    channels, side = image.shape[0], image.shape[1] // patch
    patches = image.reshape(channels, side, patch, side, patch).transpose(1, 3, 0, 2, 4)
    return (1, side, side), patches.reshape(side * side, -1).astype("float32")


# Gemma 3's words around an image with pan-and-scan crops (transformers' Gemma3Processor's, which the model reads):
# before the image's run, between it and the first crop's, between two crops'; "\n\n" around every run
_CROPS_TEXT = ("Here is the original image ", " and here are some crops to help you see better ", " ")


def template_placeholders(vision: VisionSpec | SiglipSpec) -> list[int]:
    """The one token a chat template writes per image (first) and per video (second, where the model takes videos)
    before `expand_placeholders` makes each a run: Gemma 3's <start_of_image>, else the runs' own tokens."""
    return [vision.boi_token_id] if isinstance(vision, SiglipSpec) else placeholder_tokens(vision)


def expand_placeholders(prompt_ids: list[int], images: list[PromptImage], vision: VisionSpec | SiglipSpec,
                        tokenizer: Any = None) -> list[int]:
    """The prompt with each image's (or video's) one placeholder token (as the chat template writes it) expanded to
    its run, as the model's processor does: Qwen2-VL's `<|image_pad|>` (a video's `<|video_pad|>`) repeated to its
    token count; a Qwen3-VL video's `<|video_pad|>` turned into each temporal patch's "<{seconds:.1f} seconds>",
    <|vision_start|>, its `<|video_pad|>`s, <|vision_end|>; Gemma 3's `<start_of_image>` turned into "\n\n"
    <start_of_image>, its `<image_soft_token>`s, <end_of_image> "\n\n", and for an image with pan-and-scan crops
    "Here is the original image " and that run, " and here are some crops to help you see better " and each crop's
    run (" " between them). The text between two special tokens is encoded by `tokenizer` as one piece, as the
    processor's tokenizer splits it (None: no text). Raises RowError when the counts or the order differ."""
    tokens = template_placeholders(vision)
    encoded: dict[str, list[int]] = {}

    def text(piece: str) -> list[int]:
        if piece not in encoded:
            encoded[piece] = list(tokenizer.encode(piece, add_special_tokens=False)) if tokenizer is not None else []
        return encoded[piece]

    if isinstance(vision, SiglipSpec):
        def run(image: PromptImage) -> list[int]:
            before, first, between = _CROPS_TEXT if image.crops else ("", "", "")
            out = text(before + "\n\n")
            for k, part in enumerate((image, *image.crops)):
                if k:
                    out = out + text("\n\n" + (first if k == 1 else between) + "\n\n")
                out = out + [vision.boi_token_id, *[vision.image_token_id] * part.num_tokens, vision.eoi_token_id]
            return out + text("\n\n")
    else:
        def run(image: PromptImage) -> list[int]:
            if image.timestamp is None:
                return [image.token(vision)] * image.num_tokens
            return [token for part in (image, *image.crops) for token in (
                *text(f"<{part.timestamp:.1f} seconds>"), vision.vision_start_token_id,
                *[part.token(vision)] * part.num_tokens, vision.vision_end_token_id)]
    where = [i for i, t in enumerate(prompt_ids) if t in tokens]
    given = [image.video for image in images]  # each one a video?, in row order
    placed = [prompt_ids[i] != tokens[0] for i in where]  # each placeholder a video's?, in prompt order
    if given != placed:
        raise RowError(_placeholder_mismatch(given, placed))
    out: list[int] = []
    start = 0
    for index, image in zip(where, images):
        out += prompt_ids[start:index] + run(image)
        start = index + 1
    return out + prompt_ids[start:]


def in_prompt_order(prompt_ids: list[int], images: list[PromptImage], vision: VisionSpec | SiglipSpec
                    ) -> list[PromptImage]:
    """A text prompt's images and videos (given as the row's `images`, then `videos`) in the order of its
    placeholders: each image placeholder takes the next image, each video placeholder the next video (a chat's
    come in prompt order already). Unchanged where the counts differ (`expand_placeholders` says why)."""
    tokens = template_placeholders(vision)
    queues = {False: [i for i in images if not i.video], True: [i for i in images if i.video]}
    placed = [t != tokens[0] for t in prompt_ids if t in tokens]
    if not queues[True] or [placed.count(False), placed.count(True)] != [len(queues[False]), len(queues[True])]:
        return images
    return [queues[video].pop(0) for video in placed]


def _placeholder_mismatch(given: list[bool], placed: list[bool]) -> str:
    """Why a row's images and videos (`given`: is each a video) do not fit its prompt's placeholders (`placed`)."""
    if not any(given) and not any(placed):
        return (f"the prompt has {len(placed)} image placeholder(s) for {len(given)} image(s); a chat puts one per "
                "image part, a `prompt` (text or token ids) must hold the model's image placeholder once per image, "
                "as the chat template writes it (not expanded)")
    if sorted(given) == sorted(placed):
        return ("the prompt's image and video placeholders come in another order than the row's images and videos; "
                "give them in the order the prompt names them")
    return (f"the prompt has {placed.count(False)} image and {placed.count(True)} video placeholder(s) for "
            f"{given.count(False)} image(s) and {given.count(True)} video(s); a chat puts one per image or video part, "
            "a `prompt` (text or token ids) must hold the model's placeholder once per image or video")


def template_parts(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as a chat template reads them: each image part a bare `{"type": "image"}`, each video part
    `{"type": "video"}` (the template writes the placeholder; the bytes stay out of it)."""
    return [{**m, "content": [p if p["type"] == "text" else {"type": p["type"]} for p in m["content"]]}
            if isinstance(m.get("content"), list) else m for m in messages]
