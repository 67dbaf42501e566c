"""Streams input rows from JSONL or Parquet without loading the file whole.

Each row comes out as (row index, dict) or (row index, error message): a line that is not valid
UTF-8 or JSON, or not an object, is a bad row, never a failed job. The readers take an `InputFile`: the
path with its format, derived once (`open_input`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from cbatch.config import UserError

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids", "body")

RawRow = tuple[int, "dict[str, Any] | str"]


class InputError(UserError):
    """The input file as a whole cannot be used; the message names the file and the fix."""


def input_format(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    raise InputError(
        f"{path}: unknown input extension {suffix or '(none)'!r}; use .jsonl (one JSON object per line) or .parquet"
    )


@dataclass(frozen=True, slots=True)
class InputFile:
    """INPUT and its format, as every reader takes it."""

    path: Path
    format: str  # jsonl | parquet (from the extension)


def open_input(path: Path) -> InputFile:
    """INPUT, checked to be a readable file, with its format (raises InputError naming the file)."""
    check_readable(path)
    return InputFile(path, input_format(path))


def check_readable(path: Path) -> None:
    if not path.exists():
        raise InputError(f"{path}: no such input file")
    if not path.is_file():
        raise InputError(f"{path}: the input is not a file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise InputError(f"{path}: cannot read the input ({exc.strerror})") from None


def iter_rows(source: InputFile) -> Iterator[RawRow]:
    """Every row of the input, in order, streamed."""
    check_readable(source.path)  # again: it may have gone since it was opened
    if source.format == "parquet":
        yield from _parquet_rows(source.path)
    else:
        yield from _jsonl_rows(source.path)


def _jsonl_rows(path: Path) -> Iterator[RawRow]:
    index = 0
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue  # blank lines are not rows
            yield index, _parse_line(line_no, raw)
            index += 1


def _parse_line(line_no: int, raw: bytes) -> "dict[str, Any] | str":
    """One JSONL line -> the object, or a message naming what is wrong with it."""
    try:
        text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a byte-order mark may open the file
    except UnicodeDecodeError as exc:
        return f"line {line_no}: undecodable bytes (not UTF-8) at byte {exc.start}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return f"line {line_no}: invalid JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:
        return f"line {line_no}: invalid JSON (nested too deeply)"
    except ValueError as exc:  # e.g. an integer too long to convert
        return f"line {line_no}: invalid JSON ({exc})"
    return value if isinstance(value, dict) else f"line {line_no}: expected a JSON object, got {type(value).__name__}"


def _open_parquet(path: Path):
    """The ParquetFile, checked to be readable and to have a prompt column."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for damaged files
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None
    columns = set(pf.schema_arrow.names)
    if not columns & set(PROMPT_FIELDS):
        raise InputError(
            f"{path}: no `prompt` or `messages` column (columns: {', '.join(sorted(columns)) or 'none'}); add one"
        )
    return pf


def _parquet_rows(path: Path) -> Iterator[RawRow]:
    pf = _open_parquet(path)
    index = 0
    batches = pf.iter_batches(batch_size=1024)
    while True:
        try:
            batch = next(batches, None)
        except Exception as exc:  # a damaged row group
            raise InputError(f"{path}: cannot read rows after row {index} ({exc}); the Parquet file is damaged") from None
        if batch is None:
            return
        for row in batch.to_pylist():
            yield index, {k: v for k, v in row.items() if v is not None}
            index += 1


def inspect_input(source: InputFile, probe_rows: int = 200) -> int:
    """Checks, before any work, that INPUT is a usable prompts file; returns its number of rows.

    JSONL: one pass counting non-blank lines; at least one of the first `probe_rows` rows must carry
    a prompt field (a file where none does is not a prompts file: a bad job, not bad rows).
    Parquet: the metadata, and a `prompt`/`messages` column.
    """
    path = source.path
    if source.format == "parquet":
        count = _open_parquet(path).metadata.num_rows
    else:
        count, seen_prompt, first_problem = 0, False, None
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if not raw.strip():
                    continue
                if count < probe_rows and not seen_prompt:
                    row = _parse_line(line_no, raw)
                    seen_prompt = isinstance(row, dict) and any(k in row for k in PROMPT_FIELDS)
                    if first_problem is None and isinstance(row, str):
                        first_problem = row
                count += 1
        if count and not seen_prompt:
            within = "no row" if count <= probe_rows else f"none of the first {probe_rows} rows"
            hint = f" (first problem: {first_problem})" if first_problem else ""
            raise InputError(
                f"{path}: {within} has a `prompt`, `messages` or `prompt_token_ids` field{hint}; "
                "each line needs one, e.g. {\"prompt\": \"...\"}"
            )
    if count == 0:
        raise InputError(f"{path}: the input has no rows; give at least one row with a `prompt` or `messages` field")
    return count


def find_duplicate_id(source: InputFile) -> tuple[str, int, int] | None:
    """The first row id (`id`, else OpenAI's `custom_id`) given to two rows: (id, first place, second place),
    places being JSONL line numbers or Parquet row numbers (1-based); None when ids are unique.
    Streams the input, holding one set of ids (never the rows)."""
    from cbatch.io.rows import given_row_id

    seen: dict[str, int] = {}
    for place, row in _places_and_rows(source):
        row_id = given_row_id(row)
        if row_id is None:
            continue  # its id is its row index: unique
        first = seen.setdefault(row_id, place)
        if first != place:
            return row_id, first, place
    return None


def _places_and_rows(source: InputFile) -> Iterator[tuple[int, Any]]:
    """(line number, row) for JSONL; (row number, {id, custom_id}) for Parquet (only those columns are read)."""
    path = source.path
    if source.format == "jsonl":
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, start=1):
                if raw.strip():
                    yield line_no, _parse_line(line_no, raw)
        return
    pf = _open_parquet(path)
    columns = [c for c in ("id", "custom_id") if c in pf.schema_arrow.names]
    if not columns:
        return
    number = 0
    for batch in pf.iter_batches(batch_size=65536, columns=columns):
        for row in batch.to_pylist():
            number += 1
            yield number, {k: v for k, v in row.items() if v is not None}
