"""A request's `tools`, `tool_choice` and `parallel_tool_calls` (OpenAI's chat fields), checked: a mistake is a
`ToolFieldError` naming the field and the fix.

    tools                [{"type": "function", "function": {"name", "description"?, "parameters"?}}, ...]
    tool_choice          "auto" (default with tools) | "none" | "required" | {"type": "function", "function": {"name"}}
    parallel_tool_calls  true (default): several calls may come; false: one at most
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cbatch.config import UserError

TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
CHOICES = ("auto", "none", "required")
ANY_ARGUMENTS: dict[str, Any] = {"type": "object"}  # a function without `parameters` takes any object


class ToolFieldError(UserError):
    """A malformed tool field; `field` names it (`tools[1].function.name`, `tool_choice`)."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools, checked. `tools` is what the chat template renders (the request's own objects);
    `functions` maps each function's name to its parameters' JSON schema, in the request's order."""

    tools: list[dict[str, Any]]
    functions: dict[str, dict[str, Any]]
    choice: str  # "auto", "none", "required", or "function" (`function` names it)
    function: str | None = None
    parallel: bool = True

    @property
    def parses_calls(self) -> bool:
        """The completion is parsed for calls (not with tool_choice "none")."""
        return self.choice != "none"


def _function(i: int, tool: Any) -> tuple[str, dict[str, Any]]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise ToolFieldError(where, 'must be {"type": "function", "function": {"name": ..., "parameters": {...}}}')
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolFieldError(f"{where}.function.name", "must be a non-empty string")
    parameters = function.get("parameters", ANY_ARGUMENTS)
    if not isinstance(parameters, dict):
        raise ToolFieldError(f"{where}.function.parameters", "must be a JSON schema object (or left out)")
    return name, parameters


def _choice(value: Any, functions: dict[str, dict[str, Any]]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if functions else "none"), None
    if not isinstance(value, (str, dict)):
        raise ToolFieldError("tool_choice", f"must be a string or an object, got {type(value).__name__}")
    if isinstance(value, str):
        if value not in CHOICES:
            raise ToolFieldError("tool_choice", f'must be "auto", "none", "required" or {{"type": "function", '
                                 f'"function": {{"name": ...}}}}, not {value!r}')
        if value == "required" and not functions:
            raise ToolFieldError("tool_choice", '"required" needs `tools`; give the functions the model may call')
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if value.get("type") != "function" or not isinstance(name, str):
        raise ToolFieldError("tool_choice", 'a named function is {"type": "function", "function": {"name": ...}}')
    if name not in functions:
        known = ", ".join(functions) or "none"
        raise ToolFieldError("tool_choice.function.name", f"{name!r} is not a function of `tools` (those are: {known})")
    return "function", name


def tool_spec(row: dict[str, Any]) -> ToolSpec | None:
    """A request's tool fields (`row` is the row, or an OpenAI line's body), checked; None when it gives none."""
    tools, choice, parallel = (row.get(k) for k in TOOL_FIELDS)
    if tools is None and choice is None and parallel is None:
        return None
    if tools is not None and not isinstance(tools, list):
        raise ToolFieldError("tools", "must be a list of tools")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        name, parameters = _function(i, tool)
        if name in functions:
            raise ToolFieldError(f"tools[{i}].function.name", f"{name!r} is given twice; give each function once")
        functions[name] = parameters
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolFieldError("parallel_tool_calls", f"must be true or false, got {parallel!r}")
    kind, function = _choice(choice, functions)
    return ToolSpec(list(tools or []), functions, kind, function, True if parallel is None else parallel)


__all__ = ["ANY_ARGUMENTS", "CHOICES", "TOOL_FIELDS", "ToolFieldError", "ToolSpec", "tool_spec"]
