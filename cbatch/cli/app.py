"""`cbatch run` and `cbatch bench`: flags (flags.py) become configs; how a command ends becomes its exit code."""
from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import fields
from pathlib import Path
from typing import Any, Callable, NoReturn

import typer

from cbatch.cli.flags import BENCH_COMMAND_FLAGS, PLAN_FLAGS, RUN_FLAGS, SAMPLING_FLAGS, Flag, command, fields_of, flag_of
from cbatch.config import (SAMPLING_FIELDS, ConfigError, Constraint, EngineConfig, SamplingParams, UserError,
                           mm_limits)
from cbatch.io.state import StorageError
from cbatch.parallel import WorkerFailure
from cbatch.run.exit_codes import EXIT_INTERNAL, EXIT_IO, EXIT_SIGINT, EXIT_USAGE

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Offline LLM batch inference: continuous batching over a paged KV cache.",
)



ENGINE_FIELDS = tuple(f.name for f in fields(EngineConfig))


@app.callback()
def _group() -> None:
    """Offline LLM batch inference: continuous batching over a paged KV cache."""


def fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    """One line on stderr, no traceback."""
    typer.echo(f"cbatch: error: {message}", err=True)
    raise typer.Exit(code)


def exit_for(action: Callable[[], int], resumable: bool = True) -> NoReturn:
    """Runs a command and maps how it ended to an exit code, in one place: the user's mistake (2, the flag
    or file named), the environment failing the job's files (74), an interrupt (130), a bug (70, with
    its traceback)."""
    kept = " The rows finished so far are kept: run the same command again to resume." if resumable else ""
    try:
        code = action()
    except typer.Exit:
        raise
    except ConfigError as exc:
        fail(f"{flag_of(exc.field)}: {exc.reason}")
    except UserError as exc:
        fail(str(exc))
    except StorageError as exc:
        fail(f"{exc} (the environment failed, not cbatch); fix that and run the same command again.{kept}", EXIT_IO)
    except WorkerFailure as exc:
        fail(f"{exc}: the job stopped (the environment failed, not cbatch).{kept}", EXIT_IO)
    except KeyboardInterrupt:
        typer.echo(f"cbatch: interrupted.{kept}", err=True)
        raise typer.Exit(EXIT_SIGINT)
    except Exception:  # a bug, not a user mistake: its traceback belongs in the report
        traceback.print_exc()
        typer.echo(f"cbatch: internal error (a bug in cbatch; the traceback is above).{kept}", err=True)
        raise typer.Exit(EXIT_INTERNAL)
    raise typer.Exit(code)


def engine_config(values: dict[str, Any], flags: list[Flag], **overrides: Any) -> EngineConfig:
    from cbatch.lora.registry import job_adapters

    try:
        if values.get("lora") or values.get("lora_dir"):  # --lora NAME=PATH, --lora-dir
            overrides["loras"] = job_adapters(values.get("lora"), values.get("lora_dir"))
        if values.get("limit_mm_per_prompt"):
            overrides["limit_mm_per_prompt"] = mm_limits(values["limit_mm_per_prompt"], "--limit-mm-per-prompt")
        return EngineConfig(**{**fields_of(flags, values, ENGINE_FIELDS), **overrides})
    except ConfigError as exc:
        fail(f"{flag_of(exc.field)}: {exc.reason}")
    except UserError as exc:
        fail(str(exc))


def sampling_defaults(values: dict[str, Any]) -> SamplingParams:
    """The sampling flags as a row's defaults: JSON flags decoded, values coerced as a row's are."""
    from cbatch.io.rows import sampling_value

    settings: dict[str, Any] = {}
    for flag in SAMPLING_FLAGS:
        value = values[flag.name]
        if flag.field not in SAMPLING_FIELDS or value is None:
            continue  # None: the field's default; no field: the job seed or a constraint flag
        try:
            settings[flag.field] = sampling_value(flag.field, json.loads(value) if flag.json else value)
        except ValueError as exc:  # bad JSON, or a value no row could carry either (RowError)
            fail(f"{flag.spelling}: {exc if isinstance(exc, UserError) else f'not valid JSON ({exc})'}")
    params = SamplingParams(**settings)
    params.constraint = job_constraint(values)
    problem = params.problem()
    if problem is not None:
        field, message = problem
        fail(f"{flag_of(field)}: {message}")
    return params


def job_constraint(values: dict[str, Any]) -> Constraint | None:
    """--json-schema / --regex / --choice -> the job's constraint, checked by the grammar engine now (a bad
    one fails the job before anything loads)."""
    from cbatch.engine.structured import constraint_problem
    from cbatch.io.constraints import flags_constraint

    try:
        constraint = flags_constraint(values.get("json_schema"), values.get("regex"), values.get("choice"))
    except UserError as exc:
        fail(str(exc))
    problem = constraint_problem(constraint) if constraint is not None else None
    if problem is not None:
        fail(f"{constraint.source}: {problem}")
    return constraint


def check_plot(path: Path | None) -> None:
    if path is not None:
        from cbatch.observe.plot import check_plot_path

        check_plot_path(path)


def check_lookahead(values: dict[str, Any]) -> None:
    if values["lookahead"] < 1:
        fail("--lookahead: must be at least 1")


def job_deadline(values: dict[str, Any]):
    """--max-wall-time / --deadline, from now (the job's start); None without them. A bad value: one line, exit 2."""
    import time

    from cbatch.run.deadline import make_deadline

    try:
        return make_deadline(values["max_wall_time"], values["deadline"], values.get("deadline_grace", "0s"), time.time())
    except UserError as exc:
        fail(str(exc))


def job_seed(values: dict[str, Any]) -> int:
    return values["seed"] if values["seed"] is not None else 0


def effort_budgets(values: dict[str, Any]) -> dict[str, int] | None:
    """--reasoning-effort-budgets parsed (None: the defaults); a bad value is one line naming the flag."""
    if values["reasoning_effort_budgets"] is None:
        return None
    from cbatch.reasoning import parse_effort_budgets

    try:
        return parse_effort_budgets(values["reasoning_effort_budgets"])
    except UserError as exc:
        fail(str(exc))


def classifier_tokens(values: dict[str, Any]):
    """--classifier-from-token parsed (None: not given); a bad value is one line naming the flag."""
    if values["classifier_from_token"] is None:
        return None
    from cbatch.model.pooling_config import ClassifierTokens

    try:
        return ClassifierTokens(tuple(t.strip() for t in values["classifier_from_token"].split(",")))
    except UserError as exc:
        fail(f"--classifier-from-token: {exc}")


def score_template(values: dict[str, Any]) -> str | None:
    """--score-template's text (None: not given); an unreadable file is one line naming the flag."""
    path = values["score_template"]
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"--score-template {path}: cannot read it ({exc})")


@command(app, "run", RUN_FLAGS)
def run(**values: Any) -> None:
    """Generate a completion for every row of INPUT and write them to OUTPUT."""
    from cbatch.run.preflight import JobOptions
    from cbatch.run.result_cache import CacheLimit

    check_lookahead(values)
    if not values["progress_interval"] > 0:
        fail("--progress-interval: must be a positive number of seconds, e.g. 10")
    if values["display"] not in ("auto", "dashboard", "plain", "none"):
        fail(f"--display: must be one of auto, dashboard, plain, none, not {values['display']!r}")
    if values["output_format"] not in ("cbatch", "openai", "vllm"):
        fail(f"--output-format: must be cbatch, openai or vllm, not {values['output_format']!r}")
    deadline = job_deadline(values)
    config = engine_config(values, RUN_FLAGS, seed=job_seed(values))
    defaults = sampling_defaults(values)
    try:
        cache_limit = CacheLimit.parse(values["result_cache_size"])
    except UserError as exc:
        fail(str(exc))
    options = JobOptions(
        input=values["input"], output=values["out"], engine=config, defaults=defaults, result_cache_limit=cache_limit,
        deadline=deadline,
        **{name: values[name] for name in ("token_ids", "overwrite", "allow_errors", "report", "quiet", "lookahead",
                                           "display", "plot", "progress_interval", "result_cache", "retry_errors",
                                           "reasoning_split", "output_format", "keep_columns", "allow_duplicate_ids",
                                           "part_rows", "part_format", "task", "pooling", "normalize", "dimensions",
                                           "tool_call_parser")},
        effort_budgets=effort_budgets(values), classifier=classifier_tokens(values),
        score_template=score_template(values),
    )

    def job() -> int:
        check_plot(options.plot)
        if values["ray"] is None:
            from cbatch.run.job import run_job

            return run_job(options)
        from cbatch.scaleout.cli_entry import run_on_ray

        return run_on_ray(options, values["ray"], values["replicas"], values["gpus_per_replica"], values["ray_block_rows"])

    exit_for(job)


@command(app, "bench", BENCH_COMMAND_FLAGS)
def bench(**values: Any) -> None:
    """Benchmark a synthetic workload (or a trace) under each admission policy, for real or simulated."""
    from cbatch.bench.command import BenchOptions, run_bench
    from cbatch.bench.simulator import CostModel

    if values["model"] is not None and values["model_config"] is not None:
        fail("--model and --model-config: give one (a checkpoint, or a weightless shape)")
    if values["shared_prefix"] < 0:
        fail("--shared-prefix: must be a non-negative number of tokens")
    if values["images"] < 0:
        fail("--images: must be a non-negative number of images per prompt")
    config = engine_config(values, BENCH_COMMAND_FLAGS)
    report = values["report"]

    def bench_run() -> int:
        cost = (CostModel.fit(values["cost_from"]) if values["cost_from"] else
                CostModel(values["cost_per_step"], values["cost_per_prefill_token"], values["cost_per_context_token"],
                          per_decode_token=values["cost_per_decode_token"]))
        terms = (cost.per_step, cost.per_prefill_token, cost.per_context_token, cost.per_decode_token)
        if min(terms) < 0 or sum(terms) <= 0:
            fail("--cost-per-*: costs must be >= 0 and not all 0")
        if report is not None and not (report.parent if str(report.parent) else Path(".")).is_dir():
            fail(f"--report {report}: the folder {report.parent} does not exist; create it first")
        check_plot(values["plot"])
        run_bench(BenchOptions(
            engine=config, cost=cost,
            **{name: values[name] for name in ("model_config", "num_prompts", "input_len", "output_len", "seed", "trace",
                                               "policy", "simulate", "report", "plot", "quiet", "warmup",
                                               "shared_prefix", "speculative_acceptance", "images", "image_size")},
        ))
        return 0

    exit_for(bench_run, resumable=False)


@command(app, "plan", PLAN_FLAGS)
def plan(**values: Any) -> None:
    """Check every row of INPUT as `run` would and predict the run (time, KV use, best batch settings), without
    loading the model's weights."""
    from cbatch.plan.command import PlanOptions, run_plan

    check_lookahead(values)
    options = PlanOptions(
        input=values["input"], engine=engine_config(values, PLAN_FLAGS, seed=job_seed(values)),
        defaults=sampling_defaults(values), deadline=job_deadline(values),
        **{name: values[name] for name in ("cost_from", "lengths_from", "device_kind", "report", "search",
                                           "allow_errors", "quiet", "lookahead", "result_cache", "task", "pooling",
                                           "normalize", "dimensions", "tool_call_parser", "speculative_acceptance")},
        effort_budgets=effort_budgets(values), classifier=classifier_tokens(values),
        score_template=score_template(values),
    )
    exit_for(lambda: run_plan(options), resumable=False)


def main() -> None:
    """The entry point. Click's usage errors (a bad flag value, a missing argument) become one line, exit 2."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from cbatch.scaleout import normalize_ray_flag

    sys.argv[1:] = normalize_ray_flag(sys.argv[1:])  # `--ray` takes an optional ADDRESS
    try:
        code = app(standalone_mode=False)
    except BrokenPipeError:
        code = 1
    except Exception as exc:
        code = _click_error(exc)
    sys.exit(code or 0)


def _click_error(exc: Exception) -> int:
    """Reports click's own exceptions (typer vendors click, so they are matched by class name)."""
    kinds = {cls.__name__ for cls in type(exc).__mro__}
    if "NoArgsIsHelpError" in kinds:  # bare `cbatch`: the help text
        exc.show()
        return exc.exit_code
    if "UsageError" in kinds:
        ctx = getattr(exc, "ctx", None)
        command = ctx.command_path if ctx is not None else "cbatch"
        message = " ".join(exc.format_message().split())
        typer.echo(f"cbatch: error: {message} (see `{command} --help`)", err=True)
        return 2
    if "ClickException" in kinds:
        exc.show()
        return exc.exit_code
    if "Abort" in kinds:
        return 1
    raise exc


if __name__ == "__main__":
    main()
