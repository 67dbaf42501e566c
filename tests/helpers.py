"""Small helpers shared by the engine tests: engines on tiny checkpoints, and schedulers on fake requests."""
from __future__ import annotations

import os
import random
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.engine import Engine, run_to_completion
from cbatch.engine.kv_blocks import BlockPool
from cbatch.engine.policy import get_policy
from cbatch.engine.batching import ADMISSIONS
from cbatch.engine.scheduler import Scheduler
from cbatch.engine.step import StepPlan
from cbatch.engine.sequence import Sequence


# ---- where the Triton kernels run ----------------------------------------------------------------------
TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_device() -> str:
    """"cpu" under Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 when there is no GPU), else
    "cuda"; skips the calling test module where neither can run (no GPU, interpreter turned off)."""
    if TRITON_INTERPRET:
        return "cpu"
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device and TRITON_INTERPRET is off", allow_module_level=True)
    return "cuda"


def triton_device() -> str:
    """Where Triton-backend engines run in tests: the CPU under the interpreter (no GPU), else the GPU."""
    return "cpu" if TRITON_INTERPRET else "cuda"


# ---- engines ----------------------------------------------------------------------------------------
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


def ranks_generate(path: Path, tensor_parallel_size: int, prompts: list[list[int]],
                   params: SamplingParams | list[SamplingParams] | None = None,
                   **settings) -> tuple[list[list[int]], dict]:
    """Greedy tokens of `prompts` (default: ignore_eos, 12 tokens each) on `tensor_parallel_size` CPU ranks, and
    the scheduler's counters (the schedules of two runs compare; with --expert-parallel, the `ExpertLoad` summary
    too)."""
    config = EngineConfig(model=str(path), device="cpu", tensor_parallel_size=tensor_parallel_size, **settings)
    engine = build_engine(config)
    params = params or SamplingParams(max_tokens=12, ignore_eos=True)
    try:
        outputs = run_to_completion(engine, prompts, params if isinstance(params, list) else [params] * len(prompts))
        stats = engine.scheduler.stats
        counters = {"preemptions": stats.preemptions, "steps": stats.steps, "scheduled_tokens": stats.scheduled_tokens}
        load = getattr(engine.runner.model, "expert_load", None)  # expert parallelism: the assignments per rank
        return [o.token_ids for o in outputs], counters | ({"expert_load": load.summary()} if load is not None else {})
    finally:
        engine.close()


# ---- schedulers on fake requests (no model, no tensors) ---------------------------------------------
def fake_scheduler(policy: str = "fcfs", blocks: int = 100, block_size: int = 4, max_seqs: int = 8, budget: int = 32,
                   max_len: int = 1000, caching: bool = False, **options) -> tuple[Scheduler, BlockPool]:
    """A scheduler and its block pool; `options` are the scheduler's own (priority, preemption, num_host_blocks)
    and `reserve=True` for reserve admission."""
    pool = BlockPool(blocks, block_size, enable_caching=caching)
    admission = ADMISSIONS["reserve" if options.pop("reserve", False) else "optimistic"]()
    return Scheduler(get_policy(policy), pool, max_seqs, budget, max_len, admission=admission, **options), pool


def fake_seq(i: int, prompt: int | list[int], max_tokens: int = 8, priority: int = 0) -> Sequence:
    """Request `i`; `prompt` is its token ids, or a length (ids 3, 4, ...)."""
    prompt_ids = list(range(3, prompt + 3)) if isinstance(prompt, int) else list(prompt)
    return Sequence(seq_id=i, prompt_ids=prompt_ids, params=SamplingParams(max_tokens=max_tokens, priority=priority))


def advance(sched: Scheduler, plan: StepPlan, token: int = 7) -> list[Sequence]:
    """The engine's own post-step update, every sampling sequence drawing `token`; the finished sequences."""
    return sched.update(plan, defaultdict(lambda: token))


def step(sched: Scheduler, token: int = 7) -> StepPlan:
    """One whole step of the engine's bookkeeping on fake tokens (rows finish at their max_tokens)."""
    plan = sched.schedule()
    advance(sched, plan, token)
    return plan
