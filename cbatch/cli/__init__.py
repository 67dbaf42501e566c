"""The command line: `cbatch run` and `cbatch bench` (app.py), built from one table of flags (flags.py)."""
from cbatch.cli.app import app, main
from cbatch.cli.flags import flag_of

__all__ = ["app", "flag_of", "main"]
