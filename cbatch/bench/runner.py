"""Real benchmark runs: a workload of random-token prompts through the engine, EOS ignored.

The model is a checkpoint (`--model`) or a weightless shape (`--model-config`: a preset or a
config.json) with random weights. One engine serves every policy of a comparison (the policy is
swapped between runs, with a fresh scheduler and pool), so runs differ only in their scheduling.
"""
from __future__ import annotations

import random
import time
from dataclasses import replace

from cbatch.bench.result import BenchRun
from cbatch.bench.workload import BenchRequest, random_prompt
from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.engine import Engine
from cbatch.engine.kv_blocks import BlockPool
from cbatch.engine.policy import get_policy
from cbatch.engine.scheduler import Scheduler
from cbatch.engine.step import StepInfo
from cbatch.observe.metrics import engine_step_sample


def make_bench_engine(config: EngineConfig, model_config: str | None, seed: int) -> Engine:
    """A checkpoint's engine (`config.model`), or a preset/config.json shape with random weights."""
    if model_config is None:
        return Engine.from_config(config)
    from cbatch.model.presets import preset_spec

    return Engine(config, spec=preset_spec(model_config), random_weights_seed=seed)


def reset_engine(engine: Engine, policy: str) -> None:
    """A fresh scheduler and block pool (same size) under `policy`; the runner's KV tensors are reused."""
    config = engine.config
    engine.pool = BlockPool(engine.pool.num_blocks, config.block_size)
    engine.scheduler = Scheduler(
        get_policy(policy), engine.pool, config.max_num_seqs, config.max_num_batched_tokens, engine.max_model_len
    )
    engine.config = replace(config, policy=policy)
    engine.runner.forward_seconds = 0.0


def warm_up(engine: Engine, seed: int) -> None:
    """A few short requests first, so one-off costs (allocator, kernel compilation) stay out of the timing."""
    rng = random.Random(seed)
    vocab = engine.spec.vocab_size
    for i in range(min(4, engine.config.max_num_seqs)):
        engine.add_request(random_prompt(rng, 16 + 8 * i, vocab), SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def run_real(engine: Engine, requests: list[BenchRequest], policy: str, seed: int) -> BenchRun:
    """Runs `requests` (arrival in steps) through `engine` under `policy`; wall time from the first step."""
    reset_engine(engine, policy)
    rng = random.Random(f"{seed}/prompts")
    vocab = engine.spec.vocab_size
    prompts = [random_prompt(rng, r.prompt_len, vocab) for r in requests]  # identical for every policy
    run = BenchRun(policy)
    run.finish_step, run.finish_time = [None] * len(requests), [None] * len(requests)
    metrics = run.metrics
    metrics.total_rows = len(requests)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    queued: dict[int, tuple[float, int]] = {}
    scheduler_steps = lambda: engine.scheduler.stats.steps  # noqa: E731
    metrics.started = time.perf_counter()
    next_arrival = 0
    while next_arrival < len(order) or engine.has_unfinished():
        while next_arrival < len(order) and requests[order[next_arrival]].arrival <= scheduler_steps():
            index = order[next_arrival]
            next_arrival += 1
            params = SamplingParams(max_tokens=requests[index].output_len, ignore_eos=True)
            seq = engine.add_request(prompts[index], params, seq_id=index)
            queued[index] = (metrics.now(), scheduler_steps())
            if seq.is_finished:
                run.record(queued.pop(index), seq, scheduler_steps(), metrics.now())
        if engine.has_unfinished():
            finished = engine.step()
        else:  # an idle step until the next arrival (counted, like the simulator's)
            engine.scheduler.schedule()
            finished, engine.last_step = [], StepInfo()
        metrics.record_step(engine_step_sample(metrics, engine))
        now = metrics.now()
        for seq in finished:
            run.record(queued.pop(seq.seq_id), seq, scheduler_steps(), now)
    run.wall = metrics.now()
    metrics.forward_seconds = engine.runner.forward_seconds
    run.stats, run.num_kv_blocks = engine.scheduler.stats, engine.pool.num_blocks
    return run
