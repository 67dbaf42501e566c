"""The live dashboard (rich `Live`) shown when stdout is a terminal.

It reads `JobMetrics` a few times a second from rich's background refresh; the step loop does nothing
for it, so it costs nothing per token.
"""
from __future__ import annotations

from rich.console import Group
from rich.live import Live
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from cbatch.observe.metrics import JobMetrics
from cbatch.observe.progress import eta_seconds, format_eta
from cbatch.observe.report import images_text

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    """Values in 0..1 -> a row of block characters (the last `width` buckets)."""
    if not values:
        return ""
    bucket = max(1, len(values) // width)
    points = [sum(values[i : i + bucket]) / len(values[i : i + bucket]) for i in range(0, len(values), bucket)][-width:]
    return "".join(SPARK[min(len(SPARK) - 1, int(max(0.0, min(1.0, v)) * (len(SPARK) - 1) + 0.5))] for v in points)


# A frame costs ~1-3 ms of Python (holding the GIL the step loop needs); 2 frames a second keeps the
# dashboard well under 1% of a job's time (benchmarks/dashboard_overhead.py) and still reads as live.
REFRESH_PER_SECOND = 2.0


class Dashboard:
    """The live view: reads `JobMetrics` only, from rich's refresh thread. `start=False` builds one without
    a Live display (tests render frames with `render()`)."""

    def __init__(self, metrics: JobMetrics, options, refresh_per_second: float = REFRESH_PER_SECOND, start: bool = True,
                 console=None) -> None:
        self.metrics = metrics
        # a local job passes its engine's limits; Ray replicas size their own on GPUs (None: shares not shown)
        self.max_num_seqs = options.engine.max_num_seqs or 0
        self.token_budget = options.engine.max_num_batched_tokens or 0
        self._live = Live(get_renderable=self.render, refresh_per_second=refresh_per_second, transient=False,
                          console=console)
        if start:
            self._live.start()

    def update(self) -> None:
        pass  # the Live display redraws on its own timer, from the metrics

    def close(self) -> None:
        if self._live.is_started:
            self._live.stop()

    def render(self) -> Group:
        m = self.metrics
        elapsed = max(m.now(), 1e-9)
        done = m.done_rows + m.skipped_rows
        window = list(m.recent)  # one snapshot: the job thread appends while this frame renders
        engine = m.engine  # likewise one snapshot (an immutable object, replaced each step)
        recent = [s for s in window[-200:] if s.t >= elapsed - 5.0]
        span = (recent[-1].t - recent[0].t) if len(recent) > 1 else 0.0
        recent_out = sum(s.output_tokens for s in recent[1:]) / span if span > 0 else 0.0
        recent_prompt = sum(s.prefill_tokens for s in recent[1:]) / span if span > 0 else 0.0
        last = window[-1] if window else None
        kv_total = max(engine.kv_total, 1)

        progress = Table.grid(padding=(0, 1))
        progress.add_column(style="bold cyan", min_width=12, no_wrap=True)
        progress.add_column(max_width=40)  # the bar: the one column that gives way on a narrow terminal ...
        progress.add_column(no_wrap=True)  # ... the counts beside it (and the ETA below) are never cut
        progress.add_row("rows", ProgressBar(total=max(m.total_rows, 1), completed=done),
                         f"{done}/{m.total_rows} ({done / max(m.total_rows, 1):.0%})  errors {m.error_rows}")
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold cyan", min_width=12, no_wrap=True)
        table.add_column()
        table.add_row("ETA", format_eta(eta_seconds(m)))
        table.add_row("output tok/s", f"{recent_out:,.1f} recent  {m.output_tokens / elapsed:,.1f} overall")
        table.add_row("prompt tok/s", f"{recent_prompt:,.1f} recent  {m.prompt_tokens / elapsed:,.1f} overall")
        table.add_row("batch", f"running {engine.running}  waiting {engine.waiting}  preempted {engine.preemptions}")
        step_tokens = last.scheduled_tokens if last else 0
        if self.max_num_seqs and self.token_budget:
            table.add_row("occupancy", f"{engine.running / self.max_num_seqs:.0%} of {self.max_num_seqs} seqs")
            table.add_row("token budget", f"{step_tokens / self.token_budget:.0%} of {self.token_budget} per step")
        table.add_row("KV blocks", f"{engine.kv_used}/{engine.kv_total} ({engine.kv_used / kv_total:.0%})")
        if engine.drafted_tokens:
            table.add_row("speculative", f"{engine.accepted_tokens:,}/{engine.drafted_tokens:,} drafted tokens kept "
                          f"({engine.accepted_tokens / engine.drafted_tokens:.0%})")
        if images := dict(m.image_usage):  # (a copy: the job thread updates it)
            images["images_per_s"] = images.get("images", 0) / elapsed
            table.add_row("images", images_text(images).removeprefix("images: "))
        if self.max_num_seqs:
            table.add_row("occupancy ▸", sparkline([s.running / self.max_num_seqs for s in window]))
        return Group(Text("cbatch run", style="bold"), progress, table)
