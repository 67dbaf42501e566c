"""The simulator: the engine itself (`Scheduler`, `BlockPool`, `Scheduler.update`) with a cost model in
place of the model as its runner. What-if questions at sizes no machine here can run.

A step's cost is `per_step + per_prefill_token x prefill tokens + per_decode_token x decode tokens +
per_context_token x KV tokens read` (default: 1 unit per step, so time = steps), or coefficients fitted
from a real run's report, in seconds. Sampled tokens are made up (token 0, EOS ignored): lengths are exactly the workload's.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from cbatch.bench.result import BenchRun
from cbatch.bench.workload import BenchRequest
from cbatch.config import EngineConfig, UserError
from cbatch.engine.engine import Engine, KVPool
from cbatch.engine.memory import blocks_for_every_slot, with_step_limits
from cbatch.engine.step import StepInfo, StepOutput, StepPlan
from cbatch.model.spec import ModelSpec


class _ZeroTokens(dict):
    """The simulator's "sampled tokens": token 0 for whoever samples (EOS is ignored, lengths are exact)."""

    def __missing__(self, seq_id: int) -> int:
        return 0


_ZERO_TOKENS = _ZeroTokens()


class CostModelError(UserError):
    """A report that cannot give a cost model: the message names the file and the fix."""


@dataclass(frozen=True, slots=True)
class CostModel:
    per_step: float = 1.0
    per_prefill_token: float = 0.0
    per_context_token: float = 0.0
    unit: str = "cost"  # "cost" units, or "s" when fitted from a real run
    per_decode_token: float = 0.0  # a token of a one-token chunk (a decode), which also samples

    def step_cost(self, info: StepInfo) -> float:
        decode_tokens = info.scheduled_tokens - info.prefill_tokens
        return (self.per_step + self.per_prefill_token * info.prefill_tokens + self.per_decode_token * decode_tokens
                + self.per_context_token * info.context_tokens)

    @classmethod
    def fit(cls, path: Path) -> "CostModel":
        """Least squares on a real report's time series: dt = a x steps + b x prefill + c x context
        + d x decode tokens (all >= 0; d only when the series has `scheduled_tokens`)."""
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
        columns = [series["steps"], series["prefill_tokens"], series["context_tokens"]]
        if "scheduled_tokens" in series:
            columns.append([s - p for s, p in zip(series["scheduled_tokens"], series["prefill_tokens"])])
        x = np.array(columns, dtype=float).T
        y = np.array(series["dt"], dtype=float)
        active = list(range(len(columns)))
        coef = np.zeros(4)
        while active:  # drop a column whose fit is negative, refit the rest (a tiny NNLS)
            sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
            if (sol >= 0).all():
                coef[active] = sol
                break
            active.pop(int(np.argmin(sol)))
        return cls(float(coef[0]), float(coef[1]), float(coef[2]), unit="s", per_decode_token=float(coef[3]))


@dataclass(frozen=True, slots=True)
class Done:
    """A simulated step's tokens, known when it is launched."""

    output: StepOutput

    def result(self) -> StepOutput:
        return self.output


def kept_drafts(seq_id: int, step: int, drafted: int, acceptance: float) -> int:
    """How many of a row's `drafted` tokens a simulated target keeps at `step`: each with probability `acceptance`
    while the ones before it were. The draws are seeded by (row, step), so a simulation gives the same steps in
    every run."""
    rng = random.Random(seq_id * 1_000_003 + step)
    kept = 0
    while kept < drafted and rng.random() < acceptance:
        kept += 1
    return kept


class SimulatedRunner:
    """The engine's runner in a simulation: every sampling sequence "samples" token 0, and the clock
    advances by the cost model's price of the step (an idle step, waiting for arrivals, costs `per_step`).
    Speculative decoding (`--speculative`): drafted tokens are priced as decode tokens (they take the decode path);
    `kept_drafts` decides how many are kept, the first rejected one replaced by another token."""

    def __init__(self, cost: CostModel, acceptance: float = 0.0) -> None:
        self.cost = cost
        self.acceptance = acceptance
        self.forward_seconds = 0.0  # the simulated clock: all of it is "model time"

    def reset(self) -> None:
        self.forward_seconds = 0.0

    def execute(self, plan: StepPlan) -> StepOutput:
        self.forward_seconds += self.cost.step_cost(plan.info)
        if not plan.drafts:
            return StepOutput(_ZERO_TOKENS)
        return StepOutput(_ZERO_TOKENS, verified={seq_id: self._verify(seq_id, plan.step, drafted)
                                                  for seq_id, drafted in plan.drafts.items()})

    def _verify(self, seq_id: int, step: int, drafted: list[int]) -> list[int]:
        """The "target's" tokens at a verified row's positions: the kept drafts, then one that differs."""
        kept = kept_drafts(seq_id, step, len(drafted), self.acceptance)
        if kept == len(drafted):
            return [*drafted, 0]
        return [*drafted[:kept], drafted[kept] + 1]

    def launch(self, plan: StepPlan) -> "Done":
        """Asynchronous scheduling's half of a step: the simulated step is priced and "sampled" at once (its
        tokens depend only on what the plan holds when it is launched, as on a device)."""
        return Done(self.execute(plan))

    def idle(self) -> None:
        self.forward_seconds += self.cost.step_cost(StepInfo())

    def close(self) -> None:
        pass  # nothing outlives it


def simulated_engine(config: EngineConfig, cost: CostModel, max_model_len: int, longest_request: int,
                     spec: ModelSpec | None = None, acceptance: float = 0.0) -> Engine:
    """An engine whose runner is the cost model: the real Scheduler, BlockPool and update. The pool is
    `--num-kv-blocks`, else one that never binds (every slot can hold the longest request). `acceptance`: the
    share of drafted tokens kept (`kept_drafts`; --speculative-acceptance)."""
    config = with_step_limits(config, torch.device("cpu"))  # the simulated step: the CPU's defaults unless given
    num_blocks = config.num_kv_blocks or blocks_for_every_slot(config, min(longest_request, max_model_len))
    runner = SimulatedRunner(cost, acceptance)
    return on_cost_clock(Engine(config, runner, KVPool(num_blocks), max_model_len, spec=spec))


def on_cost_clock(engine: Engine) -> Engine:
    """`--speculative auto` fits its step cost to the simulated steps' prices, not to this process's wall time."""
    engine.step_clock = lambda: engine.runner.forward_seconds
    return engine


def check_acceptance(acceptance: float | None, config: EngineConfig) -> float:
    """--speculative-acceptance as the simulator takes it (0 when not given); raises UserError for a bad one."""
    if acceptance is None:
        return 0.0
    if not 0.0 <= acceptance <= 1.0:
        raise UserError(f"--speculative-acceptance: must be between 0 and 1 (the share of drafted tokens kept), "
                        f"not {acceptance}")
    if config.speculative == "off":
        raise UserError("--speculative-acceptance: needs --speculative ngram, suffix or auto (nothing is drafted "
                        "with it off)")
    return acceptance


def simulate(requests: list[BenchRequest], config: EngineConfig, cost: CostModel, max_model_len: int,
             policy: str | None = None, spec: ModelSpec | None = None) -> BenchRun:
    """One simulated trial of `requests` under `policy` (default: the config's)."""
    from cbatch.bench.trial import run_trial, workload_prompts

    engine = simulated_engine(config, cost, max_model_len, max(r.prompt_len + r.output_len for r in requests), spec)
    prompts = workload_prompts(requests, spec.vocab_size if spec else SIMULATED_VOCAB, config.seed)
    return run_trial(engine, requests, prompts, policy or config.policy, lambda: engine.runner.forward_seconds)


SIMULATED_VOCAB = 32000  # token ids for simulated prompts when no model names a vocabulary


def cost_settings(cost: CostModel) -> dict[str, Any]:
    return {"per_step": cost.per_step, "per_prefill_token": cost.per_prefill_token,
            "per_context_token": cost.per_context_token, "per_decode_token": cost.per_decode_token, "unit": cost.unit}
