"""The prompts the library takes, in vLLM's shapes: a string, `TextPrompt` ({"prompt": ...}, with
`multi_modal_data={"image": ..., "video": ...}` for a vision-language model), `TokensPrompt`
({"prompt_token_ids": [...]}), or a list of them; read into `RowRequest`s, the rows `cbatch run` tokenizes."""
from __future__ import annotations

from typing import Any, NotRequired, Sequence, TypedDict, Union

import numpy as np

from cbatch.config import UserError
from cbatch.io.images import is_image_source
from cbatch.io.row_fields import VideoSource
from cbatch.io.rows import RowRequest, is_token_ids, text_field
from cbatch.io.videos import VideoFrames


class TextPrompt(TypedDict):
    """A text prompt (tokenized with the model's special tokens, as `cbatch run` does a row's `prompt`)."""

    prompt: str
    # {"image": a PIL image, an array or a list, "video": a video file, its decoded frames or a list}: the prompt
    # holds one placeholder for each
    multi_modal_data: NotRequired[Any]


class TokensPrompt(TypedDict):
    """A prompt given as token ids."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]  # ignored for the model; returned as the output's `prompt`
    multi_modal_data: NotRequired[Any]  # images and videos, one placeholder token each in the ids (as a row's)


PromptType = Union[str, TextPrompt, TokensPrompt]
_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")


def as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt, or a list of them, as a list (a list of ints is one prompt's ids given the wrong way)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(p, int) for p in prompts):
        raise UserError('give token ids as {"prompt_token_ids": [...]} (a TokensPrompt), not a bare list of ints')
    return prompts


def row_request(index: int, prompt: PromptType) -> RowRequest:
    """The row a prompt is: text (`prompt`) or token ids (`prompt_token_ids`); a UserError naming what is wrong."""
    where = f"prompt {index}"
    if isinstance(prompt, str):
        return RowRequest(index=index, row_id=str(index), prompt=text_field(where, prompt))
    if not isinstance(prompt, dict):
        raise UserError(f"{where}: must be a string, a TextPrompt or a TokensPrompt, got {type(prompt).__name__}")
    if "mm_processor_kwargs" in prompt:  # vLLM takes them per prompt too
        raise UserError(f"{where}: cbatch takes mm_processor_kwargs for every prompt, not per prompt; give them to the "
                        "engine: LLM(..., mm_processor_kwargs={...})")
    unknown = sorted(set(prompt) - set(_KEYS))
    if unknown:
        raise UserError(f"{where}: cbatch does not take {', '.join(unknown)} (give prompt or prompt_token_ids, "
                        "and multi_modal_data for images and videos)")
    images = _images(where, prompt.get("multi_modal_data"))
    if "prompt_token_ids" in prompt:
        ids = list(prompt["prompt_token_ids"])
        if not is_token_ids(ids):
            raise UserError(f"{where}: prompt_token_ids must be a non-empty list of non-negative integers")
        return RowRequest(index=index, row_id=str(index), prompt_token_ids=ids, images=images)
    if "prompt" not in prompt:
        raise UserError(f"{where}: give prompt (a string) or prompt_token_ids")
    return RowRequest(index=index, row_id=str(index), prompt=text_field(f"{where}.prompt", prompt["prompt"]),
                      images=images)


def _images(where: str, data: Any) -> list[tuple[str, Any]]:
    """vLLM's `multi_modal_data` -> the prompt's images and videos (where it gave each, its source; a video's a
    VideoSource), images first (the engine places them by their placeholders): {"image": a PIL image, vLLM's uint8
    array, a path, a URL or bytes, or a list of them; "video": a video file (a path, a URL, bytes or a {"bytes",
    "path"} dict; cbatch samples its frames as the model's processor does) or its decoded frames (vLLM's uint8 array
    [T, H, W, 3], or (array, metadata): io/videos.VideoFrames, taken as sampled), or a list of them}."""
    if data is None:
        return []
    if not isinstance(data, dict):
        raise UserError(f"{where}: multi_modal_data must be a dict such as {{\"image\": PIL.Image}}")
    other = sorted(set(data) - {"image", "video"})
    if other:
        raise UserError(f"{where}: multi_modal_data takes images and videos (\"image\", \"video\"), not "
                        f"{', '.join(other)}")
    found = []
    for kind in (k for k in ("image", "video") if k in data):
        given = data[kind]
        one_video = kind == "video" and isinstance(given, tuple) and len(given) == 2 and isinstance(given[1], dict)
        sources = list(given) if isinstance(given, (list, tuple)) and not one_video else [given]
        for j, source in enumerate(sources):
            name = f"multi_modal_data.{kind}[{j}]"
            found.append((name, _video(where, name, source) if kind == "video" else _image(where, name, source)))
    return found


def _image(where: str, name: str, source: Any) -> Any:
    """A `multi_modal_data` image: a PIL image, a path, a URL or bytes as they are; vLLM's array (uint8 [H, W, 3]
    RGB or [H, W] grey) as the PIL image of those pixels."""
    if isinstance(source, np.ndarray):
        if source.dtype != np.uint8 or not (source.ndim == 2 or (source.ndim == 3 and source.shape[2] == 3)):
            raise UserError(f"{where}: {name} as an array must be uint8 [height, width, 3] (RGB) or [height, width], "
                            f"got {list(source.shape)} of {source.dtype}")
        from PIL import Image

        return Image.fromarray(source).convert("RGB")
    if not is_image_source(source):
        raise UserError(f"{where}: {name} must be a PIL image, an array, a path, a URL or bytes, got "
                        f"{type(source).__name__}")
    return source


def _video(where: str, name: str, source: Any) -> VideoSource:
    """A `multi_modal_data` video: its file (as a row's `videos` entry takes it) or its decoded frames."""
    if isinstance(source, (str, bytes, bytearray, dict)):
        return VideoSource(source)
    try:
        return VideoSource(VideoFrames.of(source))
    except ValueError as exc:
        raise UserError(f"{where}: {name} must be a video file (a path, a URL, bytes or a {{\"bytes\", \"path\"}} "
                        f"dict) or its decoded frames; its {exc}") from None


__all__ = ["PromptType", "TextPrompt", "TokensPrompt", "as_list", "row_request"]
