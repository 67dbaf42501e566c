"""Writes the final OUTPUT (Parquet or JSONL by extension), one row per input row, in input order."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from cbatch.config import UserError

OUTPUT_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}
COLUMNS = ("id", "completion", "finish_reason", "prompt_tokens", "completion_tokens", "error")
OUTPUT_COLUMNS = COLUMNS + ("completion_token_ids",)  # every column the output may have of its own


class OutputError(UserError):
    """OUTPUT cannot be written; the message names the path and the fix."""


def output_format(path: Path) -> str:
    fmt = OUTPUT_SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise OutputError(f"--out {path}: unknown output extension {path.suffix or '(none)'!r}; use .parquet or .jsonl")
    return fmt


def check_writable(path: Path, flag: str = "--out") -> None:
    """The folder exists and a file can really be created in it (os.access lies for root and read-only mounts)."""
    import os
    import tempfile

    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{flag} {path}: the folder {parent} does not exist; create it first")
    if path.is_dir():
        raise OutputError(f"{flag} {path}: is a folder; give a file name ending in .parquet or .jsonl")
    try:
        fd, probe = tempfile.mkstemp(prefix=".cbatch-probe-", dir=parent)
    except OSError as exc:
        raise OutputError(f"{flag} {path}: cannot write in the folder {parent} ({exc.strerror}); choose another {flag}") from None
    os.close(fd)
    os.unlink(probe)


def output_schema(token_ids: bool):
    """The Arrow schema of the output columns (Parquet OUTPUT, and the Ray Data callable's columns)."""
    import pyarrow as pa

    fields = [
        pa.field("id", pa.string()),
        pa.field("completion", pa.string()),
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("completion_tokens", pa.int64()),
        pa.field("error", pa.string()),
    ]
    if token_ids:
        fields.append(pa.field("completion_token_ids", pa.list_(pa.int64())))
    return pa.schema(fields)


def write_output(path: Path, fmt: str, records: Iterable[dict[str, Any]], token_ids: bool, chunk_rows: int = 4096,
                 *, kept_types: dict[str, Any] | None = None, openai_model: str | None = None) -> None:
    """`kept_types`: the --keep-columns columns' Arrow types (Parquet); `openai_model`: write OpenAI batch
    output lines (JSONL) naming this model where a row named none."""
    columns = COLUMNS + (("completion_token_ids",) if token_ids else ())
    if fmt == "jsonl":
        line_of = _openai_line(openai_model) if openai_model is not None else (lambda r: {c: r.get(c) for c in columns})
        with open(path, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps({**line_of(record), **record.get("kept", {})}, ensure_ascii=False) + "\n")
        return
    import pyarrow.parquet as pq

    kept_types = kept_types or {}
    schema = _with_kept(output_schema(token_ids), kept_types)
    with pq.ParquetWriter(path, schema) as writer:
        chunk: list[dict[str, Any]] = []
        for record in records:
            chunk.append(record)
            if len(chunk) >= chunk_rows:
                writer.write_table(_table(chunk, columns, token_ids, kept_types))
                chunk = []
        if chunk or writer is not None:
            writer.write_table(_table(chunk, columns, token_ids, kept_types))


def _openai_line(model: str):
    import time

    from cbatch.io.openai import output_line

    created = int(time.time())  # one timestamp for the job's lines: when OUTPUT was written
    return lambda record: output_line(record, model, created)


def _with_kept(schema, kept_types: dict[str, Any]):
    import pyarrow as pa

    from cbatch.io.columns import JSON_TEXT

    for name, arrow_type in kept_types.items():
        schema = schema.append(pa.field(name, pa.string() if arrow_type == JSON_TEXT else arrow_type))
    return schema


def _table(chunk: list[dict[str, Any]], columns: tuple[str, ...], token_ids: bool, kept_types: dict[str, Any]):
    import pyarrow as pa

    from cbatch.io.columns import column_values

    table = pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in chunk], schema=output_schema(token_ids))
    for name, arrow_type in kept_types.items():
        values = column_values([r.get("kept", {}).get(name) for r in chunk], arrow_type)
        table = table.append_column(pa.field(name, values.type), values)
    return table
