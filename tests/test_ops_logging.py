"""Cron-friendly output (plain progress lines, a summary line, --quiet) and streaming: the job never
pulls more rows from the input than `lookahead` waiting plus the running batch."""
from __future__ import annotations

import io
import re

import pytest

from cbatch.config import EngineConfig, SamplingParams
from cbatch.observe.metrics import JobMetrics
from cbatch.observe.progress import PlainProgress
from cbatch.run.job import run_job
from cbatch.run.preflight import JobOptions
from helpers import make_engine
from ops_jobs import read_jsonl, run_inprocess, token_rows, write_jsonl

PROGRESS = re.compile(
    r"^cbatch: rows (\d+)/(\d+) \| ([\d.]+) output tok/s \| ([\d.]+) total tok/s \| errors (\d+) \| ETA (\S+)$"
)
SUMMARY = re.compile(r"^cbatch: (\d+)/(\d+) rows ok, (\d+) errors \| (\d+) output tokens in [\d.]+s = [\d.]+ tok/s .*$")


@pytest.fixture()
def job(tiny_checkpoints, tmp_path):
    rows = token_rows(40, vocab=384, seed=21, bad_every=18)
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    return source, tmp_path, ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--max-num-seqs", "8"]


class FakeClock:
    """Seconds that advance by `tick` at each reading: progress lines timed by the job's own steps."""

    def __init__(self, tick: float) -> None:
        self.tick, self.readings = tick, 0

    def __call__(self) -> float:
        self.readings += 1
        return (self.readings - 1) * self.tick


def plain_progress_on(monkeypatch, clock) -> list[PlainProgress]:
    """Jobs run after this get their plain progress lines timed by `clock`; returns the displays they made."""
    import cbatch.observe.display

    made: list[PlainProgress] = []

    def make(metrics, **settings):
        made.append(PlainProgress(metrics, clock=clock, **settings))
        return made[-1]

    monkeypatch.setattr(cbatch.observe.display, "PlainProgress", make)
    return made


def test_plain_progress_lines_and_summary_when_not_a_terminal(job, monkeypatch):
    source, tmp, flags = job
    clock = FakeClock(tick=1.0)  # one second per update: a line every second update
    made = plain_progress_on(monkeypatch, clock)
    code, stdout, err = run_inprocess("run", str(source), "--out", str(tmp / "o.jsonl"), *flags, "--progress-interval", "2")
    assert code == 1, err  # two bad rows
    assert len(made) == 1 and made[0].interval == 2.0
    assert "\x1b" not in err + stdout  # no live display, no colour codes in a log file
    lines = err.splitlines()
    assert len(lines) == (clock.readings - 1) // 2 >= 2, err  # the first reading starts the clock
    parsed = [PROGRESS.match(line) for line in lines]
    assert all(parsed), [line for line, m in zip(lines, parsed) if not m]
    done = [int(m.group(1)) for m in parsed]
    assert done == sorted(done) and all(int(m.group(2)) == 40 for m in parsed)
    assert all(re.fullmatch(r"\d+m\d\ds", m.group(6)) for m in parsed[1:])  # an ETA once tokens are generated
    assert any(float(m.group(3)) > 0 for m in parsed)
    summary = stdout.splitlines()
    assert len(summary) == 1 and SUMMARY.match(summary[0]), stdout
    ok, total, errors, tokens = map(int, SUMMARY.match(summary[0]).groups())
    rows = read_jsonl(tmp / "o.jsonl")
    assert (ok, total, errors) == (38, 40, 2)
    assert tokens == sum(r["completion_tokens"] for r in rows)


def test_plain_progress_prints_a_line_per_interval():
    stream = io.StringIO()
    times = iter([0.0, 3.0, 9.99, 10.0, 15.0, 19.9, 20.5, 21.0])
    progress = PlainProgress(JobMetrics(total_rows=5, ok_rows=2, output_tokens=40), interval=10.0, stream=stream,
                             clock=lambda: next(times))
    printed = []
    for _ in range(7):
        progress.update()
        printed.append(stream.getvalue().count("\n"))
    assert printed == [0, 0, 1, 1, 1, 2, 2]  # at 10.0 and 20.5: each line 10 s after the one before
    assert all(PROGRESS.match(line) for line in stream.getvalue().splitlines())


def test_quiet_prints_only_the_summary(job, monkeypatch):
    source, tmp, flags = job
    made = plain_progress_on(monkeypatch, FakeClock(tick=1.0))  # without -q: a line at every update
    code, stdout, err = run_inprocess("run", str(source), "--out", str(tmp / "o.jsonl"), *flags, "--progress-interval", "1", "-q")
    assert code == 1
    assert made == [] and err == ""
    assert len(stdout.splitlines()) == 1 and SUMMARY.match(stdout.strip())


def test_default_interval_is_quiet_for_short_jobs(job, monkeypatch):
    source, tmp, flags = job
    made = plain_progress_on(monkeypatch, FakeClock(tick=0.0))  # the whole job within its first 10 s
    code, stdout, err = run_inprocess("run", str(source), "--out", str(tmp / "o.jsonl"), *flags, "--allow-errors")
    assert code == 0 and len(stdout.splitlines()) == 1
    assert len(made) == 1 and made[0].interval == 10.0  # plain lines, at most one per 10 s ...
    assert err == ""  # ... so none at all for a job shorter than that


def test_rows_are_streamed_within_the_lookahead(tiny_checkpoints, tmp_path, monkeypatch):
    """However long the input, the job holds at most `lookahead` waiting rows plus the running batch."""
    import cbatch.run.job

    lookahead, max_seqs, n = 6, 3, 90
    model = tiny_checkpoints["llama"]
    engine = make_engine(model, max_num_seqs=max_seqs)
    source = write_jsonl(tmp_path / "in.jsonl", token_rows(n, vocab=384, seed=8))
    finished = [0]
    real_step = engine.step

    def counting_step():
        out = real_step()
        finished[0] += len(out)
        return out

    monkeypatch.setattr(engine, "step", counting_step)
    pulls: list[tuple[int, int, int]] = []  # (rows pulled, waiting in the engine, finished) at each pull
    real_rows = cbatch.run.job.iter_rows

    def watched_rows(path):
        for pulled, item in enumerate(real_rows(path), start=1):
            pulls.append((pulled, engine.scheduler.num_waiting, finished[0]))
            yield item

    monkeypatch.setattr(cbatch.run.job, "iter_rows", watched_rows)
    options = JobOptions(input=source, output=tmp_path / "o.jsonl", defaults=SamplingParams(max_tokens=4),
                         engine=EngineConfig(model=str(model), device="cpu", max_num_seqs=max_seqs),
                         display="none", lookahead=lookahead)
    assert run_job(options, make_engine=lambda _: engine) == 0
    assert len(read_jsonl(tmp_path / "o.jsonl")) == n and len(pulls) == n
    assert max(waiting for _, waiting, _ in pulls) == lookahead - 1  # the window is used ...
    for pulled, waiting, done in pulls:
        assert waiting < lookahead  # ... and never exceeded
        assert pulled - done <= lookahead + max_seqs  # rows in memory: waiting + running + the one being read
    assert pulls[-1][2] >= n - lookahead - max_seqs  # the last rows were read only near the end
