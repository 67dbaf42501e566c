"""Every engine knob in one place (`EngineConfig`), and per-request sampling settings (`SamplingParams`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Policy = Literal["longest-first", "fcfs", "static"]
POLICIES: tuple[str, ...] = ("longest-first", "fcfs", "static")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
PREEMPTION_MODES: tuple[str, ...] = ("recompute", "swap", "auto")
ADMISSION_MODES: tuple[str, ...] = ("optimistic", "reserve")


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
        def check(ok: bool, flag: str, fix: str) -> None:
            if not ok:
                raise ConfigError(f"{flag}: {fix}")

        check(self.device in DEVICES, "--device", f"must be one of {', '.join(DEVICES)}, not {self.device!r}")
        check(self.dtype in DTYPES, "--dtype", f"must be one of {', '.join(DTYPES)}, not {self.dtype!r}")
        check(self.policy in POLICIES, "--policy", f"must be one of {', '.join(POLICIES)}, not {self.policy!r}")
        check(
            self.attention_backend in ATTENTION_BACKENDS,
            "--attention-backend",
            f"must be one of {', '.join(ATTENTION_BACKENDS)}, not {self.attention_backend!r}",
        )
        check(self.max_num_seqs >= 1, "--max-num-seqs", "must be at least 1")
        check(self.max_num_batched_tokens >= 1, "--max-num-batched-tokens", "must be at least 1")
        check(
            self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
            "--block-size",
            "must be a power of two (e.g. 16)",
        )
        check(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "--num-kv-blocks", "must be at least 1")
        check(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "--gpu-memory-utilization",
            "must be in (0, 1], e.g. 0.9",
        )
        check(self.max_model_len is None or self.max_model_len >= 1, "--max-model-len", "must be at least 1")
        # rows without a seed draw from (job seed << 32) ^ row index, an int64
        check(-(2**31) <= self.seed < 2**31, "--seed", "must be a 32-bit integer (-2147483648..2147483647)")

        check(
            self.preemption in PREEMPTION_MODES,
            "--preemption",
            f"must be one of {', '.join(PREEMPTION_MODES)}, not {self.preemption!r}",
        )
        check(self.swap_space_gb >= 0, "--swap-space", "must be a non-negative number of GB, e.g. 4")
        check(
            self.admission in ADMISSION_MODES,
            "--admission",
            f"must be one of {', '.join(ADMISSION_MODES)}, not {self.admission!r}",
        )
        check(
            self.priority_aging_steps is None or self.priority_aging_steps >= 0,
            "--priority-aging-steps",
            "must be a non-negative number of steps (0 = no aging)",
        )


_INT64 = 2**63  # sampling settings become int64 tensors


class ConfigError(ValueError):
    """A user's mistake in settings: the message names the flag and the fix."""


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

    def validate(self) -> str | None:
        """Returns a message naming the bad field, or None when the settings are usable."""
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            return f"max_tokens must be a positive integer, got {self.max_tokens!r}"
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            return f"temperature must be a number, got {self.temperature!r}"
        if not 0.0 <= float(self.temperature) <= 100.0:
            return f"temperature must be in [0, 100], got {self.temperature!r}"
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) or not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or not 0 <= self.top_k < _INT64:
            return f"top_k must be a non-negative integer (0 = off), got {self.top_k!r}"
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -_INT64 <= self.seed < _INT64):
            return f"seed must be a 64-bit integer, got {self.seed!r}"
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            return f"stop must be a string or a list of non-empty strings, got {self.stop!r}"
        if not isinstance(self.ignore_eos, bool):
            return f"ignore_eos must be true or false, got {self.ignore_eos!r}"
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            return f"priority must be an integer (lower = sooner), got {self.priority!r}"
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
