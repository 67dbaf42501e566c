"""Executors turn rows into results. `LocalExecutor`: rows through one engine (a model or the simulator).

A row's life: parse (validation, sampling settings) -> tokenize (chat template) -> queue in the engine
-> steps -> a `RowResult` (one per sample of a row with n > 1). The same code serves `cbatch run`, each
Ray replica and `cbatch bench`, so a row gets exactly the same validation, tokenization, seed (its input
index is its seq_id) and result wherever it runs. A row that fails before it runs is one error row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol

from cbatch.config import SamplingParams
from cbatch.engine.engine import Engine, RequestOutput
from cbatch.io.outcomes import EXPIRED
from cbatch.engine.sequence import Sequence
from cbatch.io.columns import KeepColumns
from cbatch.io.reader import RawRow
from cbatch.io.rows import RowError, RowRequest, parse_row, row_id_of, with_lora
from cbatch.observe.metrics import JobMetrics, RequestTiming, engine_snapshot, engine_step_sample
from cbatch.run.result_cache import RowCache
from cbatch.run.results import RowResult
from cbatch.tokenizer import encode_messages, encode_text, split_reasoning, template_thinks


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


def tokenize_request(engine: Engine, request: RowRequest) -> list[int]:
    """The prompt's token ids (`Engine.add_request` keeps the last `truncate_prompt_tokens` of them); raises
    RowError naming what is wrong."""
    tokenizer = engine.tokenizer
    if request.prompt_token_ids is not None:
        ids = request.prompt_token_ids
    elif tokenizer is None:
        raise RowError("this model has no tokenizer; give `prompt_token_ids` instead of text")
    else:
        try:
            if request.messages is not None:
                ids = encode_messages(tokenizer, request.messages, request.params.chat_template_kwargs)
            else:
                ids = encode_text(tokenizer, request.prompt)
        except Exception as exc:  # a chat template raising on odd roles, a tokenizer edge case
            raise RowError(f"could not tokenize the prompt ({type(exc).__name__}: {exc})") from None
    vocab = engine.spec.vocab_size if engine.spec is not None else None
    outside = next((t for t in ids if t >= vocab), None) if vocab else None
    if outside is not None:
        raise RowError(f"the prompt has token id {outside}, outside the model's vocabulary (ids 0..{vocab - 1})")
    return ids


@dataclass(slots=True)
class _PendingRow:
    row_id: str
    queued_s: float
    queued_step: int
    left: set[int]  # the sample indices of this run not finished yet
    num_samples: int  # the row's n
    echo: dict[str, Any]  # request fields an OpenAI output line repeats (io/openai.py)
    kept: dict[str, Any]  # --keep-columns: input columns carried to the output


class LocalExecutor:
    """Rows through one engine. `lookahead` bounds the rows waiting in the engine (longest-first orders
    within that window); each `poll` is one engine step, recorded in `metrics`. With a result `cache`, a
    row found there is copied (it never reaches the engine) and every finished row is stored in it.
    `reasoning_split`: with a model whose chat template thinks, the thinking goes to a `reasoning` column
    (docs/sampling.md)."""

    def __init__(self, engine: Engine, defaults: SamplingParams, metrics: JobMetrics, lookahead: int = 16384,
                 cache: RowCache | None = None, reasoning_split: bool = True, keep: KeepColumns | None = None) -> None:
        self.engine = engine
        self.defaults = defaults
        self.metrics = metrics
        self.lookahead = lookahead
        self.cache = cache
        self.split_reasoning = reasoning_split and template_thinks(engine.tokenizer)
        self.keep = keep  # --keep-columns
        self._rows: dict[int, _PendingRow] = {}  # row index (the parent's seq_id) -> the row in the engine
        self._ready: list[RowResult] = []  # rows that failed before reaching the engine

    def wants_rows(self) -> bool:
        return self.engine.scheduler.num_waiting < self.lookahead

    def is_pending(self, index: int) -> bool:
        """The row is queued or running in the engine."""
        return index in self._rows

    def submit(self, index: int, raw: dict[str, Any] | str, done_samples: frozenset[int] = frozenset()) -> None:
        """Queues the row (its samples not in `done_samples`); anything wrong with this row alone (its fields,
        its tokenization, its size) makes it an error result and never stops the job."""
        kept = self.keep.pick(raw) if self.keep is not None else {}
        echo: dict[str, Any] = {}
        try:
            request = parse_row(index, raw, self.defaults)
            echo = request.echo
            if request.params.lora is None and echo.get("model") in self.engine.lora_names:
                request.params = with_lora(request.params, echo["model"])  # OpenAI lines: `model` names the adapter
            prompt_ids = tokenize_request(self.engine, request)
            hit = self.cache.lookup(index, request.row_id, prompt_ids, request.params) if self.cache else None
            if hit is None:
                samples = [i for i in range(request.params.n) if i not in done_samples]
                seq = self.engine.add_request(prompt_ids, request.params, seq_id=index, samples=samples)
        except Exception as exc:  # RowError, or a tokenizer / engine check on this row alone: never the job
            message = str(exc) if isinstance(exc, ValueError) else f"could not prepare this row ({type(exc).__name__}: {exc})"
            failed = RowResult.failed(index, row_id_of(index, raw), message)
            failed.echo, failed.kept = echo, kept
            self._ready.append(failed)
            return
        if hit is not None:
            hit.echo, hit.kept = echo, kept
            self._ready.append(hit)
            return
        self._rows[index] = _PendingRow(request.row_id, self.metrics.now(), self.engine.scheduler.stats.steps,
                                        set(samples), request.params.n, echo, kept)
        self.metrics.submitted_rows += 1
        self.metrics.submitted_max_tokens += request.params.max_tokens * len(samples)
        if seq.is_finished:  # could never run (too long for the model or the KV pool)
            self._ready.append(self._result(seq))

    def end_of_input(self) -> None:
        pass

    def busy(self) -> bool:
        return bool(self._ready) or self.engine.has_unfinished()

    def poll(self) -> list[RowResult]:
        """The rows that failed on arrival, else one engine step (an idle one while waiting for arrivals)
        and the rows it finished."""
        if self._ready:
            ready, self._ready = self._ready, []
            return ready
        engine, metrics = self.engine, self.metrics
        finished = engine.step()
        metrics.record_step(engine_step_sample(metrics, engine))
        metrics.engine = engine_snapshot(engine)
        metrics.forward_seconds = engine.runner.forward_seconds
        return [self._result(seq) for seq in finished]

    def stop_starting(self) -> None:
        self.engine.close_admission()

    def expire(self, message: str) -> list[RowResult]:
        """The rows that failed on arrival as they are, and every row in the engine as `expired` (the engine is not
        stepped again)."""
        results, self._ready = self._ready, []
        for index, row in sorted(self._rows.items()):
            results += expired_results(index, row.row_id, row.num_samples, row.left, message, row.echo, row.kept)
        self._rows.clear()
        return results

    def expire_unsubmitted(self, index: int, raw: dict[str, Any] | str, done_samples: frozenset[int],
                           message: str) -> list[RowResult]:
        """A row the deadline kept from starting: its missing samples `expired` (a row that is bad in itself is
        reported as such, as when it runs)."""
        kept = self.keep.pick(raw) if self.keep is not None else {}
        try:
            request = parse_row(index, raw, self.defaults)
        except RowError as exc:
            failed = RowResult.failed(index, row_id_of(index, raw), str(exc))
            failed.kept = kept
            return [failed]
        left = [i for i in range(request.params.n) if i not in done_samples]
        return expired_results(index, request.row_id, request.params.n, left, message, request.echo, kept)

    def _result(self, seq: Sequence) -> RowResult:
        result = self._engine_result(seq)
        if self.cache is not None and result.last:
            self.cache.store(result)  # an ok row is stored; an error row only drops its key
        return result

    def _engine_result(self, seq: Sequence) -> RowResult:
        """The result of one finished sample (or of the whole row, when it failed)."""
        row = self._rows[seq.row_index]
        out = self.engine.output_of(seq)
        row.left.discard(out.sample_index)
        failed = out.finish_reason == "error"
        if failed or not row.left:
            del self._rows[seq.row_index]
        if failed:
            result = RowResult.failed(seq.row_index, row.row_id, out.error or "failed", len(out.prompt_token_ids))
            result.echo, result.kept = row.echo, row.kept
            return result
        metrics = self.metrics
        step_time, first = metrics.step_time, seq.first_scheduled_step
        timing = RequestTiming(
            row_id=row.row_id, queued_s=row.queued_s,
            scheduled_s=max(row.queued_s, step_time(first - 1)) if first and first > 1 else row.queued_s,
            first_token_s=step_time(seq.first_token_step), finished_s=metrics.now(),
            queued_step=row.queued_step, first_scheduled_step=first, first_token_step=seq.first_token_step,
            finished_step=self.engine.scheduler.stats.steps,  # when the result left the engine
            prompt_tokens=len(out.prompt_token_ids), output_tokens=len(out.token_ids),
        )
        completion, columns = self._columns(out)
        if self.engine.config.loras:
            metrics.count_adapter(seq.params.lora, len(out.prompt_token_ids), len(out.token_ids), not row.left)
        return RowResult(
            seq.row_index, row.row_id, out.finish_reason, completion=completion, prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(out.token_ids), completion_token_ids=out.token_ids, timing=timing,
            sample_index=out.sample_index, num_samples=seq.params.n, last=not row.left, columns=columns,
            echo=row.echo, kept=row.kept,
        )

    def _columns(self, out: RequestOutput) -> tuple[str | None, dict[str, Any]]:
        """The completion text (the answer, when the reasoning is split off) and the sample's optional
        output columns: reasoning, log-probabilities (cbatch/io/writer.py)."""
        completion, columns = out.text, {}
        if self.split_reasoning and completion is not None:
            columns["reasoning"], completion = split_reasoning(completion)
        if out.logprobs is not None:
            columns.update(token_logprobs=out.logprobs.token, top_logprobs=out.logprobs.top())
        if out.prompt_logprobs is not None:
            lp = out.prompt_logprobs
            columns.update(prompt_token_ids=out.prompt_token_ids, prompt_token_logprobs=[None, *lp.token],
                           prompt_top_logprobs=[None, *lp.top()])
        return completion, columns


__all__ = ["Executor", "LocalExecutor", "RawRow", "tokenize_request"]
