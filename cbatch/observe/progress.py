"""Progress for people and for cron logs: a live view on a terminal, plain lines otherwise."""
from __future__ import annotations

import sys
import time
from typing import TextIO

from cbatch.observe.metrics import JobMetrics


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def progress_text(metrics: JobMetrics) -> str:
    """rows done/total, tokens/s, ETA: one line."""
    elapsed = max(metrics.now(), 1e-9)
    done, total = metrics.done_rows, metrics.total_rows - metrics.skipped_rows
    rate = done / elapsed
    eta = (total - done) / rate if rate > 0 and total else None
    return (
        f"rows {done + metrics.skipped_rows}/{metrics.total_rows} | "
        f"{metrics.output_tokens / elapsed:.1f} output tok/s | "
        f"{(metrics.prompt_tokens + metrics.output_tokens) / elapsed:.1f} total tok/s | "
        f"errors {metrics.error_rows} | ETA {format_eta(eta)}"
    )


class PlainProgress:
    """A line every `interval` seconds (for logs and cron mail), never per token."""

    def __init__(self, metrics: JobMetrics, interval: float = 10.0, stream: TextIO | None = None) -> None:
        self.metrics = metrics
        self.interval = interval
        self.stream = stream if stream is not None else sys.stderr  # looked up now: redirections count
        self._last = time.monotonic()

    def update(self, **_: object) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            print(f"cbatch: {progress_text(self.metrics)}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


class NoProgress:
    def update(self, **_: object) -> None:
        pass

    def close(self) -> None:
        pass


def make_progress(metrics: JobMetrics, options) -> "PlainProgress | NoProgress":
    """--quiet: nothing; a terminal: the live view; otherwise (cron, logs): plain lines."""
    if options.quiet or options.display == "none":
        return NoProgress()
    if options.display == "dashboard" or (options.display == "auto" and sys.stdout.isatty()):
        from cbatch.observe.dashboard import Dashboard

        return Dashboard(metrics, options)
    return PlainProgress(metrics)
