"""Per-job counters and a per-step time series, fed once per step (never per token).

The dashboard, the progress lines and the report all read from one `JobMetrics` (displays read nothing
else: the executor leaves an `EngineSnapshot` of its counters here once per step). Memory stays bounded
however long the job: the whole-job series is folded into at most `MAX_BUCKETS` buckets of consecutive
steps (sums kept, so rates, means and cost fits over buckets equal those over steps), the dashboard
reads the last `RECENT_STEPS` raw samples, and latency percentiles come from a uniform sample of at most
`MAX_TIMINGS` requests.
"""
from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable

RECENT_STEPS = 2048
MAX_BUCKETS = 4096  # even: a full series folds pairwise into half as many buckets twice as wide
MAX_TIMINGS = 100_000


@dataclass(slots=True)
class StepSample:
    """One step, or a bucket of `steps` consecutive steps whose counters are summed over them."""

    t: float  # seconds since the job started, at the end of the (last) step
    running: int
    waiting: int  # at the end of the (last) step
    scheduled_tokens: int
    prefill_tokens: int
    output_tokens: int  # tokens sampled this step (finished rows' padding excluded)
    kv_used: int
    context_tokens: int = 0  # KV tokens read this step (sum of scheduled sequences' contexts)
    attention_pairs: int = 0  # (query, key) pairs attended this step
    steps: int = 1

    def absorb(self, later: "StepSample") -> None:
        """Adds the steps of `later`, which come right after this sample's."""
        self.t, self.waiting = later.t, later.waiting
        self.running += later.running
        self.scheduled_tokens += later.scheduled_tokens
        self.prefill_tokens += later.prefill_tokens
        self.output_tokens += later.output_tokens
        self.kv_used += later.kv_used
        self.context_tokens += later.context_tokens
        self.attention_pairs += later.attention_pairs
        self.steps += later.steps


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The executor's live counters, taken once per step: what the dashboard shows besides rows and tokens."""

    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    kv_used: int = 0
    kv_total: int = 0
    drafted_tokens: int = 0  # speculative decoding: drafted tokens verified so far, and those kept
    accepted_tokens: int = 0


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
    total_rows: int = 0  # input rows
    skipped_rows: int = 0  # input rows finished by an earlier run (resume)
    cached_rows: int = 0  # input rows copied from the result cache (counted in ok_rows too)
    ok_rows: int = 0  # input rows finished (a row with n samples: once all n are)
    error_rows: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    # the job's clock: seconds since `started` (the simulator passes its cost-model clock instead)
    clock: Callable[[], float] = time.perf_counter
    started: float = 0.0
    requests: list[RequestTiming] = field(default_factory=list)  # a uniform sample once past MAX_TIMINGS
    timings_seen: int = 0  # requests offered to `add_timing`
    forward_seconds: float = 0.0
    engine: EngineSnapshot = field(default_factory=EngineSnapshot)
    submitted_rows: int = 0  # rows handed to an engine, and their max_tokens: the ETA before any row is done
    submitted_max_tokens: int = 0
    # jobs with LoRA adapters: adapter name ("base" for the base model) -> {"rows", "prompt_tokens", "output_tokens"}
    # of the rows generated (not resumed or cached)
    lora_usage: dict[str, dict[str, int]] = field(default_factory=dict)
    # rows with images (docs/vision.md): {"rows", "images", "image_tokens"} handed to an engine (placeholder tokens
    # in their prompts), {"encoded", "encoded_tokens"}: the vision tower's work (an image shared by rows, or
    # kept across a preemption, is encoded once), and {"prefix_cache_hit_tokens"}: image tokens whose KV came from
    # the prefix cache (rows sharing an image); empty for a text job
    image_usage: dict[str, int] = field(default_factory=dict)
    recent: deque = field(default_factory=lambda: deque(maxlen=RECENT_STEPS))  # raw StepSamples, newest last
    steps_recorded: int = 0
    _buckets: list[StepSample] = field(default_factory=list)  # closed, each `_bucket_width` steps
    _open: StepSample | None = None  # the bucket being filled (fewer than `_bucket_width` steps)
    _bucket_width: int = 1
    _sampler: random.Random = field(default_factory=lambda: random.Random(0))

    def __post_init__(self) -> None:
        self.started = self.clock()

    def restart_clock(self) -> None:
        """The job's time starts now (e.g. once the models are loaded)."""
        self.started = self.clock()

    def now(self) -> float:
        return self.clock() - self.started

    @property
    def done_rows(self) -> int:
        return self.ok_rows + self.error_rows

    @property
    def series(self) -> list[StepSample]:
        """The whole job's series: one sample per step, or per bucket of consecutive steps on long jobs."""
        return self._buckets + ([self._open] if self._open is not None else [])

    def record_step(self, sample: StepSample) -> None:
        self.steps_recorded += 1
        self.recent.append(sample)
        if self._open is None:
            self._open = replace(sample)  # a copy: `recent` keeps the raw sample
        else:
            self._open.absorb(sample)
        if self._open.steps == self._bucket_width:
            self._buckets.append(self._open)
            self._open = None
            if len(self._buckets) == MAX_BUCKETS:  # fold pairwise: half as many buckets, twice as wide
                for i in range(0, MAX_BUCKETS, 2):
                    self._buckets[i].absorb(self._buckets[i + 1])
                self._buckets = self._buckets[::2]
                self._bucket_width *= 2

    def step_time(self, step: int | None) -> float | None:
        """Wall time at the end of step `step` (1-based, as the scheduler counts): exact for the last
        RECENT_STEPS steps, before that the end of its bucket (at most one bucket width later)."""
        if step is None or self.steps_recorded == 0:
            return None
        step = min(max(step, 1), self.steps_recorded)
        back = self.steps_recorded - step  # 0: the last step
        if back < len(self.recent):
            return self.recent[-1 - back].t
        index = (step - 1) // self._bucket_width
        return self._buckets[index].t if index < len(self._buckets) else self._open.t

    def count_adapter(self, adapter: str | None, prompt_tokens: int, output_tokens: int, row_done: bool) -> None:
        """One generated sample of a job with adapters, under its adapter (None: the base model)."""
        usage = self.lora_usage.setdefault(adapter or "base", {"rows": 0, "prompt_tokens": 0, "output_tokens": 0})
        usage["rows"] += row_done
        usage["prompt_tokens"] += prompt_tokens
        usage["output_tokens"] += output_tokens

    def count_images(self, images: list) -> None:
        """A row with `images` (engine/images.PromptImage) handed to an engine: its images, and the placeholder
        tokens of them and of their pan-and-scan crops."""
        from cbatch.engine.images import with_crops  # (here: that module imports torch, this one does not)

        usage = self.image_usage
        usage["rows"] = usage.get("rows", 0) + 1
        usage["images"] = usage.get("images", 0) + len(images)
        usage["image_tokens"] = usage.get("image_tokens", 0) + sum(image.num_tokens for image in with_crops(images))

    def add_timing(self, timing: RequestTiming) -> None:
        """Keeps `timing` for the latency percentiles: all of them up to MAX_TIMINGS, then a uniform
        sample of that size (reservoir sampling, seeded: the same job keeps the same sample)."""
        self.timings_seen += 1
        if len(self.requests) < MAX_TIMINGS:
            self.requests.append(timing)
            return
        slot = self._sampler.randrange(self.timings_seen)
        if slot < MAX_TIMINGS:
            self.requests[slot] = timing


def engine_step_sample(metrics: JobMetrics, engine) -> StepSample:
    """The sample of the engine's last step (counters only: cheap enough for every step)."""
    info, scheduler = engine.last_step, engine.scheduler
    return StepSample(
        t=metrics.now(), running=len(scheduler.running), waiting=scheduler.num_waiting,
        scheduled_tokens=info.scheduled_tokens, prefill_tokens=info.prefill_tokens,
        output_tokens=info.sampled_tokens, kv_used=engine.pool.num_used,
        context_tokens=info.context_tokens, attention_pairs=info.attention_pairs,
    )


def engine_snapshot(engine) -> EngineSnapshot:
    scheduler = engine.scheduler
    return EngineSnapshot(running=len(scheduler.running), waiting=scheduler.num_waiting,
                          preemptions=scheduler.stats.preemptions, kv_used=engine.pool.num_used,
                          kv_total=engine.pool.num_blocks, drafted_tokens=scheduler.stats.drafted_tokens,
                          accepted_tokens=scheduler.stats.accepted_tokens)
