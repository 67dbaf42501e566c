"""What a task is: the one seam between a job's rows and the engine.

A task owns everything that differs between kinds of rows: its input fields and row parsing, the engine
requests a row makes (one; for a score or a rerank: one per pair with a cross-encoder, one per distinct text
with a bi-encoder), how the finished requests become the row's result(s) and output columns, its OpenAI response
body, and what it adds to the output identity. The executor, the writer, the planner and the Ray path ask the
job's task and never branch on which task it is.

A row's life, as the executor drives it:

    task.parse(index, raw)          -> ParsedRow     (no engine: also how a deadline expires an unsent row)
    task.prefetch(engine, parsed)   -> futures       (a row with images: read on worker threads; the row waits)
    task.requests(engine, parsed)   -> RowWork       (tokenized requests, the result-cache key)
    engine.add_request(...) for each request; the executor names each finished output by its `Part`
    task.collect(engine, row, part, output) -> the row's results so far (none until the task has what it needs)
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from cbatch.config import SamplingParams, UserError
from cbatch.engine.pooling import PoolingParams
from cbatch.tasks.results import RowResult

if TYPE_CHECKING:
    from cbatch.engine.engine import Engine, RequestOutput
    from cbatch.model.pooling_config import ClassifierTokens
    from cbatch.model.spec import ModelSpec

Part = tuple[int, int]  # (the request's number in its row, the sample index): one finished output of a row


class TaskError(UserError):
    """A --task the model cannot do, or a task flag that does not fit; the message names the fix."""


class TaskOptions(Protocol):
    """The job's task flags, as `cbatch run` (JobOptions) and `cbatch plan` (PlanOptions) both carry them."""

    task: str
    defaults: SamplingParams  # the job's sampling settings (a prefill-only request runs with them too)
    pooling: str | None
    normalize: bool | None
    dimensions: int | None
    classifier: "ClassifierTokens | None"  # --classifier-from-token / hf_overrides (None: the model's config's, if any)
    score_template: str | None  # --score-template's text: score / rerank pairs rendered through it
    reasoning_split: bool


@dataclass(slots=True)
class ParsedRow:
    """A row as its task read it: enough to name it in a result without the engine."""

    index: int
    row_id: str
    request: Any  # the task's own view of the row (a RowRequest, a PoolingRow, ...)
    num_samples: int = 1  # the row's n: the results it makes when it runs whole
    echo: dict[str, Any] = field(default_factory=dict)  # request fields an OpenAI output line repeats


@dataclass(slots=True)
class Request:
    """One engine request of a row."""

    prompt_ids: list[int]
    params: SamplingParams
    pooling: PoolingParams | None = None  # a prefill-only request's settings
    images: list | None = None  # the prompt's images (engine/images.PromptImage), in placeholder order


@dataclass(slots=True)
class RowWork:
    """A parsed row made ready for the engine: its requests (the first one runs as the row's own sequence, so its
    seed is the row's) and the result cache's key for it (None: never cached)."""

    parsed: ParsedRow
    requests: list[Request]
    # (the prompt: its token ids, then "image:<digest>" of each image; settings) the result cache keys on
    cache_key: tuple[list[int | str], SamplingParams] | None = None


@dataclass(slots=True)
class PendingRow:
    """A row in the engine: what is left of it and what its finished parts gave so far."""

    parsed: ParsedRow
    left: set[Part]  # the outputs not back yet
    queued_s: float
    queued_step: int
    kept: dict[str, Any] = field(default_factory=dict)  # --keep-columns: input columns carried to the output
    outputs: dict[Part, "RequestOutput"] = field(default_factory=dict)  # finished parts the task keeps until it is whole
    image_digests: list[str] = field(default_factory=list)  # of the images it read (its results' `image_digests`)

    def result(self, finish_reason: str, **values: Any) -> RowResult:
        """A result of this row, `last` when no part is left."""
        parsed = self.parsed
        return RowResult(parsed.index, parsed.row_id, finish_reason, num_samples=parsed.num_samples,
                         last=not self.left, echo=parsed.echo, kept=self.kept, image_digests=self.image_digests,
                         **values)


class Task(ABC):
    """What a job asks of each row. One instance per job, resolved against the model (`for_job`); it is data (a
    frozen JobSpec holds it, Ray ships it), and it takes the engine as an argument where it needs one."""

    name: ClassVar[str]
    input_fields: ClassVar[tuple[str, ...]]  # INPUT's probe: a row of this task has one of these
    columns: ClassVar[tuple[str, ...]] = ()  # its own output columns, written after the base ones
    decodes: ClassVar[bool] = True  # its requests generate tokens (False: prefill only, no output lengths to plan)
    defaults: SamplingParams  # the job's sampling settings (under each row's own; a prefill-only request runs with them)

    @classmethod
    @abstractmethod
    def for_job(cls, options: TaskOptions, spec: "ModelSpec", model_dir: Path | None) -> "Task":
        """The task with the job's settings, checked against the model; raises TaskError naming the fix."""

    def identity(self) -> dict[str, Any]:
        """What the task adds to the output identity (resume fingerprint and result-cache key): the settings its
        results depend on. Empty: nothing beyond the rows and the engine."""
        return {}

    def column_types(self) -> dict[str, Any]:
        """The Arrow types of `columns` (Parquet OUTPUT)."""
        return {}

    @abstractmethod
    def parse(self, index: int, raw: dict[str, Any] | str) -> ParsedRow:
        """The row read and checked; raises RowError naming the field."""

    def image_sources(self, parsed: ParsedRow) -> list[tuple[str, Any]]:
        """The row's images as (name in messages, source) (io/images.py), in order; [] for a task without images."""
        return []

    def prefetch(self, engine: "Engine", parsed: ParsedRow) -> list[Future] | None:
        """Starts the row's slow input work (reading and preprocessing its images) on worker threads, so the engine's
        steps never wait for it; `requests` then takes the results. None: nothing to wait for (the row goes to
        `requests` at once); otherwise the futures the row waits on before `requests`."""
        return None

    @abstractmethod
    def requests(self, engine: "Engine", parsed: ParsedRow) -> RowWork:
        """The row's engine requests (tokenized); raises RowError for anything wrong with this row alone."""

    @abstractmethod
    def collect(self, engine: "Engine", row: PendingRow, part: Part, out: "RequestOutput") -> list[RowResult]:
        """A finished output of `row` (already discarded from `row.left`) -> the row's results it completes (none
        until the task has every part it needs). Failed outputs never reach here: the executor fails the row."""

    @abstractmethod
    def openai_body(self, samples: list[dict[str, Any]], model: str, created: int) -> dict[str, Any]:
        """A finished row's OpenAI response body from its records (io/openai.py writes the line around it)."""


# ---- the registry: each task's module registers its class (cbatch/tasks/NAME_task.py) ---------------------------
_REGISTRY: dict[str, type[Task]] = {}


def register(task: type[Task]) -> type[Task]:
    """Registers a task class under its `name` (used as a decorator by each task's module)."""
    if task.name in _REGISTRY:
        raise ValueError(f"a task named {task.name!r} is registered already")
    _REGISTRY[task.name] = task
    return task


def task_class(name: str) -> type[Task]:
    from cbatch.config import TASKS

    if name not in _REGISTRY:
        raise TaskError(f"--task: one of {', '.join(TASKS)}, not {name!r}")
    return _REGISTRY[name]


def registered_tasks() -> dict[str, type[Task]]:
    return dict(_REGISTRY)


def make_task(options: TaskOptions, spec: "ModelSpec", model_dir: Path | None) -> Task:
    """The job's task (--task and its flags) resolved against the model; raises TaskError naming the fix."""
    return task_class(options.task).for_job(options, spec, model_dir)


__all__ = ["ParsedRow", "Part", "PendingRow", "Request", "RowWork", "Task", "TaskError", "TaskOptions", "make_task",
           "register", "registered_tasks", "task_class"]
