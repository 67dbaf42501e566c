"""A row's structured-output fields -> a `Constraint` (or a RowError naming the field).

Row fields: `json_schema` (an object, or a string holding one), `regex` (a string), `choice` (a list of
strings), `json_object: true`, and OpenAI's `response_format` ({"type": "json_object"} or
{"type": "json_schema", "json_schema": {"schema": {...}}}). At most one per row; a row without one takes
the job's (--json-schema / --regex / --choice). Whether the grammar engine accepts the schema or regex
is checked when the row is queued (cbatch/engine/structured.py), and a rejection names the field too.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cbatch.config import Constraint, UserError

CONSTRAINT_FIELDS = ("json_schema", "regex", "choice", "json_object", "response_format")


class ConstraintFieldError(UserError):
    """A malformed constraint field; `field` names it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


def schema_text(field: str, value: Any) -> str:
    """A JSON schema (an object, or a string holding one) as compact JSON, property order kept."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConstraintFieldError(field, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, dict):
        raise ConstraintFieldError(field, f"must be a JSON schema object, got {type(value).__name__}")
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def choice_text(field: str, value: Any) -> str:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
        raise ConstraintFieldError(field, "must be a non-empty list of non-empty strings")
    return json.dumps(value, ensure_ascii=False)


def regex_text(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConstraintFieldError(field, "must be a non-empty regular expression string")
    return value


def _from_response_format(value: Any) -> Constraint | None:
    field = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ConstraintFieldError(field, 'must be an object with a `type` ("text", "json_object" or "json_schema")')
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "", field)
    if kind != "json_schema":
        raise ConstraintFieldError(f"{field}.type", f'must be "text", "json_object" or "json_schema", not {kind!r}')
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise ConstraintFieldError(f"{field}.json_schema", 'must be an object with a `schema` (and optionally `name`, `strict`)')
    return Constraint("json_schema", schema_text(f"{field}.json_schema.schema", spec["schema"]), f"{field}.json_schema.schema")


def constraint_from_row(row: dict[str, Any], default: Constraint | None) -> Constraint | None:
    """The row's own constraint, else `default` (the job's). Raises ConstraintFieldError."""
    given = [k for k in CONSTRAINT_FIELDS if row.get(k) is not None and row.get(k) is not False]
    if not given:
        return default
    if len(given) > 1:
        raise ConstraintFieldError(given[1], f"give one constraint per row, not {' and '.join(given)}")
    field, value = given[0], row[given[0]]
    if field == "json_schema":
        return Constraint("json_schema", schema_text(field, value), field)
    if field == "regex":
        return Constraint("regex", regex_text(field, value), field)
    if field == "choice":
        return Constraint("choice", choice_text(field, value), field)
    if field == "json_object":
        if value is not True:
            raise ConstraintFieldError(field, f"must be true or false, got {value!r}")
        return Constraint("json_object", "", field)
    return _from_response_format(value)


def flags_constraint(json_schema_file: Path | None, regex: str | None, choices: list[str] | None) -> Constraint | None:
    """The job's constraint from --json-schema FILE, --regex PATTERN, --choice VALUE...; raises a UserError
    naming the flag."""
    given = [name for name, value in (("--json-schema", json_schema_file), ("--regex", regex), ("--choice", choices))
             if value]
    if not given:
        return None
    if len(given) > 1:
        raise ConstraintFieldError(given[1], f"give one of --json-schema, --regex, --choice, not {' and '.join(given)}")
    if json_schema_file is not None:
        try:
            text = Path(json_schema_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConstraintFieldError("--json-schema", f"cannot read {json_schema_file} ({exc})") from None
        return Constraint("json_schema", schema_text(f"--json-schema {json_schema_file}", text), "--json-schema")
    if regex is not None:
        return Constraint("regex", regex_text("--regex", regex), "--regex")
    return Constraint("choice", choice_text("--choice", list(choices)), "--choice")


__all__ = ["CONSTRAINT_FIELDS", "ConstraintFieldError", "choice_text", "constraint_from_row", "flags_constraint", "regex_text",
           "schema_text"]
