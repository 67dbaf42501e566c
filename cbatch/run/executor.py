"""Executors turn rows into results. `LocalExecutor`: rows through one engine (a model or the simulator).

A row's life: its task parses it and makes its engine requests (cbatch/tasks/base.py) -> the requests queue in
the engine -> steps -> the task turns the finished outputs into `RowResult`s. The same code serves `cbatch run`,
each Ray replica, `cbatch plan` and `cbatch bench`, so a row gets exactly the same validation, tokenization, seed
(its input index is its first request's seq_id) and result wherever it runs. A row that fails before it runs, or
whose request fails, is one error row.
"""
from __future__ import annotations

from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from cbatch.engine.engine import Engine
from cbatch.engine.sequence import Sequence
from cbatch.io.openai import without_carried
from cbatch.io.outcomes import EXPIRED
from cbatch.io.row_fields import RowError, row_id_of
from cbatch.observe.metrics import JobMetrics, RequestTiming, engine_snapshot, engine_step_sample
from cbatch.run.job_spec import JobSpec
from cbatch.tasks.base import ParsedRow, Part, PendingRow, RowWork
from cbatch.tasks.results import RowResult


class Executor(Protocol):
    """What the driver feeds rows to and polls for results."""

    def wants_rows(self) -> bool: ...  # room for more rows now
    def submit(self, index: int, raw: dict[str, Any] | str, done_samples: frozenset[int] = frozenset()) -> None: ...
    def end_of_input(self) -> None: ...  # no more rows will come
    def busy(self) -> bool: ...  # rows submitted and not yet returned
    def poll(self) -> list[RowResult]: ...  # advance (one engine step, or wait for a block); finished rows
    # a deadline (run/deadline.py): nothing new starts; then what is left of every row becomes `expired` results
    def stop_starting(self) -> None: ...
    def expire(self, message: str) -> list[RowResult]: ...  # every submitted row not yet returned
    def expire_unsubmitted(self, index: int, raw: dict[str, Any] | str, done_samples: frozenset[int],
                           message: str) -> list[RowResult]: ...  # a row never submitted


def expired_results(index: int, row_id: str, num_samples: int, samples: Iterable[int], message: str,
                    echo: dict[str, Any], kept: dict[str, Any]) -> list[RowResult]:
    """One `expired` result for each of a row's `samples` a deadline left unfinished (each naming the row's n)."""
    samples = sorted(samples)
    return [RowResult(index, row_id, EXPIRED, error=message, sample_index=i, num_samples=num_samples,
                      last=i == samples[-1], echo=echo, kept=kept) for i in samples]


def failed_result(index: int, row_id: str, exc: Exception, echo: dict[str, Any], kept: dict[str, Any],
                  prompt_tokens: int = 0) -> RowResult:
    """A row's error result: a user's mistake (a ValueError: RowError, UserError) names itself; anything else is
    named with its type."""
    message = str(exc) if isinstance(exc, ValueError) else f"could not prepare this row ({type(exc).__name__}: {exc})"
    failed = RowResult.failed(index, row_id, message, prompt_tokens)
    failed.echo, failed.kept = echo, kept
    return failed


def image_digests(work: RowWork) -> list[str]:
    """The digests of the images a row's first request reads (its results keep them for a resume's check)."""
    return [image.digest for image in work.requests[0].images or []] if work.requests else []


def expire_unsent(spec: JobSpec, index: int, raw: dict[str, Any] | str, done_samples: frozenset[int],
                  message: str) -> list[RowResult]:
    """A row a deadline kept from starting: its missing samples `expired` (a row that is bad in itself is reported
    as such, as when it runs). Every executor's `expire_unsubmitted`."""
    kept = spec.keep.pick(raw) if spec.keep is not None else {}
    try:
        parsed = spec.task.parse(index, without_carried(raw, kept))
    except RowError as exc:
        return [failed_result(index, row_id_of(index, raw), exc, {}, kept)]
    left = [i for i in range(parsed.num_samples) if i not in done_samples]
    return expired_results(index, parsed.row_id, parsed.num_samples, left, message, parsed.echo, kept)


# rows with images hold their preprocessed pixels until the vision tower has encoded them (then only their images'
# sources): at most this many past the engine's max_num_seqs are read ahead (being read on worker threads, or
# waiting in the engine), whatever --lookahead says
PREFETCH_ROWS = 64


@dataclass(slots=True)
class _Arriving:
    """A row waiting for its inputs (`Task.prefetch`) before it goes to the engine."""

    index: int
    raw: dict[str, Any] | str
    done_samples: frozenset[int]
    parsed: ParsedRow
    futures: list[Future]


class LocalExecutor:
    """Rows through one engine, as `spec` says. `spec.lookahead` bounds the rows waiting in the engine
    (longest-first orders within that window); each `poll` is one engine step, recorded in `metrics`. With a
    result cache, a row found there is copied (it never reaches the engine) and every finished row is stored."""

    def __init__(self, engine: Engine, spec: JobSpec, metrics: JobMetrics) -> None:
        self.engine = engine
        self.spec = spec
        self.task = spec.task
        self.metrics = metrics
        self.cache = spec.result_cache.open() if spec.result_cache is not None else None
        self._rows: dict[int, PendingRow] = {}  # row index (its first request's seq_id) -> the row in the engine
        self._parts: dict[int, tuple[int, int]] = {}  # a row's further requests: their seq_id -> (row index, number)
        self._ready: list[RowResult] = []  # rows that failed before reaching the engine, or came from the cache
        self._arriving: list[_Arriving] = []  # rows whose inputs are being read (images), in submission order
        self._image_rows: set[int] = set()  # rows with images in the engine (their pixels until encoded)

    def wants_rows(self) -> bool:
        with_images = len(self._arriving) + len(self._image_rows)
        return (self.engine.scheduler.num_waiting + len(self._arriving) < self.spec.lookahead
                and with_images < PREFETCH_ROWS + self.engine.scheduler.max_num_seqs)

    def is_pending(self, index: int) -> bool:
        """The row is queued or running in the engine (or reading its images before it)."""
        return index in self._rows or any(row.index == index for row in self._arriving)

    def prepare(self, index: int, raw: dict[str, Any] | str, parsed: ParsedRow | None = None) -> "RowWork | RowResult":
        """A row parsed (unless `parsed` is given) and its requests made, or its result already: an error row
        (anything wrong with this row alone: its fields, its tokenization, its images) or a result-cache hit.
        `submit` queues what this prepares; `cbatch plan` checks every row with it."""
        kept = self.spec.keep.pick(raw) if self.spec.keep is not None else {}
        echo: dict[str, Any] = {}
        try:
            parsed = parsed or self.task.parse(index, without_carried(raw, kept))
            echo = parsed.echo
            work = self.task.requests(self.engine, parsed)
            hit = self.cache.lookup(index, parsed.row_id, *work.cache_key) if self.cache and work.cache_key else None
        except Exception as exc:  # RowError, or a tokenizer check on this row alone: never the job
            return failed_result(index, row_id_of(index, raw), exc, echo, kept)
        if hit is not None:
            hit.echo, hit.kept = echo, kept
            hit.image_digests = image_digests(work)
            return hit
        return work

    def submit(self, index: int, raw: dict[str, Any] | str, done_samples: frozenset[int] = frozenset()) -> None:
        """Queues the row's requests (its samples not in `done_samples`); anything wrong with this row alone (its
        fields, its tokenization, its size) makes it an error result and never stops the job. A row whose inputs
        its task reads on worker threads (images: `Task.prefetch`) waits for them first, outside the engine."""
        kept = self.spec.keep.pick(raw) if self.spec.keep is not None else {}
        try:
            parsed = self.task.parse(index, without_carried(raw, kept))
            futures = self.task.prefetch(self.engine, parsed)
        except Exception as exc:  # RowError: never the job
            self._ready.append(failed_result(index, row_id_of(index, raw), exc, {}, kept))
            return
        if futures:
            self._arriving.append(_Arriving(index, raw, done_samples, parsed, futures))
            return
        self._enqueue(index, raw, done_samples, parsed)

    def _admit_arrived(self, wait_for_one: bool) -> None:
        """The arriving rows whose inputs are read go to the engine (in submission order among them); with
        `wait_for_one` (nothing else to do) this waits for the first one."""
        if wait_for_one and self._arriving:
            wait(self._arriving[0].futures)
        still = []
        for row in self._arriving:
            if all(future.done() for future in row.futures):
                self._enqueue(row.index, row.raw, row.done_samples, row.parsed)
            else:
                still.append(row)
        self._arriving = still

    def _enqueue(self, index: int, raw: dict[str, Any] | str, done_samples: frozenset[int], parsed: ParsedRow) -> None:
        work = self.prepare(index, raw, parsed)
        if isinstance(work, RowResult):
            self._ready.append(work)
            return
        parsed, kept = work.parsed, self.spec.keep.pick(raw) if self.spec.keep is not None else {}
        samples = [i for i in range(parsed.num_samples) if i not in done_samples]
        left = {(0, s) for s in samples} | {(k, 0) for k in range(1, len(work.requests))}
        row = PendingRow(parsed, left, self.metrics.now(), self.engine.scheduler.stats.steps, kept,
                         image_digests=image_digests(work))
        seqs: list[Sequence] = []
        try:
            for number, request in enumerate(work.requests):
                seq_id = index if number == 0 else self.engine.extra_seq_id()  # (extra ids are negative: never a row's)
                if number:
                    self._parts[seq_id] = (index, number)
                seqs.append(self.engine.add_request(request.prompt_ids, request.params, seq_id=seq_id,
                                                    samples=samples if number == 0 else None, pooling=request.pooling,
                                                    images=request.images))
        except Exception as exc:  # an engine check on this row alone: never the job
            self._ready.append(failed_result(index, parsed.row_id, exc, parsed.echo, kept))
            return
        self._rows[index] = row
        self.metrics.submitted_rows += 1
        if work.requests[0].images:
            self.metrics.count_images(work.requests[0].images)
            self._image_rows.add(index)
        if self.task.decodes:
            self.metrics.submitted_max_tokens += work.requests[0].params.max_tokens * len(samples)
        for seq in seqs:
            if seq.is_finished:  # could never run (too long for the model or the KV pool)
                self._ready += self._results(seq)

    def end_of_input(self) -> None:
        pass

    def busy(self) -> bool:
        return bool(self._ready) or bool(self._arriving) or self.engine.has_unfinished()

    def poll(self) -> list[RowResult]:
        """The rows that failed on arrival, else one engine step (an idle one while waiting for arrivals)
        and the rows it finished."""
        if self._arriving:
            self._admit_arrived(wait_for_one=not self._ready and not self.engine.has_unfinished())
        if self._ready:
            ready, self._ready = self._ready, []
            return ready
        engine, metrics = self.engine, self.metrics
        finished = engine.step()
        metrics.record_step(engine_step_sample(metrics, engine))
        metrics.engine = engine_snapshot(engine)
        metrics.forward_seconds = engine.runner.forward_seconds
        images = getattr(engine.runner, "images", None)  # (a vision-language model's image rows: its encoder's work)
        if images is not None and images.images_encoded:
            metrics.image_usage.update(encoded=images.images_encoded, encoded_tokens=images.image_tokens_encoded,
                                       prefix_cache_hit_tokens=engine.scheduler.stats.prefix_cache_hit_image_tokens)
        return [result for seq in finished for result in self._results(seq)]

    def stop_starting(self) -> None:
        self.engine.close_admission()

    def expire(self, message: str) -> list[RowResult]:
        """The rows that failed on arrival as they are, and every row in the engine as `expired` (the engine is not
        stepped again)."""
        results, self._ready = self._ready, []
        for row in self._arriving:  # (their reads finish on their own; nothing waits for them)
            results += expired_results(row.index, row.parsed.row_id, row.parsed.num_samples,
                                       [s for s in range(row.parsed.num_samples) if s not in row.done_samples],
                                       message, row.parsed.echo,
                                       self.spec.keep.pick(row.raw) if self.spec.keep is not None else {})
        self._arriving = []
        for index, row in sorted(self._rows.items()):
            samples = {sample for _, sample in row.left}  # (a row's several requests are one result)
            results += expired_results(index, row.parsed.row_id, row.parsed.num_samples, samples, message,
                                       row.parsed.echo, row.kept)
        self._rows.clear()
        self._image_rows.clear()
        return results

    def expire_unsubmitted(self, index: int, raw: dict[str, Any] | str, done_samples: frozenset[int],
                           message: str) -> list[RowResult]:
        return expire_unsent(self.spec, index, raw, done_samples, message)

    def _results(self, seq: Sequence) -> list[RowResult]:
        """The row's results `seq` finishing completes (none while its task waits for other parts; none for a part
        of a row that failed already)."""
        index, number = self._parts.pop(seq.seq_id, (seq.row_index, 0))
        row = self._rows.get(index)
        if row is None:
            return []  # another part failed first: the row is reported already
        out = self.engine.output_of(seq)
        part: Part = (number, out.sample_index)
        row.left.discard(part)
        if out.finish_reason == "error":
            del self._rows[index]
            results = [failed_result(index, row.parsed.row_id, ValueError(out.error or "failed"), row.parsed.echo,
                                     row.kept, len(out.prompt_token_ids))]
            results[0].image_digests = row.image_digests
        else:
            if not row.left:
                del self._rows[index]
            results = self.task.collect(self.engine, row, part, out)
        if index not in self._rows:
            self._image_rows.discard(index)
        for result in results:
            result.timing = self._timing(seq, row, result.prompt_tokens, result.completion_tokens) if result.ok else None
            if self.engine.config.loras and result.ok:
                self.metrics.count_adapter(seq.params.lora, result.prompt_tokens, result.completion_tokens, result.last)
            if self.cache is not None and result.last:
                self.cache.store(result)  # an ok row is stored; an error row only drops its key
        return results

    def _timing(self, seq: Sequence, row: PendingRow, prompt_tokens: int, output_tokens: int) -> RequestTiming:
        metrics = self.metrics
        step_time, first = metrics.step_time, seq.first_scheduled_step
        return RequestTiming(
            row_id=row.parsed.row_id, queued_s=row.queued_s,
            scheduled_s=max(row.queued_s, step_time(first - 1)) if first and first > 1 else row.queued_s,
            first_token_s=step_time(seq.first_token_step), finished_s=metrics.now(),
            queued_step=row.queued_step, first_scheduled_step=first, first_token_step=seq.first_token_step,
            finished_step=self.engine.scheduler.stats.steps,  # when the result left the engine
            prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        )


__all__ = ["Executor", "LocalExecutor", "expire_unsent", "expired_results", "failed_result"]
