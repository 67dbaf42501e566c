"""docs/cli.md, generated from the command-line app itself: every command's flags (from cbatch/cli/flags.py
through typer) and the exit codes (cbatch/run/exit_codes.py). `python -m cbatch.cli.reference > docs/cli.md`;
a test keeps the file current."""
from __future__ import annotations

from typing import Any

HEADER = """# Command-line reference

Generated from the code by `python -m cbatch.cli.reference > docs/cli.md` (a test checks it is current).
A row's own fields (`max_tokens`, `temperature`, ...) override the sampling flags for that row.
"""


def _default(param: Any) -> str:
    if param.required:
        return "required"
    value = param.default
    if param.is_flag and getattr(param, "secondary_opts", None):
        return param.opts[0] if value else param.secondary_opts[0]
    if value is None or value == () or value == []:
        return ""
    return f"`{value}`"


def _names(param: Any) -> str:
    names = list(param.opts) + list(getattr(param, "secondary_opts", []) or [])
    if param.param_type_name == "argument":
        return param.name.upper()
    return ", ".join(f"`{n}`" for n in names)


def command_table(command: Any) -> list[str]:
    """One table per help panel, in the order the panels first appear."""
    panels: dict[str, list[Any]] = {}
    for param in command.params:
        panel = "Arguments" if param.param_type_name == "argument" else (getattr(param, "rich_help_panel", None) or "Options")
        panels.setdefault(panel, []).append(param)
    lines: list[str] = []
    for panel, params in panels.items():
        lines += [f"### {panel}", "", "| flag | default | what it does |", "|---|---|---|"]
        for param in params:
            help_text = (getattr(param, "help", None) or "").replace("|", "\\|")
            lines.append(f"| {_names(param)} | {_default(param)} | {help_text} |")
        lines.append("")
    return lines


def render() -> str:
    import typer.main

    from cbatch.cli.app import app
    from cbatch.run.exit_codes import EXIT_CODES

    group = typer.main.get_command(app)
    lines = [HEADER]
    for name in ("run", "plan", "bench"):
        command = group.commands[name]
        lines += [f"## `cbatch {name}`", "", (command.help or "").strip().splitlines()[0], ""]
        lines += command_table(command)
    lines += ["## Exit codes (`cbatch run`)", "", "| code | meaning |", "|---|---|"]
    lines += [f"| {code} | {meaning} |" for code, meaning in EXIT_CODES.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
