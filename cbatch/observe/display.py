"""Which progress display a job gets, and what every display offers the driver."""
from __future__ import annotations

import sys
from typing import Protocol

from cbatch.observe.metrics import JobMetrics
from cbatch.observe.progress import NoProgress, PlainProgress


class Display(Protocol):
    """Reads `JobMetrics` (nothing else) when the driver calls `update` after each poll, or on its own timer."""

    def update(self) -> None: ...
    def close(self) -> None: ...


def make_display(metrics: JobMetrics, options) -> Display:
    """--quiet: nothing; a terminal: the live dashboard; otherwise (cron, logs): plain lines.

    `options` has `quiet`, `display` (auto | dashboard | plain | none), `progress_interval`, and the engine
    config (`options.engine`: max_num_seqs, max_num_batched_tokens, for the dashboard's shares)."""
    if options.quiet or options.display == "none":
        return NoProgress()
    if options.display == "dashboard" or (options.display == "auto" and sys.stdout.isatty()):
        from cbatch.observe.dashboard import Dashboard

        return Dashboard(metrics, options)
    return PlainProgress(metrics, interval=options.progress_interval)
