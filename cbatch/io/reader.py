"""Streams input rows from JSONL or Parquet without loading the file whole.

Each row comes out as (row index, dict) or (row index, error message): a line that is not valid
UTF-8 or JSON, or not an object, is a bad row, never a failed job.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids", "body")

RawRow = tuple[int, "dict[str, Any] | str"]


class InputError(ValueError):
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


def iter_rows(path: Path) -> Iterator[RawRow]:
    """Every row of the input, in order, streamed."""
    check_readable(path)
    if input_format(path) == "parquet":
        yield from _parquet_rows(path)
    else:
        yield from _jsonl_rows(path)


def _jsonl_rows(path: Path) -> Iterator[RawRow]:
    index = 0
    seen_prompt_field = False
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue  # blank lines are not rows
            row: dict[str, Any] | str
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                row = f"line {line_no}: undecodable bytes (not UTF-8) at byte {exc.start}"
            else:
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as exc:
                    row = f"line {line_no}: invalid JSON ({exc.msg} at column {exc.colno})"
                except RecursionError:
                    row = f"line {line_no}: invalid JSON (nested too deeply)"
                else:
                    row = value if isinstance(value, dict) else f"line {line_no}: expected a JSON object, got {type(value).__name__}"
            if isinstance(row, dict) and any(k in row for k in PROMPT_FIELDS):
                seen_prompt_field = True
            if index == 200 and not seen_prompt_field:
                raise InputError(
                    f"{path}: none of the first 200 rows has a `prompt` or `messages` field; "
                    "each line needs one, e.g. {\"prompt\": \"...\"}"
                )
            yield index, row
            index += 1
    if index and not seen_prompt_field:
        raise InputError(f"{path}: no row has a `prompt` or `messages` field; each line needs one, e.g. {{\"prompt\": \"...\"}}")


def _parquet_rows(path: Path) -> Iterator[RawRow]:
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
    index = 0
    for batch in pf.iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            yield index, {k: v for k, v in row.items() if v is not None}
            index += 1


def count_rows(path: Path) -> int:
    """Total rows, for progress and ETA: Parquet metadata, or non-blank lines of a JSONL file (one fast pass)."""
    if input_format(path) == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    count = 0
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                count += 1
    return count
