"""The one loop every job runs, whatever executes its rows (one engine, a Ray pool, the simulator):

    feed rows while the executor wants them -> poll the executor -> count and store each result
    -> refresh the display -> until every row is done, or an interrupt asks to stop

Counting (ok/error rows, tokens, latencies) happens here and nowhere else; what "store" means is the
caller's (the job's crash-safe state, a benchmark's per-request record).
"""
from __future__ import annotations

from typing import Callable, Iterator, Protocol

from cbatch.io.reader import RawRow
from cbatch.io.state import Finished
from cbatch.observe.display import Display
from cbatch.observe.metrics import JobMetrics
from cbatch.run.executor import Executor
from cbatch.run.interrupt import Interrupt
from cbatch.run.results import RowResult


class Feed(Protocol):
    exhausted: bool

    def fill(self, executor: Executor) -> None: ...


class RowFeed:
    """Input rows, streamed: handed over only while the executor wants more (so a huge input is never held
    whole), skipping the rows the job already has (resume); a row with some of its samples recorded goes
    with the samples it has, so only the missing ones run."""

    def __init__(self, rows: Iterator[RawRow], done: Finished | None = None) -> None:
        self._rows = rows
        self._done = done or Finished()
        self.exhausted = False

    def fill(self, executor: Executor) -> None:
        while not self.exhausted and executor.wants_rows():
            item = next(self._rows, None)
            if item is None:
                self.exhausted = True
                executor.end_of_input()
            elif item[0] not in self._done.rows:
                executor.submit(*item, self._done.partial.get(item[0], frozenset()))


def count(metrics: JobMetrics, result: RowResult) -> None:
    """Counts a result: its row once the row's last sample is in (rows with n > 1), and its tokens, which
    are the work done: a row copied from the result cache counts as ok and as cached, not as tokens."""
    if result.cached:
        metrics.cached_rows += result.last
    if result.ok:
        metrics.ok_rows += result.last
        if not result.cached:
            metrics.prompt_tokens += result.prompt_tokens
            metrics.output_tokens += result.completion_tokens
    else:
        metrics.error_rows += 1
    if result.timing is not None:
        metrics.add_timing(result.timing)


def drive(feed: Feed, executor: Executor, store: Callable[[RowResult], bool], metrics: JobMetrics,
          display: Display, interrupt: Interrupt | None = None) -> int | None:
    """Runs until every row is done (returns None) or an interrupt asks to stop (returns its exit code).

    `store(result)` keeps a result and returns True, or False for a row the job already has (a retried
    Ray block): only kept results are counted.
    """
    while True:
        if interrupt is not None and interrupt.exit_code is not None:
            return interrupt.exit_code
        feed.fill(executor)
        if feed.exhausted and not executor.busy():
            return None
        for result in executor.poll():  # with nothing to run yet (arrivals later): an idle step
            if store(result):
                count(metrics, result)
        display.update()
