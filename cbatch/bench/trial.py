"""One trial of `cbatch bench`: a workload under one policy through an engine, real or simulated.

The workload's requests become rows (`prompt_token_ids`, `max_tokens`, EOS ignored) handed to the same
driver and executor as `cbatch run`, each at its arrival step. The engine's runner is the model (a
checkpoint, or a weightless shape with random weights) or the simulator's cost model; one engine
serves every policy of a comparison (`Engine.reset(policy)` between trials), so trials differ only in
their scheduling.
"""
from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np

from cbatch.bench.result import BenchRun
from cbatch.bench.workload import BenchRequest, random_prompt
from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.engine import Engine
from cbatch.engine.resolve import resolve_model
from cbatch.observe.metrics import JobMetrics
from cbatch.observe.progress import NoProgress
from cbatch.run.driver import drive
from cbatch.run.executor import Executor, LocalExecutor
from cbatch.run.job_spec import JobSpec
from cbatch.tasks.generate_task import GenerateTask
from cbatch.tasks.results import RowResult

GREEDY = SamplingParams()


def make_bench_engine(config: EngineConfig, model_config: str | None, seed: int) -> Engine:
    """A checkpoint's engine (`config.model`), or a preset/config.json shape with random weights."""
    if model_config is None:
        return build_engine(config)
    from cbatch.model.presets import preset_spec

    return build_engine(config, resolve_model(config, preset_spec(model_config)), random_weights_seed=seed)


def warm_up(engine: Engine, seed: int) -> None:
    """A few short requests first, so one-off costs (allocator, kernel compilation) stay out of the timing."""
    rng = random.Random(seed)
    vocab = engine.spec.vocab_size
    for i in range(min(4, engine.config.max_num_seqs)):
        engine.add_request(random_prompt(rng, 16 + 8 * i, vocab), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def workload_prompts(requests: list[BenchRequest], vocab_size: int, seed: int, shared_prefix: int = 0) -> list[list[int]]:
    """Seeded random prompts of the workload's lengths (identical for every policy); the first
    `shared_prefix` tokens are the same in every prompt (a system prompt; `make_workload` counted them in
    each request's length)."""
    gen = np.random.default_rng(seed)
    low = min(3, vocab_size - 1)
    prefix = gen.integers(low, vocab_size, size=shared_prefix).tolist()
    return [prefix[: r.prompt_len] + gen.integers(low, vocab_size, size=max(0, r.prompt_len - shared_prefix)).tolist()
            for r in requests]


class WorkloadFeed:
    """The workload's rows, each handed to the executor once the engine reaches its arrival step."""

    def __init__(self, requests: list[BenchRequest], prompts: list[list[int]], steps: Callable[[], int]) -> None:
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        self._rows = [(requests[i].arrival, i, {"prompt_token_ids": prompts[i], "max_tokens": requests[i].output_len,
                                                  "ignore_eos": True}) for i in order]
        self._steps = steps
        self._next = 0
        self.exhausted = not self._rows

    def fill(self, executor: Executor) -> None:
        while self._next < len(self._rows) and self._rows[self._next][0] <= self._steps():
            _, index, row = self._rows[self._next]
            self._next += 1
            executor.submit(index, row)
        self.exhausted = self._next == len(self._rows)


def run_trial(engine: Engine, requests: list[BenchRequest], prompts: list[list[int]], policy: str,
              clock: Callable[[], float] | None = None, label: str | None = None, **settings: Any) -> BenchRun:
    """Runs the workload under `policy` (and other scheduling `settings`, e.g. enable_prefix_cache) on
    `engine` (reset first); time from the first step, on `clock` (wall time, or the simulator's cost clock)."""
    engine.reset(policy, **settings)
    run = BenchRun(policy, label=label or policy)
    run.finish_step, run.finish_time = [None] * len(requests), [None] * len(requests)
    metrics = run.metrics = JobMetrics(total_rows=len(requests), **({"clock": clock} if clock else {}))
    executor = LocalExecutor(engine, JobSpec(engine.config, GenerateTask(GREEDY)), metrics)
    steps = lambda: engine.scheduler.stats.steps  # noqa: E731

    def store(result: RowResult) -> bool:
        run.finish_step[result.index], run.finish_time[result.index] = steps(), metrics.now()
        return True

    drive(WorkloadFeed(requests, prompts, steps), executor, store, metrics, NoProgress())
    run.wall = metrics.now()
    metrics.forward_seconds = engine.runner.forward_seconds
    run.stats, run.num_kv_blocks = engine.scheduler.stats, engine.pool.num_blocks
    return run
