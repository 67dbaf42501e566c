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
from cbatch.engine.sequence import Sequence
from cbatch.io.reader import inspect_input, iter_rows
from cbatch.io.rows import RowError, RowRequest, parse_row, row_id_of
from cbatch.io.state import JobState, StateError, file_digest, settings_digest
from cbatch.io.writer import check_writable, output_format, write_output
from cbatch.model.default_model import default_model_dir
from cbatch.model.loader import ModelLoadError, read_checkpoint, resolve_dtype, resolve_model_dir
from cbatch.model.spec import UnsupportedModelError
from cbatch.observe.metrics import JobMetrics, RequestTiming, StepSample
from cbatch.observe.report import build_report, summary_line, write_report
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
    progress_interval: float = 10.0  # seconds between plain progress lines (logs, cron)


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
        self._rows: dict[int, tuple[RowRequest, float, int]] = {}  # seq_id -> (row, queued_s, queued_step)

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
            finished = engine.step()
            info = engine.last_step
            metrics.record_step(StepSample(
                t=metrics.now(), running=len(engine.scheduler.running), waiting=engine.scheduler.num_waiting,
                scheduled_tokens=info.scheduled_tokens, prefill_tokens=info.prefill_tokens,
                output_tokens=info.sampled_tokens, kv_used=engine.pool.num_used,
            ))
            for seq in finished:
                self._record(seq)
            metrics.forward_seconds = engine.runner.forward_seconds
            self.progress.update(engine=engine)

    def _admit(self, index: int, raw: dict[str, Any] | str) -> None:
        """Queues one row; anything wrong with this row alone (its fields, its tokenization, its size)
        makes it an error row and never stops the job."""
        if index in self._done:
            return
        try:
            request = parse_row(index, raw, self.options.defaults)
            prompt_ids = self._tokenize(request)
            seq = self.engine.add_request(prompt_ids, request.params, seq_id=index)
        except Exception as exc:  # RowError, or a tokenizer / chat template / engine check on this row
            message = str(exc) if isinstance(exc, ValueError) else f"could not prepare this row ({type(exc).__name__}: {exc})"
            self._record_error(index, row_id_of(index, raw), message, 0)
            return
        self._rows[index] = (request, self.metrics.now(), self.engine.scheduler.stats.steps)
        if seq.is_finished:  # could never run (too long for the model or the KV pool)
            self._record(seq)

    def _tokenize(self, request: RowRequest) -> list[int]:
        tokenizer = self.engine.tokenizer
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
        vocab = self.engine.spec.vocab_size
        outside = next((t for t in ids if t >= vocab), None)
        if outside is not None:
            raise RowError(f"the prompt has token id {outside}, outside the model's vocabulary (ids 0..{vocab - 1})")
        return ids

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
        for key in ("id", "completion", "error"):  # JSON input may carry lone surrogates: not writable as UTF-8
            if isinstance(record[key], str):
                record[key] = record[key].encode("utf-8", "replace").decode("utf-8")
        if ok:
            self.metrics.ok_rows += 1
        else:
            self.metrics.error_rows += 1
            self._rows.pop(record["index"], None)
        self.state.append(record)


def run_job(options: JobOptions, make_engine=None, make_progress=None) -> int:
    """The whole `cbatch run`. Raises JobError (or a model/config error) for a bad job: exit 2, nothing written.

    Order matters: every check that can refuse the job (paths, input, model config, lock, resume
    state) runs before the model loads, and nothing is written before all of them passed.
    """
    total_rows = validate_paths(options)
    fingerprint, config = resolve_job(options)
    state = JobState(options.output, fingerprint)
    if not options.overwrite and state.is_complete():
        if not options.quiet:
            print(f"cbatch: {options.output} is already complete for this input and settings; nothing to do", file=sys.stderr)
        return EXIT_OK
    try:
        state.check(options.overwrite)
    except StateError as exc:
        raise JobError(str(exc)) from None
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
        num_kv_blocks=engine.pool.num_blocks,
        settings={"engine": asdict(config), "defaults": asdict(options.defaults), "dtype": str(engine.dtype),
                  "device": str(engine.device), "input": str(options.input), "output": str(options.output)},
    )
    # the report's row counts describe OUTPUT: rows finished by an earlier run count too
    errors = len(state.error_rows)
    report["requests"].update(ok=state.num_rows - errors, error=errors)
    if code is not None:
        state.close()
        if options.report is not None:
            write_report(options.report, report)
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
    if options.report is not None:
        write_report(options.report, report)
    print(summary_line(report), flush=True)
    return EXIT_ROW_ERRORS if errors and not options.allow_errors else EXIT_OK
