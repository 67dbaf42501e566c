"""`cbatch run`: preflight -> engine -> the driver over rows -> report and OUTPUT (exit codes: exit_codes.py).

The Ray path (cbatch/scaleout/ray_job.py) shares everything here but the executor: `run_rows` (the
driver loop with the job's state, display and interrupts) and `conclude_job` (report, OUTPUT, exit code).
"""
from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from cbatch.config import EngineConfig, UserError
from cbatch.engine.build import build_engine
from cbatch.engine.engine import Engine
from cbatch.engine.stats import SchedulerStats
from cbatch.io.reader import iter_rows
from cbatch.io.columns import output_kept_types
from cbatch.io.openai import OpenAILines, output_model_name
from cbatch.io.state import StateError, StorageError, record_key
from cbatch.io.writer import output_columns, write_output
from cbatch.observe.metrics import JobMetrics
from cbatch.observe.display import Display, make_display
from cbatch.observe.report import build_report, summary_line, summary_table, write_report
from cbatch.observe.roofline import engine_hardware
from cbatch.run.driver import RowFeed, drive
from cbatch.run.executor import Executor, LocalExecutor
from cbatch.run.exit_codes import EXIT_EXPIRED, EXIT_OK, EXIT_ROW_ERRORS
from cbatch.run.interrupt import Interrupt
from cbatch.run.preflight import JobError, JobOptions, PreparedJob, preflight
from cbatch.run.resumed_images import check_resumed_images
from cbatch.run.job_spec import JobSpec
from cbatch.run.result_cache import cache_spec
from cbatch.tasks.base import Task
from cbatch.tasks.results import RowResult

DisplayFactory = Callable[[JobMetrics, JobOptions], Display]


def run_job(options: JobOptions, make_engine: Callable[[EngineConfig], Engine] | None = None,
            make_progress: DisplayFactory | None = None) -> int:
    """The whole `cbatch run`. Raises JobError (a UserError) for a bad job: exit 2, nothing written.

    Order matters: every check that can refuse the job runs before the model loads, and nothing is
    written before all of them passed.
    """
    prepared = preflight(options)
    if prepared is None:
        return EXIT_OK
    if prepared.total_rows == 0:
        return conclude_empty_job(options, prepared, make_progress)
    spec = job_spec(options, prepared)  # (a bad --result-cache is refused here, before the model loads)
    engine = load_engine(prepared, make_engine)
    # the engine's config has the step limits it runs with (a GPU sizes them from memory): displays and
    # the report show those
    options = replace(options, engine=engine.config)
    prepared = replace(prepared, config=engine.config)
    metrics = JobMetrics(total_rows=prepared.total_rows)
    executor = LocalExecutor(engine, replace(spec, engine=engine.config), metrics)
    try:
        code = run_rows(options, prepared, executor, metrics, make_progress or make_display)
    finally:
        engine.close()  # tensor-parallel workers stop with the rows, whatever ended them
    report = build_report(
        metrics, engine.scheduler.stats, wall_seconds=metrics.now(), max_num_seqs=prepared.config.max_num_seqs,
        num_kv_blocks=engine.pool.num_blocks, hardware=engine_hardware(engine, metrics.series, metrics.forward_seconds),
        settings={"engine": asdict(prepared.config), "defaults": asdict(options.defaults), "dtype": str(engine.dtype),
                  "device": str(engine.device), "input": str(options.input), "output": str(options.output)},
    )
    return conclude_job(options, prepared, with_task(report, prepared.task), code)


class NoRows:
    """The executor of a job whose INPUT has no rows: there is nothing to run, so no model is loaded."""

    def wants_rows(self) -> bool:
        return True  # (the feed reads on, finds the input's end and is exhausted)

    def submit(self, index: int, raw: Any, done_samples: frozenset[int] = frozenset()) -> None:
        raise AssertionError("an empty INPUT has no row to submit")

    def end_of_input(self) -> None:
        pass

    def busy(self) -> bool:
        return False

    def poll(self) -> list[RowResult]:
        return []

    def stop_starting(self) -> None:
        pass

    def expire(self, message: str) -> list[RowResult]:
        return []

    def expire_unsubmitted(self, index: int, raw: Any, done_samples: frozenset[int], message: str) -> list[RowResult]:
        return []


def conclude_empty_job(options: JobOptions, prepared: PreparedJob, make_progress: DisplayFactory | None) -> int:
    """An INPUT without rows (an empty nightly partition): a finished job, local or Ray. OUTPUT is written empty
    with its columns, the report and the summary line say 0 rows, and the exit code is 0; no model loads."""
    metrics = JobMetrics(total_rows=0)
    code = run_rows(options, prepared, NoRows(), metrics, make_progress or make_display)
    report = build_report(metrics, SchedulerStats(), wall_seconds=metrics.now(), max_num_seqs=0, num_kv_blocks=0,
                          settings={"engine": asdict(prepared.config), "defaults": asdict(options.defaults),
                                    "input": str(options.input), "output": str(options.output)})
    return conclude_job(options, prepared, with_task(report, prepared.task), code)


def job_spec(options: JobOptions, prepared: PreparedJob) -> JobSpec:
    """What every executor of the job runs its rows by (a Ray replica gets it whole)."""
    cache = cache_spec(options.result_cache, options.result_cache_limit, prepared.model, prepared.config, prepared.task)
    return JobSpec(prepared.config, prepared.task, options.lookahead, prepared.formats.keep, cache, options.deadline)


def with_task(report: dict[str, Any], task: Task) -> dict[str, Any]:
    """A prefill-only job's report names its task: its summary gives rows/s and prompt tokens/s."""
    if not task.decodes:
        report["task"] = task.name
    return report


def load_engine(prepared: PreparedJob, make_engine: Callable[[EngineConfig], Engine] | None = None) -> Engine:
    """The job's engine; a checkpoint that fails to load (damaged weights and the like) is one line."""
    try:
        if make_engine is not None:
            return make_engine(prepared.config)
        return build_engine(prepared.config, prepared.model)
    except UserError:
        raise
    except Exception as exc:
        raise JobError(f"--model {prepared.config.model}: cannot load the checkpoint ({type(exc).__name__}: {exc})") from None


def run_rows(options: JobOptions, prepared: PreparedJob, executor: Executor, metrics: JobMetrics,
             make_progress: DisplayFactory) -> int | None:
    """Opens the job's state (lock, resume) and drives every row not yet done through `executor`; returns
    an exit code if interrupted, else None. The rows stay in the part files either way."""
    state = prepared.state
    with Interrupt() as interrupt:
        try:
            done = state.open(options.overwrite, options.retry_errors)
        except StateError as exc:
            raise JobError(str(exc)) from None
        if done.rows or done.partial:
            try:  # the image files its finished rows read are the ones they name now
                check_resumed_images(state, iter_rows(prepared.formats.input), prepared.task)
            except StateError as exc:
                state.close()
                raise JobError(str(exc)) from None
        metrics.skipped_rows = len(done.rows)
        metrics.restart_clock()  # the job's time starts with its rows (model loading is not in it)
        if (done.rows or done.partial) and not options.quiet:
            partial = f" ({len(done.partial)} more have some of their samples)" if done.partial else ""
            print(f"cbatch: --retry-errors: running {prepared.total_rows - len(done.rows)} rows again; the other "
                  f"{len(done.rows)} rows of OUTPUT are kept as they are" if options.retry_errors else
                  f"cbatch: resuming: {len(done.rows)} of {prepared.total_rows} rows were finished by an earlier run"
                  f"{partial}", file=sys.stderr)
        display = make_progress(metrics, options)

        parts = state.parts  # --out DIR: a part is written the moment its last row is stored
        if parts is not None:
            write_part = part_writer(options, prepared)
            for k in parts.start(done.rows):
                parts.write(k, write_part, expired_in(state, parts, k))

        def store(result: RowResult) -> bool:
            record = result.record()
            if record_key(record) in state:  # exactly once: a retried Ray block (or a resumed row) may bring it again
                return False
            state.append(record)
            if parts is not None and result.last and (k := parts.row_done(result.index)) is not None:
                parts.write(k, write_part, expired_in(state, parts, k))
            return True

        try:
            return drive(RowFeed(iter_rows(prepared.formats.input), done), executor, store, metrics, display, interrupt,
                         options.deadline)
        except BaseException:
            state.close()
            raise
        finally:
            display.close()


def write_records(options: JobOptions, prepared: PreparedJob, path: Path,
                  records: Callable[[], Iterator[dict[str, Any]]]) -> None:
    """`records()` (in input order) written to `path` in the job's formats: OUTPUT, or one of its parts, with the
    optional columns they have and the kept columns' types (`records` is read twice where those come from it)."""
    formats, state, task = prepared.formats, prepared.state, prepared.task
    columns = output_columns(options.token_ids, state.columns, task.columns)
    kept_types = (output_kept_types(formats.keep, formats.kept_types, records) if formats.output == "parquet"
                  else None)
    openai = (OpenAILines(output_model_name(options.engine.model), task.openai_body, options.output_format == "vllm")
              if formats.openai_lines else None)
    write_output(path, formats.output, records(), columns, kept_types=kept_types, task_types=task.column_types(),
                 openai=openai)


def part_writer(options: JobOptions, prepared: PreparedJob) -> Callable[[int, Path], None]:
    """Writes part k of a folder OUTPUT (its rows' records) to a path."""
    state = prepared.state

    def write(k: int, path: Path) -> None:
        rows = state.parts.rows_of(k)
        write_records(options, prepared, path, lambda: state.records(rows.start, rows.stop))

    return write


def expired_in(state, parts, k: int) -> int:
    """The expired records among part k's rows."""
    rows = parts.rows_of(k)
    return sum(1 for index, _ in state.expired_rows if index in rows)


def write_report_and_plot(options: JobOptions, report: dict[str, Any]) -> None:
    if options.report is not None:
        try:
            write_report(options.report, report)
        except OSError as exc:
            raise StorageError(options.report, exc, "the report") from None
    if options.plot is not None:
        from cbatch.observe.plot import plot_reports

        plot_reports([report], options.plot)


def conclude_job(options: JobOptions, prepared: PreparedJob, report: dict[str, Any], code: int | None,
                 summary_suffix: str = "") -> int:
    """The end of a job, local or Ray: report, then either keep the rows for a resume (interrupted:
    `code` is 130/143) or write OUTPUT atomically in the job's formats; returns the exit code."""
    state, formats = prepared.state, prepared.formats
    # the report's row counts describe OUTPUT: rows finished by an earlier run count too, and a row with n > 1
    # samples has n output rows
    errors = len(state.error_rows)
    report["requests"].update(ok=state.num_rows - errors, error=errors, output_rows=state.num_rows)
    if code is not None and code != EXIT_EXPIRED:
        state.close()
        write_report_and_plot(options, report)
        print(f"cbatch: interrupted; {state.num_rows} of {prepared.total_rows} rows are saved. "
              "Run the same command again to resume.", file=sys.stderr)
        return code
    def write(tmp: Path) -> None:
        if state.parts is None:
            write_records(options, prepared, tmp, state.records)
            return
        write_part = part_writer(options, prepared)
        for k in state.parts.unwritten():
            state.parts.write(k, write_part, expired_in(state, state.parts, k))
        if code != EXIT_EXPIRED:
            state.parts.finish()

    if code == EXIT_EXPIRED:  # OUTPUT whole, the state kept: the same command runs the expired rows
        state.publish_expired(write)
    else:
        state.finish(write, {"rows": state.num_rows, "errors": errors})
    write_report_and_plot(options, report)
    print(summary_line(report) + summary_suffix, flush=True)
    if code == EXIT_EXPIRED:
        print(f"cbatch: the deadline ({options.deadline.flag}) came: {len(state.expired_rows)} of "
              f"{prepared.total_rows} rows expired (error rows in {options.output}); run the same command again to "
              "run them", file=sys.stderr)
    if not options.quiet and sys.stdout.isatty():  # a log file or cron mail gets the one summary line
        from rich.console import Console

        Console().print(summary_table(report))
    if code == EXIT_EXPIRED:
        return EXIT_EXPIRED
    return EXIT_ROW_ERRORS if errors and not options.allow_errors else EXIT_OK
