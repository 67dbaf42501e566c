"""SIGINT / SIGTERM during a job: stop admitting, keep what finished, exit 130 / 143. A second Ctrl-C
stops at once (KeyboardInterrupt)."""
from __future__ import annotations

import signal
from typing import Any

from cbatch.run.exit_codes import EXIT_SIGINT, EXIT_SIGTERM


class Interrupt:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def exit_code(self) -> int | None:
        """None until a signal came; then the exit code it asks for."""
        if self.signum is None:
            return None
        return EXIT_SIGINT if self.signum == signal.SIGINT else EXIT_SIGTERM

    def __enter__(self) -> "Interrupt":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
