"""Executors turn rows into results. `LocalExecutor`: rows through one engine (a model or the simulator).

A row's life: parse (validation, sampling settings) -> tokenize (chat template) -> queue in the engine
-> steps -> a `RowResult` (one per sample of a row with n > 1). The same code serves `cbatch run`, each
Ray replica and `cbatch bench`, so a row gets exactly the same validation, tokenization, seed (its input
index is its seq_id) and result wherever it runs. A row that fails before it runs is one error row.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Protocol

from cbatch.config import SamplingParams
from cbatch.engine.engine import Engine, RequestOutput
from cbatch.engine.pooling import PoolingParams, cosine, task_columns
from cbatch.io.outcomes import EXPIRED
from cbatch.engine.sequence import Sequence
from cbatch.io.columns import KeepColumns
from cbatch.io.pooling_rows import PoolingRow, parse_pooling_row
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
    if (error := engine.vocabulary_error("the prompt", ids)) is not None:
        raise RowError(error)
    return ids


@dataclass(slots=True)
class Prepared:
    """A row ready for the engine."""

    request: RowRequest
    prompt_ids: list[int]
    echo: dict[str, Any]  # request fields an OpenAI output line repeats (io/openai.py)
    kept: dict[str, Any]  # --keep-columns: input columns carried to the output


@dataclass(slots=True)
class _PendingRow:
    row_id: str
    queued_s: float
    queued_step: int
    left: set[int]  # the sample indices of this run not finished yet
    num_samples: int  # the row's n
    echo: dict[str, Any]  # request fields an OpenAI output line repeats (io/openai.py)
    kept: dict[str, Any]  # --keep-columns: input columns carried to the output
    vectors: dict[int, list[float]] = field(default_factory=dict)  # a bi-encoder score row: each half's embedding
    prompt_tokens: int = 0  # a bi-encoder score row: both halves'


class LocalExecutor:
    """Rows through one engine. `lookahead` bounds the rows waiting in the engine (longest-first orders
    within that window); each `poll` is one engine step, recorded in `metrics`. With a result `cache`, a
    row found there is copied (it never reaches the engine) and every finished row is stored in it.
    `reasoning_split`: with a model whose chat template thinks, the thinking goes to a `reasoning` column
    (docs/sampling.md)."""

    def __init__(self, engine: Engine, defaults: SamplingParams, metrics: JobMetrics, lookahead: int = 16384,
                 cache: RowCache | None = None, reasoning_split: bool = True, keep: KeepColumns | None = None,
                 pooling: PoolingParams | None = None) -> None:
        self.engine = engine
        self.defaults = defaults
        self.metrics = metrics
        self.lookahead = lookahead
        self.cache = cache
        self.split_reasoning = reasoning_split and template_thinks(engine.tokenizer)
        self.keep = keep  # --keep-columns
        self._rows: dict[int, _PendingRow] = {}  # row index (the parent's seq_id) -> the row in the engine
        self._ready: list[RowResult] = []  # rows that failed before reaching the engine
        self.pooling = pooling  # a prefill-only job (--task embed | score | classify | reward): its settings
        self._halves: dict[int, int] = {}  # a bi-encoder score row's second text: its seq_id -> the row index

    def wants_rows(self) -> bool:
        return self.engine.scheduler.num_waiting < self.lookahead

    def is_pending(self, index: int) -> bool:
        """The row is queued or running in the engine."""
        return index in self._rows

    def prepare(self, index: int, raw: dict[str, Any] | str) -> "Prepared | RowResult":
        """A generation row parsed and tokenized, or its result already: an error row (anything wrong with this row
        alone: its fields, its tokenization) or a result-cache hit. `submit` queues what this prepares; `cbatch plan`
        checks every row with it. (A prefill-only job's rows go through `_submit_pooling`.)"""
        kept = self.keep.pick(raw) if self.keep is not None else {}
        echo: dict[str, Any] = {}
        try:
            request = parse_row(index, raw, self.defaults)
            echo = request.echo
            if request.params.lora is None and echo.get("model") in self.engine.lora_names:
                request.params = with_lora(request.params, echo["model"])  # OpenAI lines: `model` names the adapter
            prompt_ids = tokenize_request(self.engine, request)
            hit = self.cache.lookup(index, request.row_id, prompt_ids, request.params) if self.cache else None
        except Exception as exc:  # RowError, or a tokenizer check on this row alone: never the job
            return self._failed(index, raw, exc, echo, kept)
        if hit is not None:
            hit.echo, hit.kept = echo, kept
            return hit
        return Prepared(request, prompt_ids, echo, kept)

    def _failed(self, index: int, raw: dict[str, Any] | str, exc: Exception, echo: dict[str, Any],
                kept: dict[str, Any]) -> RowResult:
        message = str(exc) if isinstance(exc, ValueError) else f"could not prepare this row ({type(exc).__name__}: {exc})"
        failed = RowResult.failed(index, row_id_of(index, raw), message)
        failed.echo, failed.kept = echo, kept
        return failed

    def submit(self, index: int, raw: dict[str, Any] | str, done_samples: frozenset[int] = frozenset()) -> None:
        """Queues the row (its samples not in `done_samples`); anything wrong with this row alone (its fields,
        its tokenization, its size) makes it an error result and never stops the job."""
        if self.pooling is not None:
            kept = self.keep.pick(raw) if self.keep is not None else {}
            try:
                self._submit_pooling(index, raw, kept)
            except Exception as exc:  # RowError, or a tokenizer / engine check on this row alone: never the job
                self._ready.append(self._failed(index, raw, exc, {}, kept))
            return
        prepared = self.prepare(index, raw)
        if isinstance(prepared, RowResult):
            self._ready.append(prepared)
            return
        request = prepared.request
        samples = [i for i in range(request.params.n) if i not in done_samples]
        try:
            seq = self.engine.add_request(prepared.prompt_ids, request.params, seq_id=index, samples=samples)
        except Exception as exc:  # an engine check on this row alone: never the job
            self._ready.append(self._failed(index, raw, exc, prepared.echo, prepared.kept))
            return
        self._rows[index] = _PendingRow(request.row_id, self.metrics.now(), self.engine.scheduler.stats.steps,
                                        set(samples), request.params.n, prepared.echo, prepared.kept)
        self.metrics.submitted_rows += 1
        self.metrics.submitted_max_tokens += request.params.max_tokens * len(samples)
        if seq.is_finished:  # could never run (too long for the model or the KV pool)
            self._ready.append(self._result(seq))

    def _submit_pooling(self, index: int, raw: dict[str, Any] | str, kept: dict[str, Any]) -> None:
        """`submit` for a prefill-only job's row: one request (a text, or a cross-encoder's pair), or two for a
        bi-encoder's score (each text embedded; the row's score is their cosine). Raises for a bad row."""
        request = parse_pooling_row(index, raw, self.pooling.task)
        pooling = self.pooling if request.dimensions is None else replace(self.pooling, dimensions=request.dimensions)
        if pooling.dimensions is not None and self.engine.spec is not None and pooling.dimensions > self.engine.spec.hidden_size:
            raise RowError(f"body.dimensions must be at most the model's {self.engine.spec.hidden_size}, got {pooling.dimensions}")
        bi_encoder = request.pair is not None and not pooling.head
        prompts = ([self._pooling_ids(request, text) for text in request.pair] if bi_encoder
                   else [self._pooling_ids(request, None)])
        # the cache key: the prompt ids (both halves), and a row's own `dimensions` as a negative id
        key_ids = [t for ids in prompts for t in [*ids, -1]] + ([-1 - request.dimensions] if request.dimensions else [])
        hit = self.cache.lookup(index, request.row_id, key_ids, self.defaults) if self.cache else None
        if hit is not None:
            hit.echo, hit.kept = request.echo, kept
            self._ready.append(hit)
            return
        self._rows[index] = _PendingRow(request.row_id, self.metrics.now(), self.engine.scheduler.stats.steps,
                                        set(range(len(prompts))), 1, request.echo, kept)
        self.metrics.submitted_rows += 1
        seqs = [self.engine.add_request(prompts[0], self.defaults, seq_id=index, pooling=pooling)]
        if bi_encoder:
            second = self.engine.extra_seq_id()  # (negative: never a row's)
            self._halves[second] = index
            seqs.append(self.engine.add_request(prompts[1], self.defaults, seq_id=second, pooling=pooling))
        for seq in seqs:
            if seq.is_finished:  # could never run (too long for the model or the KV pool)
                result = self._result(seq)
                if result is not None:
                    self._ready.append(result)

    def _pooling_ids(self, request: PoolingRow, text: str | None) -> list[int]:
        """A prefill-only request's token ids: its own, its text's or (`text` None with a pair: a cross-encoder)
        its pair's, tokenized as HF and sentence-transformers do (the tokenizer's special tokens added)."""
        tokenizer = self.engine.tokenizer
        if request.token_ids is not None:
            ids = request.token_ids
        elif tokenizer is None:
            raise RowError("this model has no tokenizer; give `prompt_token_ids` instead of text")
        elif request.messages is not None:
            try:
                ids = encode_messages(tokenizer, request.messages, generation_prompt=False)
            except Exception as exc:  # no chat template, a template raising on odd roles
                raise RowError(f"could not render `messages` ({type(exc).__name__}: {exc})") from None
        elif text is not None or request.pair is None:
            ids = list(tokenizer.encode(text if text is not None else request.text))
        else:
            ids = list(tokenizer.encode(*request.pair))
        if (error := self.engine.vocabulary_error("the input", ids)) is not None:
            raise RowError(error)
        return ids

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
        return [result for seq in finished if (result := self._result(seq)) is not None]

    def stop_starting(self) -> None:
        self.engine.close_admission()

    def expire(self, message: str) -> list[RowResult]:
        """The rows that failed on arrival as they are, and every row in the engine as `expired` (the engine is not
        stepped again)."""
        results, self._ready = self._ready, []
        for index, row in sorted(self._rows.items()):
            left = row.left if self.pooling is None else {0}  # (a bi-encoder row's two halves are one result)
            results += expired_results(index, row.row_id, row.num_samples, left, message, row.echo, row.kept)
        self._rows.clear()
        return results

    def expire_unsubmitted(self, index: int, raw: dict[str, Any] | str, done_samples: frozenset[int],
                           message: str) -> list[RowResult]:
        """A row the deadline kept from starting: its missing samples `expired` (a row that is bad in itself is
        reported as such, as when it runs)."""
        kept = self.keep.pick(raw) if self.keep is not None else {}
        try:
            if self.pooling is not None:
                request = parse_pooling_row(index, raw, self.pooling.task)
                return expired_results(index, request.row_id, 1, [0], message, request.echo, kept)
            request = parse_row(index, raw, self.defaults)
        except RowError as exc:
            failed = RowResult.failed(index, row_id_of(index, raw), str(exc))
            failed.kept = kept
            return [failed]
        left = [i for i in range(request.params.n) if i not in done_samples]
        return expired_results(index, request.row_id, request.params.n, left, message, request.echo, kept)

    def _result(self, seq: Sequence) -> RowResult | None:
        """The row's result once `seq` finished it (None: a bi-encoder row waiting for its other half, or the
        half of a row that already failed)."""
        result = self._engine_result(seq) if self.pooling is None else self._pooling_result(seq)
        if result is None:
            return None
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
        timing = self._timing(seq, row, len(out.prompt_token_ids), len(out.token_ids))
        completion, columns = self._columns(out)
        if self.engine.config.loras:
            self.metrics.count_adapter(seq.params.lora, len(out.prompt_token_ids), len(out.token_ids), not row.left)
        return RowResult(
            seq.row_index, row.row_id, out.finish_reason, completion=completion, prompt_tokens=len(out.prompt_token_ids),
            completion_tokens=len(out.token_ids), completion_token_ids=out.token_ids, timing=timing,
            sample_index=out.sample_index, num_samples=seq.params.n, last=not row.left, columns=columns,
            echo=row.echo, kept=row.kept,
        )

    def _timing(self, seq: Sequence, row: _PendingRow, prompt_tokens: int, output_tokens: int) -> RequestTiming:
        metrics = self.metrics
        step_time, first = metrics.step_time, seq.first_scheduled_step
        return RequestTiming(
            row_id=row.row_id, queued_s=row.queued_s,
            scheduled_s=max(row.queued_s, step_time(first - 1)) if first and first > 1 else row.queued_s,
            first_token_s=step_time(seq.first_token_step), finished_s=metrics.now(),
            queued_step=row.queued_step, first_scheduled_step=first, first_token_step=seq.first_token_step,
            finished_step=self.engine.scheduler.stats.steps,  # when the result left the engine
            prompt_tokens=prompt_tokens, output_tokens=output_tokens,
        )

    def _pooling_result(self, seq: Sequence) -> RowResult | None:
        """A prefill-only row's result once its request (both, for a bi-encoder's score) finished: the task's
        columns (engine/pooling.py `task_columns`); an error row as soon as one of them failed."""
        half = 1 if seq.seq_id in self._halves else 0
        index = self._halves.pop(seq.seq_id, seq.row_index)
        row = self._rows.get(index)
        if row is None:
            return None  # the other half failed first: the row is reported already
        out = self.engine.output_of(seq)
        row.prompt_tokens += len(out.prompt_token_ids)
        if out.finish_reason == "error":
            del self._rows[index]
            result = RowResult.failed(index, row.row_id, out.error or "failed", len(out.prompt_token_ids))
            result.echo, result.kept = row.echo, row.kept
            return result
        row.vectors[half] = out.pooled
        row.left.discard(half)
        if row.left:
            return None
        del self._rows[index]
        task = self.pooling.task
        if None in row.vectors.values():
            columns = {}  # a simulated engine (`cbatch plan`) computes no vectors
        elif len(row.vectors) == 2:
            columns = {"score": cosine(row.vectors[0], row.vectors[1])}
        else:
            columns = task_columns(task, row.vectors[0], self.engine.spec.labels if self.engine.spec else ())
        return RowResult(index, row.row_id, "stop", prompt_tokens=row.prompt_tokens,
                         timing=self._timing(seq, row, row.prompt_tokens, 0), columns=columns, echo=row.echo,
                         kept=row.kept)

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
