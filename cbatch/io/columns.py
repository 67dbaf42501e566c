"""`--keep-columns`: input columns carried into the output rows, so a job's output joins back without a key lookup.

A row's kept values travel in its record (`kept`, JSON in the part files: dates, times, decimals and bytes
as text) and come out as columns after the output's own. Parquet OUTPUT gives them the input's Arrow types
when INPUT is Parquet; from JSONL, a column whose values are all integers, numbers, strings or booleans gets
that type, any other column holds each value's JSON text.
"""
from __future__ import annotations

import base64
import datetime
import decimal
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

from cbatch.config import UserError

if TYPE_CHECKING:
    from cbatch.io.reader import InputPart


class KeepColumnsError(UserError):
    """--keep-columns names columns it cannot carry; the message names them and the fix."""


@dataclass(frozen=True, slots=True)
class KeepColumns:
    names: tuple[str, ...] | None  # None: every input column (but those named like an output column)
    reserved: frozenset[str] = frozenset()  # the output's own columns

    @classmethod
    def parse(cls, spec: str | None, reserved: Iterable[str]) -> "KeepColumns | None":
        """`all` or a comma list -> KeepColumns (None for no flag); a name the output already has is refused."""
        if spec is None:
            return None
        reserved = frozenset(reserved)
        if spec.strip() == "all":
            return cls(None, reserved)
        names = tuple(dict.fromkeys(n.strip() for n in spec.split(",") if n.strip()))
        if not names:
            raise KeepColumnsError("--keep-columns: give `all` or a comma-separated list of input columns")
        taken = [n for n in names if n in reserved]
        if taken:
            raise KeepColumnsError(f"--keep-columns: {', '.join(taken)} is an output column already; leave it out "
                                   "(or rename it in the input)")
        return cls(names, reserved)

    def pick(self, raw: dict[str, Any] | str) -> dict[str, Any]:
        """The row's kept columns, JSON-safe (a line that was not a JSON object keeps none)."""
        if not isinstance(raw, dict):
            return {}
        if self.names is None:
            return {k: json_safe(v) for k, v in raw.items() if k not in self.reserved}
        return {k: json_safe(raw.get(k)) for k in self.names}


def json_safe(value: Any) -> Any:
    """A Parquet value as JSON: dates and times as ISO text, decimals as text, bytes as base64."""
    if isinstance(value, (datetime.date, datetime.time)):  # datetime.datetime is a date
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


# ---- Arrow types of the kept columns (Parquet OUTPUT) -------------------------------------------------
def _scalar_decoder(arrow_type) -> Any:
    """How a JSON-safe value becomes a value of `arrow_type` again; None when it needs no decoding."""
    import pyarrow as pa

    t = pa.types
    if t.is_timestamp(arrow_type) or t.is_date64(arrow_type):
        return datetime.datetime.fromisoformat
    if t.is_date32(arrow_type):
        return datetime.date.fromisoformat
    if t.is_time(arrow_type):
        return datetime.time.fromisoformat
    if t.is_decimal(arrow_type):
        return decimal.Decimal
    if t.is_binary(arrow_type) or t.is_large_binary(arrow_type) or t.is_fixed_size_binary(arrow_type):
        return base64.b64decode
    return None


def _nested_needs_decoding(arrow_type) -> bool:
    return any(_scalar_decoder(f.type) is not None or _nested_needs_decoding(f.type)
               for f in (arrow_type.field(i) for i in range(arrow_type.num_fields)))


def parquet_kept_types(keep: KeepColumns, part: "InputPart") -> dict[str, Any]:
    """The Arrow types of the kept columns of a Parquet INPUT; raises KeepColumnsError for a missing column
    or one whose nested type holds dates, decimals or bytes (which do not survive the JSON part files)."""
    import pyarrow.parquet as pq

    path = part.name
    with part.open() as f:
        schema = pq.read_schema(f)
    names = keep.names if keep.names is not None else [n for n in schema.names if n not in keep.reserved]
    missing = [n for n in names if n not in schema.names]
    if missing:
        raise KeepColumnsError(f"--keep-columns: {path} has no column {', '.join(missing)} "
                               f"(columns: {', '.join(schema.names)})")
    types = {n: schema.field(n).type for n in names}
    nested = [n for n, t in types.items() if _nested_needs_decoding(t)]
    if nested:
        raise KeepColumnsError(f"--keep-columns: {', '.join(nested)} nests dates, decimals or bytes, which cbatch "
                               "cannot carry yet; leave it out")
    return types


def json_kept_types(records: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Arrow types for kept columns read from JSONL: one pass over the records, by the kinds of their values."""
    import pyarrow as pa

    kinds: dict[str, set[type]] = {}
    for record in records:
        for name, value in (record.get("kept") or {}).items():
            seen = kinds.setdefault(name, set())
            if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
                seen.add(object)  # beyond int64: JSON text
            elif value is not None:
                seen.add(type(value))
    by_kinds = {frozenset({int}): pa.int64(), frozenset({float}): pa.float64(), frozenset({int, float}): pa.float64(),
                frozenset({str}): pa.string(), frozenset({bool}): pa.bool_(), frozenset(): pa.string()}
    return {name: by_kinds.get(frozenset(seen), JSON_TEXT) for name, seen in kinds.items()}


JSON_TEXT = "json"  # a column holding each value's JSON text (a string column)


def output_kept_types(keep: KeepColumns | None, input_types: dict[str, Any] | None,
                      records: Callable[[], Iterable[dict[str, Any]]]) -> dict[str, Any] | None:
    """The kept columns' Arrow types for Parquet OUTPUT: a Parquet INPUT's (`input_types`, from
    `parquet_kept_types` when the job was checked), else read off the records (JSONL INPUT)."""
    if keep is None:
        return None
    return input_types if input_types is not None else json_kept_types(records())


def column_values(values: list[Any], arrow_type: Any) -> Any:
    """An Arrow array of `arrow_type` (or JSON_TEXT) from the JSON-safe values of one kept column."""
    import pyarrow as pa

    if arrow_type == JSON_TEXT:
        return pa.array([None if v is None else json.dumps(v, ensure_ascii=False) for v in values], pa.string())
    decode = _scalar_decoder(arrow_type)
    if decode is not None:
        values = [None if v is None else decode(v) for v in values]
    return pa.array(values, type=arrow_type)


__all__ = ["JSON_TEXT", "KeepColumns", "KeepColumnsError", "column_values", "json_kept_types", "json_safe",
           "output_kept_types", "parquet_kept_types"]
