"""What the live dashboard costs: the same `cbatch run` job with the dashboard and without, alternated.

The job runs through `run_job` (the real `cbatch run` path) on the weightless `tiny` preset, so the
numbers need no download. The dashboard draws to a forced terminal on /dev/null at its normal refresh
rate. Also prints the cost of one frame, which bounds the overhead independently of machine noise:
frames/s x ms/frame = share of one core.

    PYTHONPATH=. python benchmarks/dashboard_overhead.py [--rows 96] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console

from cbatch.bench.trial import make_bench_engine
from cbatch.config import EngineConfig, SamplingParams
from cbatch.run.job import run_job
from cbatch.run.preflight import JobOptions
from cbatch.observe.dashboard import REFRESH_PER_SECOND, Dashboard
from cbatch.observe.progress import NoProgress


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model-config", default="tiny")
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp())
    rng = random.Random(0)
    rows = tmp / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt_token_ids": [rng.randrange(3, 500) for _ in range(rng.randint(8, 64))]}) + "\n"
                            for _ in range(args.rows)))
    config = EngineConfig(device="cpu", max_num_seqs=16, num_threads=1)
    engine = make_bench_engine(config, args.model_config, seed=0)  # one engine, reused: no load time in the figures
    devnull = open(os.devnull, "w")
    frame_ms: list[float] = []

    def with_dashboard(metrics, options):
        dashboard = Dashboard(metrics, options, console=Console(file=devnull, force_terminal=True, width=120))
        live = dashboard._live
        refresh = live.refresh

        def timed_refresh():  # what the refresh thread does a few times a second: render + draw
            start = time.perf_counter()
            refresh()
            frame_ms.append((time.perf_counter() - start) * 1000)

        live.refresh = timed_refresh
        return dashboard

    def job(display: str) -> tuple[float, int]:
        reset(engine)
        out = tmp / f"out-{display}.jsonl"
        options = JobOptions(input=rows, output=out, engine=config, overwrite=True, quiet=True,
                             defaults=SamplingParams(max_tokens=args.max_tokens, ignore_eos=True), display=display)
        start = time.perf_counter()
        run_job(options, make_engine=lambda _: engine,
                make_progress=with_dashboard if display == "dashboard" else (lambda m, o: NoProgress()))
        return time.perf_counter() - start, engine.scheduler.stats.steps

    job("none")  # warm-up
    times: dict[str, list[float]] = {"none": [], "dashboard": []}
    for _ in range(args.repeats):
        for display in ("none", "dashboard"):
            seconds, steps = job(display)
            times[display].append(seconds)
    base, dash = statistics.median(times["none"]), statistics.median(times["dashboard"])
    print(f"load average: {open('/proc/loadavg').read().split()[:3]}")
    print(f"workload: {args.rows} rows, max_tokens {args.max_tokens}, {steps} steps, model {args.model_config} (CPU, 1 thread)")
    print(f"without dashboard: median {base:.3f} s  runs {[round(t, 3) for t in times['none']]}")
    print(f"with dashboard:    median {dash:.3f} s  runs {[round(t, 3) for t in times['dashboard']]}")
    print(f"wall-time overhead: {100 * (dash - base) / base:+.2f}% (noise included)")
    if frame_ms:
        ms = statistics.median(frame_ms)
        print(f"one frame (render + draw): median {ms:.2f} ms over {len(frame_ms)} frames; "
              f"at {REFRESH_PER_SECOND:g} frames/s = {ms * REFRESH_PER_SECOND / 10:.2f}% of one core")


def reset(engine) -> None:
    engine.reset()


if __name__ == "__main__":
    main()
