"""The generated parts of docs/, made from the code so they say what it does: docs/cli.md whole (every
command's flags, from cbatch/cli/flags.py through typer, and the exit codes, cbatch/run/exit_codes.py), and
the tables between `<!-- generated: NAME -->` and `<!-- end generated: NAME -->` in the other docs (`SECTIONS`:
the sampling fields, cbatch/config.py, and the OpenAI body fields, cbatch/io/openai.py).

`python -m cbatch.cli.reference --write` rewrites all of them; `python -m cbatch.cli.reference > docs/cli.md`
still writes cli.md alone. Tests keep every one current (tests/test_cli_reference.py)."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Callable

DOCS = Path(__file__).resolve().parents[2] / "docs"

HEADER = """# Command-line reference

Generated from the code by `python -m cbatch.cli.reference > docs/cli.md` (a test checks it is current).
A row's own fields (`max_tokens`, `temperature`, ...) override the sampling flags for that row.
"""


def _default(param: Any) -> str:
    if param.required:
        return "required"
    value = param.default
    if param.is_flag and getattr(param, "secondary_opts", None) and value is not None:  # (None: neither, the model's)
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
    """docs/cli.md."""
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


# ---- tables inside hand-written docs ------------------------------------------------------------------
def _doc_value(value: Any) -> str:
    """A default as docs/sampling.md writes it: 256, 0, 1, false, none."""
    if value is None or value == [] or value == {}:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


def sampling_fields_table() -> list[str]:
    """docs/sampling.md: every sampling field (cbatch/config.py's SAMPLING_FIELDS) as a row field and a flag."""
    from cbatch.cli.flags import sampling_flag
    from cbatch.config import LIST_KINDS, SAMPLING_FIELDS

    lines = ["| row field | flag | default | meaning |", "|---|---|---|---|"]
    for spec in SAMPLING_FIELDS.values():
        flag = sampling_flag(spec)
        spelling = f"`{flag.spelling}{f' {flag.metavar}' if flag.metavar else ''}`"
        if spec.kind in LIST_KINDS:
            spelling += " (repeatable)"
        if not spec.flag_sets_default:
            spelling += " (job seed)"
        lines.append(f"| `{spec.name}` | {spelling} | {_doc_value(spec.default)} | {spec.meaning} |")
    return lines


def body_fields_table() -> list[str]:
    """docs/structured-output.md: every OpenAI batch body field (cbatch/io/openai.py's BODY_FIELDS)."""
    from cbatch.io.openai import BODY_FIELDS

    lines = ["| field | status | accepted \"off\" value | urls | what cbatch does |", "|---|---|---|---|---|"]
    for name, spec in BODY_FIELDS.items():
        off = f"`{json.dumps(spec.off)}`" if spec.has_off else ""
        urls = ", ".join(url.removeprefix("/v1/") for url in spec.urls)
        lines.append(f"| `{name}` | {spec.status} | {off} | {urls} | {spec.note} |")
    return lines


# (doc file, section name) -> its lines
SECTIONS: dict[tuple[str, str], Callable[[], list[str]]] = {
    ("sampling.md", "sampling fields"): sampling_fields_table,
    ("structured-output.md", "body fields"): body_fields_table,
}


def _section_pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated: {re.escape(name)} [^\n]*-->\n)(.*?)(<!-- end generated: {re.escape(name)} -->)",
                      re.DOTALL)


def current_section(text: str, name: str) -> str | None:
    """The section's lines as the doc has them (None: the doc has no such section)."""
    match = _section_pattern(name).search(text)
    return match.group(2) if match else None


def with_sections(doc: str, text: str) -> str:
    """`text` (the doc file `doc`) with each of its generated sections made anew."""
    for (file, name), lines in SECTIONS.items():
        if file == doc:
            text, found = _section_pattern(name).subn(lambda m: m.group(1) + "\n".join(lines()) + "\n" + m.group(3), text)
            if found != 1:
                raise ValueError(f"docs/{doc}: no `<!-- generated: {name} ... -->` section to write")
    return text


def write_docs(docs: Path = DOCS) -> None:
    (docs / "cli.md").write_text(render())
    for doc in dict.fromkeys(file for file, _ in SECTIONS):
        path = docs / doc
        path.write_text(with_sections(doc, path.read_text()))


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:
        write_docs()
    else:
        print(render(), end="")
