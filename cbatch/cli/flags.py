"""Every command-line flag, once: its type, default, help, panel, and the EngineConfig or SamplingParams
field it sets. The typer commands are built from these tables (`command`), the field -> flag map that
error messages use comes from them (`flag_of`), and so does docs/cli.md (`cbatch.cli.reference`)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

ENGINE, SAMPLING, JOB, RAY, WORKLOAD, SIMULATOR = (
    "Engine", "Sampling defaults (a row's own fields win)", "Job", "Scale-out on Ray (needs the ray extra)",
    "Workload", "Simulator (--simulate)",
)


@dataclass(frozen=True, slots=True)
class Flag:
    name: str  # the command function's keyword
    type: Any
    default: Any
    help: str
    panel: str
    decls: tuple[str, ...] = ()  # spellings when not `--name-in-kebab-case` ("--out", "-o"; "--x/--no-x")
    field: str | None = None  # the EngineConfig / SamplingParams field it sets
    metavar: str | None = None
    argument: bool = False  # a positional argument

    def parameter(self) -> inspect.Parameter:
        if self.argument:
            default = typer.Argument(self.default, help=self.help, show_default=False)
        else:
            default = typer.Option(self.default, *self.decls, help=self.help, rich_help_panel=self.panel,
                                   metavar=self.metavar)
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=self.type)

    @property
    def spelling(self) -> str:
        return next((d.split("/")[0] for d in self.decls if d.startswith("--")), "--" + self.name.replace("_", "-"))


def engine_flags(policy_default: str | None) -> list[Flag]:
    """The engine's flags; `policy_default` None leaves --policy out (bench has its own)."""
    flags = [
        Flag("model", Optional[str], None, "Checkpoint folder or hub id; default SmolLM2-135M-Instruct.", ENGINE, field="model"),
        Flag("device", str, "auto", "auto | cpu | cuda.", ENGINE, field="device"),
        Flag("dtype", str, "auto", "auto | float32 | bfloat16 | float16 (auto: float32 on CPU, the checkpoint's on GPU).",
             ENGINE, field="dtype"),
        Flag("max_num_seqs", int, 64, "Most sequences in one step.", ENGINE, field="max_num_seqs"),
        Flag("max_num_batched_tokens", int, 2048, "Token budget of one step (decodes + prefill chunks).", ENGINE,
             field="max_num_batched_tokens"),
        Flag("block_size", int, 16, "Tokens per KV-cache block.", ENGINE, field="block_size"),
        Flag("num_kv_blocks", Optional[int], None, "Force the KV pool size in blocks (default: from memory).", ENGINE,
             field="num_kv_blocks"),
        Flag("attention_backend", str, "auto", "auto | torch | triton (auto: triton on CUDA).", ENGINE,
             field="attention_backend"),
        Flag("max_model_len", Optional[int], None, "Cap on prompt + completion tokens (default: the model's).", ENGINE,
             field="max_model_len"),
        Flag("threads", Optional[int], None, "CPU threads for torch (default: torch's choice).", ENGINE, field="num_threads"),
        Flag("gpu_memory_utilization", float, 0.9, "Share of GPU memory for weights + activations + KV cache.", ENGINE,
             field="gpu_memory_utilization"),
        Flag("enforce_eager", bool, False, "GPU: no CUDA graphs for decode steps.", ENGINE, field="enforce_eager"),
        Flag("prefix_cache", bool, True, "Reuse the KV of prompt prefixes shared between rows.", ENGINE,
             decls=("--prefix-cache/--no-prefix-cache",), field="enable_prefix_cache"),
        Flag("preemption", str, "recompute", "When KV runs out: recompute | swap (to host memory) | auto (swap long ones).",
             ENGINE, field="preemption"),
        Flag("swap_space", float, 4.0, "Host memory (GB) for swapped-out KV blocks.", ENGINE, field="swap_space_gb"),
        Flag("admission", str, "optimistic",
             "optimistic (admit on the prompt) | reserve (prompt + max_tokens must fit; never preempts).", ENGINE,
             field="admission"),
        Flag("priority_aging_steps", int, 1000, "A waiting row gains one priority class per this many steps (0 = no aging).",
             ENGINE, field="priority_aging_steps"),
    ]
    if policy_default is not None:
        flags.insert(7, Flag("policy", str, policy_default, "Admission: longest-first | fcfs | static.", ENGINE, field="policy"))
    return flags


SAMPLING_FLAGS = [
    Flag("max_tokens", int, 256, "Most tokens to generate per row.", SAMPLING, field="max_tokens"),
    Flag("temperature", float, 0.0, "0 = greedy.", SAMPLING, field="temperature"),
    Flag("top_p", float, 1.0, "Nucleus sampling mass (1 = off).", SAMPLING, field="top_p"),
    Flag("top_k", int, 0, "Keep the k most likely tokens (0 = off).", SAMPLING, field="top_k"),
    Flag("seed", Optional[int], None, "Job seed: rows without their own `seed` draw from (job seed, row index), so "
         "reruns are reproducible.", SAMPLING),
    Flag("stop", Optional[List[str]], None, "Stop string (repeatable); not included in the completion.", SAMPLING,
         field="stop"),
    Flag("ignore_eos", bool, False, "Keep generating past EOS (benchmarks).", SAMPLING, field="ignore_eos"),
    Flag("priority", int, 0, "Scheduling priority of rows without their own `priority` (lower = sooner).", SAMPLING,
         field="priority"),
    # structured output for rows without their own constraint (one of the three; docs/structured-output.md)
    Flag("json_schema", Optional[Path], None, "Every completion is JSON valid under the schema in this file.", SAMPLING,
         metavar="FILE"),
    Flag("regex", Optional[str], None, "Every completion matches this regular expression.", SAMPLING, metavar="PATTERN"),
    Flag("choice", Optional[List[str]], None, "Every completion is one of these strings (repeatable).", SAMPLING,
         metavar="VALUE"),
]

JOB_FLAGS = [
    Flag("input", Path, ..., "Prompts: .jsonl or .parquet with a `prompt`, `messages` or `prompt_token_ids` field per row.",
         JOB, argument=True),
    Flag("out", Path, ..., "Results: .parquet or .jsonl, one row per input row, in input order.", JOB,
         decls=("--out", "-o")),
    Flag("token_ids", bool, False, "Add a completion_token_ids column.", JOB, decls=("--token-ids",)),
    Flag("output_format", str, "cbatch", "cbatch (our columns) | openai (OpenAI Batch API output lines; .jsonl).", JOB),
    Flag("keep_columns", Optional[str], None, "Input columns to carry into the output: all, or a comma list.", JOB,
         metavar="all|COL,..."),
    Flag("allow_duplicate_ids", bool, False, "Run even when two rows share an id / custom_id.", JOB),
    Flag("report", Optional[Path], None, "Write the JSON report (throughput, utilization, latency) here.", JOB),
    Flag("plot", Optional[Path], None, "Draw occupancy, KV usage, tokens/s and latency (.png or .html; needs matplotlib).",
         JOB),
    Flag("overwrite", bool, False, "Start over: discard a partial run or an existing OUTPUT.", JOB),
    Flag("allow_errors", bool, False, "Exit 0 even when some rows failed (they still say why).", JOB),
    Flag("quiet", bool, False, "Print only errors and the final summary.", JOB, decls=("--quiet", "-q")),
    Flag("lookahead", int, 16384, "Rows queued at once; longest-first orders within this window.", JOB),
    Flag("display", str, "auto", "auto | dashboard | plain | none (auto: dashboard on a terminal).", JOB),
    Flag("progress_interval", float, 10.0, "Seconds between plain progress lines (logs, cron).", JOB),
]

RAY_FLAGS = [
    Flag("ray", Optional[str], None, "Run on Ray: a local instance, or join the cluster at ADDRESS (host:port, auto, "
         "ray://...).", RAY, decls=("--ray",), metavar="[ADDRESS]"),
    Flag("replicas", Optional[int], None, "Engine replicas (default: one per GPU in the cluster).", RAY),
    Flag("gpus_per_replica", Optional[int], None, "1 = GPU replicas, 0 = CPU replicas (default: 1 if the cluster has GPUs).",
         RAY),
    Flag("ray_block_rows", int, 512, "Rows per block sent to a replica (each holds two blocks).", RAY),
]

BENCH_FLAGS = [
    Flag("num_prompts", int, 256, "Requests in the synthetic workload.", WORKLOAD),
    Flag("input_len", str, "100:1024", "Prompt lengths: N | A:B (uniform) | lognormal:MEDIAN:SIGMA | chat.", WORKLOAD),
    Flag("output_len", str, "100:1024", "Output lengths (EOS ignored, exact): N | A:B | lognormal:MEDIAN:SIGMA | chat.",
         WORKLOAD),
    Flag("seed", int, 0, "Workload, prompt and weight seed.", WORKLOAD, field="seed"),
    Flag("trace", Optional[Path], None, "JSONL rows {prompt_len, output_len, arrival (steps, optional)} instead of a "
         "synthetic workload.", WORKLOAD),
    Flag("shared_prefix", int, 0, "Every prompt starts with the same this many tokens (a system prompt); adds a run "
         "without the prefix cache to compare.", WORKLOAD),
    Flag("policy", str, "all", "static | fcfs | longest-first | all (each on the identical workload).", WORKLOAD),
    Flag("model_config", Optional[str], None, "Weightless model: preset (qwen3-0.6b, llama-3.2-1b, llama-3.1-8b, "
         "qwen2.5-1.5b, tiny) or config.json; random weights.", ENGINE),
    Flag("simulate", bool, False, "Drive the real scheduler and block pool with a cost model instead of the model.",
         SIMULATOR, decls=("--simulate",)),
    Flag("cost_per_step", float, 1.0, "Simulated cost of every step.", SIMULATOR),
    Flag("cost_per_prefill_token", float, 0.0, "Simulated cost per prefill token.", SIMULATOR),
    Flag("cost_per_context_token", float, 0.0, "Simulated cost per KV token read.", SIMULATOR),
    Flag("cost_from", Optional[Path], None, "Fit the cost model (in seconds) to a real run's --report.", SIMULATOR),
    Flag("report", Optional[Path], None, "Write every run's JSON report here.", JOB),
    Flag("plot", Optional[Path], None, "Draw occupancy, KV usage, tokens/s and latency (.png or .html).", JOB),
    Flag("warmup", bool, True, "Run a few short requests before timing (real runs).", JOB),
    Flag("quiet", bool, False, "Print only the table.", JOB, decls=("--quiet", "-q")),
]

RUN_FLAGS = JOB_FLAGS[:2] + engine_flags("longest-first") + SAMPLING_FLAGS + JOB_FLAGS[2:] + RAY_FLAGS
BENCH_COMMAND_FLAGS = BENCH_FLAGS[:7] + engine_flags(None) + BENCH_FLAGS[7:]
ALL_FLAGS = RUN_FLAGS + BENCH_COMMAND_FLAGS


def flag_of(field: str) -> str:
    """The flag that sets an EngineConfig / SamplingParams field (errors name it)."""
    for flag in ALL_FLAGS:
        if flag.field == field:
            return flag.spelling
    return "--" + field.replace("_", "-")


def fields_of(flags: list[Flag], values: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """{field: value} for the flags among `flags` whose field is one of `names` (a dataclass's fields)."""
    return {f.field: values[f.name] for f in flags if f.field in names}


def command(app: typer.Typer, name: str, flags: list[Flag]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Registers `fn(**values)` as the command `name`, its parameters built from `flags`."""
    def register(fn: Callable[..., None]) -> Callable[..., None]:
        fn.__signature__ = inspect.Signature([f.parameter() for f in flags])
        app.command(name)(fn)
        return fn

    return register
