"""JobMetrics stays bounded on long jobs: the series folds into buckets that keep every sum, the
dashboard's recent window stays raw, step times stay close, and latency comes from a uniform sample."""
from __future__ import annotations

import random

import cbatch.observe.metrics as metrics_module
from cbatch.observe.metrics import JobMetrics, RequestTiming, StepSample
from cbatch.observe.report import time_series


def _samples(n: int, seed: int = 0) -> list[StepSample]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.uniform(0.001, 0.02)
        out.append(StepSample(t=t, running=rng.randint(1, 64), waiting=rng.randint(0, 500),
                              scheduled_tokens=rng.randint(1, 2048), prefill_tokens=rng.randint(0, 1024),
                              output_tokens=rng.randint(0, 64), kv_used=rng.randint(0, 4000),
                              context_tokens=rng.randint(0, 10**5), attention_pairs=rng.randint(0, 10**6)))
    return out


def test_folded_series_keeps_every_sum_and_bounds_its_length(monkeypatch):
    monkeypatch.setattr(metrics_module, "MAX_BUCKETS", 16)
    monkeypatch.setattr(metrics_module, "RECENT_STEPS", 10)
    samples = _samples(1000)
    m = JobMetrics()
    for s in samples:
        m.record_step(StepSample(*(getattr(s, f) for f in StepSample.__slots__)))
    series = m.series
    assert len(series) <= 16 and m.steps_recorded == 1000
    assert sum(b.steps for b in series) == 1000
    for field in ("running", "scheduled_tokens", "prefill_tokens", "output_tokens", "kv_used", "context_tokens",
                  "attention_pairs"):
        assert sum(getattr(b, field) for b in series) == sum(getattr(s, field) for s in samples), field
    assert series[-1].t == samples[-1].t and series[-1].waiting == samples[-1].waiting
    # each bucket is exactly the sum of its consecutive raw steps, and the report's series reads it so
    width = m._bucket_width
    for i, bucket in enumerate(series):
        chunk = samples[i * width : (i + 1) * width]
        assert bucket.steps == len(chunk) and bucket.t == chunk[-1].t
        assert bucket.output_tokens == sum(s.output_tokens for s in chunk)
    report_series = time_series(series, 64, 4000, points=len(series))
    assert report_series["steps"] == [b.steps for b in series]
    first = samples[:width]
    assert abs(report_series["occupancy"][0] - sum(s.running for s in first) / (width * 64)) < 1e-12
    # the dashboard's window is the last 10 raw samples
    assert [s.t for s in m.recent] == [s.t for s in samples[-10:]]


def test_step_time_exact_recently_and_within_a_bucket_before(monkeypatch):
    monkeypatch.setattr(metrics_module, "MAX_BUCKETS", 16)
    monkeypatch.setattr(metrics_module, "RECENT_STEPS", 10)
    samples = _samples(1000, seed=1)
    m = JobMetrics()
    for s in samples:
        m.record_step(s)
    for step in (991, 995, 1000):
        assert m.step_time(step) == samples[step - 1].t
    width = m._bucket_width
    for step in (1, 17, 500, 900):
        got = m.step_time(step)
        assert samples[step - 1].t <= got <= samples[min(step - 1 + width, 999)].t
    assert m.step_time(None) is None and m.step_time(5000) == samples[-1].t


def _timing(i: int) -> RequestTiming:
    return RequestTiming(row_id=str(i), queued_s=0.0, scheduled_s=0.0, first_token_s=1.0, finished_s=float(i),
                         queued_step=0, first_scheduled_step=1, first_token_step=1, finished_step=i,
                         prompt_tokens=1, output_tokens=1)


def test_latency_timings_are_a_bounded_uniform_sample(monkeypatch):
    monkeypatch.setattr(metrics_module, "MAX_TIMINGS", 500)
    m = JobMetrics()
    for i in range(20_000):
        m.add_timing(_timing(i))
    assert len(m.requests) == 500 and m.timings_seen == 20_000
    kept = sorted(int(t.row_id) for t in m.requests)
    assert len(set(kept)) == 500
    # uniform over the whole job, not the first or the last 500: each fifth of the rows holds ~100
    per_fifth = [sum(1 for k in kept if f * 4000 <= k < (f + 1) * 4000) for f in range(5)]
    assert all(60 <= n <= 140 for n in per_fifth), per_fifth
