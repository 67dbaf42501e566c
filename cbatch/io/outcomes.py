"""What a row's `finish_reason` says, for every reader of records: stop and length are completions; "error" (the
row could not run) and "expired" (a deadline came before it finished: run/deadline.py) are failed rows."""
from __future__ import annotations

EXPIRED = "expired"
FAILED = frozenset({"error", EXPIRED})
