"""Writes the final OUTPUT (Parquet or JSONL by extension), one row per input row (per sample of a row with
n > 1), in input order then sample order.

The base columns are always there; an optional column is written when some record of the job has it
(`present`): `sample_index` (a row with n > 1), `reasoning` (a model whose chat template thinks),
the log-probability columns (a row that asked); rows without it get its default (sample_index 0, else null).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Collection, Iterable, Iterator, Sequence

from cbatch.config import UserError

if TYPE_CHECKING:
    from cbatch.io.openai import OpenAILines

OUTPUT_SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}
COLUMNS = ("id", "completion", "finish_reason", "prompt_tokens", "completion_tokens", "error")
LOGPROB_COLUMNS = ("token_logprobs", "top_logprobs", "prompt_token_ids", "prompt_token_logprobs", "prompt_top_logprobs")
OPTIONAL_COLUMNS = ("sample_index", "reasoning") + LOGPROB_COLUMNS
COLUMN_DEFAULTS = {"sample_index": 0}
OUTPUT_COLUMNS = COLUMNS + ("completion_token_ids",) + OPTIONAL_COLUMNS  # every column the output may have of its own
# A task's own columns (cbatch/tasks/: embedding, score, ...) come after these, with the Arrow types it gives.


class OutputError(UserError):
    """OUTPUT cannot be written; the message names the path and the fix."""


def output_format(path: Path) -> str:
    fmt = OUTPUT_SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise OutputError(f"--out {path}: unknown output extension {path.suffix or '(none)'!r}; use .parquet or .jsonl")
    return fmt


def check_writable(path: Path, flag: str = "--out", folder: bool = False) -> None:
    """The folder exists and a file can really be created in it (os.access lies for root and read-only mounts).
    `folder`: `path` is a folder OUTPUT (its parent must exist; it is made if missing)."""
    import os
    import tempfile

    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{flag} {path}: the folder {parent} does not exist; create it first")
    if path.is_dir() and not folder:
        raise OutputError(f"{flag} {path}: is a folder; give a file name ending in .parquet or .jsonl")
    if folder and path.exists() and not path.is_dir():
        raise OutputError(f"{flag} {path}: is a file; give a folder (a name without an extension) or a file name")
    try:
        fd, probe = tempfile.mkstemp(prefix=".cbatch-probe-", dir=parent)
    except OSError as exc:
        raise OutputError(f"{flag} {path}: cannot write in the folder {parent} ({exc.strerror}); choose another {flag}") from None
    os.close(fd)
    os.unlink(probe)


def output_columns(token_ids: bool, present: Collection[str] = (), task_columns: Sequence[str] = ()) -> list[str]:
    """The output's columns in order: the base ones, with the optional ones and the task's own (`task_columns`)
    some record has."""
    def some(*names: str) -> list[str]:
        return [name for name in names if name in present]

    return (["id", *some("sample_index"), "completion", *some("reasoning"), *COLUMNS[2:]]
            + (["completion_token_ids"] if token_ids else []) + some(*LOGPROB_COLUMNS) + some(*task_columns))


def _arrow_types() -> dict[str, Any]:
    import pyarrow as pa

    top = pa.list_(pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())]))  # k most likely, best first
    ids, logprobs = pa.list_(pa.int64()), pa.list_(pa.float64())
    return {
        "id": pa.string(), "sample_index": pa.int64(), "completion": pa.string(), "reasoning": pa.string(),
        "finish_reason": pa.string(), "prompt_tokens": pa.int64(), "completion_tokens": pa.int64(), "error": pa.string(),
        "completion_token_ids": ids, "token_logprobs": logprobs, "top_logprobs": pa.list_(top),
        "prompt_token_ids": ids, "prompt_token_logprobs": logprobs, "prompt_top_logprobs": pa.list_(top),
    }


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


def output_schema(columns: Sequence[str], task_types: dict[str, Any] | None = None):
    """The Arrow schema of `columns` (`output_columns`; the task's own columns typed by `task_types`): Parquet
    OUTPUT, and the Ray Data callable's columns."""
    import pyarrow as pa

    types = {**_arrow_types(), **(task_types or {})}
    return pa.schema([pa.field(name, types[name]) for name in columns])


def write_output(path: Path, fmt: str, records: Iterable[dict[str, Any]], columns: Sequence[str], chunk_rows: int = 4096,
                 *, kept_types: dict[str, Any] | None = None, task_types: dict[str, Any] | None = None,
                 openai: "OpenAILines | None" = None) -> None:
    """Writes `columns` (`output_columns`) of every record, then its --keep-columns values. `kept_types`: the
    kept columns' Arrow types (Parquet); `task_types`: the task's own columns' Arrow types; `openai`: OpenAI
    batch output lines instead (JSONL, one per input row, its samples as choices)."""
    def row(record: dict[str, Any]) -> dict[str, Any]:
        return {c: record.get(c, COLUMN_DEFAULTS.get(c)) for c in columns}

    if fmt == "jsonl" and openai is not None:
        from cbatch.io.openai import write_openai_lines

        return write_openai_lines(path, records, openai)
    if fmt == "jsonl":
        with open(path, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps({**row(record), **record.get("kept", {})}, ensure_ascii=False) + "\n")
        return
    import pyarrow.parquet as pq

    kept_types = kept_types or {}
    base = output_schema(columns, task_types)
    with pq.ParquetWriter(path, _with_kept(base, kept_types)) as writer:
        chunk: list[dict[str, Any]] = []
        for record in records:
            chunk.append(record)
            if len(chunk) >= chunk_rows:
                writer.write_table(_table([row(r) for r in chunk], base, chunk, kept_types))
                chunk = []
        writer.write_table(_table([row(r) for r in chunk], base, chunk, kept_types))


def _with_kept(schema, kept_types: dict[str, Any]):
    import pyarrow as pa

    from cbatch.io.columns import JSON_TEXT

    for name, arrow_type in kept_types.items():
        schema = schema.append(pa.field(name, pa.string() if arrow_type == JSON_TEXT else arrow_type))
    return schema


def _table(rows: list[dict[str, Any]], base, records: list[dict[str, Any]], kept_types: dict[str, Any]):
    """The output columns of `rows` under the `base` schema, then each kept column of `records`."""
    import pyarrow as pa

    from cbatch.io.columns import column_values

    table = pa.Table.from_pylist(rows, schema=base)
    for name, arrow_type in kept_types.items():
        values = column_values([r.get("kept", {}).get(name) for r in records], arrow_type)
        table = table.append_column(pa.field(name, values.type), values)
    return table
