"""Per-job counters and a per-step time series, fed once per step (never per token).

The dashboard, the progress lines and the report all read from one `JobMetrics`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(slots=True)
class StepSample:
    t: float  # seconds since the job started, at the end of the step
    running: int
    waiting: int
    scheduled_tokens: int
    prefill_tokens: int
    output_tokens: int  # tokens sampled this step (finished rows' padding excluded)
    kv_used: int
    context_tokens: int = 0  # KV tokens read this step (sum of scheduled sequences' contexts)
    attention_pairs: int = 0  # (query, key) pairs attended this step


@dataclass(slots=True)
class RequestTiming:
    row_id: str
    queued_s: float
    scheduled_s: float | None
    first_token_s: float | None
    finished_s: float
    queued_step: int
    first_scheduled_step: int | None
    first_token_step: int | None
    finished_step: int
    prompt_tokens: int
    output_tokens: int


@dataclass
class JobMetrics:
    total_rows: int = 0
    skipped_rows: int = 0  # finished by an earlier run (resume)
    ok_rows: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    steps: list[StepSample] = field(default_factory=list)
    requests: list[RequestTiming] = field(default_factory=list)
    forward_seconds: float = 0.0
    keep_series: bool = True  # the per-step series feeds plots and latency in seconds

    def now(self) -> float:
        return time.perf_counter() - self.started

    @property
    def done_rows(self) -> int:
        return self.ok_rows + self.error_rows

    def record_step(self, sample: StepSample) -> None:
        if self.keep_series:
            self.steps.append(sample)

    def step_time(self, step: int | None) -> float | None:
        """Wall time at the end of step `step` (1-based, as the scheduler counts)."""
        if step is None or not self.steps:
            return None
        return self.steps[min(max(step, 1), len(self.steps)) - 1].t


def engine_step_sample(metrics: JobMetrics, engine) -> StepSample:
    """The sample of the engine's last step (counters only: cheap enough for every step)."""
    info, scheduler = engine.last_step, engine.scheduler
    return StepSample(
        t=metrics.now(), running=len(scheduler.running), waiting=scheduler.num_waiting,
        scheduled_tokens=info.scheduled_tokens, prefill_tokens=info.prefill_tokens,
        output_tokens=info.sampled_tokens, kv_used=engine.pool.num_used,
        context_tokens=info.context_tokens, attention_pairs=info.attention_pairs,
    )
