"""One input row -> a validated request (prompt + sampling settings), or a message naming what is wrong.

Accepted shapes: `{"prompt": "..."}`, `{"messages": [{"role", "content"}, ...]}`,
`{"prompt_token_ids": [...]}`, each with optional `id`, sampling fields (`SAMPLING_FIELDS` in cbatch/config.py,
vLLM's names: docs/sampling.md) and a structured-output constraint (`json_schema`, `regex`, `choice`, `json_object`,
`response_format`: cbatch/io/constraints.py); and the OpenAI batch format `{"custom_id", "method", "url",
"body": {...}}` (cbatch/io/openai.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

from cbatch.config import (INT, NUMBER, OBJECT, SAMPLING_FIELDS, STRINGS, TOKEN_BIASES, TOKEN_IDS, SamplingParams,
                           UserError)
from cbatch.io.constraints import ConstraintFieldError, constraint_from_row
from cbatch.io.openai import RequestError, is_openai_request, request_fields
from cbatch.io.row_fields import (RowError, VideoSource, given_row_id, is_token_ids, parse_messages, row_id_of,
                                  text_field, token_ids_field)
from cbatch.reasoning import DEFAULT_EFFORT_BUDGETS, with_reasoning_effort
from cbatch.tools import ToolFormat, ToolSpec, tool_spec


@dataclass(slots=True)
class RowRequest:
    index: int
    row_id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    params: SamplingParams | None = None
    echo: dict[str, Any] = field(default_factory=dict)  # request fields an OpenAI output line repeats: object, model
    tools: ToolSpec | None = None  # `tools`, `tool_choice`, `parallel_tool_calls` (a chat row's; cbatch/tools/)
    tool_format: ToolFormat | None = None  # the format its calls are parsed in (set when its task makes its requests)
    reasoning_effort: str | None = None  # the row's (checked): a thinking budget, or a variable of a template reading it
    effort_budget: bool = False  # its thinking budget is its reasoning_effort's (not the row's own)
    images: list[tuple[str, Any]] = field(default_factory=list)  # (where the row gave it, its source), prompt order
    image_futures: list | None = None  # their PromptImages being read on worker threads (GenerateTask.prefetch)
    # a /v1/completions line: its completion is the model's raw text, thinking included (vLLM's completions endpoint
    # splits no reasoning off; chat and Responses lines, and cbatch's own rows, have the `reasoning` split)
    raw_text: bool = False


def parse_row(index: int, row: dict[str, Any] | str, defaults: SamplingParams,
              effort_budgets: Mapping[str, int] = DEFAULT_EFFORT_BUDGETS) -> RowRequest:
    """Raises RowError for a bad row. `effort_budgets`: the job's thinking budget per `reasoning_effort`."""
    if isinstance(row, str):
        raise RowError(row)
    row_id = row_id_of(index, row)
    response_object = None
    if is_openai_request(row):  # OpenAI batch format: the request lives in `body`
        try:
            row, response_object = request_fields(row)
        except RequestError as exc:
            raise RowError(str(exc)) from None
    request = RowRequest(index=index, row_id=row_id)
    given = [k for k in ("prompt", "messages", "prompt_token_ids") if row.get(k) is not None]
    if not given:
        raise RowError("missing prompt: give `prompt` (text), `messages` (chat) or `prompt_token_ids`")
    if len(given) > 1:
        raise RowError(f"give only one of `prompt`, `messages`, `prompt_token_ids` (got {', '.join(given)})")
    field = given[0]
    if field == "prompt":
        request.prompt = text_field("prompt", row["prompt"])
    elif field == "messages":
        request.messages = parse_messages(row["messages"], images=True)
    else:
        request.prompt_token_ids = token_ids_field(row["prompt_token_ids"])
    request.images = row_images(row, request)
    request.params = sampling_from_row(row, defaults)
    try:
        request.params = with_reasoning_effort(row, request.params, effort_budgets)
        if row.get("reasoning_effort") is not None:
            request.reasoning_effort = row["reasoning_effort"]
            request.effort_budget = row.get("thinking_token_budget") is None
        request.tools = tool_spec(row)
    except UserError as exc:  # a bad reasoning_effort or tool field, named
        raise RowError(str(exc)) from None
    if request.tools is not None and request.tools.tools and request.messages is None:
        raise RowError("`tools` are for a chat: give `messages` (the chat template renders the tools)")
    lora = row.get("lora")
    if lora is not None:
        if not isinstance(lora, str) or not lora:
            raise RowError(f"`lora` must be the name of a LoRA adapter of the job (a string), got {lora!r}")
        request.params = with_lora(request.params, lora)
    request.echo = {"object": response_object or ("chat.completion" if request.messages else "text_completion")}
    request.raw_text = response_object == "text_completion"
    if isinstance(row.get("model"), str):
        request.echo["model"] = row["model"]
    return request


def row_images(row: dict[str, Any], request: RowRequest) -> list[tuple[str, Any]]:
    """The row's images and videos in prompt order, (where the row gave it, its source: a video's a VideoSource),
    unread: a chat's image and video parts (a bare `{"type": "image"}` part takes the next entry of the row's
    `images`, a bare `{"type": "video"}` the next of its `videos`; entries left over go before the first user
    message's text, images then videos, as Qwen's examples put them), or a text prompt's (or token ids') `images`
    then `videos`, one per placeholder it has (engine order: io/images.in_prompt_order)."""
    given = {"image": _listed(row, "images", "image"), "video": _listed(row, "videos", "video")}
    if request.messages is None:  # a text prompt or token ids: one placeholder per image or video
        return given["image"] + given["video"]
    for message in request.messages:
        for part in message["content"] if isinstance(message["content"], list) else ():
            kind = part["type"]
            if kind != "text" and part[kind] is None:
                if not given[kind]:
                    raise RowError(f"`{part['name']}` is {'an image' if kind == 'image' else 'a video'} part with no "
                                   f"source, and the row's `{kind}s` has no entry left for it")
                part["name"], part[kind] = given[kind].pop(0)
    left = [(name, kind, source) for kind in ("image", "video") for name, source in given[kind]]
    if left:
        user = next((m for m in request.messages if m["role"] == "user"), None)
        if user is None:
            raise RowError(f"`{left[0][0].split('[')[0]}`: the chat has no user message to put them in")
        text = user["content"]
        parts = text if isinstance(text, list) else [{"type": "text", "text": text or ""}]
        user["content"] = [{"type": kind, kind: source, "name": name} for name, kind, source in left] + parts
    return [(part["name"], part[part["type"]]) for message in request.messages if isinstance(message["content"], list)
            for part in message["content"] if part["type"] != "text"]


def _listed(row: dict[str, Any], plural: str, single: str) -> list[tuple[str, Any]]:
    """The row's `images` (else `image`: one) or `videos` (else `video`), checked: (its name, its source); a video's
    source wrapped as a VideoSource."""
    key = plural if row.get(plural) is not None else single
    given = row.get(key)
    entries = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
    for j, source in enumerate(entries):
        if not (isinstance(source, (str, bytes, bytearray))
                or (isinstance(source, dict) and ("bytes" in source or "path" in source))):
            raise RowError(f"`{key}[{j}]` must be {'an image' if single == 'image' else 'a video'}: a URL, a path, a "
                           "data: URI, bytes or {\"bytes\", \"path\"}")
    wrap = VideoSource if single == "video" else (lambda source: source)
    return [(f"{key}[{j}]", wrap(source)) for j, source in enumerate(entries)]


_WITH_LORA: dict[tuple[int, str], tuple[SamplingParams, SamplingParams]] = {}  # (id(params), adapter) -> both


def with_lora(params: SamplingParams, lora: str) -> SamplingParams:
    """`params` for the LoRA adapter `lora`; rows that share settings share the result too (the host step checks
    each distinct settings object once per step: cbatch/config.py's distinct_params)."""
    key = (id(params), lora)
    cached = _WITH_LORA.get(key)
    if cached is not None and cached[0] is params:
        return cached[1]
    adapted = replace(params, lora=lora)
    if len(_WITH_LORA) < 4096:
        _WITH_LORA[key] = (params, adapted)
    return adapted


def sampling_from_row(row: dict[str, Any], defaults: SamplingParams) -> SamplingParams:
    """The CLI defaults with the row's own settings on top (a row's OBJECT fields, `chat_template_kwargs`, add
    to the job's key by key; every other field replaces); the result is validated. A row with no settings of its
    own gets `defaults` itself: rows that share one object cost the engine's host step one check, not one per row."""
    changes = {key: sampling_value(key, row[key]) for key in SAMPLING_FIELDS if row.get(key) is not None}
    for key, value in changes.items():
        if SAMPLING_FIELDS[key].kind == OBJECT and isinstance(value, dict):
            changes[key] = {**getattr(defaults, key), **value}
    try:
        constraint = constraint_from_row(row, defaults.constraint)
    except ConstraintFieldError as exc:
        raise RowError(str(exc)) from None
    unchanged = not changes and constraint is defaults.constraint
    params = defaults if unchanged else replace(defaults, **changes, constraint=constraint)
    error = params.validate()
    if error is not None:
        raise RowError(error)
    return params


def sampling_value(key: str, value: Any) -> Any:
    """A sampling field's value as JSON or Parquet carry it -> the SamplingParams type (validated later):
    integral floats to ints, numbers to floats, a lone stop string or token id to a list, logit_bias keys
    (JSON object keys are strings; Parquet maps are (key, value) pairs) to token ids. By the field's kind
    (SAMPLING_FIELDS); a BOOL or OBJECT value is taken as it is."""
    kind = SAMPLING_FIELDS[key].kind
    if kind == INT:
        return _integral(value)
    if kind == NUMBER and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind == NUMBER and isinstance(value, float) and not math.isfinite(value):
        raise RowError(f"{key} must be a finite number, got {value!r}")
    if kind == STRINGS and isinstance(value, (str, tuple)):
        return [value] if isinstance(value, str) else list(value)
    if kind == TOKEN_IDS:
        return [_integral(t) for t in value] if isinstance(value, (list, tuple)) else [_integral(value)]
    if kind == TOKEN_BIASES:
        pairs = value.items() if isinstance(value, dict) else value if isinstance(value, list) else None
        if pairs is None or not all(isinstance(p, (list, tuple)) and len(p) == 2 for p in pairs):
            raise RowError(f"{key} must be an object of token id -> bias, e.g. {{\"1234\": -100}}, got {value!r}")
        return {_token_key(k): v for k, v in pairs}
    return value


def _integral(value: Any) -> Any:
    """JSON and Parquet may carry integers as floats."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _token_key(key: Any) -> Any:
    if isinstance(key, str) and key.strip().isdigit():
        return int(key)
    return _integral(key)


__all__ = ["RowError", "RowRequest", "given_row_id", "is_token_ids", "parse_messages", "parse_row", "row_id_of",
           "sampling_from_row", "sampling_value", "text_field", "with_lora"]
