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
from cbatch.io.reader import check_readable, count_rows, input_format, iter_rows
from cbatch.io.state import JobState, file_digest, records_in_order, settings_digest
from cbatch.io.writer import check_writable, output_format, write_output
from cbatch.observe.metrics import JobMetrics
from cbatch.observe.report import build_report, summary_line, write_report
from cbatch.rowrun import RowRunner, is_ok

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
        self.rows = RowRunner(engine, options.defaults, self.metrics)  # parse, tokenize, queue, record

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
            for record in self.rows.step():
                self._store(record, ok=is_ok(record))
            self.progress.update(engine=engine)

    def _admit(self, index: int, raw: dict[str, Any] | str) -> None:
        if index in self.results:
            return
        record = self.rows.admit(index, raw)
        if record is not None:
            self._store(record, ok=is_ok(record))

    def _store(self, record: dict[str, Any], ok: bool = False) -> None:
        if ok:
            self.metrics.ok_rows += 1
        else:
            self.metrics.error_rows += 1
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
        num_kv_blocks=engine.pool.num_blocks,
        settings={"engine": asdict(options.engine), "defaults": asdict(options.defaults), "dtype": str(engine.dtype),
                  "device": str(engine.device), "input": str(options.input), "output": str(options.output)},
    )
    if options.report is not None:
        write_report(options.report, report)
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
    errors = sum(1 for r in job.results.values() if r["finish_reason"] == "error")
    return EXIT_ROW_ERRORS if errors and not options.allow_errors else EXIT_OK
