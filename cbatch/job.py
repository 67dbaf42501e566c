"""`cbatch run`: stream rows in, run them through the engine, persist results as they finish, write OUTPUT.

Exit codes: 0 every row ok; 1 finished with error rows (0 with --allow-errors); 2 usage or input
error (nothing written); 130 / 143 interrupted by SIGINT / SIGTERM (finished rows kept for resume).
"""
from __future__ import annotations

import signal
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cbatch.config import ConfigError, EngineConfig, SamplingParams
from cbatch.engine.engine import Engine, resolve_device
from cbatch.io.reader import inspect_input, iter_rows
from cbatch.io.state import JobState, StateError, file_digest, settings_digest
from cbatch.io.writer import check_writable, output_format, write_output
from cbatch.model.default_model import default_model_dir
from cbatch.model.loader import ModelLoadError, read_checkpoint, resolve_dtype, resolve_model_dir
from cbatch.model.spec import UnsupportedModelError
from cbatch.observe.metrics import JobMetrics
from cbatch.observe.report import build_report, summary_line, summary_table, write_report
from cbatch.observe.roofline import engine_hardware
from cbatch.rowrun import RowRunner, is_ok

EXIT_OK, EXIT_ROW_ERRORS, EXIT_USAGE, EXIT_SIGINT, EXIT_SIGTERM = 0, 1, 2, 130, 143
EXIT_INTERNAL = 70  # sysexits' EX_SOFTWARE: a bug in cbatch, not in the input or the flags


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
    progress_interval: float = 10.0  # seconds between plain progress lines (logs, cron)
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


def validate_paths(options: JobOptions) -> int:
    """Checks input and output before any work (raises JobError); returns the number of input rows."""
    try:
        output_format(options.output)
        check_writable(options.output)
        if options.report is not None:
            check_writable(options.report, flag="--report")
        if options.input.exists() and options.output.exists() and options.input.samefile(options.output):
            raise JobError(f"--out {options.output} is the input file; choose another --out")
        return inspect_input(options.input)
    except ValueError as exc:
        raise JobError(str(exc)) from None


def resolve_job(options: JobOptions) -> tuple[dict[str, str], EngineConfig]:
    """The job's fingerprint and its engine config with the model folder resolved, without loading weights.

    The fingerprint is what makes a partial run's rows valid for this run: the input bytes, and every
    setting that changes a completion (model, dtype, device, seed, sampling defaults). Batch shape
    settings (--max-num-seqs, --policy, ...) are left out: completions do not depend on them.
    """
    config = options.engine
    model_dir = resolve_model_dir(config.model) if config.model else default_model_dir()
    checkpoint = read_checkpoint_or_fail(model_dir)
    device = resolve_device(config.device)
    settings = {
        "model": str(model_dir.resolve()),
        "model_config": checkpoint.raw_config,
        "weights": sorted((p.name, p.stat().st_size) for p in model_dir.glob("*.safetensors")),
        "device": device.type,
        "dtype": str(resolve_dtype(config.dtype, checkpoint.spec, device)),
        "attention_backend": config.attention_backend,
        "max_model_len": config.max_model_len,
        "seed": config.seed,
        "defaults": asdict(options.defaults),
    }
    fingerprint = {"input": file_digest(options.input), "settings": settings_digest(settings)}
    return fingerprint, replace(config, model=str(model_dir))


def read_checkpoint_or_fail(model_dir: Path):
    """The checkpoint's config (no weights); a bad folder is a JobError whose message names it."""
    try:
        return read_checkpoint(model_dir)
    except (ModelLoadError, UnsupportedModelError) as exc:
        message = str(exc)
        raise JobError(message if str(model_dir) in message else f"--model {model_dir}: {message}") from None
    except (OSError, ValueError) as exc:  # e.g. a damaged generation_config.json
        raise JobError(f"--model {model_dir}: cannot read the checkpoint ({exc}); it looks damaged") from None


class JobRunner:
    def __init__(self, options: JobOptions, engine: Engine, state: JobState, total_rows: int) -> None:
        self.options = options
        self.engine = engine
        self.state = state
        self.progress = None
        self.metrics = JobMetrics(total_rows=total_rows)
        self._done: set[int] = set()
        self.rows = RowRunner(engine, options.defaults, self.metrics)  # parse, tokenize, queue, record

    def run(self, done: set[int], interrupt: _Interrupt) -> int | None:
        """Runs every row not in `done`; returns an exit code if interrupted, else None.

        Rows are pulled from the reader only while fewer than `lookahead` wait in the engine, so a
        huge input is never held whole: memory is bounded by lookahead + running rows.
        """
        self._done = done
        metrics = self.metrics
        metrics.skipped_rows = len(done)
        rows = iter_rows(self.options.input)
        exhausted = False
        engine = self.engine
        while True:
            if interrupt.signum is not None:
                return EXIT_SIGINT if interrupt.signum == signal.SIGINT else EXIT_SIGTERM
            while not exhausted and engine.scheduler.num_waiting < self.options.lookahead and interrupt.signum is None:
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
        """Queues one row; anything wrong with this row alone (its fields, its tokenization, its size)
        makes it an error row and never stops the job."""
        if index in self._done:
            return
        record = self.rows.admit(index, raw)
        if record is not None:
            self._store(record, ok=is_ok(record))

    def _store(self, record: dict[str, Any], ok: bool = False) -> None:
        if ok:
            self.metrics.ok_rows += 1
        else:
            self.metrics.error_rows += 1
        self.state.append(record)


def write_report_and_plot(options: JobOptions, report: dict[str, Any]) -> None:
    if options.report is not None:
        write_report(options.report, report)
    if options.plot is not None:
        from cbatch.observe.plot import plot_reports

        plot_reports([report], options.plot)


def preflight(options: JobOptions) -> tuple[int, EngineConfig, JobState] | None:
    """Every check that can refuse a job (paths, input, model config, lock, resume state), before any
    model loads or anything is written: (total rows, resolved engine config, job state), or None when
    OUTPUT is already complete for this input and these settings. Raises JobError."""
    total_rows = validate_paths(options)
    fingerprint, config = resolve_job(options)
    state = JobState(options.output, fingerprint)
    if not options.overwrite and state.is_complete():
        if not options.quiet:
            print(f"cbatch: {options.output} is already complete for this input and settings; nothing to do", file=sys.stderr)
        return None
    try:
        state.check(options.overwrite)
    except StateError as exc:
        raise JobError(str(exc)) from None
    return total_rows, config, state


def conclude_job(options: JobOptions, state: JobState, report: dict[str, Any], code: int | None,
                 total_rows: int, summary_suffix: str = "") -> int:
    """The end of a job, local or Ray: report, then either keep the rows for a resume (interrupted:
    `code` is 130/143) or write OUTPUT atomically; returns the exit code."""
    # the report's row counts describe OUTPUT: rows finished by an earlier run count too
    errors = len(state.error_rows)
    report["requests"].update(ok=state.num_rows - errors, error=errors)
    if code is not None:
        state.close()
        write_report_and_plot(options, report)
        print(
            f"cbatch: interrupted; {state.num_rows} of {total_rows} rows are saved. "
            "Run the same command again to resume.",
            file=sys.stderr,
        )
        return code
    fmt = output_format(options.output)
    try:
        state.finish(
            lambda tmp: write_output(tmp, fmt, state.records(), options.token_ids),
            {"rows": state.num_rows, "errors": errors},
        )
    except OSError as exc:  # disk full, folder removed: the finished rows stay in the part files
        state.close()
        raise JobError(
            f"could not write {options.output} ({exc.strerror or exc}); all {state.num_rows} finished rows are kept: "
            "fix the problem and run the same command again"
        ) from None
    write_report_and_plot(options, report)
    print(summary_line(report) + summary_suffix, flush=True)
    if not options.quiet and sys.stdout.isatty():  # a log file or cron mail gets the one summary line
        from rich.console import Console

        Console().print(summary_table(report))
    return EXIT_ROW_ERRORS if errors and not options.allow_errors else EXIT_OK


def run_job(options: JobOptions, make_engine=None, make_progress=None) -> int:
    """The whole `cbatch run`. Raises JobError (or a model/config error) for a bad job: exit 2, nothing written.

    Order matters: every check that can refuse the job (paths, input, model config, lock, resume
    state) runs before the model loads, and nothing is written before all of them passed.
    """
    prepared = preflight(options)
    if prepared is None:
        return EXIT_OK
    total_rows, config, state = prepared
    try:
        engine = (make_engine or Engine.from_config)(config)
    except (ModelLoadError, UnsupportedModelError, ConfigError):
        raise
    except Exception as exc:  # damaged weights and the like: one line, not a traceback
        raise JobError(f"--model {config.model}: cannot load the checkpoint ({type(exc).__name__}: {exc})") from None
    from cbatch.observe.progress import make_progress as default_progress

    with _Interrupt() as interrupt:
        try:
            done = state.open(options.overwrite)
        except StateError as exc:
            raise JobError(str(exc)) from None
        job = JobRunner(options, engine, state, total_rows)
        job.progress = (make_progress or default_progress)(job.metrics, options)
        if done and not options.quiet:
            print(f"cbatch: resuming: {len(done)} of {total_rows} rows were finished by an earlier run", file=sys.stderr)
        try:
            code = job.run(set(done), interrupt)
        except BaseException:
            job.progress.close()
            state.close()
            raise
        job.progress.close()
    wall = job.metrics.now()
    report = build_report(
        job.metrics, engine.scheduler.stats, wall_seconds=wall, max_num_seqs=config.max_num_seqs,
        num_kv_blocks=engine.pool.num_blocks, hardware=engine_hardware(engine, job.metrics.steps, job.metrics.forward_seconds),
        settings={"engine": asdict(config), "defaults": asdict(options.defaults), "dtype": str(engine.dtype),
                  "device": str(engine.device), "input": str(options.input), "output": str(options.output)},
    )
    return conclude_job(options, state, report, code, total_rows)
