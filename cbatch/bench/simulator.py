"""The simulator: the engine's own `Scheduler`, `BlockPool` and post-step bookkeeping (`commit_step`),
with a cost model in place of the model. What-if questions at sizes no machine here can run.

A step's cost is `per_step + per_prefill_token x prefill tokens + per_context_token x KV tokens read`
(default: 1 unit per step, so time = steps), or coefficients fitted from a real run's report, in
seconds. Sampled tokens are made up (token 0, EOS ignored): lengths are exactly the workload's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbatch.bench.result import BenchRun
from cbatch.bench.workload import BenchRequest
from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.kv_blocks import BlockPool
from cbatch.engine.policy import get_policy
from cbatch.engine.scheduler import Scheduler
from cbatch.engine.sequence import FinishReason, Sequence, SequenceStatus
from cbatch.engine.step import StepInfo, admission_error, commit_step, length_finish
from cbatch.observe.metrics import StepSample


class _ZeroTokens(dict):
    """The simulator's "sampled tokens": token 0 for whoever samples (EOS is ignored, lengths are exact)."""

    def __missing__(self, seq_id: int) -> int:
        return 0


_ZERO_TOKENS = _ZeroTokens()


class CostModelError(ValueError):
    """A report that cannot give a cost model: the message names the file and the fix."""


@dataclass(frozen=True, slots=True)
class CostModel:
    per_step: float = 1.0
    per_prefill_token: float = 0.0
    per_context_token: float = 0.0
    unit: str = "cost"  # "cost" units, or "s" when fitted from a real run

    def step_cost(self, info: StepInfo) -> float:
        return self.per_step + self.per_prefill_token * info.prefill_tokens + self.per_context_token * info.context_tokens

    @classmethod
    def fit(cls, path: Path) -> "CostModel":
        """Least squares on a real report's time series: dt = a x steps + b x prefill + c x context (a, b, c >= 0)."""
        import numpy as np

        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CostModelError(f"--cost-from {path}: not a readable JSON report ({exc})") from None
        if "runs" in report:  # a bench report: fit on its first real run
            report = next((r for r in report["runs"] if r.get("time_unit") == "s"), None) or {}
        series = report.get("series")
        if not series or len(series.get("dt", [])) < 3 or report.get("time_unit", "s") != "s":
            raise CostModelError(
                f"--cost-from {path}: needs the report of a real run (cbatch run/bench --report) with at least 3 steps"
            )
        x = np.array([series["steps"], series["prefill_tokens"], series["context_tokens"]], dtype=float).T
        y = np.array(series["dt"], dtype=float)
        active = [0, 1, 2]
        coef = np.zeros(3)
        while active:  # drop a column whose fit is negative, refit the rest (a tiny NNLS)
            sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            if (sol >= 0).all():
                coef[active] = sol
                break
            active.pop(int(np.argmin(sol)))
        return cls(float(coef[0]), float(coef[1]), float(coef[2]), unit="s")


def simulate(requests: list[BenchRequest], config: EngineConfig, cost: CostModel, max_model_len: int,
             policy: str | None = None) -> BenchRun:
    """Runs `requests` through a Scheduler + BlockPool under `config`; the clock is the cost model's."""
    policy = policy or config.policy
    num_blocks = config.num_kv_blocks or useful_blocks(requests, config, max_model_len)
    pool = BlockPool(num_blocks, config.block_size)
    scheduler = Scheduler(get_policy(policy), pool, config.max_num_seqs, config.max_num_batched_tokens, max_model_len)
    run = BenchRun(policy)
    run.finish_step = [None] * len(requests)
    run.finish_time = [None] * len(requests)
    metrics = run.metrics
    metrics.total_rows = len(requests)
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    queued: dict[int, tuple[float, int]] = {}
    clock, next_arrival = 0.0, 0  # `clock` in cost units (or seconds for a fitted model)
    finish = lambda seq, token: length_finish(seq, token, max_model_len)  # noqa: E731
    stats = scheduler.stats
    while next_arrival < len(order) or scheduler.has_work():
        while next_arrival < len(order) and requests[order[next_arrival]].arrival <= stats.steps:
            index = order[next_arrival]
            next_arrival += 1
            seq = _add(scheduler, index, requests[index], max_model_len)
            queued[index] = (clock, stats.steps)
            if seq.is_finished:
                run.record(queued.pop(index), seq, stats.steps, clock)
        # NOTE: with nothing to run before the next arrival the plan is empty: an idle step at fixed cost
        plan = scheduler.schedule()
        if not plan and scheduler.has_work():  # the engine raises the same way (Engine.step)
            raise RuntimeError(f"scheduler made no progress with work pending at step {stats.steps} (a bug: please report it)")
        finished, info = commit_step(scheduler, plan, _ZERO_TOKENS, finish)
        clock += cost.step_cost(info)
        metrics.record_step(StepSample(
            t=clock, running=len(scheduler.running), waiting=scheduler.num_waiting,
            scheduled_tokens=info.scheduled_tokens, prefill_tokens=info.prefill_tokens,
            output_tokens=info.sampled_tokens, kv_used=pool.num_used,
            context_tokens=info.context_tokens, attention_pairs=info.attention_pairs,
        ))
        for seq in finished:
            run.record(queued.pop(seq.seq_id), seq, stats.steps, clock)
    run.stats, run.num_kv_blocks, run.wall = stats, pool.num_blocks, clock
    return run


def _add(scheduler: Scheduler, index: int, request: BenchRequest, max_model_len: int) -> Sequence:
    params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
    seq = Sequence(seq_id=index, prompt_ids=[0] * request.prompt_len, params=params)
    error = admission_error(request.prompt_len, params, max_model_len, scheduler.pool)
    if error is not None:
        seq.finish_reason, seq.error, seq.status = FinishReason.ERROR, error, SequenceStatus.FINISHED
        return seq
    scheduler.add(seq)
    return seq


def useful_blocks(requests: list[BenchRequest], config: EngineConfig, max_model_len: int) -> int:
    """A pool that never binds: every slot can hold the workload's longest request."""
    longest = min(max(r.prompt_len + r.output_len for r in requests), max_model_len)
    return config.max_num_seqs * -(-longest // config.block_size) + 1


def cost_settings(cost: CostModel) -> dict[str, Any]:
    return {"per_step": cost.per_step, "per_prefill_token": cost.per_prefill_token,
            "per_context_token": cost.per_context_token, "unit": cost.unit}
