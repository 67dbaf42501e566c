"""Every engine knob in one place (`EngineConfig`), and per-request sampling settings (`SamplingParams`)."""
from __future__ import annotations

from dataclasses import dataclass, field

DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
PREEMPTION_MODES: tuple[str, ...] = ("recompute", "swap", "auto")
ADMISSION_MODES: tuple[str, ...] = ("optimistic", "reserve")


class UserError(ValueError):
    """A user's mistake (exit 2 on the command line): the message names the file, field or flag and the fix."""


class ConfigError(UserError):
    """A bad setting. `field` is the EngineConfig or SamplingParams field at fault (the command line names
    its flag instead: cbatch/cli.py maps fields to flags); `reason` says what is wrong and the fix."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Settings of one engine instance. Defaults are the CLI's defaults."""

    model: str | None = None  # folder or hub id; None = the default model (SmolLM2-135M-Instruct)
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (float32 on CPU, the checkpoint's dtype on GPU) | float32 | bfloat16 | float16
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 2048  # token budget of one step (decodes + prefill chunks)
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None = size the pool from the memory budget
    kv_cache_memory_gb: float | None = None  # CPU memory budget for the KV pool; None = automatic
    gpu_memory_utilization: float = 0.9  # share of GPU memory cbatch may use (weights + activations + KV)
    policy: str = "longest-first"  # admission order: longest-first | fcfs | static
    attention_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | torch | triton
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0  # seed for requests that give none
    num_threads: int | None = None  # CPU threads for torch; None = torch's default
    enforce_eager: bool = False  # GPU: no CUDA graphs for decode steps
    enable_prefix_cache: bool = True  # share computed full KV blocks between requests with the same prefix
    preemption: str = "recompute"  # recompute | swap | auto (swap victims whose recompute would be long)
    swap_space_gb: float = 4.0  # host memory for swapped-out KV blocks
    admission: str = "optimistic"  # optimistic (admit on the prompt) | reserve (prompt + max_tokens must fit)
    priority_aging_steps: int | None = 1000  # a waiting request gains one priority class per this many steps

    def __post_init__(self) -> None:
        from cbatch.engine.policy import POLICIES
        from cbatch.model.backend import BACKENDS

        def check(ok: bool, name: str, fix: str) -> None:
            if not ok:
                raise ConfigError(name, fix)

        def one_of(name: str, choices: tuple[str, ...]) -> None:
            value = getattr(self, name)
            check(value in choices, name, f"must be one of {', '.join(choices)}, not {value!r}")

        one_of("device", DEVICES)
        one_of("dtype", DTYPES)
        one_of("policy", POLICIES)
        one_of("attention_backend", BACKENDS)
        one_of("preemption", PREEMPTION_MODES)
        one_of("admission", ADMISSION_MODES)
        check(self.max_num_seqs >= 1, "max_num_seqs", "must be at least 1")
        check(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be at least 1")
        check(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0, "block_size",
              "must be a power of two (e.g. 16)")
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks", "must be at least 1")
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization", "must be in (0, 1], e.g. 0.9")
        check(self.max_model_len is None or self.max_model_len >= 1, "max_model_len", "must be at least 1")
        # rows without a seed draw from (job seed << 32) ^ row index, an int64
        check(-(2**31) <= self.seed < 2**31, "seed", "must be a 32-bit integer (-2147483648..2147483647)")
        check(self.swap_space_gb >= 0, "swap_space_gb", "must be a non-negative number of GB, e.g. 4")
        check(self.priority_aging_steps is None or self.priority_aging_steps >= 0, "priority_aging_steps",
              "must be a non-negative number of steps (0 = no aging)")


_INT64 = 2**63  # sampling settings become int64 tensors

CONSTRAINT_KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a constrained completion must match (structured output, cbatch/engine/structured.py).

    `text` is the constraint's canonical text, the key its compiled grammar is cached by: the schema as
    compact JSON (property order kept: it is the output's order), the regex, the choices as a JSON list,
    "" for json_object (any JSON object)."""

    kind: str  # one of CONSTRAINT_KINDS
    text: str
    source: str = field(default="", compare=False)  # the row field or flag it came from (error messages)

@dataclass(slots=True)
class SamplingParams:
    """How to generate one completion. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k filter
    seed: int | None = None  # per-request seed: same tokens whatever else is in the batch
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    priority: int = 0  # scheduling class: lower is admitted sooner (and preempted later)
    constraint: Constraint | None = None  # structured output: the completion must match it

    def problem(self) -> tuple[str, str] | None:
        """(field, a sentence naming it and what is wrong) for the first unusable setting, or None."""
        def bad_int(value, low: int, high: int) -> bool:
            return isinstance(value, bool) or not isinstance(value, int) or not low <= value < high

        def bad_number(value) -> bool:
            return isinstance(value, bool) or not isinstance(value, (int, float))

        checks = (
            ("max_tokens", bad_int(self.max_tokens, 1, _INT64), "must be a positive integer"),
            ("temperature", bad_number(self.temperature), "must be a number"),
            ("temperature", not bad_number(self.temperature) and not 0.0 <= float(self.temperature) <= 100.0,
             "must be in [0, 100]"),
            ("top_p", bad_number(self.top_p) or not 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", bad_int(self.top_k, 0, _INT64), "must be a non-negative integer (0 = off)"),
            ("seed", self.seed is not None and bad_int(self.seed, -_INT64, _INT64), "must be a 64-bit integer"),
            ("stop", not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop),
             "must be a string or a list of non-empty strings"),
            ("ignore_eos", not isinstance(self.ignore_eos, bool), "must be true or false"),
            ("priority", bad_int(self.priority, -_INT64, _INT64), "must be an integer (lower = sooner)"),
        )
        for name, bad, rule in checks:
            if bad:
                return name, f"{name} {rule}, got {getattr(self, name)!r}"
        return None

    def validate(self) -> str | None:
        """A message naming the bad field, or None when the settings are usable."""
        problem = self.problem()
        return problem[1] if problem else None
