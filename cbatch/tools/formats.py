"""How each model family writes tool calls, both ways: parsing a completion into calls, and the xgrammar
structural tag that makes a completion one or more well-formed calls (`tool_choice` "required" or named).

    hermes       <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (Qwen2.5, Qwen3, Hermes)
                 text before the first call is the content; several calls follow each other
    llama3_json  {"name": "f", "parameters": {...}}                              (Llama 3.1 / 3.2 / 3.3)
                 optionally after <|python_tag|>; several calls separated by ";"
    mistral      [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]             (Mistral, Mixtral)
                 text before [TOOL_CALLS] is the content

The engine decodes without special tokens, so a completion may arrive without <|python_tag|> or
[TOOL_CALLS] (special tokens in Llama's and Mistral's vocabularies): the parsers take the bare JSON too,
and the constraints never ask for those tokens. A completion that is not well-formed calls parses to its
text as content and no calls; a parser never raises.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from cbatch.tools.calls import ParsedCompletion, arguments_text, content_or_none, openai_calls
from cbatch.tools.spec import ToolFieldError

_DECODER = json.JSONDecoder()


def _call(item: Any, argument_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON string) of a decoded call object, or None when it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    given = [k for k in argument_keys if k in item]
    if len(given) > 1 or set(item) - {"name", *argument_keys}:
        return None
    arguments = arguments_text(item[given[0]] if given else None)
    return None if arguments is None else (item["name"], arguments)


_NOT_JSON = object()


def _json_value(text: str) -> Any:
    """The one JSON value `text` holds (whitespace around it allowed), else _NOT_JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return _NOT_JSON


def _json_values(text: str, separator: str) -> list[Any] | None:
    """The JSON values `text` holds, one after another with `separator` (and whitespace) between them;
    None when anything else is there."""
    values, pos, end = [], 0, len(text)
    while True:
        while pos < end and text[pos].isspace():
            pos += 1
        try:
            value, pos = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return None
        values.append(value)
        while pos < end and text[pos].isspace():
            pos += 1
        if pos == end:
            return values
        if not text.startswith(separator, pos):
            return None
        pos += len(separator)


def _after_marker(text: str, marker: str) -> tuple[str, str]:
    """(the content before `marker`, the calls after it); without the marker (decoded away with the special
    tokens) all of `text` is the calls."""
    content, found, calls = text.partition(marker)
    return (content, calls) if found else ("", text)


def _arguments_format(parameters: dict[str, Any]) -> dict[str, Any]:
    """The structural-tag content of a call's arguments: its JSON schema, at most one whitespace character in a
    row (a weak model cannot loop on blanks; structural tags have no compact-JSON switch)."""
    return {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": 1}


@dataclass(frozen=True)
class ToolFormat:
    """One family's tool-call format: a call is `open` + {"name": ..., ARGUMENTS_KEY: {...}} + `close`, and
    `separator` comes between calls."""

    name: str
    argument_keys: tuple[str, ...]  # the call object's arguments key(s); the first is what the constraint writes
    separator: str
    open: str = ""  # around each call (hermes: the <tool_call> tags)
    close: str = ""
    id_length: int = 24
    id_prefix: str = "call_"

    def parse(self, text: str, key: str) -> ParsedCompletion:
        """`text` (a completion) -> its content and calls; `key` names the completion for the call ids."""
        found = self._split(text)
        if found is None:
            return ParsedCompletion(text)
        content, items = found
        calls = [_call(item, self.argument_keys) for item in items]
        if not calls or None in calls:
            return ParsedCompletion(text)
        return ParsedCompletion(content_or_none(content), openai_calls(key, calls, self.id_length, self.id_prefix))

    def _split(self, text: str) -> tuple[str, list[Any]] | None:
        """(the content, the decoded call objects), or None when `text` holds no calls in this format."""
        raise NotImplementedError

    def call_tag(self, name: str, parameters: dict[str, Any]) -> dict[str, Any]:
        """The structural tag of one call of function `name` (its name written by the grammar, its
        arguments generated under `parameters`)."""
        begin = f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{self.argument_keys[0]}": '
        return {"type": "tag", "begin": self.open + begin, "content": _arguments_format(parameters), "end": "}" + self.close}

    def calls_format(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        """The structural-tag format of one call (`parallel` False) or several, each one of `tags`."""
        return {"type": "tags_with_separator", "tags": tags, "separator": self.separator, "at_least_one": True,
                "stop_after_first": not parallel}


class HermesFormat(ToolFormat):
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)

    def _split(self, text: str) -> tuple[str, list[Any]] | None:
        start = text.find("<tool_call>")
        if start < 0:
            return None
        bodies = self._CALL.findall(text, start)
        items = [_json_value(body) for body in bodies]
        return None if _NOT_JSON in items else (text[:start], items)


class Llama3JsonFormat(ToolFormat):
    PYTHON_TAG = "<|python_tag|>"

    def _split(self, text: str) -> tuple[str, list[Any]] | None:
        content, calls = _after_marker(text, self.PYTHON_TAG)
        if not calls.strip().startswith("{"):
            return None
        values = _json_values(calls, ";")
        return None if values is None else (content, values)


class MistralFormat(ToolFormat):
    MARKER = "[TOOL_CALLS]"

    def _split(self, text: str) -> tuple[str, list[Any]] | None:
        content, calls = _after_marker(text, self.MARKER)
        items = _json_value(calls)
        return (content, items) if isinstance(items, list) else None

    def calls_format(self, tags: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
        inner = super().calls_format(tags, parallel)
        return {"type": "sequence", "elements": [{"type": "const_string", "value": "["}, inner,
                                                 {"type": "const_string", "value": "]"}]}


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (
    HermesFormat("hermes", ("arguments",), "\n", open="<tool_call>\n", close="\n</tool_call>"),
    Llama3JsonFormat("llama3_json", ("parameters", "arguments"), "; "),
    MistralFormat("mistral", ("arguments",), ", ", id_length=9, id_prefix=""),
)}

# ---- which format a model writes -------------------------------------------------------------------------
_TEMPLATE_MARKERS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"), ("[AVAILABLE_TOOLS]", "mistral"),
                     ("<|python_tag|>", "llama3_json"))
_MODEL_TYPES = {"qwen2": "hermes", "qwen2_moe": "hermes", "qwen3": "hermes", "qwen3_moe": "hermes",
                "mistral": "mistral", "mixtral": "mistral"}


def detect_format(chat_template: str, model_type: str | None) -> ToolFormat | None:
    """The format a model's chat template asks for (its markers), else its architecture's (config.json's
    model_type); None when neither tells."""
    for marker, name in _TEMPLATE_MARKERS:
        if marker in chat_template:
            return FORMATS[name]
    if "<|start_header_id|>" in chat_template and "tools" in chat_template:  # Llama 3 templates without python_tag
        return FORMATS["llama3_json"]
    name = _MODEL_TYPES.get(model_type or "")
    return FORMATS[name] if name else None


def tool_format(parser: str | None, chat_template: str, model_type: str | None) -> ToolFormat:
    """The job's tool-call format: `parser` (--tool-call-parser) when given, else the model's own. Raises a
    UserError naming the flag when the name is unknown or the model does not tell."""
    names = ", ".join(FORMATS)
    if parser is not None:
        if parser not in FORMATS:
            raise ToolFieldError("--tool-call-parser", f"{parser!r} is not a tool-call parser; give one of {names}")
        return FORMATS[parser]
    found = detect_format(chat_template, model_type)
    if found is None:
        raise ToolFieldError("--tool-call-parser", f"this model's chat template names no tool-call format; give one "
                             f"of {names}")
    return found


__all__ = ["FORMATS", "HermesFormat", "Llama3JsonFormat", "MistralFormat", "ToolFormat", "detect_format", "tool_format"]
