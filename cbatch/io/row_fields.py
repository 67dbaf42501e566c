"""The ground floor of row parsing: the error a bad row raises and the fields every kind of row shares (its id,
text, token ids, chat messages). Every row parser (io/rows.py, io/pooling_rows.py, the tasks) builds on these, and
this module imports no other row module.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cbatch.config import UserError
from cbatch.tools import ToolFieldError, tool_message_fields


class RowError(UserError):
    """A bad row: the message names the field and the problem."""


def given_row_id(row: dict[str, Any] | str) -> str | None:
    """The input's own id: `id`, else OpenAI's `custom_id` (a string or an integer); None if it has none."""
    if isinstance(row, dict):
        for key in ("id", "custom_id"):
            value = row.get(key)
            if isinstance(value, (str, int)) and not isinstance(value, bool):
                return str(value)
    return None


def row_id_of(index: int, row: dict[str, Any] | str) -> str:
    """The output id: the input's own id, else the row index."""
    row_id = given_row_id(row)
    return str(index) if row_id is None else row_id


def parse_messages(value: Any, images: bool = False) -> list[dict[str, Any]]:
    """A row's `messages`, checked (raises RowError naming the message and field). `images`: image content parts are
    taken (OpenAI's `image_url`, or `{"type": "image", "image": SOURCE}`; a bare `{"type": "image"}` takes the row's
    next `images` entry): a message with one keeps its content as parts, `{"type": "text"}` and
    `{"type": "image", "image": SOURCE or None, "name": where}` (io/images.py reads them); video parts (`video_url`,
    `{"type": "video", "video": SOURCE}`; a bare one takes the row's next `videos` entry) likewise, as
    `{"type": "video", "video": VideoSource or None, "name": where}` (io/videos.py reads them)."""
    return _messages(value, images)


IMAGE_PART_TYPES = ("image_url", "image", "input_image", "image_pil")  # (image_pil: vLLM's, a library PIL image)
VIDEO_PART_TYPES = ("video_url", "video")  # (video_url: vLLM's OpenAI-style part)


@dataclass(frozen=True, slots=True)
class VideoSource:
    """A row's video: its source (any form an image's takes), marked so that it is read as a video (io/videos.py)."""

    source: Any


def _video_part(where: str, part: dict[str, Any]) -> dict[str, Any]:
    """A video content part -> {"type": "video", "video": its VideoSource (None: the row's next `videos` entry),
    "name"}."""
    source = part.get("video_url", part.get("video"))
    if isinstance(source, dict):  # {"url": ...}
        source = source.get("url")
    if part.get("type") == "video_url" and not isinstance(source, str):
        raise RowError(f"`{where}.video_url` must be {{\"url\": \"...\"}} (a URL, a path or a data: URI)")
    return {"type": "video", "video": None if source is None else VideoSource(source), "name": where}


def _image_part(where: str, part: dict[str, Any]) -> dict[str, Any]:
    """An image content part -> {"type": "image", "image": its source (None: the row's next `images` entry), "name"}."""
    source = part.get("image_url", part.get("image", part.get("image_pil")))
    if isinstance(source, dict):  # OpenAI: {"url": ..., "detail": ...}
        source = source.get("url")
    if part.get("type") == "image_url" and not isinstance(source, str):
        raise RowError(f"`{where}.image_url` must be {{\"url\": \"...\"}} (a URL, a path or a data: URI)")
    return {"type": "image", "image": source, "name": where}


def _content_parts(where: str, content: list[Any], images: bool) -> str | list[dict[str, Any]]:
    """OpenAI content parts: the text parts joined, or (a message with images) the parts in order."""
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": _text(f"{where}[{j}].text", part["text"])})
        elif kind in IMAGE_PART_TYPES and images:
            parts.append(_image_part(f"{where}[{j}]", part))
        elif kind in VIDEO_PART_TYPES and images:
            parts.append(_video_part(f"{where}[{j}]", part))
        elif kind in IMAGE_PART_TYPES + VIDEO_PART_TYPES:
            raise RowError(f"`{where}[{j}]` is an image or video part; this task reads text only (images and videos: "
                           f"--task generate with a vision-language model)")
        else:
            raise RowError(f"`{where}` parts must be text, image or video parts "
                           f"({{\"type\": \"text\", \"text\": ...}})")
    if any(p["type"] != "text" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def _messages(value: Any, images: bool = False) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise RowError("`messages` must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RowError(f"`messages[{i}]` must be an object with a string `role` and `content`")
        try:
            tool_fields = tool_message_fields(f"messages[{i}]", message)
        except ToolFieldError as exc:
            raise RowError(str(exc)) from None
        content = message.get("content")
        if isinstance(content, list):  # OpenAI content parts
            content = _content_parts(f"messages[{i}].content", content, images)
        if isinstance(content, list):  # (a message with images: its parts, checked)
            out.append({"role": _text(f"messages[{i}].role", message["role"]), "content": content, **tool_fields})
            continue
        if not isinstance(content, str) and not (content is None and "tool_calls" in tool_fields):  # (calls only)
            raise RowError(f"`messages[{i}].content` must be a string")
        text = content if content is None else _text(f"messages[{i}].content", content)
        out.append({"role": _text(f"messages[{i}].role", message["role"]), "content": text, **tool_fields})
    return out


def text_field(field: str, value: Any) -> str:
    """A row's text field: a string, not blank, valid Unicode (raises RowError naming the field)."""
    if not isinstance(value, str):
        raise RowError(f"`{field}` must be a string, got {type(value).__name__}")
    if not value.strip():
        raise RowError(f"`{field}` is empty")
    return _text(field, value)


def _text(field: str, value: str) -> str:
    """`value`, if it is valid Unicode (JSON escapes can smuggle in lone surrogates, which no tokenizer takes)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RowError(f"`{field}` is not valid Unicode text (an unpaired surrogate at character {exc.start})") from None
    return value


def is_token_ids(value: Any) -> bool:
    """A non-empty list of non-negative integers (booleans are not ids)."""
    return (isinstance(value, list) and bool(value)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value))


def token_ids_field(value: Any) -> list[int]:
    """A row's `prompt_token_ids`, checked (raises RowError)."""
    if not is_token_ids(value):
        raise RowError("`prompt_token_ids` must be a non-empty list of non-negative integers")
    return list(value)


__all__ = ["RowError", "given_row_id", "is_token_ids", "parse_messages", "row_id_of", "text_field", "token_ids_field"]
