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
