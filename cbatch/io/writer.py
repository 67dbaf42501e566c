"""Writes the final OUTPUT (Parquet or JSONL by extension), one row per input row, in input order."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Iterator

from cbatch.config import UserError

OUTPUT_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}
COLUMNS = ("id", "completion", "finish_reason", "prompt_tokens", "completion_tokens", "error")


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


def output_columns(token_ids: bool) -> tuple[str, ...]:
    return COLUMNS + (("completion_token_ids",) if token_ids else ())


def written_columns(path: Path, fmt: str) -> tuple[str, ...]:
    """The columns of an OUTPUT cbatch wrote (JSONL: its first row's keys)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return tuple(pq.ParquetFile(path).schema_arrow.names)
    with open(path, "rb") as f:
        first = f.readline()
    return tuple(json.loads(first)) if first.strip() else ()


def read_output(path: Path, fmt: str) -> Iterator[dict[str, Any]]:
    """OUTPUT's rows in input order, as the records they were written from (`--retry-errors` keeps them)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=4096):
            yield from batch.to_pylist()
        return
    with open(path, "rb") as f:
        for line in f:  # split on b"\n" only: a JSON string may hold U+2028, which str.splitlines splits on
            yield json.loads(line)


def write_output(path: Path, fmt: str, records: Iterable[dict[str, Any]], token_ids: bool, chunk_rows: int = 4096) -> None:
    columns = output_columns(token_ids)
    if fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps({c: record.get(c) for c in columns}, ensure_ascii=False) + "\n")
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = output_schema(token_ids)
    with pq.ParquetWriter(path, schema) as writer:
        chunk: list[dict[str, Any]] = []
        for record in records:
            chunk.append({c: record.get(c) for c in columns})
            if len(chunk) >= chunk_rows:
                writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
                chunk = []
        if chunk or writer is not None:
            writer.write_table(pa.Table.from_pylist(chunk, schema=schema))
