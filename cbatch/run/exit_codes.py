"""`cbatch run`'s exit codes, in one place (the CLI reference in docs/cli.md is generated from this table).

A failure is classified once, by `classify`: the user's mistake (exit 2, one line naming the file or
flag and the fix), the environment (exit 74, one line naming the path and the cause: no space, quota,
read-only, permission), or a bug in cbatch (exit 70, with the traceback for the report).
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_ROW_ERRORS = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 70  # sysexits' EX_SOFTWARE
EXIT_IO = 74  # sysexits' EX_IOERR
EXIT_EXPIRED = 75  # sysexits' EX_TEMPFAIL: try again later
EXIT_SIGINT = 130
EXIT_SIGTERM = 143

EXIT_CODES: dict[int, str] = {
    EXIT_OK: "every row succeeded (or OUTPUT was already complete for this input and settings: nothing to do)",
    EXIT_ROW_ERRORS: "finished, but some rows are error rows (`--allow-errors` makes this 0); also: Ray replicas "
                     "kept failing (the finished rows are kept)",
    EXIT_USAGE: "bad usage or input: a missing or unreadable input, an unknown extension, no prompt field, a model "
                "folder that is not a supported checkpoint, an unwritable output folder, a malformed flag, an OUTPUT "
                "this job may not touch. One line names the file or flag and the fix; nothing is written",
    EXIT_INTERNAL: "internal error, a bug in cbatch: the traceback is on stderr for the bug report; the finished rows "
                   "are kept and running the same command again resumes",
    EXIT_IO: "the environment failed the job's own files (disk full, quota, read-only, permission), or a "
             "tensor-parallel worker process died (killed, out of memory): one line names the path or the rank and "
             "the cause; the finished rows are kept: fix it and run the same command again",
    EXIT_EXPIRED: "the deadline (--max-wall-time, --deadline) came first: OUTPUT holds every finished row and an "
                  "`expired` error row for each row left; running the same command again runs only the expired rows",
    EXIT_SIGINT: "interrupted by SIGINT: the finished rows are kept (rows in flight run again on resume); a second "
                 "Ctrl-C stops at once",
    EXIT_SIGTERM: "interrupted by SIGTERM: as for SIGINT",
}
