"""Rows of prefill-only jobs (--task embed | score | classify | reward), in and out.

In: `{"input" | "text" | "prompt": "...", "id"?}` or `{"prompt_token_ids": [...]}` (classify and reward also
`{"messages": [...]}`: a chat, rendered with the chat template, no generation prompt); score rows give a pair,
`text_1` + `text_2` (vLLM's names) or `query` + `document`. OpenAI Batch lines: `url` "/v1/embeddings" with
`body.input` (one string or one list of token ids) and optional `dimensions`, `encoding_format` "float";
"/v1/score" with `body.text_1` / `body.text_2` (vLLM's score API); "/v1/classify" and "/v1/pooling" with
`body.input`. A field cbatch does not know is an error naming it.

Out (`--output-format openai`): the response body OpenAI (embeddings) and vLLM (score, classify, pooling) return:
`{"object": "list", "data": [{"object", "index": 0, ...}], "model", "usage"}`.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from cbatch.io.openai import RequestError, batch_body
from cbatch.io.rows import RowError, is_token_ids, parse_messages, row_id_of, text_field
from cbatch.io.writer import TASK_COLUMNS

TEXT_FIELDS = ("input", "text", "prompt")
PAIR_FIELDS = (("text_1", "text_2"), ("query", "document"))
URL_OF_TASK = {"embed": "/v1/embeddings", "score": "/v1/score", "classify": "/v1/classify", "reward": "/v1/pooling"}
INPUT_FIELDS = {"score": ("text_1", "query", "body"), "embed": (*TEXT_FIELDS, "prompt_token_ids", "body"),
                **{t: (*TEXT_FIELDS, "prompt_token_ids", "messages", "body") for t in ("classify", "reward")}}  # INPUT's probe
_BODY_FIELDS = {"embed": ("model", "input", "dimensions", "encoding_format", "user"),
                "score": ("model", "text_1", "text_2", "user"),
                "classify": ("model", "input", "messages", "user"), "reward": ("model", "input", "messages", "user")}


@dataclass(slots=True)
class PoolingRow:
    """One row of a prefill-only job: a text, a pair of texts (score) or token ids."""

    index: int
    row_id: str
    text: str | None = None
    pair: tuple[str, str] | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # classify, reward: a chat, rendered with the chat template
    dimensions: int | None = None  # an OpenAI line's own `dimensions` (embed)
    echo: dict[str, Any] = field(default_factory=dict)  # an OpenAI line's `model`, and that it is one


def parse_pooling_row(index: int, row: dict[str, Any] | str, task: str) -> PoolingRow:
    """Raises RowError naming the field for a bad row."""
    if isinstance(row, str):
        raise RowError(row)
    out = PoolingRow(index, row_id_of(index, row))
    if "body" in row:
        row = _body(row, task)
        out.echo["openai"] = True
        if isinstance(row.get("model"), str):
            out.echo["model"] = row["model"]
        out.dimensions = _dimensions(row.get("dimensions"))
    if task == "score":
        out.pair = _pair(row)
        return out
    chats = task in ("classify", "reward")  # a reward model rates a conversation
    given = [k for k in (*TEXT_FIELDS, "prompt_token_ids", *(["messages"] if chats else [])) if row.get(k) is not None]
    if len(given) != 1:
        names = "`input` (text), `messages` (a chat) or `prompt_token_ids`" if chats else "`input` (text) or `prompt_token_ids`"
        raise RowError(f"missing input: give {names}" if not given else f"give only one of {names} (got {', '.join(given)})")
    if given[0] == "messages":
        out.messages = parse_messages(row["messages"])
        return out
    value = row[given[0]]
    if is_token_ids(value):
        out.token_ids = list(value)
    elif isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        out.text = text_field(given[0], value[0])
    elif isinstance(value, str):
        out.text = text_field(given[0], value)
    else:
        raise RowError(f"`{given[0]}` must be one string or one non-empty list of token ids (one input per row)")
    return out


def _body(row: dict[str, Any], task: str) -> dict[str, Any]:
    try:
        body = batch_body(row)
    except RequestError as exc:
        raise RowError(str(exc)) from None
    url = row.get("url")
    if url is not None and url != URL_OF_TASK[task]:
        raise RowError(f"url: --task {task} takes {URL_OF_TASK[task]!r} lines, got {url!r}")
    unknown = next((k for k in body if k not in _BODY_FIELDS[task]), None)
    if unknown is not None:
        raise RowError(f"body.{unknown}: not a field cbatch knows for {URL_OF_TASK[task]}; remove it")
    if body.get("encoding_format", "float") != "float":
        raise RowError(f"body.encoding_format: cbatch writes float embeddings; remove it or set it to \"float\"")
    return body


def _dimensions(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RowError(f"body.dimensions must be a positive integer, got {value!r}")
    return value


def _pair(row: dict[str, Any]) -> tuple[str, str]:
    for first, second in PAIR_FIELDS:
        if row.get(first) is not None or row.get(second) is not None:
            missing = first if row.get(first) is None else second if row.get(second) is None else None
            if missing is not None:
                raise RowError(f"missing `{missing}`: a score row gives both `{first}` and `{second}`")
            return text_field(first, row[first]), text_field(second, row[second])
    raise RowError("missing pair: a score row gives `text_1` and `text_2` (or `query` and `document`)")


# ---- output -----------------------------------------------------------------------------------------
_DATA_OBJECT = {"embed": "embedding", "score": "score", "classify": "classification", "reward": "reward"}


def pooling_body(record: dict[str, Any], task: str, model: str, created: int) -> dict[str, Any]:
    """A finished row's OpenAI / vLLM response body."""
    digest = hashlib.blake2b(f"{record['index']}\x00{record['id']}".encode(), digest_size=12).hexdigest()
    item: dict[str, Any] = {"object": _DATA_OBJECT[task], "index": 0}
    item.update({k: record[k] for k in TASK_COLUMNS if record.get(k) is not None})
    if task == "classify":
        item["num_classes"] = len(record.get("probs") or [])
    prompt_tokens = record["prompt_tokens"]
    echo = record.get("echo") or {}
    return {"id": f"{task}-{digest}", "object": "list", "created": created, "model": echo.get("model") or model,
            "data": [item], "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def task_of_record(record: dict[str, Any]) -> str | None:
    """The prefill-only task whose columns `record` has (None: a generation record, or an error row)."""
    if record.get("embedding") is not None:
        return "embed"
    if record.get("probs") is not None:
        return "classify"
    if record.get("reward") is not None:
        return "reward"
    return "score" if record.get("score") is not None else None


__all__ = ["PoolingRow", "TASK_COLUMNS", "URL_OF_TASK", "parse_pooling_row", "pooling_body", "task_of_record"]
