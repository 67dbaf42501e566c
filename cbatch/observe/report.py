"""The job report: one JSON document (`--report`) and the summary table printed at the end."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cbatch.engine.stats import SchedulerStats
from cbatch.observe.metrics import JobMetrics, StepSample


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
    hardware: dict[str, Any] | None = None,
    time_unit: str = "s",
) -> dict[str, Any]:
    """The report. `time_unit` is "s", or "cost" for the simulator (its clock counts cost-model units)."""
    wall = max(wall_seconds, 1e-9)
    report = {
        "settings": settings,
        "time_unit": time_unit,
        "requests": {
            "total": metrics.total_rows,  # input rows
            "ok": metrics.ok_rows,  # rows done (`cbatch run` adds `output_rows` and counts OUTPUT's rows here)
            "error": metrics.error_rows,
            "resumed": metrics.skipped_rows,
            "cached": metrics.cached_rows,
        },
        "tokens": {"prompt": metrics.prompt_tokens, "output": metrics.output_tokens},  # of every output row
        "time": {"wall_seconds": wall_seconds, "model_forward_seconds": metrics.forward_seconds},
        "throughput": {
            "requests_per_s": metrics.done_rows / wall,
            "prompt_tokens_per_s": metrics.prompt_tokens / wall,
            "output_tokens_per_s": metrics.output_tokens / wall,
            "total_tokens_per_s": (metrics.prompt_tokens + metrics.output_tokens) / wall,
        },
        "utilization": utilization(stats, max_num_seqs, num_kv_blocks),
        "latency": latency(metrics, stats),
        "lengths": length_quantiles(metrics),
        "series": time_series(metrics.series, max_num_seqs, num_kv_blocks),
    }
    if stats.drafted_tokens:  # speculative decoding (docs/speculative.md)
        report["speculative"] = speculation(stats, metrics.output_tokens)
    if metrics.lora_usage:  # LoRA adapters: rows and tokens per adapter ("base": the base model's rows)
        report["lora"] = {name: dict(usage) for name, usage in sorted(metrics.lora_usage.items())}
    if metrics.image_usage:  # rows with images: images and their tokens, what the vision tower encoded, images/s
        report["images"] = {**metrics.image_usage, "images_per_s": metrics.image_usage.get("images", 0) / wall}
    if hardware is not None:
        report["hardware"] = hardware
    return report


def utilization(stats: SchedulerStats, max_num_seqs: int, num_kv_blocks: int) -> dict[str, Any]:
    steps = max(stats.steps, 1)
    return {
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
        # prompt tokens run through the model: a row's n samples share one prefill (its tokens count once
        # here, n times in tokens.prompt); recomputes count again, prefix-cache hits do not
        "computed_prompt_tokens": stats.computed_prompt_tokens,
        "forked_samples": stats.forked_samples,
        "padding_waste": stats.padding_tokens / max(stats.scheduled_tokens, 1),
        "prefix_cache_hit_rate": stats.prefix_cache_hit_rate,
        "prefix_cache_saved_tokens": stats.prefix_cache_hit_tokens,
        "swap_preemptions": stats.swap_preemptions,
        "swapped_out_blocks": stats.swapped_out_blocks,
        "swapped_in_blocks": stats.swapped_in_blocks,
        "admission_stalls": stats.admission_stalls,
    }


def speculation(stats: SchedulerStats, output_tokens: int) -> dict[str, Any]:
    """Drafted and kept tokens, the acceptance rate, and output tokens per step (plain decoding: at most one per
    running row)."""
    return {
        "drafted_tokens": stats.drafted_tokens,
        "accepted_tokens": stats.accepted_tokens,
        "acceptance_rate": stats.acceptance_rate,
        "draft_steps": stats.draft_steps,
        "accepted_per_draft_step": stats.accepted_tokens / max(stats.draft_steps, 1),
        "output_tokens_per_step": output_tokens / max(stats.steps, 1),
    }


def latency(metrics: JobMetrics, stats: SchedulerStats) -> dict[str, Any]:
    """Percentiles in seconds and in steps, per priority class waits, and a histogram of total latency.

    They come from `sampled_requests` of `requests`: all of them up to cbatch.observe.metrics.MAX_TIMINGS,
    a uniform sample beyond."""
    timings = metrics.requests
    total_s = [r.finished_s - r.queued_s for r in timings]
    return {
        "seconds": {
            "queue_wait": percentiles([r.scheduled_s - r.queued_s for r in timings if r.scheduled_s is not None]),
            "total": percentiles(total_s),
            "time_to_first_token": percentiles([r.first_token_s - r.queued_s for r in timings if r.first_token_s is not None]),
        },
        "steps": {
            "queue_wait": percentiles([(r.first_scheduled_step or r.finished_step) - r.queued_step for r in timings]),
            "time_to_first_token": percentiles([r.first_token_step - r.queued_step for r in timings
                                                if r.first_token_step is not None]),
            "total": percentiles([r.finished_step - r.queued_step for r in timings]),
        },
        "queue_wait_steps_by_priority": {
            str(p): {**percentiles(w), "max": max(w), "requests": len(w)}
            for p, w in sorted(stats.wait_steps_by_priority.items())
        },
        "oldest_wait_steps": max((max(w) for w in stats.wait_steps_by_priority.values()), default=None),
        "histogram_total_seconds": histogram(total_s),
        "sampled_requests": len(timings),
        "requests": max(metrics.timings_seen, len(timings)),
    }


def length_quantiles(metrics: JobMetrics, points: int = 101) -> dict[str, list[int]]:
    """Prompt and output lengths of the (sampled) requests at 0, 1, ..., 100%: `cbatch plan --lengths-from`
    draws a later run's output lengths from them."""
    out: dict[str, list[int]] = {}
    for name in ("prompt_tokens", "output_tokens"):
        values = sorted(getattr(r, name) for r in metrics.requests)
        out[name] = [values[round(i * (len(values) - 1) / (points - 1))] for i in range(points)] if values else []
    return out


def histogram(values: list[float], bins: int = 30) -> dict[str, list[float]]:
    """Equal-width bins over [min, max]: `edges` (bins + 1) and `counts` (bins)."""
    if not values:
        return {"edges": [], "counts": []}
    low, high = min(values), max(values)
    width = (high - low) / bins or 1.0
    counts = [0] * bins
    for v in values:
        counts[min(bins - 1, int((v - low) / width))] += 1
    return {"edges": [low + i * width for i in range(bins + 1)], "counts": counts}


def time_series(samples: list[StepSample], max_num_seqs: int, num_kv_blocks: int, points: int = 400) -> dict[str, list]:
    """The per-step samples (or buckets of steps, see JobMetrics) folded into at most `points` buckets.

    Sums (steps, tokens, dt) are kept per bucket, so a linear cost model fitted on buckets is the
    same fit as on steps; occupancy and KV usage are bucket means; rates are bucket sums / dt.
    """
    keys = ("t", "dt", "steps", "occupancy", "kv_usage", "waiting", "output_tokens_per_s", "prompt_tokens_per_s",
            "scheduled_tokens", "prefill_tokens", "context_tokens", "output_tokens")
    series: dict[str, list] = {k: [] for k in keys}
    size = max(1, -(-len(samples) // points))
    previous_t = 0.0
    for start in range(0, len(samples), size):
        chunk = samples[start : start + size]
        n, t_end = sum(s.steps for s in chunk), chunk[-1].t
        dt = t_end - previous_t
        previous_t = t_end
        out = sum(s.output_tokens for s in chunk)
        prefill = sum(s.prefill_tokens for s in chunk)
        for key, value in (
            ("t", t_end), ("dt", dt), ("steps", n),
            ("occupancy", sum(s.running for s in chunk) / (n * max_num_seqs)),
            ("kv_usage", sum(s.kv_used for s in chunk) / (n * max(num_kv_blocks, 1))),
            ("waiting", chunk[-1].waiting),
            ("output_tokens_per_s", out / dt if dt > 0 else 0.0),
            ("prompt_tokens_per_s", prefill / dt if dt > 0 else 0.0),
            ("scheduled_tokens", sum(s.scheduled_tokens for s in chunk)), ("prefill_tokens", prefill),
            ("context_tokens", sum(s.context_tokens for s in chunk)), ("output_tokens", out),
        ):
            series[key].append(value)
    return series


def write_report(path: Path, report: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(path)


def summary_line(report: dict[str, Any]) -> str:
    r, t, u = report["requests"], report["throughput"], report["utilization"]
    outputs = r.get("output_rows", r["total"])
    rows = f"{r['ok']}/{r['total']} rows ok" if outputs == r["total"] else f"{r['ok']}/{outputs} samples of {r['total']} rows ok"
    return (
        f"cbatch: {rows}, {r['error']} errors"
        + (f" ({r['resumed']} from an earlier run)" if r.get("resumed") else "")
        + (f" ({r['cached']} from the result cache)" if r.get("cached") else "")
        + (_prefill_only_rates(report) if report.get("task", "generate") != "generate" else
           f" | {report['tokens']['output']} output tokens in {report['time']['wall_seconds']:.1f}s"
           f" = {t['output_tokens_per_s']:.1f} tok/s ({t['total_tokens_per_s']:.1f} total)")
        + f" | occupancy {u['mean_batch_occupancy']:.0%}, peak KV {u['peak_kv_usage']:.0%}, preemptions {u['preemptions']}"
        + (f" | speculative: {speculation_text(report['speculative'])}" if "speculative" in report else "")
        + (" | " + images_text(report["images"]) if "images" in report else "")
    )


def images_text(images: dict[str, Any]) -> str:
    """A job's images in a few words (the summary line, the table, the dashboard): images and their tokens, what
    the vision tower encoded, the image tokens whose KV the prefix cache gave, images per second."""
    return (f"images: {images.get('images', 0):,} ({images.get('image_tokens', 0):,} tokens), "
            f"{images.get('encoded', 0):,} encoded, {images.get('prefix_cache_hit_tokens', 0):,} image tokens "
            f"from the prefix cache, {images.get('images_per_s', 0.0):,.1f} images/s")


def speculation_text(spec: dict[str, Any]) -> str:
    """The `speculative` figures in one line (the summary, the report table, `cbatch plan`)."""
    return (f"{spec['accepted_tokens']:,}/{spec['drafted_tokens']:,} drafted tokens kept "
            f"({spec['acceptance_rate']:.0%}), {spec['output_tokens_per_step']:.2f} output tok/step")


def _prefill_only_rates(report: dict[str, Any]) -> str:
    """A prefill-only job's (--task embed, ...) rates: rows and prompt tokens per second (it has no output tokens)."""
    t = report["throughput"]
    return (f" | {report['task']}: {report['tokens']['prompt']} prompt tokens in {report['time']['wall_seconds']:.1f}s"
            f" = {t['requests_per_s']:.1f} rows/s, {t['prompt_tokens_per_s']:.1f} prompt tok/s")


def summary_table(report: dict[str, Any]):
    """The end-of-job table (rich): requests, tokens, time, throughput, utilization, latency."""
    from rich.table import Table

    unit = report.get("time_unit", "s")
    r, tok, tm, t, u = (report[k] for k in ("requests", "tokens", "time", "throughput", "utilization"))
    lat = report["latency"]["seconds"]
    table = Table(title="cbatch report", show_header=False, title_justify="left")
    table.add_column(style="bold cyan")
    table.add_column()
    table.add_row("requests", f"{r['total']} total, {r['ok']} ok, {r['error']} error"
                  + (f" ({r['output_rows']} output rows)" if r.get("output_rows", r["total"]) != r["total"] else ""))
    table.add_row("tokens", f"{tok['prompt']:,} prompt ({u['computed_prompt_tokens']:,} computed), {tok['output']:,} output")
    table.add_row("time", f"{tm['wall_seconds']:.2f} {unit} wall, {tm['model_forward_seconds']:.2f} {unit} model forward")
    table.add_row("throughput", f"{t['output_tokens_per_s']:,.1f} output tok/{unit}, {t['total_tokens_per_s']:,.1f} total tok/{unit}, "
                  f"{t['requests_per_s']:,.2f} req/{unit}")
    table.add_row("utilization", f"{u['steps']} steps, occupancy {u['mean_batch_occupancy']:.0%}, "
                  f"{u['mean_tokens_per_step']:.1f} tok/step, KV mean {u['mean_kv_usage']:.0%} peak {u['peak_kv_usage']:.0%}")
    table.add_row("preemption", f"{u['preemptions']} preemptions, {u['recomputed_tokens']:,} tokens recomputed, "
                  f"padding waste {u['padding_waste']:.1%}")
    if "speculative" in report:
        table.add_row("speculative", speculation_text(report["speculative"]))
    if "images" in report:
        table.add_row("images", images_text(report["images"]).removeprefix("images: "))

    def pct(p: dict) -> str:
        return "-" if p["p50"] is None else f"{p['p50']:.2f} / {p['p90']:.2f} / {p['p99']:.2f}"

    table.add_row(f"latency p50/p90/p99 ({unit})",
                  f"queue {pct(lat['queue_wait'])}, first token {pct(lat['time_to_first_token'])}, total {pct(lat['total'])}")
    hw = report.get("hardware")
    if hw:
        line = f"{hw['achieved_tflops']:.2f} TFLOP/s, {hw['achieved_gb_per_s']:.1f} GB/s"
        if hw.get("peak_tflops"):
            line += f" ({hw['flops_utilization']:.1%} of {hw['peak_tflops']:.0f} TFLOP/s, " \
                    f"{hw['bandwidth_utilization']:.1%} of {hw['peak_gb_per_s']:.0f} GB/s peak on {hw['device_name']})"
        table.add_row("hardware (est.)", line)
        if tuning := hw.get("kernel_tuning"):
            table.add_row("kernels", describe_attention_tuning(tuning))
            if splits := tuning.get("kv_splits"):
                table.add_row("split-KV", describe_split_tuning(splits))
            if gemm := tuning.get("decode_gemm"):
                table.add_row("decode GEMMs", describe_gemm_tuning(gemm))
    return table


def _tuned_how(tuning: dict) -> str:
    """Where a start-up tuning's choice came from: the cache, or timing (how long; "partly" where its budget ran
    out before every candidate was timed), or the device error that left the policy's defaults in place."""
    if tuning.get("error"):
        return f"tuning failed, the defaults run: {tuning['error']}"
    if tuning["cached"]:
        return "cached"
    return f"tuned in {tuning['seconds']:.1f} s" + ("" if tuning.get("complete", True) else ", partly")


def describe_attention_tuning(tuning: dict) -> str:
    """One line of the decode attention tiles start-up tuning chose (`TuningResult.describe()`)."""
    return f"decode attention {tuning['decode_attention']} ({_tuned_how(tuning)}; default {tuning['policy_default']})"


def describe_split_tuning(splits: dict) -> str:
    """One line of the split-KV rule start-up tuning chose (`SplitTuningResult.describe()`)."""
    how = _tuned_how(splits)
    if splits["rule"] == splits["policy_default"]:
        return f"the default, {splits['rule']} ({how})"
    return f"{splits['rule']} ({how}; default {splits['policy_default']})"


def describe_gemm_tuning(gemm: dict) -> str:
    """One line of what the decode GEMMs' start-up tuning chose (`GemmTuningResult.describe()`)."""
    how = _tuned_how(gemm)
    triton = {label: pick for label, pick in gemm["chosen"].items() if pick != "cublas"}
    picks = "; ".join(f"{label} {pick}" for label, pick in triton.items())
    return (f"Triton for {gemm['triton']} of {gemm['shapes']} (layer shape, batch) pairs, cuBLAS for the rest ({how})"
            + (f": {picks}" if picks else ""))
