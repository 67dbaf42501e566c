"""docs/cli.md is generated from the command-line app: it must say what the code does."""
from pathlib import Path

from cbatch.cli.reference import render

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


def test_cli_reference_is_current():
    assert DOCS.read_text() == render(), "docs/cli.md is stale: run `python -m cbatch.cli.reference > docs/cli.md`"


def test_reference_names_every_flag_and_exit_code():
    from cbatch.cli.flags import ALL_FLAGS
    from cbatch.run.exit_codes import EXIT_CODES

    text = render()
    for flag in ALL_FLAGS:
        if not flag.argument:
            assert f"`{flag.spelling}`" in text, flag.spelling
    for code in EXIT_CODES:
        assert f"\n| {code} | " in text


def test_generated_doc_sections_are_current():
    """The tables of docs/sampling.md (sampling fields) and docs/structured-output.md (OpenAI body fields)."""
    from cbatch.cli.reference import SECTIONS, current_section

    for (doc, name), lines in SECTIONS.items():
        text = (DOCS.parent / doc).read_text()
        assert current_section(text, name) == "\n".join(lines()) + "\n", \
            f"docs/{doc} is stale: run `python -m cbatch.cli.reference --write`"


def test_write_docs_rewrites_a_stale_section(tmp_path):
    from cbatch.cli.reference import SECTIONS, current_section, write_docs

    for doc in {doc for doc, _ in SECTIONS}:
        stale = (DOCS.parent / doc).read_text().replace("| `n` |", "| `n_old` |")
        (tmp_path / doc).write_text(stale)
    write_docs(tmp_path)
    assert (tmp_path / "cli.md").read_text() == render()
    for (doc, name), lines in SECTIONS.items():
        written = (tmp_path / doc).read_text()
        assert current_section(written, name) == "\n".join(lines()) + "\n" and "`n_old`" not in written
        assert written == (DOCS.parent / doc).read_text()  # and nothing outside the section changed
