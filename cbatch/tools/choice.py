"""`tool_choice` "required" or a named function -> the structured-output constraint that makes the completion
well-formed calls in the model's format (an xgrammar structural tag: cbatch/engine/structured.py compiles it
like any other constraint, and the format's parser reads the result back)."""
from __future__ import annotations

import json

from cbatch.config import Constraint
from cbatch.tools.formats import ToolFormat
from cbatch.tools.spec import ToolSpec


def tool_choice_constraint(spec: ToolSpec, fmt: ToolFormat) -> Constraint | None:
    """The constraint of `spec`'s tool_choice in format `fmt`: "required" -> one call of any of the tools (several,
    `fmt.separator` between them, when parallel_tool_calls); a named function -> exactly one call of it; "auto"
    and "none" -> None (the model chooses)."""
    if spec.choice == "required":
        names, parallel = list(spec.functions), spec.parallel
    elif spec.choice == "function":
        names, parallel = [spec.function], False
    else:
        return None
    tags = [fmt.call_tag(name, spec.functions[name]) for name in names]
    tag = {"type": "structural_tag", "format": fmt.calls_format(tags, parallel)}
    return Constraint("structural_tag", json.dumps(tag, ensure_ascii=False, separators=(",", ":")), "tool_choice")


__all__ = ["tool_choice_constraint"]
