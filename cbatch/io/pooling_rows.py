"""Rows of prefill-only jobs (--task embed | score | classify | reward): what each task's `RowFormat` accepts.

In: `{"input" | "text" | "prompt": "...", "id"?}` or `{"prompt_token_ids": [...]}` (classify and reward also
`{"messages": [...]}`: a chat, rendered with the chat template, no generation prompt); score rows give a pair,
`text_1` + `text_2` (vLLM's names), `queries` + `documents` or `query` + `document`, or lists (vLLM's /score: each
side one text or a list; one text, or a list of one, against each of the other side's; two lists of the same length,
item by item). OpenAI Batch lines: `url` "/v1/embeddings" with
`body.input` (one string or one list of token ids) and optional `dimensions`, `encoding_format` "float";
"/v1/score" (or "/score") with `body.text_1` / `body.text_2` or `body.queries` / `body.documents` (vLLM's score API); "/v1/classify" and "/v1/pooling" with
`body.input`. A field cbatch does not know is an error naming it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cbatch.io.openai import RequestError, batch_body
from cbatch.io.row_fields import RowError, is_token_ids, parse_messages, row_id_of, text_field

TEXT_FIELDS = ("input", "text", "prompt")
PAIR_FIELDS = (("text_1", "text_2"), ("queries", "documents"), ("query", "document"))
Pair = tuple[str, str]


@dataclass(frozen=True, slots=True)
class RowFormat:
    """What a prefill-only task's rows may hold (each task declares its own)."""

    task: str  # the --task name, for messages
    url: str  # the OpenAI batch line's url
    body_fields: tuple[str, ...]  # the body fields it knows
    pair: bool = False  # a row is a pair of texts (score), not one input
    chats: bool = False  # a row may be a chat (`messages`: a reward model rates a conversation)
    aliases: tuple[str, ...] = ()  # other urls its lines may give (vLLM's /score)

    @property
    def input_fields(self) -> tuple[str, ...]:
        """INPUT's probe: a row of this format has one of these."""
        if self.pair:
            return (*(first for first, _ in PAIR_FIELDS), "body")
        return (*TEXT_FIELDS, "prompt_token_ids", *(("messages",) if self.chats else ()), "body")


@dataclass(slots=True)
class PoolingRow:
    """One row of a prefill-only job: a text, a pair of texts (score) or token ids."""

    index: int
    row_id: str
    text: str | None = None
    pair: Pair | None = None
    pairs: list[Pair] | None = None  # a score row of lists: its pairs, in order (`pair` is then None)
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # classify, reward: a chat, rendered with the chat template
    dimensions: int | None = None  # an OpenAI line's own `dimensions` (embed)
    echo: dict[str, Any] = field(default_factory=dict)  # an OpenAI line's `model`, and that it is one


def parse_pooling_row(index: int, row: dict[str, Any] | str, fmt: RowFormat) -> PoolingRow:
    """Raises RowError naming the field for a bad row."""
    if isinstance(row, str):
        raise RowError(row)
    out = PoolingRow(index, row_id_of(index, row))
    if "body" in row:
        row = _body(row, fmt)
        out.echo["openai"] = True
        if isinstance(row.get("model"), str):
            out.echo["model"] = row["model"]
        out.dimensions = _dimensions(row.get("dimensions"))
    if fmt.pair:
        pairs, listed = _pairs(row)
        out.pairs, out.pair = (pairs, None) if listed else (None, pairs[0])
        return out
    chats = fmt.chats
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


def _body(row: dict[str, Any], fmt: RowFormat) -> dict[str, Any]:
    try:
        body = batch_body(row)
    except RequestError as exc:
        raise RowError(str(exc)) from None
    url = row.get("url")
    if url is not None and url != fmt.url and url not in fmt.aliases:
        raise RowError(f"url: --task {fmt.task} takes {' or '.join(map(repr, (fmt.url, *fmt.aliases)))} lines, got {url!r}")
    unknown = next((k for k in body if k not in fmt.body_fields), None)
    if unknown is not None:
        raise RowError(f"body.{unknown}: not a field cbatch knows for {fmt.url}; remove it")
    if body.get("encoding_format", "float") != "float":
        raise RowError(f"body.encoding_format: cbatch writes float embeddings; remove it or set it to \"float\"")
    return body


def _dimensions(value: Any) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise RowError(f"body.dimensions must be a positive integer, got {value!r}")
    return value


def _pairs(row: dict[str, Any]) -> tuple[list[Pair], bool]:
    """A score row's pairs, and whether it gave lists (then it is scored pair by pair into `scores`)."""
    for first, second in PAIR_FIELDS:
        if row.get(first) is not None or row.get(second) is not None:
            missing = first if row.get(first) is None else second if row.get(second) is None else None
            if missing is not None:
                raise RowError(f"missing `{missing}`: a score row gives both `{first}` and `{second}`")
            listed = not (isinstance(row[first], str) and isinstance(row[second], str))
            return score_pairs(first, row[first], second, row[second]), listed
    raise RowError("missing pair: a score row gives `text_1` and `text_2` (or `queries` and `documents`, or `query` "
                   "and `document`)")


def score_pairs(first: str, lefts: Any, second: str, rights: Any) -> list[Pair]:
    """The (first, second) pairs a score input names, by vLLM's rules (its `LLM.score` and /score): each side one
    text or a non-empty list of texts; one `first` text (or a list of one) is scored against each `second` text
    (1:1, 1:N), two lists of the same length item by item (N:N); N:1 is refused. Raises RowError naming the fields."""
    lefts, rights = _score_texts(first, lefts), _score_texts(second, rights)
    if len(lefts) not in (1, len(rights)):
        raise RowError(f"`{first}` has {len(lefts)} texts and `{second}` {len(rights)}: give one `{first}` text "
                       f"(scored against each `{second}` text) or as many as `{second}` has (scored item by item)")
    return list(zip(lefts * len(rights) if len(lefts) == 1 else lefts, rights))


def _score_texts(name: str, value: Any) -> list[str]:
    """One side of a score input as its texts: a string is one text, a list (or tuple) its items."""
    if isinstance(value, str):
        return [text_field(name, value)]
    if not isinstance(value, (list, tuple)) or not value:
        got = "an empty list" if isinstance(value, (list, tuple)) else type(value).__name__
        raise RowError(f"`{name}` must be a text or a non-empty list of texts, got {got}")
    return [text_field(f"{name}[{i}]", text) for i, text in enumerate(value)]


__all__ = ["PAIR_FIELDS", "Pair", "TEXT_FIELDS", "PoolingRow", "RowFormat", "parse_pooling_row", "score_pairs"]
