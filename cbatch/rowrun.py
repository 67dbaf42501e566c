"""One row's life inside one engine: parse -> tokenize -> queue -> step -> output record.

Shared by the local driver (`cbatch/job.py`) and the Ray replicas (`cbatch/scaleout/`), so a row
gets exactly the same validation, tokenization, seed (its input index is its seq_id) and output
record wherever it runs. Records are the dicts the crash-safe state and the writer take.
"""
from __future__ import annotations

from typing import Any

from cbatch.config import SamplingParams
from cbatch.engine.engine import Engine, RequestOutput
from cbatch.engine.sequence import Sequence
from cbatch.io.rows import RowError, RowRequest, parse_row, row_id_of
from cbatch.observe.metrics import JobMetrics, RequestTiming, engine_step_sample
from cbatch.tokenizer import encode_messages, encode_text

Record = dict[str, Any]


def tokenize_request(engine: Engine, request: RowRequest) -> list[int]:
    """The prompt's token ids; raises RowError naming what is wrong."""
    tokenizer = engine.tokenizer
    if request.prompt_token_ids is not None:
        ids = request.prompt_token_ids
    elif tokenizer is None:
        raise RowError("this model has no tokenizer; give `prompt_token_ids` instead of text")
    else:
        try:
            if request.messages is not None:
                ids = encode_messages(tokenizer, request.messages)
            else:
                ids = encode_text(tokenizer, request.prompt)
        except Exception as exc:  # a chat template raising on odd roles, a tokenizer edge case
            raise RowError(f"could not tokenize the prompt ({type(exc).__name__}: {exc})") from None
    vocab = engine.spec.vocab_size
    outside = next((t for t in ids if t >= vocab), None)
    if outside is not None:
        raise RowError(f"the prompt has token id {outside}, outside the model's vocabulary (ids 0..{vocab - 1})")
    return ids


def _writable(text: str | None) -> str | None:
    """JSON input may carry lone surrogates, which UTF-8 output cannot hold: replace them."""
    return text.encode("utf-8", "replace").decode("utf-8") if isinstance(text, str) else text


def error_record(index: int, row_id: str, error: str, prompt_tokens: int) -> Record:
    return {
        "index": index, "id": _writable(row_id), "completion": None, "finish_reason": "error",
        "prompt_tokens": prompt_tokens, "completion_tokens": 0, "error": _writable(error), "completion_token_ids": [],
    }


def result_record(index: int, row_id: str, out: RequestOutput) -> Record:
    return {
        "index": index, "id": _writable(row_id), "completion": _writable(out.text), "finish_reason": out.finish_reason,
        "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids), "error": None,
        "completion_token_ids": out.token_ids,
    }


def is_ok(record: Record) -> bool:
    return record["finish_reason"] != "error"


class RowRunner:
    """Feeds raw rows into one engine and turns its finished sequences into records.

    Counts tokens and per-request timings into `metrics`; ok/error row counts are the caller's
    (it decides which records are new, e.g. on resume or after a retried block).
    """

    def __init__(self, engine: Engine, defaults: SamplingParams, metrics: JobMetrics) -> None:
        self.engine = engine
        self.defaults = defaults
        self.metrics = metrics
        self._rows: dict[int, tuple[RowRequest, float, int]] = {}  # seq_id -> (row, queued_s, queued_step)

    def is_pending(self, index: int) -> bool:
        """The row is queued or running in the engine."""
        return index in self._rows

    def admit(self, index: int, raw: dict[str, Any] | str) -> Record | None:
        """Queues the row; returns its record at once if it can never run (bad row, too long), else None."""
        try:
            request = parse_row(index, raw, self.defaults)
            prompt_ids = tokenize_request(self.engine, request)
            seq = self.engine.add_request(prompt_ids, request.params, seq_id=index)
        except Exception as exc:  # RowError, or a tokenizer / engine check on this row alone: never the job
            message = str(exc) if isinstance(exc, ValueError) else f"could not prepare this row ({type(exc).__name__}: {exc})"
            return error_record(index, row_id_of(index, raw), message, 0)
        self._rows[index] = (request, self.metrics.now(), self.engine.scheduler.stats.steps)
        if seq.is_finished:  # could never run (too long for the model or the KV pool)
            return self.record(seq)
        return None

    def step(self) -> list[Record]:
        """One engine step, recorded in the metrics; the records of the rows that finished."""
        engine, metrics = self.engine, self.metrics
        finished = engine.step()
        metrics.record_step(engine_step_sample(metrics, engine))
        metrics.forward_seconds = engine.runner.forward_seconds
        return [self.record(seq) for seq in finished]

    def record(self, seq: Sequence) -> Record:
        request, queued_s, queued_step = self._rows.pop(seq.seq_id)
        out = self.engine.output_of(seq)
        if out.finish_reason == "error":
            return error_record(seq.seq_id, request.row_id, out.error or "failed", len(out.prompt_token_ids))
        metrics = self.metrics
        metrics.prompt_tokens += len(out.prompt_token_ids)
        metrics.output_tokens += len(out.token_ids)
        step_time = metrics.step_time
        metrics.add_timing(RequestTiming(
            row_id=request.row_id, queued_s=queued_s,
            scheduled_s=step_time(seq.first_scheduled_step - 1) if seq.first_scheduled_step and seq.first_scheduled_step > 1 else queued_s,
            first_token_s=step_time(seq.first_token_step), finished_s=metrics.now(),
            queued_step=queued_step, first_scheduled_step=seq.first_scheduled_step,
            first_token_step=seq.first_token_step, finished_step=seq.finish_step or queued_step,
            prompt_tokens=len(out.prompt_token_ids), output_tokens=len(out.token_ids),
        ))
        return result_record(seq.seq_id, request.row_id, out)
