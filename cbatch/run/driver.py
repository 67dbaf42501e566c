"""The one loop every job runs, whatever executes its rows (one engine, a Ray pool, the simulator):

    feed rows while the executor wants them -> poll the executor -> count and store each result
    -> refresh the display -> until every row is done, or an interrupt asks to stop, or a deadline comes
    (nothing new starts; the running rows get the grace; then every row left is stored `expired`)

Counting (ok/error rows, tokens, latencies) happens here and nowhere else; what "store" means is the
caller's (the job's crash-safe state, a benchmark's per-request record).
"""
from __future__ import annotations

from typing import Callable, Iterator, Protocol

from cbatch.io.reader import RawRow
from cbatch.io.state import Finished
from cbatch.observe.display import Display
from cbatch.observe.metrics import JobMetrics
from cbatch.run.deadline import Deadline
from cbatch.run.executor import Executor
from cbatch.run.exit_codes import EXIT_EXPIRED
from cbatch.run.interrupt import Interrupt
from cbatch.tasks.results import RowResult


class Feed(Protocol):
    exhausted: bool

    def fill(self, executor: Executor) -> None: ...
    def expire_rest(self, executor: Executor, message: str) -> Iterator[RowResult]: ...


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

    def expire_rest(self, executor: Executor, message: str) -> Iterator[RowResult]:
        """The rows never handed over (a deadline came): read on to the end, each row not done `expired`."""
        for index, raw in self._rows:
            if index not in self._done.rows:
                yield from executor.expire_unsubmitted(index, raw, self._done.partial.get(index, frozenset()), message)
        self.exhausted = True


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
          display: Display, interrupt: Interrupt | None = None, deadline: Deadline | None = None) -> int | None:
    """Runs until every row is done (returns None), an interrupt asks to stop (returns its exit code), or the
    deadline (returns EXIT_EXPIRED once every row left is stored `expired`).

    `store(result)` keeps a result and returns True, or False for a row the job already has (a retried
    Ray block): only kept results are counted.
    """
    def keep(results) -> None:
        for result in results:
            if store(result):
                count(metrics, result)

    closing = False  # the deadline came: nothing new starts, the running rows have the grace
    while True:
        if interrupt is not None and interrupt.exit_code is not None:
            return interrupt.exit_code
        if not closing:
            if deadline is not None and deadline.passed():
                closing = True
                executor.stop_starting()
            else:
                feed.fill(executor)
                if feed.exhausted and not executor.busy():
                    return None
        if closing and (not executor.busy() or deadline.grace_over()):
            keep(executor.expire(deadline.message))
            keep(feed.expire_rest(executor, deadline.message))
            return EXIT_EXPIRED
        keep(executor.poll())  # with nothing to run yet (arrivals later): an idle step
        display.update()
