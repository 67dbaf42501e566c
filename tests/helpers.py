"""Small helpers shared by the engine tests."""
from __future__ import annotations

import os
import random
from pathlib import Path

from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.engine import Engine, run_to_completion


def triton_device() -> str:
    """Where Triton-backend engines run in tests: the CPU under the interpreter (no GPU), else the GPU."""
    return "cpu" if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") else "cuda"


def make_engine(path: Path, **settings) -> Engine:
    """An engine on the CPU; Triton-backend engines on `triton_device()`."""
    settings.setdefault("device", triton_device() if settings.get("attention_backend") == "triton" else "cpu")
    return build_engine(EngineConfig(model=str(path), **settings))


def random_prompts(n: int, vocab: int, seed: int, min_len: int = 1, max_len: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    per_row = params if isinstance(params, list) else [params] * len(prompts)
    return [o.token_ids for o in run_to_completion(engine, prompts, per_row)]
