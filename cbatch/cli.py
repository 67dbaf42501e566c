"""The command line: `cbatch run` and `cbatch bench`. Flags become configs; errors become exit codes."""
from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Callable, List, NoReturn, Optional

import typer

from cbatch.config import ConfigError, EngineConfig, SamplingParams, UserError
from cbatch.io.state import StorageError
from cbatch.run.exit_codes import EXIT_INTERNAL, EXIT_IO, EXIT_SIGINT, EXIT_USAGE

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Offline LLM batch inference: continuous batching over a paged KV cache.",
)



@app.callback()
def _group() -> None:
    """Offline LLM batch inference: continuous batching over a paged KV cache."""


ENGINE_HELP = "Engine"
SAMPLING_HELP = "Sampling defaults (a row's own fields win)"
JOB_HELP = "Job"
RAY_HELP = "Scale-out on Ray (needs the ray extra)"

# Engine flags shared by `run` and `bench` (one definition each).
MODEL_OPT = typer.Option(None, help="Checkpoint folder or hub id; default SmolLM2-135M-Instruct.", rich_help_panel=ENGINE_HELP)
DEVICE_OPT = typer.Option("auto", help="auto | cpu | cuda.", rich_help_panel=ENGINE_HELP)
DTYPE_OPT = typer.Option("auto", help="auto | float32 | bfloat16 | float16 (auto: float32 on CPU).", rich_help_panel=ENGINE_HELP)
MAX_NUM_SEQS_OPT = typer.Option(64, help="Most sequences in one step.", rich_help_panel=ENGINE_HELP)
MAX_NUM_BATCHED_TOKENS_OPT = typer.Option(2048, help="Token budget of one step (decodes + prefill chunks).", rich_help_panel=ENGINE_HELP)
BLOCK_SIZE_OPT = typer.Option(16, help="Tokens per KV-cache block.", rich_help_panel=ENGINE_HELP)
NUM_KV_BLOCKS_OPT = typer.Option(None, help="Force the KV pool size in blocks (default: from memory).", rich_help_panel=ENGINE_HELP)
ATTENTION_BACKEND_OPT = typer.Option("auto", help="auto | torch | triton (auto: triton on CUDA).", rich_help_panel=ENGINE_HELP)
MAX_MODEL_LEN_OPT = typer.Option(None, help="Cap on prompt + completion tokens (default: the model's).", rich_help_panel=ENGINE_HELP)
THREADS_OPT = typer.Option(None, help="CPU threads for torch (default: torch's choice).", rich_help_panel=ENGINE_HELP)
GPU_MEMORY_OPT = typer.Option(0.9, help="Share of GPU memory for weights + activations + KV cache.", rich_help_panel=ENGINE_HELP)
ENFORCE_EAGER_OPT = typer.Option(False, help="GPU: no CUDA graphs for decode steps.", rich_help_panel=ENGINE_HELP)
PREFIX_CACHE_OPT = typer.Option(True, "--prefix-cache/--no-prefix-cache", help="Reuse the KV of prompt prefixes shared between rows.", rich_help_panel=ENGINE_HELP)
PREEMPTION_OPT = typer.Option("recompute", help="When KV runs out: recompute | swap (to host memory) | auto (swap long ones).", rich_help_panel=ENGINE_HELP)
SWAP_SPACE_OPT = typer.Option(4.0, help="Host memory (GB) for swapped-out KV blocks.", rich_help_panel=ENGINE_HELP)
ADMISSION_OPT = typer.Option("optimistic", help="optimistic (admit on the prompt) | reserve (prompt + max_tokens must fit; never preempts).", rich_help_panel=ENGINE_HELP)
AGING_OPT = typer.Option(1000, help="A waiting row gains one priority class per this many steps (0 = no aging).", rich_help_panel=ENGINE_HELP)


# EngineConfig / SamplingParams fields whose flag is not the field's name in kebab case
FLAG_OF_FIELD = {
    "num_threads": "--threads", "swap_space_gb": "--swap-space", "enable_prefix_cache": "--prefix-cache",
}


def flag_of(field: str) -> str:
    return FLAG_OF_FIELD.get(field, "--" + field.replace("_", "-"))


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
    except KeyboardInterrupt:
        typer.echo(f"cbatch: interrupted.{kept}", err=True)
        raise typer.Exit(EXIT_SIGINT)
    except Exception:  # a bug, not a user mistake: its traceback belongs in the report
        traceback.print_exc()
        typer.echo(f"cbatch: internal error (a bug in cbatch; the traceback is above).{kept}", err=True)
        raise typer.Exit(EXIT_INTERNAL)
    raise typer.Exit(code)


def engine_config(**flags) -> EngineConfig:
    try:
        return EngineConfig(**flags)
    except ConfigError as exc:
        fail(f"{flag_of(exc.field)}: {exc.reason}")


def sampling_defaults(max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, priority=0) -> SamplingParams:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        stop=list(stop or []), ignore_eos=ignore_eos, priority=priority,
    )
    problem = params.problem()
    if problem is not None:
        field, message = problem
        fail(f"{flag_of(field)}: {message}")
    return params


@app.command()
def run(
    input: Path = typer.Argument(..., help="Prompts: .jsonl or .parquet with a `prompt` or `messages` field per row."),
    out: Path = typer.Option(..., "--out", "-o", help="Results: .parquet or .jsonl, one row per input row, in input order."),
    model: Optional[str] = MODEL_OPT,
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    max_num_seqs: int = MAX_NUM_SEQS_OPT,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS_OPT,
    block_size: int = BLOCK_SIZE_OPT,
    num_kv_blocks: Optional[int] = NUM_KV_BLOCKS_OPT,
    policy: str = typer.Option("longest-first", help="Admission: longest-first | fcfs | static.", rich_help_panel=ENGINE_HELP),
    attention_backend: str = ATTENTION_BACKEND_OPT,
    max_model_len: Optional[int] = MAX_MODEL_LEN_OPT,
    threads: Optional[int] = THREADS_OPT,
    gpu_memory_utilization: float = GPU_MEMORY_OPT,
    enforce_eager: bool = ENFORCE_EAGER_OPT,
    prefix_cache: bool = PREFIX_CACHE_OPT,
    preemption: str = PREEMPTION_OPT,
    swap_space: float = SWAP_SPACE_OPT,
    admission: str = ADMISSION_OPT,
    priority_aging_steps: int = AGING_OPT,
    max_tokens: int = typer.Option(256, help="Most tokens to generate per row.", rich_help_panel=SAMPLING_HELP),
    temperature: float = typer.Option(0.0, help="0 = greedy.", rich_help_panel=SAMPLING_HELP),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass (1 = off).", rich_help_panel=SAMPLING_HELP),
    top_k: int = typer.Option(0, help="Keep the k most likely tokens (0 = off).", rich_help_panel=SAMPLING_HELP),
    seed: Optional[int] = typer.Option(None, help="Job seed: rows without their own `seed` draw from (job seed, row index), so reruns are reproducible.", rich_help_panel=SAMPLING_HELP),
    stop: Optional[List[str]] = typer.Option(None, help="Stop string (repeatable); not included in the completion.", rich_help_panel=SAMPLING_HELP),
    ignore_eos: bool = typer.Option(False, help="Keep generating past EOS (benchmarks).", rich_help_panel=SAMPLING_HELP),
    priority: int = typer.Option(0, help="Scheduling priority of rows without their own `priority` (lower = sooner).", rich_help_panel=SAMPLING_HELP),
    token_ids: bool = typer.Option(False, "--token-ids", help="Add a completion_token_ids column.", rich_help_panel=JOB_HELP),
    report: Optional[Path] = typer.Option(None, help="Write the JSON report (throughput, utilization, latency) here.", rich_help_panel=JOB_HELP),
    plot: Optional[Path] = typer.Option(None, help="Draw occupancy, KV usage, tokens/s and latency (.png or .html; needs matplotlib).", rich_help_panel=JOB_HELP),
    overwrite: bool = typer.Option(False, help="Start over: discard a partial run or an existing OUTPUT.", rich_help_panel=JOB_HELP),
    allow_errors: bool = typer.Option(False, help="Exit 0 even when some rows failed (they still say why).", rich_help_panel=JOB_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only errors and the final summary.", rich_help_panel=JOB_HELP),
    lookahead: int = typer.Option(16384, help="Rows queued at once; longest-first orders within this window.", rich_help_panel=JOB_HELP),
    display: str = typer.Option("auto", help="auto | dashboard | plain | none (auto: dashboard on a terminal).", rich_help_panel=JOB_HELP),
    progress_interval: float = typer.Option(10.0, help="Seconds between plain progress lines (logs, cron).", rich_help_panel=JOB_HELP),
    ray: Optional[str] = typer.Option(None, "--ray", metavar="[ADDRESS]", help="Run on Ray: a local instance, or join the cluster at ADDRESS (host:port, auto, ray://...).", rich_help_panel=RAY_HELP),
    replicas: Optional[int] = typer.Option(None, help="Engine replicas (default: one per GPU in the cluster).", rich_help_panel=RAY_HELP),
    gpus_per_replica: Optional[int] = typer.Option(None, help="1 = GPU replicas, 0 = CPU replicas (default: 1 if the cluster has GPUs).", rich_help_panel=RAY_HELP),
    ray_block_rows: int = typer.Option(512, help="Rows per block sent to a replica (each holds two blocks).", rich_help_panel=RAY_HELP),
) -> None:
    """Generate a completion for every row of INPUT and write them to OUTPUT."""
    from cbatch.run.preflight import JobOptions

    if lookahead < 1:
        fail("--lookahead: must be at least 1")
    if not progress_interval > 0:
        fail("--progress-interval: must be a positive number of seconds, e.g. 10")
    if display not in ("auto", "dashboard", "plain", "none"):
        fail(f"--display: must be one of auto, dashboard, plain, none, not {display!r}")
    config = engine_config(
        model=model, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, num_kv_blocks=num_kv_blocks,
        policy=policy, attention_backend=attention_backend, max_model_len=max_model_len,
        seed=seed if seed is not None else 0, num_threads=threads,
        gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, enable_prefix_cache=prefix_cache,
        preemption=preemption, swap_space_gb=swap_space, admission=admission, priority_aging_steps=priority_aging_steps,
    )
    defaults = sampling_defaults(max_tokens, temperature, top_p, top_k, None, stop, ignore_eos, priority)
    if plot is not None:
        from cbatch.observe.plot import PlotError, check_plot_path

        try:
            check_plot_path(plot)
        except PlotError as exc:
            fail(str(exc))
    options = JobOptions(
        input=input, output=out, engine=config, defaults=defaults, token_ids=token_ids, overwrite=overwrite,
        allow_errors=allow_errors, report=report, quiet=quiet, lookahead=lookahead, display=display, plot=plot,
        progress_interval=progress_interval,
    )

    def job() -> int:
        if ray is None:
            from cbatch.run.job import run_job

            return run_job(options)
        from cbatch.scaleout.cli_entry import run_on_ray

        return run_on_ray(options, ray, replicas, gpus_per_replica, ray_block_rows)

    exit_for(job)


BENCH_HELP = "Workload"
SIM_HELP = "Simulator (--simulate)"


@app.command()
def bench(
    num_prompts: int = typer.Option(256, help="Requests in the synthetic workload.", rich_help_panel=BENCH_HELP),
    input_len: str = typer.Option("100:1024", help="Prompt lengths: N | A:B (uniform) | lognormal:MEDIAN:SIGMA | chat.", rich_help_panel=BENCH_HELP),
    output_len: str = typer.Option("100:1024", help="Output lengths (EOS ignored, exact): N | A:B | lognormal:MEDIAN:SIGMA | chat.", rich_help_panel=BENCH_HELP),
    seed: int = typer.Option(0, help="Workload, prompt and weight seed.", rich_help_panel=BENCH_HELP),
    trace: Optional[Path] = typer.Option(None, help="JSONL rows {prompt_len, output_len, arrival (steps, optional)} instead of a synthetic workload.", rich_help_panel=BENCH_HELP),
    policy: str = typer.Option("all", help="static | fcfs | longest-first | all (each on the identical workload).", rich_help_panel=BENCH_HELP),
    model: Optional[str] = MODEL_OPT,
    model_config: Optional[str] = typer.Option(None, help="Weightless model: preset (qwen3-0.6b, llama-3.2-1b, llama-3.1-8b, qwen2.5-1.5b, tiny) or config.json; random weights.", rich_help_panel=ENGINE_HELP),
    device: str = DEVICE_OPT,
    dtype: str = DTYPE_OPT,
    max_num_seqs: int = MAX_NUM_SEQS_OPT,
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS_OPT,
    block_size: int = BLOCK_SIZE_OPT,
    num_kv_blocks: Optional[int] = NUM_KV_BLOCKS_OPT,
    attention_backend: str = ATTENTION_BACKEND_OPT,
    max_model_len: Optional[int] = MAX_MODEL_LEN_OPT,
    threads: Optional[int] = THREADS_OPT,
    gpu_memory_utilization: float = GPU_MEMORY_OPT,
    enforce_eager: bool = ENFORCE_EAGER_OPT,
    prefix_cache: bool = PREFIX_CACHE_OPT,
    preemption: str = PREEMPTION_OPT,
    swap_space: float = SWAP_SPACE_OPT,
    admission: str = ADMISSION_OPT,
    priority_aging_steps: int = AGING_OPT,
    shared_prefix: int = typer.Option(0, help="Every prompt starts with the same this many tokens (a system prompt): shows the prefix cache.", rich_help_panel=BENCH_HELP),
    simulate: bool = typer.Option(False, "--simulate", help="Drive the real scheduler and block pool with a cost model instead of the model.", rich_help_panel=SIM_HELP),
    cost_per_step: float = typer.Option(1.0, help="Simulated cost of every step.", rich_help_panel=SIM_HELP),
    cost_per_prefill_token: float = typer.Option(0.0, help="Simulated cost per prefill token.", rich_help_panel=SIM_HELP),
    cost_per_context_token: float = typer.Option(0.0, help="Simulated cost per KV token read.", rich_help_panel=SIM_HELP),
    cost_from: Optional[Path] = typer.Option(None, help="Fit the cost model (in seconds) to a real run's --report.", rich_help_panel=SIM_HELP),
    report: Optional[Path] = typer.Option(None, help="Write every run's JSON report here.", rich_help_panel=JOB_HELP),
    plot: Optional[Path] = typer.Option(None, help="Draw occupancy, KV usage, tokens/s and latency (.png or .html).", rich_help_panel=JOB_HELP),
    warmup: bool = typer.Option(True, help="Run a few short requests before timing (real runs).", rich_help_panel=JOB_HELP),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the table.", rich_help_panel=JOB_HELP),
) -> None:
    """Benchmark a synthetic workload (or a trace) under each admission policy, for real or simulated."""
    from cbatch.bench.command import BenchOptions, run_bench
    from cbatch.bench.simulator import CostModel
    from cbatch.observe.plot import check_plot_path

    if model is not None and model_config is not None:
        fail("--model and --model-config: give one (a checkpoint, or a weightless shape)")
    if shared_prefix < 0:
        fail("--shared-prefix: must be a non-negative number of tokens")
    config = engine_config(
        model=model, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, block_size=block_size, num_kv_blocks=num_kv_blocks,
        attention_backend=attention_backend, max_model_len=max_model_len, seed=seed, num_threads=threads,
        gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, enable_prefix_cache=prefix_cache,
        preemption=preemption, swap_space_gb=swap_space, admission=admission, priority_aging_steps=priority_aging_steps,
    )

    def bench_run() -> int:
        cost = CostModel.fit(cost_from) if cost_from else CostModel(cost_per_step, cost_per_prefill_token, cost_per_context_token)
        if min(cost.per_step, cost.per_prefill_token, cost.per_context_token) < 0 or cost.per_step + cost.per_prefill_token + cost.per_context_token <= 0:
            fail("--cost-per-*: costs must be >= 0 and not all 0")
        if report is not None and not (report.parent if str(report.parent) else Path(".")).is_dir():
            fail(f"--report {report}: the folder {report.parent} does not exist; create it first")
        if plot is not None:
            check_plot_path(plot)
        run_bench(BenchOptions(
            engine=config, model_config=model_config, num_prompts=num_prompts, input_len=input_len,
            output_len=output_len, seed=seed, trace=trace, policy=policy, simulate=simulate, cost=cost,
            report=report, plot=plot, quiet=quiet, warmup=warmup, shared_prefix=shared_prefix,
        ))
        return 0

    exit_for(bench_run, resumable=False)


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
