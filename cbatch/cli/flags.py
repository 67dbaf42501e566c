"""Every command-line flag, once: its type, default, help, panel, and the EngineConfig or SamplingParams
field it sets. The typer commands are built from these tables (`command`), the field -> flag map that
error messages use comes from them (`flag_of`), and so does docs/cli.md (`cbatch.cli.reference`)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional

import typer

from cbatch.config import (ATTENTION_BACKENDS, TASKS, BOOL, INT, JSON_KINDS, LIST_KINDS, NUMBER, OBJECT, SAMPLING_FIELDS, STRINGS, TOKEN_BIASES,
                           TOKEN_IDS, SamplingField)

ENGINE, SAMPLING, JOB, RAY, WORKLOAD, SIMULATOR, ACROSS_JOBS, PLAN = (
    "Engine", "Sampling defaults (a row's own fields win)", "Job", "Scale-out on Ray (needs the ray extra)",
    "Workload", "Simulator (--simulate)", "Across jobs (docs/nightly.md)", "Plan",
)
LORA = "LoRA adapters (docs/lora.md)"


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
    json: bool = False  # the value is a JSON text (decoded before it reaches the field)

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
        Flag("max_num_seqs", Optional[int], None, "Most sequences in one step (default: 256 on CPU; on a GPU what "
             "its memory holds, up to 1024).", ENGINE, field="max_num_seqs"),
        Flag("max_num_batched_tokens", Optional[int], None, "Token budget of one step, decodes + prefill chunks "
             "(default: 2048 on CPU; on a GPU up to 8192, sized from memory).", ENGINE, field="max_num_batched_tokens"),
        Flag("block_size", int, 16, "Tokens per KV-cache block.", ENGINE, field="block_size"),
        Flag("kv_cache_dtype", str, "auto", "auto (the model's dtype) | fp8 (e4m3: half the KV memory and reads; "
             "slightly less exact).", ENGINE, field="kv_cache_dtype"),
        Flag("num_kv_blocks", Optional[int], None, "Force the KV pool size in blocks (default: from memory).", ENGINE,
             field="num_kv_blocks"),
        Flag("attention_backend", str, "auto", f"{' | '.join(ATTENTION_BACKENDS)} (auto: the fastest backend that "
             "runs on the device; docs/ARCHITECTURE.md).", ENGINE, field="attention_backend"),
        Flag("max_model_len", Optional[int], None, "Cap on prompt + completion tokens (default: the model's).", ENGINE,
             field="max_model_len"),
        Flag("max_image_tokens_per_step", Optional[int], None, "Rows with images: most image tokens the vision tower "
             "encodes in one step (default: no limit; a larger image runs alone; docs/vision.md).", ENGINE,
             field="max_image_tokens_per_step", metavar="N"),
        Flag("tensor_parallel_size", int, 1, "Split each layer across N GPUs (N CPU processes on CPU): models bigger "
             "than one device (docs/tensor-parallel.md).", ENGINE, decls=("--tensor-parallel-size", "-tp"),
             field="tensor_parallel_size", metavar="N"),
        Flag("expert_parallel", bool, False, "MoE models with --tensor-parallel-size N: each rank holds 1/N of the "
             "experts whole instead of a slice of every expert (docs/tensor-parallel.md).", ENGINE,
             field="expert_parallel"),
        Flag("async_scheduling", Optional[bool], None, "Schedule the next step while the GPU runs this one (default: "
             "on for one GPU, off on CPU and with --tensor-parallel-size).", ENGINE,
             decls=("--async-scheduling/--no-async-scheduling",), field="async_scheduling"),
        Flag("threads", Optional[int], None, "CPU threads for torch (default: torch's choice).", ENGINE, field="num_threads"),
        Flag("gpu_memory_utilization", float, 0.9, "Share of GPU memory for weights + activations + KV cache.", ENGINE,
             field="gpu_memory_utilization"),
        Flag("enforce_eager", bool, False, "GPU: no CUDA graphs for decode steps.", ENGINE, field="enforce_eager"),
        Flag("kernel_tuning", bool, True, "GPU: time a few tile shapes of decode attention at start-up and keep the "
             "fastest (a few seconds, cached per device in ~/.cache/cbatch).", ENGINE,
             decls=("--kernel-tuning/--no-kernel-tuning",), field="tune_kernels"),
        Flag("decode_gemm", bool, True, "GPU: with --kernel-tuning, time a Triton GEMM against cuBLAS per layer shape "
             "and decode batch size (<= 256 rows) at start-up and run it in the decode steps where it was faster "
             "(off: cuBLAS for every GEMM).", ENGINE, decls=("--decode-gemm/--no-decode-gemm",), field="decode_gemm"),
        Flag("split_sampler", bool, True, "GPU: the sampling kernel splits each row's vocabulary across programs "
             "(off: one program per row; the same tokens, slower for batches below ~4 rows per SM).", ENGINE,
             decls=("--split-sampler/--no-split-sampler",), field="split_sampler"),
        Flag("fp32_logits", bool, True, "GPU, bfloat16/float16: float32 logits straight from the lm_head matmul "
             "(off: HF's logits rounded to the model's dtype; greedy near-ties may differ).", ENGINE,
             decls=("--fp32-logits/--no-fp32-logits",), field="fp32_logits"),
        Flag("split_kv", bool, True, "GPU: decode attention cuts long contexts into key segments when a step has few "
             "sequences (fewer than 6 programs per SM); --no-split-kv measures what that gains.", ENGINE,
             decls=("--split-kv/--no-split-kv",), field="split_kv"),
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
    flags += LORA_FLAGS + SPECULATIVE_FLAGS
    if policy_default is not None:
        flags.insert(8, Flag("policy", str, policy_default, "Admission: longest-first | fcfs | static | prefix (rows opening "
                             "with the same tokens together, longest-first inside).", ENGINE, field="policy"))
    return flags


# the adapters (cbatch/lora/registry.py makes EngineConfig.loras of the first two)
LORA_FLAGS = [
    Flag("lora", Optional[List[str]], None, "A LoRA adapter rows may use: NAME=PATH of a PEFT folder (repeatable); a "
         "row's `lora` field (or an OpenAI line's `model`) names it, rows without one use the base model.", LORA,
         metavar="NAME=PATH"),
    Flag("lora_dir", Optional[Path], None, "A folder of PEFT adapter folders, each named by its folder name.", LORA,
         metavar="DIR"),
    Flag("max_loras", int, 4, "Most distinct adapters in one step (their slots); rows of others wait.", LORA,
         field="max_loras"),
    Flag("max_lora_rank", int, 16, "The largest adapter rank (an adapter above it is refused before the job starts).",
         LORA, field="max_lora_rank"),
    Flag("lora_grouping", bool, True, "Admit waiting rows adapter by adapter (fewer adapters per step).", LORA,
         decls=("--lora-grouping/--no-lora-grouping",), field="lora_grouping"),
]


SPECULATIVE = "Speculative decoding (docs/speculative.md: never changes a token)"
SPECULATIVE_FLAGS = [
    Flag("speculative", str, "off", "off | ngram (draft from the row's own prompt and output) | suffix (also from the "
         "job's finished rows) | auto (suffix where the measured acceptance pays for the drafted tokens). Drafts are "
         "kept only where they equal the tokens a plain run chooses: outputs are identical.", SPECULATIVE,
         field="speculative"),
    Flag("speculative_tokens", int, 4, "Most tokens drafted for a row in one step.", SPECULATIVE,
         field="speculative_tokens"),
    Flag("speculative_min_ngram", int, 2, "Shortest suffix of a row's tokens a draft is looked up by.", SPECULATIVE,
         field="speculative_min_ngram"),
    Flag("speculative_max_ngram", int, 5, "Longest suffix of a row's tokens a draft is looked up by.", SPECULATIVE,
         field="speculative_max_ngram"),
]


# A flag for every sampling field (cbatch/config.py's table), typed by how the field is carried: JSON kinds
# take JSON text, list kinds repeat, the others take the field's type with its default.
_FLAG_TYPES: dict[str, Any] = {INT: int, NUMBER: float, BOOL: bool, STRINGS: List[str], TOKEN_IDS: List[int],
                               TOKEN_BIASES: str, OBJECT: str}


def sampling_flag(spec: SamplingField) -> Flag:
    """The flag of a sampling field: the rows' default for it (a row's own field wins)."""
    json = spec.kind in JSON_KINDS
    default = None if json or spec.kind in LIST_KINDS else spec.default
    value_type = _FLAG_TYPES[spec.kind]
    return Flag(spec.flag or spec.name, value_type if default is not None else Optional[value_type], default, spec.help,
                SAMPLING, field=spec.name if spec.flag_sets_default else None,
                metavar=spec.metavar or ("JSON" if json else None), json=json)


SAMPLING_FLAGS = [sampling_flag(spec) for spec in SAMPLING_FIELDS.values()] + [
    # structured output for rows without their own constraint (one of the three; docs/structured-output.md)
    Flag("json_schema", Optional[Path], None, "Every completion is JSON valid under the schema in this file.", SAMPLING,
         metavar="FILE"),
    Flag("regex", Optional[str], None, "Every completion matches this regular expression.", SAMPLING, metavar="PATTERN"),
    Flag("choice", Optional[List[str]], None, "Every completion is one of these strings (repeatable).", SAMPLING,
         metavar="VALUE"),
]

JOB_FLAGS = [
    Flag("input", str, ..., "Prompts: .jsonl or .parquet with a `prompt`, `messages` or `prompt_token_ids` field per row; a file, a folder, a glob or an fsspec URL (s3://...; pip install 'cbatch[remote]').",
         JOB, argument=True),
    Flag("out", Path, ..., "Results: .parquet or .jsonl, one row per input row, in input order; or a folder (a name "
         "without an extension) of parts written as the job goes.", JOB, decls=("--out", "-o")),
    Flag("token_ids", bool, False, "Add a completion_token_ids column.", JOB, decls=("--token-ids",)),
    Flag("reasoning_split", bool, True, "Models that think (<think>...</think>, or gpt-oss's harmony analysis "
         "channel): the thinking goes to a `reasoning` column; --no-reasoning-split keeps the raw text in `completion`.", JOB,
         decls=("--reasoning-split/--no-reasoning-split",)),
    Flag("output_format", str, "cbatch", "cbatch (our columns) | openai (OpenAI Batch API output lines; .jsonl) | vllm "
         "(the same, error lines as vLLM's run-batch writes them).", JOB),
    Flag("keep_columns", Optional[str], None, "Input columns to carry into the output: all, or a comma list.", JOB,
         metavar="all|COL,..."),
    Flag("allow_duplicate_ids", bool, False, "Run even when two rows share an id / custom_id.", JOB),
    Flag("part_rows", int, 100_000, "--out FOLDER: input rows per part file (a part is written when its rows are done).",
         JOB, metavar="N"),
    Flag("part_format", str, "parquet", "--out FOLDER: the parts' format, parquet | jsonl.", JOB),
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

TASK_FLAGS = [  # prefill-only jobs (docs/tasks.md)
    Flag("task", str, "generate", f"{' | '.join(TASKS)} (every task but generate: prefill only, no decoding; "
         "docs/tasks.md).", JOB),
    Flag("pooling", Optional[str], None, "--task embed / bi-encoder score: last | mean | cls (default: the model's "
         "sentence-transformers config).", JOB),
    Flag("normalize", Optional[bool], None, "--task embed: L2-normalize the embeddings (default: as the model's "
         "config says).", JOB, decls=("--normalize/--no-normalize",)),
    Flag("dimensions", Optional[int], None, "--task embed: keep the first N dimensions (Matryoshka), then normalize.",
         JOB, metavar="N"),
    Flag("classifier_from_token", Optional[str], None, "--task score / rerank / classify with a causal LM (an LM-head "
         "reranker such as Qwen3-Reranker): these vocabulary tokens' logits at the last prompt position are the head, as "
         "vLLM's classifier_from_token (two: false,true, score = sigmoid(logit(true) - logit(false))); default: the "
         "model's config.json's (docs/tasks.md).", JOB, metavar="FALSE,TRUE"),
    Flag("score_template", Optional[Path], None, "--task score / rerank with a cross-encoder or an LM-head reranker: "
         "render each pair through this Jinja template (vLLM's score template: `messages` of roles query and "
         "document), then tokenize it (docs/tasks.md).", JOB, metavar="FILE"),
    Flag("tool_call_parser", Optional[str], None, "Rows with `tools`: the format their calls are parsed in (hermes | "
         "llama3_json | mistral; default: the model's chat template's; docs/tools.md).", JOB, metavar="NAME"),
    Flag("reasoning_effort_budgets", Optional[str], None, "Thinking tokens per `reasoning_effort` (default "
         "low=512,medium=2048,high=8192; docs/tools.md).", JOB, metavar="low=N,medium=N,high=N"),
    Flag("image_min_pixels", Optional[int], None, "Rows with images: scale smaller images up to at least N pixels "
         "(default: the model's preprocessor_config.json; videos keep their video processor's; docs/vision.md).",
         JOB, field="image_min_pixels", metavar="N"),
    Flag("image_max_pixels", Optional[int], None, "Rows with images: scale larger images down to at most N pixels "
         "(fewer image tokens per row; default: the model's; videos keep their video processor's; docs/vision.md).",
         JOB, field="image_max_pixels", metavar="N"),
    Flag("video_min_pixels", Optional[int], None, "Rows with videos: scale smaller frames up to at least N pixels "
         "(default: the model's video processor config; docs/vision.md).", JOB, field="video_min_pixels",
         metavar="N"),
    Flag("video_max_pixels", Optional[int], None, "Rows with videos: scale larger frames down to at most N pixels "
         "(fewer video tokens per row; default: the model's video processor config; docs/vision.md).", JOB,
         field="video_max_pixels", metavar="N"),
    Flag("video_fps", Optional[float], None, "Rows with videos: sample F frames per second of video (fewer: fewer "
         "video tokens per row; default: the model's video processor config, else 2; docs/vision.md).", JOB,
         field="video_fps", metavar="F"),
    Flag("image_pan_and_scan", Optional[bool], None, "Rows with images, Gemma 3: also give the model up to "
         "pan_and_scan_max_num_crops crops of each wide or tall image, 256 tokens each (default: the model's "
         "preprocessor_config.json; docs/vision.md).", JOB, decls=("--image-pan-and-scan/--no-image-pan-and-scan",),
         field="image_pan_and_scan"),
    Flag("limit_mm_per_prompt", Optional[str], None, "Rows with images or videos: at most N images and M videos "
         "in one row (vLLM's --limit-mm-per-prompt; 0 refuses the kind); a row with more is an error row.", JOB,
         metavar="image=N,video=M"),
]

DEADLINE_FLAGS = [
    Flag("max_wall_time", Optional[str], None, "End the job this long after it starts (90m, 2h, 1h30m): rows not "
         "finished by then become `expired` error rows (exit 75); the same command again runs only those.", JOB,
         metavar="DURATION"),
    Flag("deadline", Optional[str], None, "End the job at this local time (HH:MM, the next one; or 2026-11-27T06:00), "
         "as --max-wall-time does.", JOB, metavar="TIME"),
    Flag("deadline_grace", str, "60s", "At the deadline no new row starts; the running rows get this long to finish.",
         JOB, metavar="DURATION"),
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
    Flag("shared_prefix", int, 0, "This many tokens, the same for every prompt (a system prompt), in front of each "
         "prompt's --input-len tokens; adds a run without the prefix cache to compare.", WORKLOAD),
    Flag("images", int, 0, "Images per prompt (a vision-language --model): synthetic pages, each prompt's own, "
         "their placeholders before its --input-len tokens.", WORKLOAD),
    Flag("image_size", str, "896x1152", "Each image's WIDTHxHEIGHT in pixels, or several (896x1152,1024x768) drawn "
         "per image; the model's processor resizes them as a row's.", WORKLOAD),
    Flag("policy", str, "all", "static | fcfs | longest-first | prefix | all (the first three, each on the identical "
         "workload).",
         WORKLOAD),
    Flag("model_config", Optional[str], None, "Weightless model: preset (qwen3-0.6b, llama-3.2-1b, llama-3.1-8b, "
         "qwen2.5-1.5b, qwen3-30b-a3b, mixtral-8x7b, gemma-3-4b, gpt-oss-20b, tiny) or config.json; random weights.", ENGINE),
    Flag("simulate", bool, False, "Drive the real scheduler and block pool with a cost model instead of the model.",
         SIMULATOR, decls=("--simulate",)),
    Flag("cost_per_step", float, 1.0, "Simulated cost of every step.", SIMULATOR),
    Flag("cost_per_prefill_token", float, 0.0, "Simulated cost per prefill token.", SIMULATOR),
    Flag("cost_per_context_token", float, 0.0, "Simulated cost per KV token read.", SIMULATOR),
    Flag("cost_per_decode_token", float, 0.0, "Simulated cost per decode token (a one-token chunk).", SIMULATOR),
    Flag("cost_from", Optional[Path], None, "Fit the cost model (in seconds) to a real run's --report.", SIMULATOR),
    Flag("speculative_acceptance", Optional[float], None, "With --speculative: the share of drafted tokens the "
         "simulation keeps (each kept with this probability while the ones before it were; default 0).", SIMULATOR,
         metavar="0..1"),
    Flag("report", Optional[Path], None, "Write every run's JSON report here.", JOB),
    Flag("plot", Optional[Path], None, "Draw occupancy, KV usage, tokens/s and latency (.png or .html).", JOB),
    Flag("warmup", bool, True, "Run a few short requests before timing (real runs).", JOB),
    Flag("quiet", bool, False, "Print only the table.", JOB, decls=("--quiet", "-q")),
]

ACROSS_JOBS_FLAGS = [
    Flag("result_cache", Optional[Path], None, "Folder of finished rows shared by jobs: a row generated before with "
         "the same model, dtype, device, prompt, sampling settings and seed is copied, not generated.", ACROSS_JOBS),
    Flag("result_cache_size", str, "10GB", "Bound of --result-cache: bytes (10GB, 512MiB) or entries (50000entries); "
         "least recently used rows go first.", ACROSS_JOBS),
    Flag("retry_errors", bool, False, "Run only the error rows of a complete OUTPUT again (after fixing a flag or "
         "the model); its other rows stay as they are.", ACROSS_JOBS),
]

PLAN_OWN_FLAGS = [
    Flag("cost_from", Optional[Path], None, "Fit the step cost to a real run's --report on the kind of machine the "
         "run will use (default: a rough estimate from the model's FLOPs and bytes).", PLAN),
    Flag("lengths_from", Optional[Path], None, "Draw output lengths from an earlier run's --report of this job "
         "(default: every row generates max_tokens, an upper bound).", PLAN),
    Flag("device_kind", Optional[str], None, "The machine the run will use: cpu, h200, h100, h100-pcie, a100, l40s, "
         "l4, a10 (default: this one).", PLAN),
    Flag("search", bool, True, "Also try other --max-num-seqs / --max-num-batched-tokens and name the fastest.", PLAN,
         decls=("--search/--no-search",)),
    Flag("speculative_acceptance", Optional[float], None, "With --speculative: the share of drafted tokens the plan "
         "assumes kept (each kept with this probability while the ones before it were; default 0: measure it with "
         "a real run's report, `speculative.acceptance_rate`).", PLAN, metavar="0..1"),
    Flag("report", Optional[Path], None, "Write the plan (error rows, prediction, search) as JSON here.", PLAN),
]


def flags_named(flags: list[Flag], *names: str) -> list[Flag]:
    by_name = {f.name: f for f in flags}
    return [by_name[name] for name in names]


RUN_FLAGS = (JOB_FLAGS[:2] + engine_flags("longest-first") + SAMPLING_FLAGS + JOB_FLAGS[2:] + TASK_FLAGS + DEADLINE_FLAGS
             + ACROSS_JOBS_FLAGS + RAY_FLAGS)
BENCH_COMMAND_FLAGS = BENCH_FLAGS[:9] + engine_flags(None) + BENCH_FLAGS[9:]  # (workload, engine, the rest)
PLAN_FLAGS = (JOB_FLAGS[:1] + engine_flags("longest-first") + SAMPLING_FLAGS + PLAN_OWN_FLAGS
              + flags_named(JOB_FLAGS, "allow_errors", "quiet", "lookahead") + DEADLINE_FLAGS[:2] + ACROSS_JOBS_FLAGS[:1]
              + TASK_FLAGS)
ALL_FLAGS = RUN_FLAGS + BENCH_COMMAND_FLAGS + PLAN_FLAGS


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
