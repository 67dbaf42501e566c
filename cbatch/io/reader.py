"""Streams input rows from JSONL or Parquet without loading the file whole.

Each row comes out as (row index, dict) or (row index, error message): a line that is not valid
UTF-8 or JSON, or not an object, is a bad row, never a failed job. The readers take an `InputFile`: INPUT's
files (one, or a folder's or a glob's, gzip/zstd JSONL too; local or behind an fsspec URL such as `s3://`) with
their format, derived once (`open_input`).
"""
from __future__ import annotations

import glob
import hashlib
import json
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from cbatch.config import UserError
from cbatch.io import remote

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}  # JSONL only (Parquet compresses inside the file)
PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids", "body")
_GLOB_CHARS = set("*?[")

RawRow = tuple[int, "dict[str, Any] | str"]


class InputError(UserError):
    """The input as a whole cannot be used; the message names the file and the fix."""


@dataclass(frozen=True, slots=True)
class InputPart:
    """One file of INPUT: a local file, or (`fs` set) a file of an fsspec filesystem, `path` then its path there."""

    path: Path
    format: str  # jsonl | parquet (from the extension)
    compression: str | None = None  # gzip | zstd: a compressed JSONL file (.jsonl.gz, .jsonl.zst)
    fs: Any = None  # an fsspec filesystem (INPUT given as a URL); None: the local filesystem

    @property
    def name(self) -> str:
        """How a message names the file: its path, or its URL."""
        return str(self.path) if self.fs is None else remote.url_of(self.fs, str(self.path))

    def open(self) -> BinaryIO:
        """The file's raw (still compressed) bytes."""
        return open(self.path, "rb") if self.fs is None else self.fs.open(str(self.path), "rb")


@dataclass(frozen=True, slots=True)
class InputFile:
    """INPUT as every reader takes it: one file, or the files of a folder or a glob (sorted by path), JSONL or
    Parquet each. Rows are numbered across the files in that order: a row's index is its place in the whole input,
    stable as long as the files are (the job's fingerprint holds every file's digest)."""

    given: str  # what the user gave: a file, a folder or a pattern (or a URL of one)
    parts: tuple[InputPart, ...]

    @property
    def format(self) -> str:
        """jsonl | parquet, or mixed (a folder of both: each file read by its own reader, rows as dicts alike)."""
        formats = {part.format for part in self.parts}
        return formats.pop() if len(formats) == 1 else "mixed"

    @property
    def path(self) -> Path:
        """The first file (a single-file INPUT: the file)."""
        return self.parts[0].path

    def label(self, part: InputPart) -> str:
        """How a message names a part: its path (its name within a folder or pattern of several)."""
        return part.name if len(self.parts) == 1 else part.path.name

    @property
    def name(self) -> str:
        """How a message names the whole input: what the user gave (several files), or its one file's path or URL."""
        return self.given if len(self.parts) > 1 else self.parts[0].name

    @property
    def local(self) -> bool:
        return self.parts[0].fs is None


def input_format(path: Path, fs: Any = None) -> InputPart:
    """A file's format and compression, from its name (raises InputError naming it): derived once per file, by
    `open_input`."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    suffix = suffixes[-2] if compression and len(suffixes) == 2 else (suffixes[-1] if suffixes else "")
    if suffix in JSONL_SUFFIXES:
        return InputPart(path, "jsonl", compression, fs)
    if suffix in PARQUET_SUFFIXES and compression is None:
        return InputPart(path, "parquet", None, fs)
    raise InputError(
        f"{path}: unknown input extension {''.join(path.suffixes[-2:]) or '(none)'!r}; use .jsonl (one JSON object "
        "per line; .jsonl.gz or .jsonl.zst compressed) or .parquet"
    )


def open_input(given: "str | Path") -> InputFile:
    """INPUT: a file, a folder (its .jsonl[.gz|.zst] / .parquet files, sorted) or a glob pattern such as
    `data/day=*/part-*.parquet`, local or as an fsspec URL (`s3://bucket/day=*/*.parquet`, `file:///data/x.jsonl`);
    every file checked to be readable, all of one format (raises InputError)."""
    given = str(given)
    if remote.is_url(given):
        fs, files = remote.list_files(given, _GLOB_CHARS, _is_input_name)
        return _input_of(given, tuple(input_format(Path(f), fs) for f in files))
    path = Path(given)
    if _GLOB_CHARS & set(given):
        files = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not files:
            raise InputError(f"{path}: the pattern matches no file")
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith((".", "_")))
        files = [p for p in files if _is_input_name(p.name)]
        if not files:
            raise InputError(f"{path}: the folder has no .jsonl or .parquet file")
    else:
        files = [path]
    return _input_of(given, tuple(input_format(p) for p in files))


def _input_of(given: str, parts: tuple[InputPart, ...]) -> InputFile:
    for part in parts:
        check_readable(part)
    return InputFile(given, parts)


def _is_input_name(name: str) -> bool:
    """A name a folder's input file may have (the derivation proper waits for `open_input`'s list)."""
    name = name.lower()
    return name.endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES) or any(
        name.endswith(s + c) for s in JSONL_SUFFIXES for c in COMPRESSIONS)


def check_readable(part: InputPart) -> None:
    if part.fs is not None:
        remote.check_readable(part.fs, str(part.path))
        return
    path = part.path
    if not path.exists():
        raise InputError(f"{path}: no such input file")
    if not path.is_file():
        raise InputError(f"{path}: the input is not a file")
    try:
        with open(path, "rb"):
            pass
    except OSError as exc:
        raise InputError(f"{path}: cannot read the input ({exc.strerror})") from None


def _open_bytes(part: InputPart):
    """A binary file object over the part's (decompressed) bytes."""
    if part.compression == "gzip":
        import gzip

        return gzip.open(part.open(), "rb")
    if part.compression == "zstd":
        try:
            import zstandard
        except ImportError:
            raise InputError(f"{part.name}: a .zst input needs the zstandard package: pip install zstandard") from None
        return zstandard.open(part.open(), "rb")
    return part.open()


def _lines(part: InputPart) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a JSONL part; a damaged compressed file is an InputError naming it."""
    try:
        with _open_bytes(part) as f:
            yield from enumerate(f, start=1)
    except (OSError, EOFError) as exc:  # a truncated or damaged .gz, a read failure
        raise InputError(f"{part.name}: cannot read the input ({exc})") from None


def part_digest(part: InputPart) -> str:
    """sha256 of the part's bytes as stored (the job fingerprint's input digest)."""
    h = hashlib.sha256()
    with part.open() as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def iter_rows(source: InputFile) -> Iterator[RawRow]:
    """Every row of the input, in order (the parts one after the other), streamed."""
    index = 0
    for part in source.parts:
        check_readable(part)  # again: it may have gone since it was opened
        if part.format == "parquet":
            rows = _parquet_rows(part)
        else:
            rows = _jsonl_rows(part, source.label(part) if len(source.parts) > 1 else None)
        for row in rows:
            yield index, row
            index += 1


def _jsonl_rows(part: InputPart, label: str | None) -> Iterator["dict[str, Any] | str"]:
    """The part's rows (a bad line: its message, naming the file when INPUT has several)."""
    for line_no, raw in _lines(part):
        if not raw.strip():
            continue  # blank lines are not rows
        row = _parse_line(line_no, raw)
        yield f"{label}: {row}" if label is not None and isinstance(row, str) else row


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


def _open_parquet(part: InputPart, fields: tuple[str, ...] = ()):
    """The ParquetFile, checked to be readable and to have one of `fields`' columns (none: no column check; the
    job's preflight checked them)."""
    import pyarrow.parquet as pq

    path = part.name
    try:
        pf = pq.ParquetFile(part.path if part.fs is None else part.open())
    except Exception as exc:  # pyarrow raises several types for damaged files
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None
    columns = set(pf.schema_arrow.names)
    if fields and not columns & set(fields):
        named = "`prompt` or `messages`" if fields == PROMPT_FIELDS else " or ".join(f"`{f}`" for f in fields)
        raise InputError(f"{path}: no {named} column (columns: {', '.join(sorted(columns)) or 'none'}); add one")
    return pf


def _parquet_rows(part: InputPart) -> Iterator[dict[str, Any]]:
    pf = _open_parquet(part)
    path = part.name
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
            yield {k: v for k, v in row.items() if v is not None}
            index += 1


def inspect_input(source: InputFile, probe_rows: int = 200, fields: tuple[str, ...] = PROMPT_FIELDS) -> int:
    """Checks, before any work, that INPUT is a usable prompts file (each part); returns its number of rows (an
    empty INPUT has 0: a finished job, as a nightly partition without rows is).

    JSONL: one pass counting non-blank lines; at least one of the first `probe_rows` rows must carry
    a prompt field (a file where none does is not a prompts file: a bad job, not bad rows).
    Parquet: the metadata, and a `prompt`/`messages` column. `fields`: the input fields of the job's task
    (a prefill-only job's differ: io/pooling_rows.py).
    """
    total = 0
    for part in source.parts:
        path = part.name
        if part.format == "parquet":
            count = _open_parquet(part, fields).metadata.num_rows
        else:
            count, seen_prompt, first_problem = 0, False, None
            for line_no, raw in _lines(part):
                if not raw.strip():
                    continue
                if count < probe_rows and not seen_prompt:
                    row = _parse_line(line_no, raw)
                    seen_prompt = isinstance(row, dict) and any(k in row for k in fields)
                    if first_problem is None and isinstance(row, str):
                        first_problem = row
                count += 1
            if count and not seen_prompt:
                within = "no row" if count <= probe_rows else f"none of the first {probe_rows} rows"
                hint = f" (first problem: {first_problem})" if first_problem else ""
                if fields != PROMPT_FIELDS:
                    raise InputError(f"{path}: {within} has any of the fields {', '.join(fields)}{hint}; "
                                     "each line needs one, e.g. {\"input\": \"...\"}")
                raise InputError(
                    f"{path}: {within} has a `prompt`, `messages` or `prompt_token_ids` field{hint}; "
                    "each line needs one, e.g. {\"prompt\": \"...\"}"
                )
        total += count
    return total  # (0: an empty partition is a job with nothing to do, not a mistake)


Place = tuple[str, str, int]  # (file label: "" for a one-file INPUT, "line" | "row", 1-based number)


def find_duplicate_id(source: InputFile) -> tuple[str, Place, Place] | None:
    """The first row id (`id`, else OpenAI's `custom_id`) given to two rows: (id, first place, second place);
    None when ids are unique. Streams the input holding 8 bytes a row (a hash of each id: 80 MB at 10M rows, where
    a set of the ids themselves took ~1 GB); only when two hashes agree does a second pass look at those ids."""
    import numpy as np

    from cbatch.io.row_fields import given_row_id

    hashes = array("q", (hash(i) for i in (given_row_id(row) for _, row in _places_and_rows(source)) if i is not None))
    ordered = np.sort(np.frombuffer(hashes, dtype=np.int64)) if hashes else np.zeros(0, dtype=np.int64)
    suspects = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
    if not suspects:
        return None
    seen: dict[str, Place] = {}
    for place, row in _places_and_rows(source):
        row_id = given_row_id(row)
        if row_id is None or hash(row_id) not in suspects:
            continue
        first = seen.setdefault(row_id, place)
        if first != place:
            return row_id, first, place
    return None  # the hashes collided, the ids differ


def describe_places(first: Place, second: Place) -> str:
    """'lines 1 and 4', or 'a.jsonl line 3 and b.jsonl line 9' across files."""
    if first[:2] == second[:2]:
        return f"{first[0] + ' ' if first[0] else ''}{first[1]}s {first[2]} and {second[2]}"
    return f"{first[0]} {first[1]} {first[2]} and {second[0]} {second[1]} {second[2]}"


def _places_and_rows(source: InputFile) -> Iterator[tuple[Place, Any]]:
    """(place, row): JSONL lines with the rows, Parquet rows with {id, custom_id} (only those columns are read)."""
    for part in source.parts:
        label = source.label(part) if len(source.parts) > 1 else ""
        if part.format == "jsonl":
            for line_no, raw in _lines(part):
                if raw.strip():
                    yield (label, "line", line_no), _parse_line(line_no, raw)
            continue
        pf = _open_parquet(part)
        columns = [c for c in ("id", "custom_id") if c in pf.schema_arrow.names]
        if not columns:
            continue
        number = 0
        for batch in pf.iter_batches(batch_size=65536, columns=columns):
            for row in batch.to_pylist():
                number += 1
                yield (label, "row", number), {k: v for k, v in row.items() if v is not None}
