"""`cbatch run`: stream rows in, run them through the engine, persist results as they finish, write OUTPUT.

Exit codes: 0 every row ok; 1 finished with error rows (0 with --allow-errors); 2 usage or input
error (nothing written); 130 / 143 interrupted by SIGINT / SIGTERM (finished rows kept for resume).
"""
from __future__ import annotations

import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.engine import Engine
from cbatch.engine.sequence import Sequence
from cbatch.io.reader import check_readable, count_rows, input_format, iter_rows
from cbatch.io.rows import RowError, RowRequest, parse_row, row_id_of
from cbatch.io.state import JobState, file_digest, records_in_order, settings_digest
from cbatch.io.writer import check_writable, output_format, write_output
from cbatch.observe.metrics import JobMetrics, RequestTiming, engine_step_sample
from cbatch.observe.report import build_report, summary_line, summary_table, write_report
from cbatch.observe.roofline import engine_hardware
from cbatch.tokenizer import encode_messages, encode_text

EXIT_OK, EXIT_ROW_ERRORS, EXIT_USAGE, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143


class JobError(ValueError):
    """A bad job (exit 2): the message is one line naming the file or flag and the fix."""


@dataclass(slots=True)
class JobOptions:
    input: Path
    output: Path
    engine: EngineConfig
    defaults: SamplingParams
    token_ids: bool = False
    overwrite: bool = False
    allow_errors: bool = False
    report: Path | None = None
    quiet: bool = False
    lookahead: int = 16384  # rows queued in the engine at once: longest-first sorts inside this window
    display: str = "auto"  # auto | dashboard | plain | none
    plot: Path | None = None  # --plot: report.png / .html


class _Interrupt:
    """SIGINT / SIGTERM: stop admitting, keep what finished, exit 130 / 143."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_Interrupt":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def validate_paths(options: JobOptions) -> None:
    """Checks input and output before any work; raises JobError."""
    try:
        check_readable(options.input)
        input_format(options.input)
        output_format(options.output)
        check_writable(options.output)
        if options.report is not None:
            check_writable(options.report)
    except ValueError as exc:
        raise JobError(str(exc)) from None


def fingerprint(options: JobOptions, engine: Engine) -> dict[str, str]:
    """What makes a partial run's rows valid for this run: the input bytes and the generation settings."""
    settings = {
        "model": str(engine.model_dir) if engine.model_dir else engine.spec.architecture,
        "dtype": str(engine.dtype),
        "max_model_len": engine.max_model_len,
        "seed": options.engine.seed,
        "defaults": asdict(options.defaults),
    }
    return {"input": file_digest(options.input), "settings": settings_digest(settings)}


class JobRunner:
    def __init__(self, options: JobOptions, engine: Engine, state: JobState, progress) -> None:
        self.options = options
        self.engine = engine
        self.state = state
        self.progress = progress
        self.metrics = JobMetrics()
        self.results: dict[int, dict[str, Any]] = {}
        self._rows: dict[int, tuple[RowRequest, float, int]] = {}  # seq_id -> (row, queued_s, queued_step)

    def run(self, done: dict[int, dict[str, Any]], interrupt: _Interrupt) -> int | None:
        """Runs every row not in `done`; returns an exit code if interrupted, else None."""
        self.results = dict(done)
        metrics = self.metrics
        metrics.total_rows = count_rows(self.options.input)
        metrics.skipped_rows = len(done)
        rows = iter_rows(self.options.input)
        exhausted = False
        engine = self.engine
        while True:
            if interrupt.signum is not None:
                return EXIT_SIGINT if interrupt.signum == signal.SIGINT else EXIT_SIGTERM
            while not exhausted and engine.scheduler.num_waiting < self.options.lookahead:
                item = next(rows, None)
                if item is None:
                    exhausted = True
                    break
                self._admit(*item)
            if not engine.has_unfinished():
                if exhausted:
                    return None
                continue
            finished = engine.step()
            metrics.record_step(engine_step_sample(metrics, engine))
            for seq in finished:
                self._record(seq)
            metrics.forward_seconds = engine.runner.forward_seconds
            self.progress.update(engine=engine)

    def _admit(self, index: int, raw: dict[str, Any] | str) -> None:
        if index in self.results:
            return
        try:
            request = parse_row(index, raw, self.options.defaults)
            prompt_ids = self._tokenize(request)
        except RowError as exc:
            self._record_error(index, row_id_of(index, raw), str(exc), 0)
            return
        seq = self.engine.add_request(prompt_ids, request.params, seq_id=index)
        self._rows[index] = (request, self.metrics.now(), self.engine.scheduler.stats.steps)
        if seq.is_finished:  # could never run (too long for the model or the KV pool)
            self._record(seq)

    def _tokenize(self, request: RowRequest) -> list[int]:
        tokenizer = self.engine.tokenizer
        if request.prompt_token_ids is not None:
            vocab = self.engine.spec.vocab_size
            if max(request.prompt_token_ids) >= vocab:
                raise RowError(f"`prompt_token_ids` has ids outside the vocabulary (size {vocab})")
            return request.prompt_token_ids
        if tokenizer is None:
            raise RowError("this model has no tokenizer; give `prompt_token_ids` instead of text")
        try:
            if request.messages is not None:
                return encode_messages(tokenizer, request.messages)
            return encode_text(tokenizer, request.prompt)
        except RowError:
            raise
        except Exception as exc:  # a chat template raising on odd roles, a tokenizer edge case
            raise RowError(f"could not tokenize the prompt ({type(exc).__name__}: {exc})") from None

    def _record_error(self, index: int, row_id: str, error: str, prompt_tokens: int) -> None:
        self._store({
            "index": index, "id": row_id, "completion": None, "finish_reason": "error",
            "prompt_tokens": prompt_tokens, "completion_tokens": 0, "error": error, "completion_token_ids": [],
        })

    def _record(self, seq: Sequence) -> None:
        request, queued_s, queued_step = self._rows.pop(seq.seq_id)
        out = self.engine.output_of(seq)
        if out.finish_reason == "error":
            self._record_error(seq.seq_id, request.row_id, out.error or "failed", len(out.prompt_token_ids))
            return
        metrics = self.metrics
        metrics.prompt_tokens += len(out.prompt_token_ids)
        metrics.output_tokens += len(out.token_ids)
        step_time = metrics.step_time
        metrics.requests.append(RequestTiming(
            row_id=request.row_id, queued_s=queued_s,
            scheduled_s=step_time(seq.first_scheduled_step - 1) if seq.first_scheduled_step and seq.first_scheduled_step > 1 else queued_s,
            first_token_s=step_time(seq.first_token_step), finished_s=metrics.now(),
            queued_step=queued_step, first_scheduled_step=seq.first_scheduled_step,
            first_token_step=seq.first_token_step, finished_step=seq.finish_step or queued_step,
            prompt_tokens=len(out.prompt_token_ids), output_tokens=len(out.token_ids),
        ))
        self._store({
            "index": seq.seq_id, "id": request.row_id, "completion": out.text, "finish_reason": out.finish_reason,
            "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids), "error": None,
            "completion_token_ids": out.token_ids,
        }, ok=True)

    def _store(self, record: dict[str, Any], ok: bool = False) -> None:
        if ok:
            self.metrics.ok_rows += 1
        else:
            self.metrics.error_rows += 1
            self._rows.pop(record["index"], None)
        self.results[record["index"]] = record
        self.state.append(record)


def run_job(options: JobOptions, make_engine=Engine.from_config, make_progress=None) -> int:
    """The whole `cbatch run`. Raises JobError for a bad job (exit 2)."""
    validate_paths(options)
    engine = make_engine(options.engine)
    state = JobState(options.output, fingerprint(options, engine))
    if not options.overwrite and state.is_complete():
        if not options.quiet:
            print(f"cbatch: {options.output} is already complete for this input and settings; nothing to do", file=sys.stderr)
        return EXIT_OK
    try:
        done = state.open(options.overwrite)
    except ValueError as exc:
        raise JobError(str(exc)) from None
    from cbatch.observe.progress import make_progress as default_progress

    job = JobRunner(options, engine, state, None)
    job.progress = (make_progress or default_progress)(job.metrics, options)
    with _Interrupt() as interrupt:
        try:
            code = job.run(done, interrupt)
        except BaseException:
            job.progress.close()
            state.close()
            raise
    job.progress.close()
    wall = job.metrics.now()
    report = build_report(
        job.metrics, engine.scheduler.stats, wall_seconds=wall, max_num_seqs=options.engine.max_num_seqs,
        num_kv_blocks=engine.pool.num_blocks, hardware=engine_hardware(engine, job.metrics.steps, job.metrics.forward_seconds),
        settings={"engine": asdict(options.engine), "defaults": asdict(options.defaults), "dtype": str(engine.dtype),
                  "device": str(engine.device), "input": str(options.input), "output": str(options.output)},
    )
    if options.report is not None:
        write_report(options.report, report)
    if options.plot is not None:
        from cbatch.observe.plot import plot_reports

        plot_reports([report], options.plot)
    if code is not None:
        state.close()
        print(
            f"cbatch: interrupted; {job.metrics.done_rows + len(done)} of {job.metrics.total_rows} rows are saved. "
            "Run the same command again to resume.",
            file=sys.stderr,
        )
        return code
    fmt = output_format(options.output)
    state.finish(
        lambda tmp: write_output(tmp, fmt, records_in_order(job.results), options.token_ids),
        {"rows": len(job.results), "errors": sum(1 for r in job.results.values() if r["finish_reason"] == "error")},
    )
    print(summary_line(report))
    if not options.quiet:
        from rich.console import Console

        Console().print(summary_table(report))
    errors = sum(1 for r in job.results.values() if r["finish_reason"] == "error")
    return EXIT_ROW_ERRORS if errors and not options.allow_errors else EXIT_OK
