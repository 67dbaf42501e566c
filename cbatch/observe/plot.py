"""`--plot`: occupancy, KV usage and tokens/s over the job's time, and the latency distribution.

Drawn from reports (their `series` and latency histogram), so a plot can be redrawn from a saved
report. PNG via matplotlib's Agg backend (the `plot` extra); `.html` embeds the same PNG.
"""
from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from cbatch.config import UserError

INSTALL_HINT = "--plot needs matplotlib: pip install 'cbatch[plot]' (or pip install matplotlib)"


class PlotError(UserError):
    """--plot cannot be drawn (matplotlib missing, unknown extension): one line naming the fix."""


def check_plot_path(path: Path) -> None:
    """Before any work: the extension is known, the folder exists and matplotlib is installed."""
    if path.suffix.lower() not in (".png", ".html"):
        raise PlotError(f"--plot {path}: give a file name ending in .png or .html")
    if not (path.parent if str(path.parent) else Path(".")).is_dir():
        raise PlotError(f"--plot {path}: the folder {path.parent} does not exist; create it first")
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise PlotError(INSTALL_HINT)


def plot_reports(reports: list[dict[str, Any]], path: Path) -> None:
    """Writes one figure for one or more runs (several runs are overlaid, labelled by policy)."""
    check_plot_path(path)
    png = render_png(reports)
    if path.suffix.lower() == ".png":
        path.write_bytes(png)
    else:
        data = base64.b64encode(png).decode()
        path.write_text(f'<!doctype html><title>cbatch report</title><img alt="cbatch report" src="data:image/png;base64,{data}">\n')


def render_png(reports: list[dict[str, Any]], dpi: int = 80) -> bytes:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(INSTALL_HINT) from None

    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    (ax_occ, ax_kv), (ax_tok, ax_lat) = axes
    unit = reports[0].get("time_unit", "s")
    for report in reports:
        s = report["series"]
        label = report.get("policy") or report.get("settings", {}).get("engine", {}).get("policy", "run")
        ax_occ.plot(s["t"], [100 * v for v in s["occupancy"]], label=label)
        ax_kv.plot(s["t"], [100 * v for v in s["kv_usage"]], label=label)
        ax_tok.plot(s["t"], s["output_tokens_per_s"], label=label)
        hist = report["latency"]["histogram_total_seconds"]
        if hist["counts"]:
            edges = hist["edges"]
            ax_lat.stairs(hist["counts"], edges, label=label)
    for ax, title, ylabel in (
        (ax_occ, "batch occupancy", "% of max-num-seqs"),
        (ax_kv, "KV cache usage", "% of blocks"),
        (ax_tok, "output tokens per " + unit, f"tokens/{unit}"),
    ):
        ax.set_title(title)
        ax.set_xlabel(f"time ({unit})")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_occ.set_ylim(0, 105)
    ax_kv.set_ylim(0, 105)
    ax_lat.set_title("request latency (queue to done)")
    ax_lat.set_xlabel("seconds" if unit == "s" else f"time ({unit})")
    ax_lat.set_ylabel("requests")
    ax_lat.grid(alpha=0.3)
    if len(reports) > 1:
        ax_occ.legend(loc="lower left", fontsize="small")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return buffer.getvalue()
