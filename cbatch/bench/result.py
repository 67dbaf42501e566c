"""What a benchmark run (real or simulated) records, and the side-by-side table of several runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cbatch.engine.stats import SchedulerStats
from cbatch.observe.metrics import JobMetrics


@dataclass(slots=True)
class BenchRun:
    """One policy's run: the metrics the report is built from, and each request's finish step and time."""

    policy: str
    label: str = ""  # the column it gets in the comparison (the policy, or e.g. "longest-first, no prefix cache")
    metrics: JobMetrics = field(default_factory=JobMetrics)
    finish_step: list[int | None] = field(default_factory=list)  # by request index; None for error rows
    finish_time: list[float | None] = field(default_factory=list)
    report: dict[str, Any] = field(default_factory=dict)
    stats: SchedulerStats | None = None  # the scheduler's counters at the end
    num_kv_blocks: int = 0
    wall: float = 0.0  # seconds, or cost units for the simulator

    def build_report(self, max_num_seqs: int, settings: dict[str, Any], time_unit: str,
                     hardware: dict[str, Any] | None = None) -> dict[str, Any]:
        from cbatch.observe.report import build_report

        assert self.stats is not None
        self.metrics.forward_seconds = self.metrics.forward_seconds or self.wall
        report = build_report(self.metrics, self.stats, wall_seconds=self.wall, max_num_seqs=max_num_seqs,
                              num_kv_blocks=self.num_kv_blocks, settings=settings, hardware=hardware,
                              time_unit=time_unit)
        report["policy"] = self.policy
        report["label"] = self.label or self.policy
        report["per_request"] = {"finish_step": self.finish_step, "finish_time": self.finish_time}
        self.report = report
        return report


def comparison_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per run: the headline figures and their ratio against static batching (or the first run)."""
    base = next((r for r in runs if r["policy"] == "static"), runs[0])

    def figures(r: dict[str, Any]) -> dict[str, float | None]:
        lat = r["latency"]["seconds"]["total"]
        return {
            "output_tokens_per_s": r["throughput"]["output_tokens_per_s"],
            "wall_time": r["time"]["wall_seconds"],
            "mean_occupancy": r["utilization"]["mean_batch_occupancy"],
            "padding_waste": r["utilization"]["padding_waste"],
            "latency_p50": lat["p50"],
            "latency_p99": lat["p99"],
            "prefix_cache_hit_rate": r["utilization"]["prefix_cache_hit_rate"],
            **({"images_per_s": r["images"]["images_per_s"]} if "images" in r else {}),
        }

    b = figures(base)
    rows = []
    for r in runs:
        f = figures(r)
        ratios = {k: (v / b[k] if v is not None and b[k] else None) for k, v in f.items()}
        rows.append({"policy": r["policy"], "label": r.get("label", r["policy"]), "baseline": base.get("label", base["policy"]),
                     **f, "ratio": ratios})
    return rows


def comparison_table(runs: list[dict[str, Any]]):
    """One rich table, policies side by side, each figure with its ratio against the baseline."""
    from rich.table import Table

    rows = comparison_rows(runs)
    unit = runs[0].get("time_unit", "s")
    table = Table(title=f"cbatch bench (ratios against {rows[0]['baseline']})", title_justify="left")
    table.add_column("")
    for row in rows:
        table.add_column(row["label"], justify="right")
    for key, label, fmt in (
        ("output_tokens_per_s", f"output tok/{unit}", "{:,.1f}"),
        ("wall_time", f"wall time ({unit})", "{:,.2f}"),
        ("mean_occupancy", "mean occupancy", "{:.1%}"),
        ("padding_waste", "padding waste", "{:.1%}"),
        ("latency_p50", f"latency p50 ({unit})", "{:,.2f}"),
        ("latency_p99", f"latency p99 ({unit})", "{:,.2f}"),
        ("prefix_cache_hit_rate", "prefix cache hits", "{:.1%}"),
        *([("images_per_s", f"images/{unit}", "{:,.2f}")] if "images_per_s" in rows[0] else []),  # --images
    ):
        cells = []
        for row in rows:
            value, ratio = row[key], row["ratio"][key]
            cell = "-" if value is None else fmt.format(value)
            if ratio is not None and row["label"] != row["baseline"] and key not in ("padding_waste", "prefix_cache_hit_rate"):
                cell += f" ({ratio:.2f}x)"
            cells.append(cell)
        table.add_row(label, *cells)
    if any("speculative" in r for r in runs):  # --speculative: drafts kept and output tokens per step
        table.add_row("speculative", *(f"{s['accepted_tokens']:,}/{s['drafted_tokens']:,} kept, "
                                       f"{s['output_tokens_per_step']:.2f} tok/step" if (s := r.get("speculative"))
                                       else "-" for r in runs))
    return table
