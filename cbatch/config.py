"""Every engine knob in one place (`EngineConfig`) with the names it accepts, per-request sampling settings
(`SamplingParams`), and the errors of a user's mistake. The ground floor: it imports nothing of cbatch."""
from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from pathlib import Path
from typing import Any, Callable, Iterator

DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
PREEMPTION_MODES: tuple[str, ...] = ("recompute", "swap", "auto")
ADMISSION_MODES: tuple[str, ...] = ("optimistic", "reserve")
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp8")
# speculative decoding's draft sources (cbatch/engine/speculative/): never a change of any token
SPECULATIVE_MODES: tuple[str, ...] = ("off", "ngram", "suffix", "auto")
# The names of what the layers above register (tests/test_registries.py holds them to these): admission policies
# (cbatch/engine/policy.py, the default first) and compute backends.
POLICIES: tuple[str, ...] = ("longest-first", "fcfs", "static", "prefix")
# A compute backend is a file cbatch/model/backend/NAME_backend.py that registers NAME: the names are read from the
# file names (importing the backends would import torch, which the command line keeps out of its start-up).
BACKEND_FILE_SUFFIX = "_backend.py"
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", *sorted(
    path.name.removesuffix(BACKEND_FILE_SUFFIX)
    for path in (Path(__file__).parent / "model" / "backend").glob(f"*{BACKEND_FILE_SUFFIX}")))
# A task is a file cbatch/tasks/NAME_task.py that registers NAME (cbatch/tasks/__init__.py): read from the file names
# in the same way, `generate` (the default) first.
TASK_FILE_SUFFIX = "_task.py"
TASKS: tuple[str, ...] = ("generate", *sorted(
    name for path in (Path(__file__).parent / "tasks").glob(f"*{TASK_FILE_SUFFIX}")
    if (name := path.name.removesuffix(TASK_FILE_SUFFIX)) != "generate"))


def cache_root() -> Path:
    """Where cbatch keeps what it converts or builds once (the default model, the CPU kernels): $CBATCH_CACHE,
    else ~/.cache/cbatch."""
    return Path(os.environ.get("CBATCH_CACHE", Path.home() / ".cache" / "cbatch"))


class UserError(ValueError):
    """A user's mistake (exit 2 on the command line): the message names the file, field or flag and the fix."""


class ConfigError(UserError):
    """A bad setting. `field` is the EngineConfig or SamplingParams field at fault (the command line names
    its flag instead: cbatch/cli/flags.py maps fields to flags); `reason` says what is wrong and the fix."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


# Which EngineConfig fields change what a row's output is (its tokens, vectors or columns): a field's metadata says,
# and the output identity (cbatch/run/identity.py) that both the resume fingerprint and the result-cache key are made
# from follows it, so an output-changing flag is one field here. ALWAYS: its (resolved) value is always part of it;
# CHANGED: only when it differs from its default (a flag added later: identities written before it still hold);
# FILES: identified by the files it names (the checkpoint, the adapters), which each consumer digests its own way;
# SEED: the job's seed, which a sampled row without its own draws from (the result cache keys each row by the seed
# it uses instead: a greedy row uses none).
OUTPUT_ALWAYS = MappingProxyType({"output": "always"})
OUTPUT_SEED = MappingProxyType({"output": "seed"})
OUTPUT_CHANGED = MappingProxyType({"output": "changed"})
OUTPUT_FILES = MappingProxyType({"output": "files"})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of one engine instance. Defaults are the CLI's defaults. A field that changes outputs says so in its
    metadata (OUTPUT_ALWAYS, OUTPUT_CHANGED, OUTPUT_FILES, OUTPUT_SEED); the others only change how fast the job runs."""

    model: str | None = field(default=None, metadata=OUTPUT_FILES)  # folder or hub id; None = the default model (SmolLM2-135M-Instruct)
    device: str = field(default="auto", metadata=OUTPUT_ALWAYS)  # auto | cpu | cuda
    dtype: str = field(default="auto", metadata=OUTPUT_ALWAYS)  # auto (float32 on CPU, the checkpoint's dtype on GPU) | float32 | bfloat16 | float16
    # None = the device's default (cbatch.engine.memory): CPU 256 / 2048; GPU sized from memory, up to 1024 / 8192.
    # An engine's own config always has them set (build_engine fills them in).
    max_num_seqs: int | None = None  # sequences in one step
    max_num_batched_tokens: int | None = None  # token budget of one step (decodes + prefill chunks)
    # image tokens the vision tower may encode in one step (rows with images; None: no limit; engine/encoder_budget.py)
    max_image_tokens_per_step: int | None = None
    # rows with images (Qwen-VL): the job's pixel bounds over the model's preprocessor_config.json (None: the model's).
    # They decide each image's tokens, and the largest image the GPU reserves memory for (engine/encoder_memory.py)
    image_min_pixels: int | None = field(default=None, metadata=OUTPUT_CHANGED)
    image_max_pixels: int | None = field(default=None, metadata=OUTPUT_CHANGED)
    # rows with videos (Qwen2-VL, Qwen2.5-VL): the job's per-frame pixel bounds over the model's video processor's
    # (model/image_processor.video_limits; None: the model's). The image bounds above never apply to video frames
    video_min_pixels: int | None = field(default=None, metadata=OUTPUT_CHANGED)
    video_max_pixels: int | None = field(default=None, metadata=OUTPUT_CHANGED)
    # rows with videos: frames sampled per second of video over the model's video processor's `fps` (None: the model's)
    video_fps: float | None = field(default=None, metadata=OUTPUT_CHANGED)
    # rows with images (Gemma 3): pan-and-scan crops of wide and tall images (None: the model's do_pan_and_scan)
    image_pan_and_scan: bool | None = field(default=None, metadata=OUTPUT_CHANGED)
    # rows with images or videos: at most N of a kind ("image", "video") in one prompt, (kind, N) pairs; a row
    # with more is an error row (vLLM's limit_mm_per_prompt; 0: the kind is refused; none: no limit)
    limit_mm_per_prompt: tuple[tuple[str, int], ...] = ()
    block_size: int = 16  # tokens per KV block
    kv_cache_dtype: str = field(default="auto", metadata=OUTPUT_CHANGED)  # auto (the activations' dtype) | fp8 (e4m3, per-head scales: half the KV bytes)
    num_kv_blocks: int | None = None  # None = size the pool from the memory budget
    kv_cache_memory_gb: float | None = None  # CPU memory budget for the KV pool; None = automatic
    gpu_memory_utilization: float = 0.9  # share of GPU memory cbatch may use (weights + activations + KV)
    policy: str = "longest-first"  # admission order: longest-first | fcfs | static
    attention_backend: str = field(default="auto", metadata=OUTPUT_ALWAYS)  # auto (triton on CUDA, cpu on CPU: torch without a C++ compiler) | ATTENTION_BACKENDS
    max_model_len: int | None = field(default=None, metadata=OUTPUT_ALWAYS)  # None = the model's max_position_embeddings
    seed: int = field(default=0, metadata=OUTPUT_SEED)  # seed for requests that give none
    num_threads: int | None = None  # CPU threads for torch; None = torch's default
    enforce_eager: bool = False  # GPU: no CUDA graphs for decode steps
    # GPU: the largest decode batch captured as a CUDA graph (None: max_num_seqs). A job sets the number of sequences
    # it can run at once (its rows x n): a 256-row job captures 20 graphs, not 68 up to 1024 (a larger batch runs eager)
    cuda_graph_max_batch: int | None = None
    tune_kernels: bool = True  # GPU: time decode attention's tile candidates at start-up, keep the fastest (cached)
    # GPU, with tune_kernels: time a Triton GEMM's tile configs against cuBLAS per layer shape and decode batch size
    # (<= 256 rows) at start-up; decode steps' CUDA graphs run it where it was faster (kernels/gemm.py). Off: cuBLAS
    decode_gemm: bool = True
    # GPU: the sampling kernel splits each row's vocabulary over several programs (about 4 per SM in all), then
    # reduces the partials per row; off: one program per row. The tokens are the same either way.
    split_sampler: bool = True
    # GPU, bfloat16/float16 models: the lm_head GEMM writes float32 logits (soft-capping then in float32); off: HF's
    # logits, rounded to the model's dtype (soft-capped there), then float32. Greedy near-ties may differ.
    fp32_logits: bool = field(default=True, metadata=OUTPUT_CHANGED)
    # GPU: decode attention cuts long contexts into key segments when a step has few sequences (split-KV,
    # kernels/paged_attention.auto_num_splits); False: one program per (sequence, kv head), to measure the gain
    split_kv: bool = True
    enable_prefix_cache: bool = True  # share computed full KV blocks between requests with the same prefix
    preemption: str = "recompute"  # recompute | swap | auto (swap victims whose recompute would be long)
    swap_space_gb: float = 4.0  # host memory for swapped-out KV blocks
    admission: str = "optimistic"  # optimistic (admit on the prompt) | reserve (prompt + max_tokens must fit)
    priority_aging_steps: int | None = 1000  # a waiting request gains one priority class per this many steps
    tensor_parallel_size: int = 1  # ranks each layer is split across (one process per rank; cbatch/parallel)
    # MoE: each of those ranks holds num_experts / N whole experts (attention stays split by heads)
    expert_parallel: bool = False
    # schedule step N+1 while the device runs step N; None = on for CUDA with one rank (build_engine decides)
    async_scheduling: bool | None = None
    # LoRA adapters rows may name (docs/lora.md): (name, PEFT folder) each; at most max_loras in one step
    loras: tuple[tuple[str, str], ...] = field(default=(), metadata=OUTPUT_FILES)
    max_loras: int = 4  # adapter slots: distinct adapters among one step's rows
    max_lora_rank: int = 16  # the largest adapter rank the slots hold
    lora_grouping: bool = True  # admission takes the waiting rows adapter by adapter (fewer adapters per step)
    # speculative decoding without a second model (docs/speculative.md): drafted tokens are verified exactly (a
    # draft is kept only where it equals the token a plain decode step would choose), so no output changes and
    # none of these fields is an output setting. off | ngram (prompt lookup over the row's own tokens) | suffix
    # (also the job's finished outputs) | auto (suffix, per step and row where the measured acceptance pays)
    speculative: str = "off"
    speculative_tokens: int = 4  # the most tokens drafted for a row in one step (k)
    speculative_min_ngram: int = 2  # the shortest suffix of a row's tokens a draft is looked up by
    speculative_max_ngram: int = 5  # the longest

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, fix: str) -> None:
            if not ok:
                raise ConfigError(name, fix)

        def one_of(name: str, choices: tuple[str, ...]) -> None:
            value = getattr(self, name)
            check(value in choices, name, f"must be one of {', '.join(choices)}, not {value!r}")

        one_of("device", DEVICES)
        one_of("dtype", DTYPES)
        one_of("policy", POLICIES)
        one_of("attention_backend", ATTENTION_BACKENDS)
        one_of("preemption", PREEMPTION_MODES)
        one_of("admission", ADMISSION_MODES)
        one_of("kv_cache_dtype", KV_CACHE_DTYPES)
        one_of("speculative", SPECULATIVE_MODES)
        check(1 <= self.speculative_tokens <= 64, "speculative_tokens", "must be between 1 and 64")
        check(1 <= self.speculative_min_ngram <= self.speculative_max_ngram <= 32, "speculative_min_ngram",
              "must be at least 1 and at most --speculative-max-ngram (at most 32)")
        check(self.max_num_seqs is None or self.max_num_seqs >= 1, "max_num_seqs", "must be at least 1")
        check(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
              "must be at least 1")
        check(self.max_image_tokens_per_step is None or self.max_image_tokens_per_step >= 1,
              "max_image_tokens_per_step", "must be at least 1")
        for kind in ("image", "video"):
            low, high = getattr(self, f"{kind}_min_pixels"), getattr(self, f"{kind}_max_pixels")
            check(low is None or low >= 1, f"{kind}_min_pixels", "must be at least 1")
            check(high is None or high >= max(low or 1, 1), f"{kind}_max_pixels",
                  f"must be at least 1 and at least --{kind}-min-pixels")
        check(self.video_fps is None or self.video_fps > 0, "video_fps", "must be above 0 (frames per second, e.g. 1)")
        check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size",
              "must be a power of two (e.g. 16)")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be at least 1")
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1], e.g. 0.9")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be at least 1")
        # rows without a seed draw from (job seed << 32) ^ row index, an int64
        check(-(2**31) <= self.seed < 2**31, "seed", "must be a 32-bit integer (-2147483648..2147483647)")
        check(self.swap_space_gb >= 0, "swap_space_gb", "must be a non-negative number of GB, e.g. 4")
        check(self.tensor_parallel_size >= 1, "tensor_parallel_size", "must be at least 1")
        check(not (self.expert_parallel and self.tensor_parallel_size == 1), "expert_parallel",
              "spreads the experts over the tensor-parallel ranks; give --tensor-parallel-size N > 1 as well")
        check(not (self.async_scheduling and self.tensor_parallel_size > 1), "async_scheduling",
              "does not work with --tensor-parallel-size > 1 yet (the workers need each step's tokens); leave it off")
        check(self.priority_aging_steps is None or self.priority_aging_steps >= 0, "priority_aging_steps",
              "must be a non-negative number of steps (0 = no aging)")
        check(self.max_loras >= 1, "max_loras", "must be at least 1")
        check(self.max_lora_rank >= 1, "max_lora_rank", "must be at least 1")
        names = [name for name, _ in self.loras]
        check(len(set(names)) == len(names), "lora", "names an adapter twice; give each adapter one name")
        kinds = [kind for kind, _ in self.limit_mm_per_prompt]
        check(set(kinds) <= {"image", "video"} and len(set(kinds)) == len(kinds)
              and all(isinstance(n, int) and n >= 0 for _, n in self.limit_mm_per_prompt), "limit_mm_per_prompt",
              "takes image and video, each once, with a count of at least 0 (e.g. image=4,video=1)")


def mm_limits(value: Any, where: str) -> tuple[tuple[str, int], ...]:
    """vLLM's limit_mm_per_prompt ({"image": 4, "video": 1}; a count may be {"count": N}), or the flag's
    image=4,video=1 (or that JSON), as EngineConfig.limit_mm_per_prompt's pairs; a UserError naming `where`."""
    if isinstance(value, str):
        text = value.strip()
        try:
            value = json.loads(text) if text.startswith("{") else {
                kind.strip(): int(count) for kind, _, count in (part.partition("=") for part in text.split(","))}
        except ValueError:
            raise UserError(f"{where}: expected image=N,video=N (or JSON such as {{\"image\": 4}}), not {text!r}") from None
    if not isinstance(value, dict):
        raise UserError(f"{where}: a dict such as {{\"image\": 4, \"video\": 1}}, not {type(value).__name__}")
    pairs = []
    for kind, count in value.items():
        if isinstance(count, dict):  # vLLM's {"count": N, "width": W, ...}: the rest sizes its memory profile
            extra = sorted(set(count) - {"count"})
            if extra:
                raise UserError(f"{where}: {kind}'s {', '.join(extra)} size vLLM's memory profile; cbatch sizes its "
                                "memory from the images themselves: give the count alone")
            count = count.get("count")
        if kind not in ("image", "video") or isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise UserError(f"{where}: takes image and video counts of at least 0 (e.g. image=4,video=1), not "
                            f"{kind!r}: {count!r}")
        pairs.append((kind, count))
    return tuple(sorted(pairs))


_INT64 = 2**63  # sampling settings become int64 tensors
MAX_LOGPROBS = 20  # most `logprobs` / `prompt_logprobs` per token (vLLM's default max_logprobs)
MAX_SAMPLES = 4096  # most samples (`n`) per row
MAX_LOGIT_BIAS = 100.0  # |bias| limit, as OpenAI's and vLLM's logit_bias
# keys of apply_chat_template that cbatch sets itself: a row may not override them
RESERVED_TEMPLATE_KWARGS = ("conversation", "messages", "tokenize", "add_generation_prompt", "return_dict",
                            "return_tensors", "padding", "truncation", "max_length", "tokenizer_kwargs")


CONSTRAINT_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a constrained completion must match (structured output, cbatch/engine/structured.py).

    `text` is the constraint's canonical text, the key its compiled grammar is cached by: the schema as
    compact JSON (property order kept: it is the output's order), the regex, the choices as a JSON list,
    "" for json_object (any JSON object), the EBNF text of a grammar (xgrammar's dialect; the library's
    `structured_outputs.grammar`: no row field gives one), an xgrammar structural tag as compact JSON (tool
    calls: cbatch/tools)."""

    kind: str  # one of CONSTRAINT_KINDS
    text: str
    source: str = field(default="", compare=False)  # the row field or flag it came from (error messages)


@dataclass(slots=True)
class SamplingParams:
    """How to generate one completion, with vLLM's names and meanings. temperature 0 means greedy.

    Order in which they act on the logits (cbatch/engine/sampler.py): logit_bias -> min_tokens (EOS and
    stop_token_ids banned) -> repetition / frequency / presence penalties -> temperature -> min_p ->
    top-k / top-p -> the seeded draw. Log-probabilities are of the raw logits (vLLM v1's default).

    Every field but `constraint` and `lora` (a name of the job's adapters: engine.py checks it) has an entry in
    SAMPLING_FIELDS (below): its checks, its row field, flag and OpenAI body field. A new setting is a field here, an entry there, and the code that applies it.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None  # per-request seed: same tokens whatever else is in the batch
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0  # scheduling class: lower is admitted sooner (and preempted later)
    n: int = 1  # samples per row: the prompt is computed once, sample i draws from (seed, i)
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and the output (HF / vLLM / CTRL)
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    min_tokens: int = 0  # no EOS, stop token or stop string before this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # finish (reason "stop") on any of these tokens
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    logprobs: int | None = None  # k: each generated token's log-probability and the k most likely
    prompt_logprobs: int | None = None  # k: the same for the prompt's tokens
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra chat template variables
    truncate_prompt_tokens: int | None = None  # k: a longer prompt runs on its last k tokens
    thinking_token_budget: int | None = None  # most tokens inside <think>...</think>; then the think-end is forced
    constraint: Constraint | None = None  # structured output: the completion must match it
    lora: str | None = None  # the LoRA adapter the row runs with (a name of EngineConfig.loras); None = the base model

    def problem(self) -> tuple[str, str] | None:
        """(field, a sentence naming it and what is wrong) for the first unusable setting, or None."""
        for name, bad, rule in self._checks():
            if bad:
                return name, f"{name} {rule}, got {getattr(self, name)!r}"
        return None

    def _checks(self) -> Iterator[tuple[str, bool, str]]:
        """(field, is it bad, the rule it breaks): each field's rules from SAMPLING_FIELDS, in the order the
        fields are declared above, then the checks no single rule says. A field at its default passes its rules
        (tests hold the defaults to them) and is skipped: a row sets a few fields of twenty, and a job checks
        every row (twice)."""
        for name, default in _sampling_defaults():
            value = getattr(self, name)
            if value is default or (type(value) is type(default) and value == default):  # (True == 1: not a default)
                continue
            spec = SAMPLING_FIELDS.get(name)
            if spec is None or (value is None and name in _NONE_IS_OFF):
                continue  # the constraint is checked where it is parsed (io/constraints.py)
            for rule in spec.rules:
                yield name, rule.bad(value), rule.text
        yield "min_tokens", not _bad_int(self.min_tokens, 0, _INT64) and not _bad_int(self.max_tokens, 1, _INT64) \
            and self.min_tokens > self.max_tokens, f"must not exceed max_tokens ({self.max_tokens})"
        kwargs = self.chat_template_kwargs
        reserved = [k for k in RESERVED_TEMPLATE_KWARGS if isinstance(kwargs, dict) and k in kwargs]
        yield "chat_template_kwargs", bool(reserved), f"may not set {', '.join(reserved)} (cbatch sets it)"

    def validate(self) -> str | None:
        """A message naming the bad field, or None when the settings are usable."""
        problem = self.problem()
        return problem[1] if problem else None

    @property
    def penalized(self) -> bool:
        """Uses a penalty that needs the row's token counts."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def changed_fields(self) -> dict[str, Any]:
        """The fields set away from their defaults (what a job's fingerprint keeps of the newer ones)."""
        default = SamplingParams()
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)}


@functools.lru_cache(maxsize=1)
def _sampling_defaults() -> tuple[tuple[str, Any], ...]:
    """(field, its default) of SamplingParams, in declaration order."""
    return tuple((f.name, getattr(SamplingParams(), f.name)) for f in fields(SamplingParams))


# ---- the sampling fields, once ---------------------------------------------------------------------------
# How a field's value is carried (cbatch/io/rows.py reads rows by it, cbatch/cli/flags.py types flags by it).
INT, NUMBER, BOOL, STRINGS, TOKEN_IDS, TOKEN_BIASES, OBJECT = (
    "integer", "number", "boolean", "strings", "token ids", "token biases", "object")
LIST_KINDS = (STRINGS, TOKEN_IDS)  # a row may give one value for a list of one; the flag is repeatable
JSON_KINDS = (TOKEN_BIASES, OBJECT)  # the flag takes JSON text


def _bad_int(value: Any, low: int, high: int) -> bool:
    """Not an integer (a bool is not one) in [low, high)."""
    return isinstance(value, bool) or not isinstance(value, int) or not low <= value < high


def _not_number(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, (int, float))


def _bad_number(value: Any, low: float = -math.inf, high: float = math.inf) -> bool:
    """Not a finite number in [low, high]."""
    return _not_number(value) or not math.isfinite(value) or not low <= value <= high


@dataclass(frozen=True, slots=True)
class Rule:
    """One check of a field's value: `bad(value)` is True for a value that breaks `text`."""

    bad: Callable[[Any], bool]
    text: str  # what the error says after the field's name: "must be a positive integer"


def _integer(low: int, high: int, text: str) -> Rule:
    return Rule(lambda v: _bad_int(v, low, high), text)


def _number(low: float, high: float, text: str) -> Rule:
    return Rule(lambda v: _bad_number(v, low, high), text)


@dataclass(frozen=True, slots=True)
class SamplingField:
    """One per-row sampling setting everywhere it appears: the SamplingParams field of the same name, the row
    field, the flag that sets the rows' default and the OpenAI batch body field. The row parser
    (cbatch/io/rows.py), the flags (cbatch/cli/flags.py), the OpenAI body table (cbatch/io/openai.py),
    SamplingParams' checks and docs/sampling.md's table are all made from SAMPLING_FIELDS."""

    name: str  # the SamplingParams field and the row field (vLLM's name); its default is SamplingParams'
    kind: str  # how its value is carried: INT, NUMBER, BOOL, STRINGS, TOKEN_IDS, TOKEN_BIASES or OBJECT
    help: str  # the flag's help (--help, docs/cli.md)
    meaning: str  # a few words for the tables of docs/sampling.md and docs/structured-output.md
    rules: tuple[Rule, ...]  # what a usable value is, checked in order (None is "off" where the default is None)
    flag: str | None = None  # the flag's keyword when it is not `name` (--stop-token-id: "stop_token_id")
    metavar: str | None = None  # the flag's value in --help (K, ID); JSON for JSON_KINDS
    flag_sets_default: bool = True  # False: the flag sets something else of the job (--seed: the job seed)
    in_body: bool = True  # an OpenAI batch body may give it (under `name`)
    body_note: str | None = None  # what the OpenAI body table says, when not `meaning`

    @property
    def default(self) -> Any:
        return getattr(SamplingParams(), self.name)


_INT64_RULE = _integer(-_INT64, _INT64, "must be a 64-bit integer")
_LOGPROBS_RULE = _integer(0, MAX_LOGPROBS + 1, f"must be an integer from 0 to {MAX_LOGPROBS} (or null = off)")
_PENALTY_RULE = _number(-2.0, 2.0, "must be in [-2, 2] (0 = off)")

# In the flags' order (--help, docs/cli.md).
SAMPLING_FIELDS: dict[str, SamplingField] = {f.name: f for f in (
    SamplingField("max_tokens", INT, "Most tokens to generate per row.", "most tokens generated",
                  (_integer(1, _INT64, "must be a positive integer"),)),
    SamplingField("temperature", NUMBER, "0 = greedy.", "0 = greedy",
                  (Rule(_not_number, "must be a number"), _number(0.0, 100.0, "must be in [0, 100]"))),
    SamplingField("top_p", NUMBER, "Nucleus sampling mass (1 = off).", "nucleus mass",
                  (Rule(lambda v: _not_number(v) or not 0.0 < v <= 1.0, "must be in (0, 1]"),)),
    SamplingField("top_k", INT, "Keep the k most likely tokens (0 = off).", "keep the k most likely (0 = off)",
                  (_integer(0, _INT64, "must be a non-negative integer (0 = off)"),)),
    SamplingField("seed", INT, "Job seed: rows without their own `seed` draw from (job seed, row index), so reruns "
                  "are reproducible.", "the row's seed: the same tokens whatever the batch", (_INT64_RULE,),
                  flag_sets_default=False),
    SamplingField("stop", STRINGS, "Stop string (repeatable); not included in the completion.",
                  "stop strings, cut from the text",
                  (Rule(lambda v: not isinstance(v, list) or not all(isinstance(s, str) and s for s in v),
                        "must be a string or a list of non-empty strings"),)),
    SamplingField("ignore_eos", BOOL, "Keep generating past EOS (benchmarks).", "generate past EOS",
                  (Rule(lambda v: not isinstance(v, bool), "must be true or false"),)),
    SamplingField("priority", INT, "Scheduling priority of rows without their own `priority` (lower = sooner).",
                  "scheduling class, lower first", (_integer(-_INT64, _INT64, "must be an integer (lower = sooner)"),)),
    SamplingField("n", INT, "Samples per row: one output row each (`sample_index`); the prompt is computed once.",
                  "samples per row", (_integer(1, MAX_SAMPLES + 1, f"must be an integer from 1 to {MAX_SAMPLES}"),),
                  body_note="several completions per row: the line's `choices`, one per sample (index = sample)"),
    SamplingField("logprobs", INT, "Log-probability of each generated token and its K most likely tokens (columns "
                  "token_logprobs, top_logprobs).", "per generated token: its log-probability and the K most likely",
                  (_LOGPROBS_RULE,), metavar="K",
                  body_note="chat: true/false (with top_logprobs); completions: the number of alternatives"),
    SamplingField("prompt_logprobs", INT, "The same for the prompt's tokens (columns prompt_token_ids, "
                  "prompt_token_logprobs, prompt_top_logprobs).", "the same for the prompt's tokens",
                  (_LOGPROBS_RULE,), metavar="K",
                  body_note="the prompt tokens' log-probabilities (in the cbatch output format only)"),
    SamplingField("repetition_penalty", NUMBER, "Divide positive (multiply negative) logits of tokens in the prompt "
                  "or output by this (1 = off).", "> 1 discourages tokens of the prompt and the output",
                  (Rule(lambda v: _bad_number(v) or not v > 0, "must be a positive number (1 = off)"),)),
    SamplingField("presence_penalty", NUMBER, "Subtract this from the logits of tokens already generated (-2..2).",
                  "-2..2, once per token present in the output", (_PENALTY_RULE,)),
    SamplingField("frequency_penalty", NUMBER, "Subtract this times each token's count so far (-2..2).",
                  "-2..2, per occurrence in the output", (_PENALTY_RULE,)),
    SamplingField("min_p", NUMBER, "Drop tokens less likely than this times the most likely one (0 = off).",
                  "drop tokens below min_p x the top probability",
                  (_number(0.0, 1.0, "must be in [0, 1] (0 = off)"),)),
    SamplingField("min_tokens", INT, "No EOS, stop token or stop string before this many tokens.",
                  "no EOS, stop token or stop string before this many tokens",
                  (_integer(0, _INT64, "must be a non-negative integer"),)),
    SamplingField("stop_token_ids", TOKEN_IDS, "Stop on this token id (repeatable).", "stop on any of these tokens",
                  (Rule(lambda v: not isinstance(v, list) or any(_bad_int(t, 0, 2**31) for t in v),
                        "must be a list of token ids (non-negative integers)"),), flag="stop_token_id", metavar="ID"),
    SamplingField("logit_bias", TOKEN_BIASES, 'Token id -> bias added to its logit, JSON: \'{"1234": -100}\'.',
                  "token id -> bias added to its logit",
                  (Rule(lambda v: not isinstance(v, dict) or any(
                      _bad_int(t, 0, 2**31) or _bad_number(b, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS) for t, b in v.items()),
                      f"must map token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                      'e.g. {"1234": -100}'),)),
    SamplingField("chat_template_kwargs", OBJECT, 'Chat template variables, JSON: \'{"enable_thinking": false}\'.',
                  "extra chat template variables",
                  (Rule(lambda v: not isinstance(v, dict) or not all(isinstance(k, str) for k in v),
                        'must be an object of template variables, e.g. {"enable_thinking": false}'),)),
    SamplingField("truncate_prompt_tokens", INT, "Rows whose prompt is longer run on its last K tokens (vLLM's "
                  "truncate_prompt_tokens).", "a longer prompt runs on its last K tokens",
                  (_integer(1, _INT64, "must be a positive integer (or null = off)"),), metavar="K"),
    SamplingField("thinking_token_budget", INT, "A thinking model thinks at most N tokens, then is made to end its "
                  "thinking and answer (vLLM's thinking_token_budget; docs/tools.md).",
                  "most thinking tokens; then the think-end token is forced and the model answers",
                  (_integer(0, _INT64, "must be a non-negative integer (or null = no budget)"),), flag="thinking_budget",
                  metavar="N"),
)}
_NONE_IS_OFF = frozenset(f.name for f in fields(SamplingParams) if f.default is None)  # None passes their rules


def distinct_params(params: list[SamplingParams]) -> list[SamplingParams]:
    """The different SamplingParams objects among `params` (by identity), in first-seen order. The rows of a step
    usually share a few (a job's rows without settings of their own share the job's), so the host step's checks
    of an option run once per object, not once per row."""
    first = params[0] if params else None
    if all(p is first for p in params):
        return params[:1]
    return list({id(p): p for p in params}.values())
