"""The tool parts of chat messages: an assistant's `tool_calls` and a `tool` message's result, checked for rows
and put in the shape HF chat templates read.

OpenAI gives a call's `function.arguments` as a JSON string; HF templates write it with `tojson` (Llama 3,
Mistral) or test `is string` (Qwen), so they expect the object: it is decoded before rendering (as vLLM does).
"""
from __future__ import annotations

import json
from typing import Any

from cbatch.tools.spec import ToolFieldError


def _call(where: str, call: Any) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type", "function") != "function":
        raise ToolFieldError(where, 'must be {"id", "type": "function", "function": {"name", "arguments"}}')
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolFieldError(f"{where}.function.name", "must be a non-empty string")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            decoded = None
        if not isinstance(decoded, dict):
            raise ToolFieldError(f"{where}.function.arguments", "must be a JSON object, or a string holding one")
    elif not isinstance(arguments, dict):
        raise ToolFieldError(f"{where}.function.arguments", "must be a JSON object, or a string holding one")
    if call.get("id") is not None and not isinstance(call["id"], str):
        raise ToolFieldError(f"{where}.id", "must be a string")
    return call


def tool_message_fields(where: str, message: dict[str, Any]) -> dict[str, Any]:
    """A chat message's tool fields, checked (`where` is its place, e.g. "messages[2]"): an assistant's
    `tool_calls`, a tool result's `tool_call_id` and `name`; {} for a message without them."""
    out: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if message.get("role") != "assistant":
            raise ToolFieldError(f"{where}.tool_calls", "only an assistant message has tool calls")
        if not isinstance(calls, list):
            raise ToolFieldError(f"{where}.tool_calls", "must be a list of calls")
        out["tool_calls"] = [_call(f"{where}.tool_calls[{i}]", call) for i, call in enumerate(calls)]
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            if not isinstance(message[key], str):
                raise ToolFieldError(f"{where}.{key}", "must be a string")
            out[key] = message[key]
    return out


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as chat templates read them: each assistant call's JSON-string arguments decoded (the
    messages themselves are not changed; a list without calls comes back as it is)."""
    if not any(m.get("tool_calls") for m in messages):
        return messages
    return [{**m, "tool_calls": [_decoded(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


def _decoded(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    return {**call, "function": {**function, "arguments": json.loads(function["arguments"])}}


__all__ = ["template_messages", "tool_message_fields"]
