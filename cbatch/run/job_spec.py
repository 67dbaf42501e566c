"""`JobSpec`: everything that decides what a job's rows become, in one frozen value. Every executor of a job is
built from it (`LocalExecutor(engine, spec, metrics)` in `cbatch run`, in each Ray replica, in `cbatch plan` and
`cbatch bench`), and Ray ships it whole, so a replica runs a row exactly as a local run does: the same task, kept
columns, result cache and deadline.
"""
from __future__ import annotations

from dataclasses import dataclass

from cbatch.config import EngineConfig, SamplingParams
from cbatch.io.columns import KeepColumns
from cbatch.run.deadline import Deadline
from cbatch.run.result_cache import CacheSpec
from cbatch.tasks.base import Task


@dataclass(frozen=True, slots=True)
class JobSpec:
    engine: EngineConfig
    task: Task  # what each row asks (cbatch/tasks/), with its settings (sampling defaults, pooling, ...)
    lookahead: int = 16384  # rows queued in the engine at once: longest-first sorts inside this window
    keep: KeepColumns | None = None  # --keep-columns
    result_cache: CacheSpec | None = None  # --result-cache
    deadline: Deadline | None = None  # --max-wall-time / --deadline: when the job stops starting rows

    @property
    def defaults(self) -> SamplingParams:
        """The job's sampling settings (under each row's own)."""
        return self.task.defaults


__all__ = ["JobSpec"]
