"""Observability: the live dashboard's frames, the report's consistency, the plot, `cbatch bench` end to end."""
from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import subprocess
import sys
from types import SimpleNamespace

import pytest

from cbatch.config import EngineConfig
from cbatch.observe.metrics import EngineSnapshot, JobMetrics, StepSample
from ops_jobs import SAMPLE, cbatch_env, run_inprocess


@pytest.fixture(scope="module")
def pressured_run():
    """A real run on the tiny preset with a KV pool small enough to preempt: (engine, run, report)."""
    from cbatch.bench.trial import make_bench_engine, run_trial, workload_prompts
    from cbatch.bench.workload import parse_distribution, synthetic_workload
    from cbatch.observe.roofline import engine_hardware

    config = EngineConfig(device="cpu", max_num_seqs=6, num_kv_blocks=24, block_size=8, max_num_batched_tokens=48)
    engine = make_bench_engine(config, "tiny", seed=1)
    requests = synthetic_workload(14, parse_distribution("5:40", "--input-len"), parse_distribution("10:60", "--output-len"), 2)
    run = run_trial(engine, requests, workload_prompts(requests, engine.spec.vocab_size, 1), "longest-first")
    report = run.build_report(6, {}, "s", engine_hardware(engine, run.metrics.series, run.metrics.forward_seconds))
    return engine, run, report, requests


# ---- report --------------------------------------------------------------------------------------
def test_report_rates_times_wall_give_the_totals(pressured_run):
    _, _, report, requests = pressured_run
    wall = report["time"]["wall_seconds"]
    tok, thr = report["tokens"], report["throughput"]
    assert tok["output"] == sum(r.output_len for r in requests)
    assert tok["prompt"] == sum(r.prompt_len for r in requests)
    assert thr["output_tokens_per_s"] * wall == pytest.approx(tok["output"])
    assert thr["prompt_tokens_per_s"] * wall == pytest.approx(tok["prompt"])
    assert thr["total_tokens_per_s"] * wall == pytest.approx(tok["prompt"] + tok["output"])
    assert thr["requests_per_s"] * wall == pytest.approx(report["requests"]["ok"] + report["requests"]["error"])
    assert 0 < report["time"]["model_forward_seconds"] <= wall


def test_report_utilization_is_consistent_with_the_scheduler(pressured_run):
    engine, run, report, _ = pressured_run
    u, stats = report["utilization"], engine.scheduler.stats
    assert u["preemptions"] == stats.preemptions > 0  # the pool was small enough to preempt
    assert u["recomputed_tokens"] == stats.recomputed_tokens > 0
    assert u["steps"] == stats.steps == len(run.metrics.series)
    assert 0 < u["mean_batch_occupancy"] <= 1
    assert 0 < u["mean_kv_usage"] <= u["peak_kv_usage"] <= 1
    assert u["mean_tokens_per_step"] * u["steps"] == pytest.approx(stats.scheduled_tokens)
    # scheduled work = prompts + outputs (the last token of each is never fed back) + recompute, less what
    # the prefix cache gave back (preempted rows restart on their own cached blocks)
    assert stats.prefix_cache_hit_tokens > 0
    assert stats.scheduled_tokens == (report["tokens"]["prompt"] + report["tokens"]["output"] - 14
                                      + stats.recomputed_tokens - stats.prefix_cache_hit_tokens)
    assert u["padding_waste"] == 0


def test_report_series_and_latency(pressured_run):
    _, _, report, _ = pressured_run
    series = report["series"]
    assert sum(series["steps"]) == report["utilization"]["steps"]
    assert sum(series["output_tokens"]) == report["tokens"]["output"]
    assert sum(series["dt"]) == pytest.approx(series["t"][-1])
    assert all(0 <= v <= 1 for v in series["occupancy"] + series["kv_usage"])
    for unit in ("seconds", "steps"):
        lat = report["latency"][unit]
        for name in ("queue_wait", "time_to_first_token", "total"):
            p = lat[name]
            assert p["p50"] <= p["p90"] <= p["p99"]
        assert lat["time_to_first_token"]["p99"] <= lat["total"]["p99"]
    assert sum(report["latency"]["histogram_total_seconds"]["counts"]) == report["requests"]["ok"]
    hw = report["hardware"]
    assert hw["achieved_tflops"] > 0 and hw["achieved_gb_per_s"] > 0 and hw["peak_tflops"] is None  # CPU


def test_device_peaks_match_by_name():
    from cbatch.observe.roofline import device_peak

    assert device_peak("NVIDIA H100 80GB HBM3") == (989.0, 3.35)
    assert device_peak("NVIDIA H100 PCIe") == (756.0, 2.0)
    assert device_peak("NVIDIA H200") == (989.0, 4.8)
    assert device_peak("Some Future GPU") is None


# ---- plot ----------------------------------------------------------------------------------------
def test_plot_renders_a_non_blank_png(pressured_run, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.image

    from cbatch.observe.plot import plot_reports

    _, _, report, _ = pressured_run
    path = tmp_path / "report.png"
    plot_reports([report, {**report, "policy": "other"}], path)
    image = matplotlib.image.imread(path)
    height, width = image.shape[:2]
    assert width >= 600 and height >= 400
    assert image[..., :3].std() > 0.05  # lines and text, not a blank canvas
    html = tmp_path / "report.html"
    plot_reports([report], html)
    assert html.read_text().startswith("<!doctype html>") and "base64," in html.read_text()


def test_plot_refuses_unknown_extension(tmp_path):
    from cbatch.observe.plot import PlotError, check_plot_path

    with pytest.raises(PlotError, match=r"\.png or \.html"):
        check_plot_path(tmp_path / "report.jpg")


# ---- dashboard -----------------------------------------------------------------------------------
def test_dashboard_frame_has_every_field():
    from rich.console import Console

    from cbatch.bench.trial import make_bench_engine
    from cbatch.config import SamplingParams
    from cbatch.observe.dashboard import Dashboard
    from cbatch.observe.metrics import engine_snapshot, engine_step_sample

    config = EngineConfig(device="cpu", max_num_seqs=4, max_num_batched_tokens=32, num_kv_blocks=64, block_size=8)
    engine = make_bench_engine(config, "tiny", seed=0)
    for i in range(7):
        engine.add_request([5 + i] * (6 + 3 * i), SamplingParams(max_tokens=20, ignore_eos=True))
    metrics = JobMetrics(total_rows=10, ok_rows=3)
    dashboard = Dashboard(metrics, SimpleNamespace(engine=config), start=False)
    for _ in range(6):
        engine.step()
        metrics.record_step(engine_step_sample(metrics, engine))
        metrics.engine = engine_snapshot(engine)
    metrics.output_tokens = sum(s.output_tokens for s in metrics.series)
    dashboard.update()
    console = Console(record=True, force_terminal=True, width=100)
    console.print(dashboard.render())
    text = console.export_text()
    running, waiting = len(engine.scheduler.running), engine.scheduler.num_waiting
    assert running == 4 and waiting == 3
    for field in ("rows", "3/10", "ETA", "output tok/s", "prompt tok/s", "recent", "overall",
                  f"running {running}", f"waiting {waiting}", "preempted 0", "occupancy", "100% of 4 seqs",
                  "token budget", "of 32 per step", "KV blocks", f"{engine.pool.num_used}/64"):
        assert field in text, field
    assert any(ch in text for ch in "▁▂▃▄▅▆▇█")  # the occupancy sparkline


def job_metrics(total: int, ok: int, errors: int, elapsed: float) -> JobMetrics:
    """A job's metrics `elapsed` seconds in (on a fake clock): its last 30 steps half a second apart, each
    sampling 8 tokens and prefilling 12 (16 and 24 tokens/s), 2 output and 3 prompt tokens/s overall."""
    now = [0.0]
    metrics = JobMetrics(total_rows=total, ok_rows=ok, error_rows=errors, clock=lambda: now[0])
    for i in range(30):
        metrics.record_step(StepSample(t=elapsed - 0.5 * (29 - i), running=5 + i % 3, waiting=3, scheduled_tokens=20,
                                       prefill_tokens=12, output_tokens=8, kv_used=40))
    metrics.output_tokens, metrics.prompt_tokens = int(2 * elapsed), int(3 * elapsed)
    metrics.engine = EngineSnapshot(running=5, waiting=3, preemptions=2, kv_used=40, kv_total=128)
    now[0] = elapsed
    return metrics


def frame(metrics: JobMetrics, width: int) -> list[str]:
    """The dashboard's frame as a terminal `width` columns wide shows it, line by line."""
    from rich.console import Console

    from cbatch.observe.dashboard import Dashboard

    dashboard = Dashboard(metrics, SimpleNamespace(engine=EngineConfig(max_num_seqs=8, max_num_batched_tokens=64)),
                          start=False)
    console = Console(record=True, force_terminal=True, width=width, file=io.StringIO())
    console.print(dashboard.render())
    return console.export_text().splitlines()


@pytest.mark.parametrize("width", [60, 80, 110, 160])
@pytest.mark.parametrize("total,ok,counts,eta", [
    pytest.param(64, 58, "59/64 (92%)  errors 1", "0m05s", id="64-rows"),  # 59 rows in 59 s: 5 s left
    pytest.param(10_000_000, 1_234_566, "1234567/10000000 (12%)  errors 1", "1h58m", id="10M-rows"),  # 7100 s left
])
def test_dashboard_layout_at_common_widths(width, total, ok, counts, eta):
    from rich.cells import cell_len

    lines = frame(job_metrics(total, ok, errors=1, elapsed=59.0 if total == 64 else 1000.0), width)
    assert all(cell_len(line) <= width for line in lines), lines  # nothing runs past the edge ...
    assert len(lines) == 10, lines  # ... or wraps onto a line of its own
    bar = re.fullmatch(r"rows {9}([━╸╺]+) (.*?) *", lines[1])
    assert bar and bar.group(2) == counts, lines[1]  # the bar, one space, then the counts: never run together
    label_and_spaces = 12 + 1 + 1  # the label column, a space either side of the bar
    assert len(bar.group(1)) == min(40, width - label_and_spaces - len(counts))  # the bar gives way, not the counts
    assert re.fullmatch(rf"ETA {{10}}{eta} *", lines[2]), lines[2]
    body = "\n".join(lines)
    for field in ("output tok/s 16.0 recent  2.0 overall", "prompt tok/s 24.0 recent  3.0 overall",
                  "batch        running 5  waiting 3  preempted 2",
                  "occupancy    62% of 8 seqs", "token budget 31% of 64 per step", "KV blocks    40/128 (31%)"):
        assert field in body, field
    assert re.search(r"occupancy ▸ +[▁▂▃▄▅▆▇█]{30}", body)  # one sparkline point per step


def test_eta_is_a_number_before_the_first_row_finishes():
    """Once tokens are generated the ETA is an estimate (from the token rate and the rows' max_tokens),
    not "?", though no row has finished yet."""
    from cbatch.observe.progress import eta_seconds, progress_text

    now = [0.0]
    metrics = JobMetrics(total_rows=10, clock=lambda: now[0])
    metrics.submitted_rows, metrics.submitted_max_tokens = 10, 10 * 20
    now[0] = 2.0
    assert eta_seconds(metrics) is None and progress_text(metrics).endswith("ETA ?")  # nothing to go by yet
    metrics.record_step(StepSample(t=2.0, running=10, waiting=0, scheduled_tokens=100, prefill_tokens=90,
                                   output_tokens=40, kv_used=20))
    assert metrics.done_rows == 0
    assert eta_seconds(metrics) == (10 * 20 - 40) / (40 / 2.0)  # 8 s: the tokens left at 20 tokens/s
    assert progress_text(metrics).endswith("ETA 0m08s")
    assert any(re.fullmatch(r"ETA {10}0m08s *", line) for line in frame(metrics, 80))


def test_sparkline_scales_to_width():
    from cbatch.observe.dashboard import sparkline

    line = sparkline([i / 99 for i in range(100)], width=10)
    assert len(line) == 10 and line[0] == "▁" and line[-1] == "█"
    assert sparkline([]) == ""


def test_run_on_a_terminal_shows_the_dashboard(tiny_chat_model, tmp_path):
    """`cbatch run` with stdout a pseudo-terminal: the live dashboard is drawn (auto), then the summary
    line and table; --plot writes the figure."""
    master, slave = pty.openpty()
    env = cbatch_env(COLUMNS="120", TERM="xterm")
    plot = tmp_path / "r.png"
    proc = subprocess.Popen(
        [sys.executable, "-m", "cbatch.cli", "run", str(SAMPLE / "prompts.jsonl"), "--out", str(tmp_path / "o.jsonl"),
         "--model", str(tiny_chat_model), "--max-tokens", "24", "--max-num-seqs", "4", "--plot", str(plot)],
        stdout=slave, stderr=slave, stdin=subprocess.DEVNULL, env=env,
    )
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 180)
        if not ready:
            break
        try:
            data = os.read(master, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    proc.wait(timeout=180)
    os.close(master)
    out = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, out[-2000:]
    for field in ("rows", "output tok/s", "running", "KV blocks", "token budget", "cbatch: 12/12 rows ok",
                  "cbatch report", "throughput", "latency p50/p90/p99"):
        assert field in out, field
    assert "\x1b[" in out  # drawn with terminal control codes (rich Live), not plain lines
    assert plot.stat().st_size > 10_000


def test_non_terminal_gets_plain_progress_lines(capsys):
    from cbatch.observe.display import make_display as make_progress
    from cbatch.observe.progress import NoProgress, PlainProgress

    options = SimpleNamespace(quiet=False, display="auto", engine=EngineConfig(), progress_interval=10.0)
    assert not sys.stdout.isatty()  # pytest captures stdout
    progress = make_progress(JobMetrics(total_rows=5, ok_rows=2, output_tokens=40), options)
    assert isinstance(progress, PlainProgress)
    progress.interval = 0.0
    progress.update()
    line = capsys.readouterr().err
    assert line.startswith("cbatch: rows 2/5") and "output tok/s" in line and "\x1b[" not in line
    assert isinstance(make_progress(JobMetrics(), SimpleNamespace(quiet=True, display="auto")), NoProgress)


# ---- cbatch bench end to end --------------------------------------------------------------------
def test_bench_simulate_cli(tmp_path):
    report, plot = tmp_path / "bench.json", tmp_path / "bench.png"
    code, stdout, err = run_inprocess("bench", "--simulate", "--num-prompts", "300", "--input-len", "chat", "--output-len",
                                      "chat", "--max-num-seqs", "8", "--report", str(report), "--plot", str(plot))
    assert code == 0, err
    for word in ("static", "fcfs", "longest-first", "output tok/cost", "wall time", "mean occupancy", "latency p99"):
        assert word in stdout, word
    data = json.loads(report.read_text())
    assert [r["policy"] for r in data["runs"]] == ["static", "fcfs", "longest-first"]
    assert data["workload"]["num_prompts"] == 300
    outputs = {r["tokens"]["output"] for r in data["runs"]}
    assert outputs == {data["workload"]["output_tokens"]}  # identical workload for every policy
    rows = {r["policy"]: r for r in data["comparison"]}
    assert rows["fcfs"]["ratio"]["wall_time"] < 0.5  # continuous batching well ahead of static
    assert len(data["runs"][1]["per_request"]["finish_step"]) == 300
    assert plot.stat().st_size > 10_000


def test_bench_real_tiny_model_single_policy(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt_len": 8 + i, "output_len": 5 + 2 * i}) + "\n" for i in range(6)))
    report = tmp_path / "r.json"
    code, stdout, err = run_inprocess("bench", "--model-config", "tiny", "--device", "cpu", "--trace", str(trace), "--policy",
                                      "fcfs", "--max-num-seqs", "3", "--report", str(report))
    assert code == 0, err
    assert "cbatch report" in stdout
    run = json.loads(report.read_text())["runs"][0]
    assert run["tokens"] == {"prompt": sum(8 + i for i in range(6)), "output": sum(5 + 2 * i for i in range(6))}
    assert run["settings"]["simulated"] is False and run["time_unit"] == "s"


@pytest.mark.parametrize("args,message", [
    (["--input-len", "10-20"], "--input-len: expected N, A:B"),
    (["--policy", "random"], "--policy: must be one of"),
    (["--model-config", "gpt-9"], "--model-config 'gpt-9': not a preset"),
    (["--plot", "x.jpg"], "--plot x.jpg: give a file name ending in .png or .html"),
])
def test_bench_mistakes_are_one_line(args, message):
    simulate = [] if "--model-config" in args else ["--simulate"]
    code, stdout, err = run_inprocess("bench", *simulate, "--num-prompts", "5", *args)
    assert code == 2
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    import importlib.util

    from cbatch.observe.plot import PlotError, check_plot_path

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(PlotError, match=r"pip install 'cbatch\[plot\]'"):
        check_plot_path(tmp_path / "r.png")
