"""The OpenAI Batch API format, in and out: a drop-in for batch input files and their output files.

In: lines `{"custom_id", "method": "POST", "url": "/v1/chat/completions" | "/v1/completions", "body": {...}}`.
Every body field is in `BODY_FIELDS`, THE one list of what cbatch honours: a field it cannot honour (yet)
makes that row an error naming the field, unless it holds the value that means "off" (e.g. `"n": 1`),
which is exactly what cbatch does anyway. Nothing is dropped silently.

Out (`--output-format openai`): one line per input row, in input order, shaped like OpenAI's batch output
lines: `{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}`, the body a
`chat.completion` or `text_completion` object with `choices` and `usage`. A failed row is shaped like a
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

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
OBJECT_OF_URL = {CHAT_URL: "chat.completion", COMPLETIONS_URL: "text_completion"}
ENVELOPE_FIELDS = ("custom_id", "method", "url", "body")
LINE_KEYS = (*ENVELOPE_FIELDS, "id")  # a line may also carry cbatch's own `id` (the output id, before custom_id)
OPENAI_LINE_FIELDS = ("id", "custom_id", "response", "error")  # an output line's own keys

HONOURED, NOT_YET, UNSUPPORTED = "honoured", "not yet", "unsupported"
_ANY = object()  # no value of the field is accepted


@dataclass(frozen=True, slots=True)
class BodyField:
    status: str  # HONOURED | NOT_YET (planned; none today) | UNSUPPORTED
    note: str
    off: Any = _ANY  # the value meaning "off": accepted, since cbatch does exactly that

    @property
    def has_off(self) -> bool:
        return self.off is not _ANY


def _yes(note: str) -> BodyField:
    return BodyField(HONOURED, note)


def _no(note: str, off: Any = _ANY) -> BodyField:
    return BodyField(UNSUPPORTED, note, off)


# Every body field cbatch knows, and what it does with it (docs/structured-output.md shows this table).
BODY_FIELDS: dict[str, BodyField] = {
    "model": _yes("echoed in the response; the job's --model generates"),
    "messages": _yes("/v1/chat/completions: the chat (text content parts, tool calls and results), rendered with the "
                     "model's chat template"),
    "prompt": _yes("/v1/completions: one string, or one list of token ids"),
    "max_completion_tokens": _yes("same as max_tokens (max_tokens wins when both are given)"),
    "top_logprobs": _yes("chat: alternatives per token (with logprobs: true)"),
    "response_format": _yes("structured output: type text, json_object or json_schema"),
    "user": _yes("no effect on the completion"),
    "metadata": _yes("no effect on the completion"),
    # every sampling field a row takes (cbatch/config.py's SAMPLING_FIELDS), under the row field's name
    **{spec.name: _yes(spec.body_note or spec.meaning) for spec in SAMPLING_FIELDS.values() if spec.in_body},
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


def _check_body_field(name: str, value: Any) -> None:
    spec = BODY_FIELDS.get(name)
    if spec is None:
        raise RequestError(f"body.{name}: not a field cbatch knows for {CHAT_URL} or {COMPLETIONS_URL}; remove it")
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
    """An OpenAI batch line -> (the row fields cbatch reads, the response object: chat.completion or
    text_completion). Raises RequestError naming the first field it cannot honour."""
    body = batch_body(row)
    url = row.get("url")
    if url is None:
        url = CHAT_URL if "messages" in body else COMPLETIONS_URL
    if url not in OBJECT_OF_URL:
        raise RequestError(f"url: must be {CHAT_URL!r} or {COMPLETIONS_URL!r}, got {url!r}")
    for name, value in body.items():
        _check_body_field(name, value)
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


__all__ = ["BODY_FIELDS", "BodyField", "BodyMaker", "CHAT_URL", "COMPLETIONS_URL", "ENVELOPE_FIELDS", "OPENAI_LINE_FIELDS",
           "OpenAILines", "RequestError", "batch_body", "is_openai_request", "without_carried", "output_line", "output_model_name",
           "request_digest", "request_fields", "write_openai_lines"]
