"""Every check that can refuse a job, before any model loads and before anything is written.

`preflight` checks the paths and the input, derives the job's formats (`JobFormats`), resolves the model
(folder, config, device, dtype: no weights), fingerprints the job and checks the lock and resume state; it
returns a `PreparedJob` that the engine builder, the driver and the writers consume, so nothing is resolved
or derived twice.
"""
from __future__ import annotations

import hashlib

import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from cbatch.config import EngineConfig, SamplingParams, UserError
from cbatch.engine.resolve import ResolvedModel, resolve_model
from cbatch.io.columns import KeepColumns, parquet_kept_types
from cbatch.io.openai import OPENAI_LINE_FIELDS
from cbatch.io.partitions import PartitionedOutput, PartPlan
from cbatch.io.reader import InputFile, describe_places, find_duplicate_id, inspect_input, open_input, part_digest
from cbatch.io.state import JobState, StateError, settings_digest
from cbatch.io.writer import OUTPUT_COLUMNS, check_writable, output_columns, output_format, written_columns
from cbatch.model.loader import ModelLoadError
from cbatch.model.pooling_config import ClassifierTokens
from cbatch.model.spec import UnsupportedModelError
from cbatch.run.deadline import Deadline
from cbatch.run.identity import output_identity
from cbatch.run.result_cache import DEFAULT_CACHE_LIMIT, CacheLimit
from cbatch.tasks import Task, make_task, task_class
from cbatch.tasks.pooled import check_task_flags


# the sampling fields a job's fingerprint has always held in full
_FINGERPRINTED_ALWAYS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "priority")


class JobError(UserError):
    """A bad job (exit 2): the message is one line naming the file or flag and the fix."""


@dataclass(slots=True)
class JobOptions:
    input: str | Path  # a file, folder, glob or fsspec URL
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
    result_cache: Path | None = None  # --result-cache: rows finished by earlier jobs are copied (result_cache.py)
    result_cache_limit: CacheLimit = DEFAULT_CACHE_LIMIT
    retry_errors: bool = False  # run only the error rows of a complete OUTPUT again, keep the others
    reasoning_split: bool = True  # a thinking model's <think>...</think> goes to a `reasoning` column
    output_format: str = "cbatch"  # cbatch (our columns) | openai (OpenAI batch output lines; JSONL) | vllm (vLLM's)
    keep_columns: str | None = None  # --keep-columns: "all" or a comma list of input columns
    allow_duplicate_ids: bool = False
    deadline: Deadline | None = None  # --max-wall-time / --deadline: when the job stops starting rows
    part_rows: int = 100_000  # --out DIR: input rows per part file
    part_format: str = "parquet"  # --out DIR: the part files' format (parquet | jsonl)
    task: str = "generate"  # --task: config.TASKS (cbatch/tasks/)
    pooling: str | None = None  # --pooling (prefill-only tasks; None: the model's own)
    normalize: bool | None = None  # --normalize / --no-normalize (None: the model's own)
    dimensions: int | None = None  # --dimensions (Matryoshka)
    tool_call_parser: str | None = None  # --tool-call-parser: rows with tools (None: the model's own format)
    effort_budgets: dict[str, int] | None = None  # --reasoning-effort-budgets (None: the defaults)
    classifier: ClassifierTokens | None = None  # --classifier-from-token (None: the model's config.json's, if any)
    score_template: str | None = None  # --score-template's text (score / rerank pairs rendered through it)


@dataclass(frozen=True, slots=True)
class JobFormats:
    """How the job's files are read and written: derived once from the paths and flags (`validate_paths`) and
    handed to the readers and writers, which never derive them again."""

    input: InputFile  # INPUT with its format (jsonl | parquet)
    output: str  # OUTPUT's file format: jsonl | parquet (from its extension)
    openai_lines: bool  # --output-format openai / vllm: OUTPUT holds OpenAI batch output lines (JSONL)
    keep: KeepColumns | None  # --keep-columns, parsed (None: no flag)
    kept_types: dict[str, Any] | None = None  # the kept columns' Arrow types when INPUT is Parquet (its schema)
    parts: PartPlan | None = None  # --out DIR: OUTPUT is a folder of parts (`output` is their format)


@dataclass(slots=True)
class PreparedJob:
    total_rows: int
    config: EngineConfig  # with `model` resolved to the checkpoint folder
    model: ResolvedModel
    fingerprint: dict[str, str]
    state: JobState
    formats: JobFormats
    task: Task  # --task with its settings, resolved against the model (cbatch/tasks/)


def validate_paths(options: JobOptions) -> tuple[JobFormats, int]:
    """Checks input and output before any work (raises JobError); returns the job's formats and the number of
    input rows."""
    try:
        parts = part_plan(options)
        output = parts.format if parts is not None else output_format(options.output)
        check_writable(options.output, folder=parts is not None)
        if options.report is not None:
            check_writable(options.report, flag="--report")
        openai_lines = options.output_format in ("openai", "vllm")
        if openai_lines and output != "jsonl":
            what = "--part-format jsonl" if parts is not None else "a .jsonl --out"
            raise JobError(f"--out {options.output}: --output-format {options.output_format} writes JSONL; give {what}")
        source = open_input(options.input)
        if source.local and options.output.exists() and any(part.path.samefile(options.output) for part in source.parts):
            raise JobError(f"--out {options.output} is the input file; choose another --out")
        task = task_class(options.task)
        total_rows = inspect_input(source, fields=task.input_fields)
        # a name the output has already is refused; a Parquet INPUT must have the kept columns, in types cbatch carries
        keep = KeepColumns.parse(options.keep_columns, OPENAI_LINE_FIELDS if openai_lines else OUTPUT_COLUMNS + task.columns)
        kept_types = parquet_kept_types(keep, source.parts[0]) if keep is not None and source.format == "parquet" else None
        if not options.allow_duplicate_ids:
            check_unique_ids(source)
        return JobFormats(source, output, openai_lines, keep, kept_types, parts), total_rows
    except ValueError as exc:
        raise JobError(str(exc)) from None


def part_plan(options: JobOptions) -> PartPlan | None:
    """--out DIR (an existing folder, or a name without an extension): OUTPUT as parts of --part-rows rows in
    --part-format; None for a file OUTPUT."""
    if not (options.output.is_dir() or options.output.suffix == ""):
        return None
    if options.part_rows < 1:
        raise JobError("--part-rows: must be at least 1")
    if options.part_format not in ("parquet", "jsonl"):
        raise JobError(f"--part-format: parquet or jsonl, not {options.part_format!r}")
    if options.retry_errors:
        raise JobError(f"--retry-errors: not available for a folder --out yet; run the same command to resume it, "
                       "or give a file --out")
    return PartPlan(options.part_format, options.part_rows)


def check_unique_ids(source: InputFile) -> None:
    """No two rows share an id (raises JobError naming both places)."""
    duplicate = find_duplicate_id(source)
    if duplicate is not None:
        row_id, first, second = duplicate
        raise JobError(f"{source.name}: {describe_places(first, second)} have the same id {row_id!r}; give every row "
                       "its own `id`/`custom_id`, or pass --allow-duplicate-ids")


def resolve_or_fail(config: EngineConfig, device: torch.device | None = None) -> ResolvedModel:
    """The model as the engine will run it (no weights); a bad folder is a JobError whose message names it.
    `device`: the one a planned run will use (`cbatch plan`), instead of --device here."""
    try:
        return resolve_model(config, device=device)
    except (ModelLoadError, UnsupportedModelError) as exc:
        message, folder = str(exc), config.model or "the default model"
        raise JobError(message if folder in message or "--model" in message else f"--model {folder}: {message}") from None
    except (OSError, ValueError) as exc:  # e.g. a damaged generation_config.json
        if isinstance(exc, UserError):
            raise
        raise JobError(f"--model {config.model}: cannot read the checkpoint ({exc}); it looks damaged") from None


def job_fingerprint(options: JobOptions, model: ResolvedModel, source: InputFile | None = None,
                    task: Task | None = None) -> dict[str, str]:
    """What makes a partial run's rows valid for this run: the input bytes, the checkpoint (its folder, config and
    weight files, and the files that turn a row into tokens: `reading_files`), the output identity (run/identity.py:
    every engine and task setting that changes an output), the job's sampling defaults, and what the records hold
    (the output's format and kept columns, when not the default). Batch shape settings (--max-num-seqs, --policy,
    ...) are left out: outputs do not depend on them. NOTE: of the sampling fields, only those set away from their
    defaults count beyond the first few, so a job that uses none of a newer field keeps its fingerprint."""
    checkpoint = model.checkpoint
    task = task if task is not None else resolve_task(options, model)
    settings = {
        "model": str(checkpoint.path.resolve()),
        "model_config": checkpoint.raw_config,
        "weights": sorted((p.name, p.stat().st_size) for p in checkpoint.path.glob("*.safetensors")),
        "reading_files": reading_files(checkpoint.path, vision=model.spec.vision is not None),
        **output_identity(options.engine, task, model.device, model.dtype, model.max_model_len),
        "defaults": {**{k: v for k, v in asdict(options.defaults).items() if k in _FINGERPRINTED_ALWAYS},
                     **options.defaults.changed_fields()},
    }
    if options.output_format != "cbatch" or options.keep_columns is not None:  # what the records hold
        settings["output"] = {"format": options.output_format, "keep_columns": options.keep_columns}
    fingerprint = {"input": input_digest(source or open_input(options.input)), "settings": settings_digest(settings)}
    if options.engine.loras:  # each adapter's files, checked whole (absent without adapters)
        from cbatch.lora.registry import adapter_digests

        digests = adapter_digests(options.engine.loras, model.spec, options.engine.max_lora_rank)
        fingerprint.update({f"lora:{name}": digest for name, digest in digests.items()})
    return fingerprint


# The checkpoint's files besides config.json and the weights that change what a row becomes or how it ends: the
# tokenizer and its chat template, the generation defaults (end tokens), and a vision-language model's processor
# files (pixel bounds, frame sampling: model/image_processor.py).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                    "generation_config.json")


def reading_files(folder: Path, vision: bool) -> dict[str, str]:
    """The digest of each of the files above the checkpoint has: one edited between runs (a new chat template, a
    pixel bound) changes rows' tokens, so a partial run made before must not be resumed after."""
    from cbatch.model.image_processor import IMAGE_CONFIG, PROCESSOR_CONFIG, VIDEO_CONFIG

    names = _TOKENIZER_FILES + ((PROCESSOR_CONFIG, IMAGE_CONFIG, VIDEO_CONFIG) if vision else ())
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in names
            if (folder / name).is_file()}


def input_digest(source: InputFile) -> str:
    """INPUT's bytes: a one-file INPUT's digest (as it always was); several files: the digest of their names
    (relative to the first's folder) and digests, in order, so a file added, removed, renamed or changed is a
    different input."""
    if len(source.parts) == 1:
        return part_digest(source.parts[0])
    root = source.parts[0].path.parent
    lines = [f"{_relative(part.path, root)}\t{part_digest(part)}" for part in source.parts]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _relative(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def nothing_to_retry(options: JobOptions, formats: JobFormats, state: JobState, task: Task) -> bool:
    """--retry-errors: checks that OUTPUT may be retried (raises JobError); True when it has no error rows.

    A retry runs the error rows under this job's settings, which may differ from those OUTPUT was made
    with (that is its point: a fixed --max-model-len, another model); the other rows are kept as they
    are, so OUTPUT's columns must be the ones this job writes."""
    if options.overwrite:
        raise JobError("--retry-errors keeps OUTPUT's ok rows and --overwrite discards them: give one of the two")
    if formats.openai_lines:
        raise JobError("--retry-errors: OpenAI batch output lines cannot be read back as rows; retry a job written "
                       "with --output-format cbatch, or run again with --overwrite")
    try:
        state.check(False, retry_errors=True)
    except StateError as exc:
        raise JobError(str(exc)) from None
    if state.dir.exists():  # a retry that was interrupted: resume it
        return False
    written = written_columns(options.output, formats.output)
    columns = tuple(c for c in written if c in state.own_columns)  # cbatch's own; the others are --keep-columns'
    kept = tuple(c for c in written if c not in state.own_columns)
    expected = tuple(output_columns(options.token_ids, columns, task.columns))  # optional columns as OUTPUT has them
    if columns != expected:
        raise JobError(f"--retry-errors: {options.output} has the columns {', '.join(columns)}, this job writes "
                       f"{', '.join(expected)}; give the same --token-ids as the job that wrote it")
    keep = formats.keep
    if (keep is None and kept) or (keep is not None and keep.names is not None and tuple(keep.names) != kept):
        has = f"the kept columns {', '.join(kept)}" if kept else "no kept columns"
        raise JobError(f"--retry-errors: {options.output} has {has}; give the same --keep-columns as the job that "
                       "wrote it")
    return state.recorded_errors() == 0


def preflight(options: JobOptions) -> PreparedJob | None:
    """Every check that can refuse the job (raises JobError); None when OUTPUT is already complete for
    this input and these settings (nothing to do)."""
    formats, total_rows = validate_paths(options)
    model = resolve_or_fail(options.engine)
    task = resolve_task(options, model)
    fingerprint = job_fingerprint(options, model, formats.input, task)
    parts = PartitionedOutput(options.output, formats.parts, total_rows) if formats.parts is not None else None
    state = JobState(options.output, fingerprint, formats.output, parts, OUTPUT_COLUMNS + task.columns)
    done = nothing_to_retry(options, formats, state, task) if options.retry_errors else not options.overwrite and state.is_complete()
    if done:
        if not options.quiet:
            what = "has no error rows to retry" if options.retry_errors else "is already complete for this input and settings"
            print(f"cbatch: {options.output} {what}; nothing to do", file=sys.stderr)
        return None
    try:
        state.check(options.overwrite, options.retry_errors)
    except StateError as exc:
        raise JobError(str(exc)) from None
    graphs = options.engine.cuda_graph_max_batch or total_rows * max(1, options.defaults.n)  # a row's own n may run eager
    config = replace(options.engine, model=str(model.checkpoint.path), cuda_graph_max_batch=graphs)
    return PreparedJob(total_rows, config, model, fingerprint, state, formats, task)


def resolve_task(options: Any, model: ResolvedModel) -> Task:
    """The job's --task with its settings against the model (cbatch/tasks/); a task the model cannot do is a
    JobError. `options`: a JobOptions, or `cbatch plan`'s PlanOptions (the same task fields)."""
    try:
        task = make_task(options, model.checkpoint.spec, model.checkpoint.path)
        check_task_flags(task, options, options.engine.tensor_parallel_size)
    except UserError as exc:
        raise JobError(str(exc)) from None
    return task
