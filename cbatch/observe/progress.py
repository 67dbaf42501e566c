"""Progress for cron logs: a plain line every few seconds (the live view is dashboard.py; display.py picks)."""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

from cbatch.observe.metrics import JobMetrics


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def eta_seconds(metrics: JobMetrics) -> float | None:
    """Seconds left at this run's pace in rows/s; before the first row finishes, an upper bound from the
    output token rate and the submitted rows' mean max_tokens (rows that stop early finish sooner)."""
    elapsed = max(metrics.now(), 1e-9)
    done, todo = metrics.done_rows, metrics.total_rows - metrics.skipped_rows
    if done:
        return (todo - done) / (done / elapsed)
    generated = sum(s.output_tokens for s in metrics.series)  # rows count their tokens only when done
    if generated and metrics.submitted_rows:
        mean_max_tokens = metrics.submitted_max_tokens / metrics.submitted_rows
        return max(0.0, todo * mean_max_tokens - generated) / (generated / elapsed)
    return None


def progress_text(metrics: JobMetrics) -> str:
    """rows done/total, tokens/s, ETA: one line."""
    elapsed = max(metrics.now(), 1e-9)
    done = metrics.done_rows
    eta = eta_seconds(metrics)
    return (
        f"rows {done + metrics.skipped_rows}/{metrics.total_rows} | "
        f"{metrics.output_tokens / elapsed:.1f} output tok/s | "
        f"{(metrics.prompt_tokens + metrics.output_tokens) / elapsed:.1f} total tok/s | "
        f"errors {metrics.error_rows} | ETA {format_eta(eta)}"
    )


class PlainProgress:
    """A line every `interval` seconds of `clock` (for logs and cron mail), never per token."""

    def __init__(self, metrics: JobMetrics, interval: float = 10.0, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.interval = interval
        self.stream = stream  # None: sys.stderr as it is when a line is printed
        self.clock = clock
        self._last = clock()

    def update(self) -> None:
        now = self.clock()
        if now - self._last >= self.interval:
            self._last = now
            print(f"cbatch: {progress_text(self.metrics)}", file=self.stream or sys.stderr, flush=True)

    def close(self) -> None:
        pass  # the job prints its summary line at the end


class NoProgress:
    def update(self) -> None:
        pass

    def close(self) -> None:
        pass
