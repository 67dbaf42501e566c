"""A parsed completion of a tool-calling row: its text content and its calls, in OpenAI's shapes.

A call is `{"id", "type": "function", "function": {"name", "arguments"}}`, `arguments` a JSON string.
Ids are a hash of (the row's key, the call's index): the same row gives the same ids on every run, so a
resumed job's output and the result cache stay byte-stable.
"""
from __future__ import annotations

import hashlib
import json
import string
from dataclasses import dataclass, field
from typing import Any

_ID_ALPHABET = string.ascii_letters + string.digits


def tool_call_id(key: str, index: int, length: int = 24, prefix: str = "call_") -> str:
    """A deterministic id for call `index` of the completion `key` (e.g. "row-7/0": row id and sample): `prefix`
    and `length` letters and digits (Mistral's templates take exactly nine, no prefix)."""
    digest = int.from_bytes(hashlib.sha256(f"{key}\x00{index}".encode()).digest(), "big")
    chars = []
    for _ in range(length):
        digest, i = divmod(digest, len(_ID_ALPHABET))
        chars.append(_ID_ALPHABET[i])
    return prefix + "".join(chars)


def arguments_text(arguments: Any) -> str | None:
    """A call's arguments as OpenAI's JSON string: an object is serialised, a string holding a JSON object is
    kept as it is, nothing is "{}"; None for anything else (the call is malformed)."""
    if arguments is None:
        return "{}"
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):
        try:
            return arguments if isinstance(json.loads(arguments), dict) else None
        except json.JSONDecodeError:
            return None
    return None


@dataclass(frozen=True, slots=True)
class ParsedCompletion:
    """What a tool-call parser makes of a completion. `content` is None when the completion held only calls."""

    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI's finish_reason: "tool_calls" when the model stopped after calling (not when cut by length)."""
        return "tool_calls" if self.tool_calls and engine_reason == "stop" else engine_reason


def openai_calls(key: str, calls: list[tuple[str, str]], id_length: int = 24, id_prefix: str = "call_") -> list[dict[str, Any]]:
    """(name, arguments JSON string) pairs -> OpenAI's tool_calls with deterministic ids."""
    return [{"id": tool_call_id(key, i, id_length, id_prefix), "type": "function",
             "function": {"name": name, "arguments": args}} for i, (name, args) in enumerate(calls)]


def content_or_none(text: str) -> str | None:
    stripped = text.strip()
    return stripped or None


__all__ = ["ParsedCompletion", "arguments_text", "content_or_none", "openai_calls", "tool_call_id"]
