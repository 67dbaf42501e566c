"""The job report: one JSON document (`--report`) and the summary table printed at the end."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cbatch.engine.scheduler import SchedulerStats
from cbatch.observe.metrics import JobMetrics


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 by the nearest-rank method (None for no values)."""
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]  # noqa: E731
    return {"p50": pick(0.50), "p90": pick(0.90), "p99": pick(0.99), "mean": sum(ordered) / len(ordered)}


def build_report(
    metrics: JobMetrics,
    stats: SchedulerStats,
    *,
    wall_seconds: float,
    max_num_seqs: int,
    num_kv_blocks: int,
    settings: dict[str, Any],
) -> dict[str, Any]:
    steps = max(stats.steps, 1)
    wall = max(wall_seconds, 1e-9)
    timings = metrics.requests
    queue_s = [r.scheduled_s - r.queued_s for r in timings if r.scheduled_s is not None]
    ttft_s = [r.first_token_s - r.queued_s for r in timings if r.first_token_s is not None]
    total_s = [r.finished_s - r.queued_s for r in timings]
    queue_steps = [(r.first_scheduled_step or r.finished_step) - r.queued_step for r in timings]
    ttft_steps = [r.first_token_step - r.queued_step for r in timings if r.first_token_step is not None]
    total_steps = [r.finished_step - r.queued_step for r in timings]
    return {
        "settings": settings,
        "requests": {
            "total": metrics.total_rows,
            "ok": metrics.ok_rows,
            "error": metrics.error_rows,
            "resumed": metrics.skipped_rows,
        },
        "tokens": {"prompt": metrics.prompt_tokens, "output": metrics.output_tokens},
        "time": {"wall_seconds": wall_seconds, "model_forward_seconds": metrics.forward_seconds},
        "throughput": {
            "requests_per_s": metrics.done_rows / wall,
            "prompt_tokens_per_s": metrics.prompt_tokens / wall,
            "output_tokens_per_s": metrics.output_tokens / wall,
            "total_tokens_per_s": (metrics.prompt_tokens + metrics.output_tokens) / wall,
        },
        "utilization": {
            "steps": stats.steps,
            "mean_batch_occupancy": stats.occupancy_sum / steps,
            "mean_tokens_per_step": stats.scheduled_tokens / steps,
            "mean_kv_usage": stats.kv_usage_sum / steps,
            "peak_kv_usage": stats.peak_kv_blocks / max(num_kv_blocks, 1),
            "kv_blocks_total": num_kv_blocks,
            "kv_blocks_peak": stats.peak_kv_blocks,
            "max_num_seqs": max_num_seqs,
            "preemptions": stats.preemptions,
            "recomputed_tokens": stats.recomputed_tokens,
            "padding_waste": stats.padding_tokens / max(stats.scheduled_tokens, 1),
            "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
            "prefix_cache_saved_tokens": stats.prefix_cache_hit_tokens,
            "swap_preemptions": stats.swap_preemptions,
            "swapped_out_blocks": stats.swapped_out_blocks,
            "swapped_in_blocks": stats.swapped_in_blocks,
            "admission_stalls": stats.admission_stalls,
        },
        "latency": {
            "seconds": {"queue_wait": percentiles(queue_s), "total": percentiles(total_s),
                        "time_to_first_token": percentiles(ttft_s)},
            "steps": {"queue_wait": percentiles(queue_steps), "time_to_first_token": percentiles(ttft_steps),
                      "total": percentiles(total_steps)},
            "queue_wait_steps_by_priority": {
                str(p): {**percentiles(w), "max": max(w), "requests": len(w)}
                for p, w in sorted(stats.wait_steps_by_priority.items())
            },
            "oldest_wait_steps": max((max(w) for w in stats.wait_steps_by_priority.values()), default=None),
        },
    }


def write_report(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)


def summary_line(report: dict[str, Any]) -> str:
    r, t, u = report["requests"], report["throughput"], report["utilization"]
    return (
        f"cbatch: {r['ok']}/{r['total']} rows ok, {r['error']} errors"
        + (f" ({r['resumed']} from an earlier run)" if r.get("resumed") else "")
        + f" | {report['tokens']['output']} output tokens in {report['time']['wall_seconds']:.1f}s"
        f" = {t['output_tokens_per_s']:.1f} tok/s ({t['total_tokens_per_s']:.1f} total)"
        f" | occupancy {u['mean_batch_occupancy']:.0%}, peak KV {u['peak_kv_usage']:.0%}, preemptions {u['preemptions']}"
    )
