"""The OpenAI Batch API format, in and out: a drop-in for batch input files and their output files.

In: lines `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions" | "/v1/responses",
"body": {...}}`. Every body field is in `BODY_FIELDS`, THE one list of what cbatch honours and for which urls: a
field it cannot honour (yet) makes that row an error naming the field, unless it holds the value that means "off"
(e.g. `"n": 1`), which is exactly what cbatch does anyway. Nothing is dropped silently. A Responses body
(`input`, `instructions`, `max_output_tokens`, `text.format`) becomes the chat row it means (`responses_fields`).

Out (`--output-format openai`): one line per input row, in input order, shaped like OpenAI's batch output
lines: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, the body a
`chat.completion` or `text_completion` object with `choices` and `usage`, or a `response` object (Responses lines). A failed row is shaped like a
line of OpenAI's error file for a rejected request: status 400 and `body.error` {message, type, param, code}.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from cbatch.config import SAMPLING_FIELDS, UserError
from cbatch.io.outcomes import EXPIRED, FAILED

CHAT_URL, COMPLETIONS_URL, RESPONSES_URL = "/v1/chat/completions", "/v1/completions", "/v1/responses"
OBJECT_OF_URL = {CHAT_URL: "chat.completion", COMPLETIONS_URL: "text_completion", RESPONSES_URL: "response"}
CHAT_AND_COMPLETIONS = (CHAT_URL, COMPLETIONS_URL)
EVERY_URL = tuple(OBJECT_OF_URL)
ENVELOPE_FIELDS = ("custom_id", "method", "url", "body")
LINE_KEYS = (*ENVELOPE_FIELDS, "id")  # a line may also carry cbatch's own `id` (the output id, before custom_id)
OPENAI_LINE_FIELDS = ("id", "custom_id", "response", "error")  # an output line's own keys

HONOURED, NOT_YET, UNSUPPORTED = "honoured", "not yet", "unsupported"
RESPONSES_SAMPLING = ("temperature", "top_p")  # the sampling fields a /v1/responses body takes
_ANY = object()  # no value of the field is accepted


@dataclass(frozen=True, slots=True)
class BodyField:
    status: str  # HONOURED | NOT_YET (planned; none today) | UNSUPPORTED
    note: str
    off: Any = _ANY  # the value meaning "off": accepted, since cbatch does exactly that
    urls: tuple[str, ...] = CHAT_AND_COMPLETIONS  # the urls whose bodies take it

    @property
    def has_off(self) -> bool:
        return self.off is not _ANY


def _yes(note: str, urls: tuple[str, ...] = CHAT_AND_COMPLETIONS) -> BodyField:
    return BodyField(HONOURED, note, urls=urls)


def _no(note: str, off: Any = _ANY) -> BodyField:
    return BodyField(UNSUPPORTED, note, off)


# Every body field cbatch knows, and what it does with it (docs/structured-output.md shows this table).
BODY_FIELDS: dict[str, BodyField] = {
    "model": _yes("echoed in the response; the job's --model generates", EVERY_URL),
    "messages": _yes("/v1/chat/completions: the chat (text content parts, tool calls and results), rendered with the "
                     "model's chat template"),
    "prompt": _yes("/v1/completions: one string, or one list of token ids"),
    "max_completion_tokens": _yes("same as max_tokens (max_tokens wins when both are given)"),
    "top_logprobs": _yes("chat: alternatives per token (with logprobs: true)"),
    "response_format": _yes("structured output: type text, json_object or json_schema"),
    "user": _yes("no effect on the completion", EVERY_URL),
    "metadata": _yes("no effect on the completion", EVERY_URL),
    # every sampling field a row takes (cbatch/config.py's SAMPLING_FIELDS), under the row field's name
    **{spec.name: _yes(spec.body_note or spec.meaning, EVERY_URL if spec.name in RESPONSES_SAMPLING else CHAT_AND_COMPLETIONS)
       for spec in SAMPLING_FIELDS.values() if spec.in_body},
    # /v1/responses (OpenAI's Responses API): the body becomes a chat row (`responses_fields`)
    "input": _yes("/v1/responses: a string (one user message) or a list of message items (text parts; image parts for a vision-language model)", (RESPONSES_URL,)),
    "instructions": _yes("/v1/responses: a system message before the input", (RESPONSES_URL,)),
    "max_output_tokens": _yes("/v1/responses: as max_tokens", (RESPONSES_URL,)),
    "text": _yes("/v1/responses: `format` for structured output: type text, json_object or json_schema", (RESPONSES_URL,)),
    # cbatch's structured-output row fields (cbatch/io/constraints.py), also accepted inside a body
    "json_schema": _yes("cbatch: structured output, a JSON schema"),
    "json_object": _yes("cbatch: structured output, any JSON object"),
    "regex": _yes("cbatch: structured output, a regular expression"),
    "choice": _yes("cbatch: structured output, one of a list of strings"),
    "best_of": _no("several candidates per row, the best returned", off=1),
    # not for an offline text generator
    "echo": _no("echo the prompt", off=False),
    "suffix": _no("text after the completion (insertion)"),
    "stream": _no("streaming (a batch file is never streamed)", off=False),
    "stream_options": _no("streaming options"),
    "tools": _yes("tool calling: the functions, rendered with the chat template; calls parsed into message.tool_calls"),
    "tool_choice": _yes('tool calling: auto, none, required or a named function ("required" and a named function '
                        "are enforced with the structured-output engine)"),
    "parallel_tool_calls": _yes("tool calling: false allows one call at most"),
    "functions": _no("function calling (deprecated)"),
    "function_call": _no("function calling (deprecated)", off="none"),
    "audio": _no("audio output"),
    "modalities": _no("output modalities", off=["text"]),
    "prediction": _no("predicted outputs"),
    "web_search_options": _no("web search"),
    "reasoning_effort": _yes("low, medium or high: a thinking budget per effort (the job's --reasoning-effort-budgets)"),
    "service_tier": _no("OpenAI's service tiers"),
    "store": _no("storing the completion at OpenAI", off=False),
}


class RequestError(UserError):
    """A bad OpenAI batch line; the message names the field (`body.logprobs`, `url`, ...)."""


def is_openai_request(row: dict[str, Any]) -> bool:
    return "body" in row


def _check_body_field(name: str, value: Any, url: str) -> None:
    spec = BODY_FIELDS.get(name)
    if spec is None or url not in spec.urls:
        raise RequestError(f"body.{name}: not a field cbatch knows for {url}; remove it")
    if spec.status == HONOURED or value is None or (spec.has_off and value == spec.off):
        return
    when = "not supported yet" if spec.status == NOT_YET else "not supported"
    fix = f"remove it or set it to {json.dumps(spec.off)}" if spec.has_off else "remove it"
    raise RequestError(f"body.{name}: {spec.note} is {when} by cbatch; {fix}")


def batch_body(row: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI batch line's `body`, after the checks every endpoint shares: a `custom_id`, no top-level key the
    format does not define (cbatch's `id` aside; a key --keep-columns carries is taken off the line before:
    `without_carried`),
    method POST, body a JSON object."""
    unknown = next((k for k in row if k not in LINE_KEYS), None)
    if unknown is not None:
        raise RequestError(f"{unknown}: not a key of an OpenAI batch line ({', '.join(ENVELOPE_FIELDS)}); remove it, "
                           "or carry it to the output with --keep-columns")
    custom_id = row.get("custom_id")
    if "id" not in row and (not isinstance(custom_id, str) or not custom_id):
        raise RequestError("custom_id: every OpenAI batch line needs its own `custom_id` (a non-empty string), "
                           f"got {custom_id!r}")
    method = row.get("method", "POST")
    if method != "POST":
        raise RequestError(f'method: must be "POST", got {method!r}')
    body = row["body"]
    if not isinstance(body, dict):
        raise RequestError(f"body: must be a JSON object, got {type(body).__name__}")
    return body


def without_carried(row: dict[str, Any] | str, carried: Iterable[str]) -> dict[str, Any] | str:
    """An OpenAI batch line without the top-level keys --keep-columns carries to the output (they are the user's, not
    the request's, and are not dropped); any other row as it is."""
    if not isinstance(row, dict) or not is_openai_request(row):
        return row
    extra = set(carried).difference(ENVELOPE_FIELDS).intersection(row)
    return {k: v for k, v in row.items() if k not in extra} if extra else row


def request_fields(row: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """An OpenAI batch line -> (the row fields cbatch reads, the response object: chat.completion,
    text_completion or response). Raises RequestError naming the first field it cannot honour."""
    body = batch_body(row)
    url = row.get("url")
    if url is None:
        url = CHAT_URL if "messages" in body else COMPLETIONS_URL
    if url not in OBJECT_OF_URL:
        raise RequestError(f"url: must be one of {', '.join(map(repr, OBJECT_OF_URL))}, got {url!r}")
    for name, value in body.items():
        _check_body_field(name, value, url)
    if url == RESPONSES_URL:
        return responses_fields(body), OBJECT_OF_URL[url]
    prompt_field, other = ("messages", "prompt") if url == CHAT_URL else ("prompt", "messages")
    if body.get(other) is not None:
        raise RequestError(f"body.{other}: {url} takes `{prompt_field}`, not `{other}`")
    fields = dict(body)
    if url == COMPLETIONS_URL:
        fields.update(_completion_prompt(body.get("prompt")))
    if "max_completion_tokens" in fields and fields.get("max_tokens") is None:
        fields["max_tokens"] = fields["max_completion_tokens"]
    if url == CHAT_URL:  # chat: logprobs true/false, top_logprobs k; completions: logprobs k already
        fields["logprobs"] = (fields.get("top_logprobs") or 0) if fields.get("logprobs") else None
    return fields, OBJECT_OF_URL[url]


def _completion_prompt(prompt: Any) -> dict[str, Any]:
    """/v1/completions' `prompt`: a string, a list of token ids, or a list holding one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return {"prompt": None, "prompt_token_ids": prompt}
    if isinstance(prompt, list):
        raise RequestError("body.prompt: one prompt per line (a string or a list of token ids), not a list of prompts")
    return {"prompt": prompt}


# ---- /v1/responses -> a chat row -----------------------------------------------------------------------------------
RESPONSES_PART_TYPES = ("input_text", "output_text")  # a message item's text parts (the rest: images, files, ...)
TEXT_FORMATS = {  # text.format -> the chat body's response_format (cbatch/io/constraints.py reads it)
    "text": lambda fmt: None,
    "json_object": lambda fmt: {"type": "json_object"},
    "json_schema": lambda fmt: {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict")
                                                                       if k in fmt}},
}


def responses_fields(body: dict[str, Any]) -> dict[str, Any]:
    """A /v1/responses body (its fields checked against BODY_FIELDS) -> the chat row it means: `instructions` a
    system message before `input`'s messages, `max_output_tokens` as max_tokens, `text.format` as
    response_format."""
    if body.get("input") is None:
        raise RequestError("body.input: a /v1/responses line needs `input` (a string or a list of message items)")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError(f"body.instructions: must be a string, got {type(instructions).__name__}")
    system = [{"role": "system", "content": instructions}] if instructions else []
    fields = {k: body[k] for k in ("model", "metadata", "user", *RESPONSES_SAMPLING) if k in body}
    fields["messages"] = system + _input_messages(body["input"])
    if body.get("max_output_tokens") is not None:
        fields["max_tokens"] = body["max_output_tokens"]
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        fields["response_format"] = response_format
    return fields


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise RequestError("body.input: must be a string or a non-empty list of message items")
    return [_input_message(f"body.input[{i}]", item) for i, item in enumerate(value)]


def _input_message(name: str, item: Any) -> dict[str, Any]:
    """One Responses message item -> a chat message (its text parts as the chat's text parts)."""
    if not isinstance(item, dict) or not isinstance(item.get("role"), str):
        raise RequestError(f"{name}: must be a message item, an object with a string `role` and `content`")
    if item.get("type", "message") != "message":
        raise RequestError(f"{name}.type: cbatch takes message items only, got {item['type']!r}")
    unknown = next((k for k in item if k not in ("type", "role", "content", "id", "status")), None)
    if unknown is not None:
        raise RequestError(f"{name}.{unknown}: not a field of a message item cbatch knows; remove it")
    content = item.get("content")
    if not isinstance(content, (str, list)):
        raise RequestError(f"{name}.content: must be a string or a list of input_text / input_image parts, got "
                           f"{type(content).__name__}")
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "input_image" and isinstance(part.get("image_url"), str):
                parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})  # (a vision model's)
                continue
            if not isinstance(part, dict) or part.get("type") not in RESPONSES_PART_TYPES or not isinstance(part.get("text"), str):
                raise RequestError(f"{name}.content[{j}]: must be a text part ({{\"type\": \"input_text\", \"text\"}}) "
                                   f"or an image ({{\"type\": \"input_image\", \"image_url\"}})")
            parts.append({"type": "text", "text": part["text"]})
        content = parts
    return {"role": item["role"], "content": content}


def _text_format(text: Any) -> dict[str, Any] | None:
    """`body.text` -> a response_format (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise RequestError(f"body.text: must be an object with `format`, got {type(text).__name__}")
    unknown = next((k for k in text if k != "format"), None)
    if unknown is not None:
        raise RequestError(f"body.text.{unknown}: not a field cbatch knows for {RESPONSES_URL}; remove it")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind not in TEXT_FORMATS:
        raise RequestError(f"body.text.format.type: one of {', '.join(TEXT_FORMATS)}, got {kind!r}")
    if kind == "json_schema" and not isinstance(fmt.get("schema"), dict):
        raise RequestError("body.text.format.schema: a json_schema format needs `schema` (a JSON schema object)")
    return TEXT_FORMATS[kind](fmt)


# ---- output -----------------------------------------------------------------------------------------
def output_model_name(model: str | None) -> str:
    """The `model` a response names when its request named none: the --model as given (a folder: its name)."""
    from pathlib import Path

    from cbatch.model.default_model import DEFAULT_MODEL_NAME

    if model is None:
        return DEFAULT_MODEL_NAME
    return Path(model).name if Path(model).exists() else model


def request_digest(record: dict[str, Any]) -> str:
    """A stable id for a row's request: the same on a resumed or repeated run."""
    return hashlib.blake2b(f"{record['index']}\x00{record['id']}".encode(), digest_size=12).hexdigest()


# A finished row's response body: (its records, one per sample in sample order; the model name a row that named
# none answers with; the lines' `created` time) -> the body. Each task supplies its own (cbatch/tasks/).
BodyMaker = Callable[[list[dict[str, Any]], str, int], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class OpenAILines:
    """--output-format openai: OUTPUT as OpenAI batch output lines, their bodies made by the job's task."""

    model: str  # what a response names when its request named no model
    body: BodyMaker
    vllm_errors: bool = False  # --output-format vllm: an error line as vLLM's run-batch writes it (body null, `error` set)


def output_line(samples: list[dict[str, Any]], model: str, created: int, body: BodyMaker,
                vllm_errors: bool = False) -> dict[str, Any]:
    """A finished row's records (one per sample, in sample order) -> its OpenAI batch output line (a failed
    row: an error-file line, or with `vllm_errors` vLLM's run-batch error line; else the task's `body`)."""
    first = samples[0]
    digest = request_digest(first)
    failed = next((r for r in samples if r["finish_reason"] in FAILED), None)
    error = None
    if failed is not None:
        expired = failed["finish_reason"] == EXPIRED  # as OpenAI's batches write a request the window did not reach
        error = {"message": failed.get("error") or "failed", "type": "invalid_request_error", "param": None,
                 "code": "batch_expired" if expired else None}
        body, status = (None, 408 if expired else 400) if vllm_errors else ({"error": error}, 408 if expired else 400)
    else:
        body, status = body(samples, model, created), 200
    return {"id": f"batch_req_{digest}", "custom_id": first["id"],
            "response": {"status_code": status, "request_id": f"req_{digest}", "body": body},
            "error": error if vllm_errors else None}


def write_openai_lines(path: Path, records: Iterable[dict[str, Any]], lines: OpenAILines) -> None:
    """OUTPUT as OpenAI batch output lines: one per input row (records come in input order, then sample
    order), with the row's --keep-columns values after the line's own keys."""
    created = int(time.time())  # one timestamp for the job's lines: when OUTPUT was written
    with open(path, "w", encoding="utf-8") as f:
        for _, samples in itertools.groupby(records, key=lambda r: r["index"]):
            samples = list(samples)
            line = {**output_line(samples, lines.model, created, lines.body, lines.vllm_errors), **samples[0].get("kept", {})}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


__all__ = ["BODY_FIELDS", "BodyField", "BodyMaker", "CHAT_URL", "COMPLETIONS_URL", "RESPONSES_URL", "responses_fields", "ENVELOPE_FIELDS", "OPENAI_LINE_FIELDS",
           "OpenAILines", "RequestError", "batch_body", "is_openai_request", "without_carried", "output_line", "output_model_name",
           "request_digest", "request_fields", "write_openai_lines"]
