"""A job's deadline (--max-wall-time / --deadline): at the deadline nothing new starts, the running rows get the
grace, every row left becomes an `expired` error row in a whole OUTPUT (exit 75), and the same command run again
runs only the expired rows, ending with the OUTPUT an uninterrupted run writes. The deadline here is counted in
engine steps (an injected clock), so nothing depends on the machine's speed."""
from __future__ import annotations

import json
from datetime import datetime

import pytest

from cbatch.config import EngineConfig, SamplingParams, UserError
from cbatch.engine.build import build_engine
from cbatch.run.deadline import Deadline, parse_clock, parse_duration
from cbatch.run.exit_codes import EXIT_EXPIRED
from cbatch.run.job import run_job
from cbatch.run.preflight import JobOptions
from ops_jobs import read_jsonl, run_inprocess, token_rows, write_jsonl

N_ROWS = 40


@pytest.fixture(scope="module")
def job(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("deadline")
    rows = token_rows(N_ROWS, vocab=384, seed=5, bad_every=13)
    source = write_jsonl(root / "in.jsonl", rows)
    model = tiny_checkpoints["llama"]
    reference = root / "reference.jsonl"
    assert run_job(options(source, reference, model)) == 1  # its bad rows are error rows
    return {"source": source, "model": model, "reference": reference.read_bytes()}


def options(source, out, model, deadline=None, **extra) -> JobOptions:
    return JobOptions(input=source, output=out, engine=EngineConfig(model=str(model), device="cpu", max_num_seqs=4, seed=7),
                      defaults=SamplingParams(max_tokens=6), token_ids=True, display="none", quiet=True,
                      deadline=deadline, **extra)


def run_with_step_deadline(job, out, at_step: int, grace_steps: int, **extra) -> tuple[int, list[dict]]:
    """The job with a deadline at engine step `at_step` and a grace of `grace_steps` steps."""
    holder = {}

    def make_engine(config):
        holder["engine"] = build_engine(config)
        return holder["engine"]

    def steps() -> float:
        return holder["engine"].scheduler.stats.steps if "engine" in holder else 0

    deadline = Deadline(at_step, grace_steps, "--max-wall-time 2h", clock=steps)
    code = run_job(options(job["source"], out, job["model"], deadline, **extra), make_engine=make_engine)
    return code, read_jsonl(out)


def test_rows_left_at_the_deadline_expire_and_a_rerun_completes_them(job, tmp_path):
    out = tmp_path / "out.jsonl"
    code, got = run_with_step_deadline(job, out, at_step=5, grace_steps=0)
    assert code == EXIT_EXPIRED
    reference = [json.loads(line) for line in job["reference"].decode().splitlines()]
    assert [r["id"] for r in got] == [r["id"] for r in reference]  # every row, in input order
    expired = [r for r in got if r["finish_reason"] == "expired"]
    finished = [r for r in got if r["finish_reason"] in ("stop", "length")]
    assert 20 < len(expired) < N_ROWS and finished  # some rows finished before the deadline, most did not
    assert all(r["error"].startswith("expired: the job's deadline (--max-wall-time 2h) came before this row finished")
               for r in expired)
    by_id = {r["id"]: r for r in reference}
    assert all(r == by_id[r["id"]] for r in finished)  # what finished is what an uninterrupted run writes
    assert [r for r in got if r["finish_reason"] == "error"] == [r for r in reference if r["finish_reason"] == "error"]
    # the same command again (no deadline): only the expired rows run, and OUTPUT becomes the reference's
    assert run_job(options(job["source"], out, job["model"])) == 1
    assert out.read_bytes() == job["reference"]
    assert not (tmp_path / ".out.jsonl.cbatch").exists()


def test_the_grace_lets_running_rows_finish_while_waiting_ones_expire(job, tmp_path):
    code, got = run_with_step_deadline(job, tmp_path / "out.jsonl", at_step=3, grace_steps=1000)
    assert code == EXIT_EXPIRED
    reference = {r["id"]: r for r in map(json.loads, job["reference"].decode().splitlines())}
    done = [r for r in got if r["finish_reason"] in ("stop", "length")]
    expired = [r for r in got if r["finish_reason"] == "expired"]
    assert 4 <= len(done) <= 8 and expired  # the rows running at step 3 (max_num_seqs 4) ran to their ends
    assert all(r == reference[r["id"]] for r in done)


def test_a_deadline_that_never_comes_changes_nothing(job, tmp_path):
    out = tmp_path / "out.jsonl"
    code, _ = run_with_step_deadline(job, out, at_step=10**6, grace_steps=0)
    assert code == 1 and out.read_bytes() == job["reference"]


def test_cli_exit_code_openai_lines_and_retry_errors(job, tmp_path):
    """A deadline that has passed when the rows start: every row expires (exit 75); OpenAI lines say batch_expired;
    --retry-errors before the expired rows ran says to run the same command first."""
    base = [str(job["source"]), "--model", str(job["model"]), "--device", "cpu", "--display", "none"]
    out = tmp_path / "out.jsonl"
    code, _, err = run_inprocess("run", *base, "--out", str(out), "--output-format", "openai", "--max-wall-time", "0.001")
    assert code == EXIT_EXPIRED, err
    lines = read_jsonl(out)
    assert len(lines) == N_ROWS
    codes = {line["response"]["body"]["error"]["code"] for line in lines}
    assert "batch_expired" in codes and codes <= {"batch_expired", None}  # None: the bad rows, reported as such
    assert "rows expired" in err and "run the same command again" in err
    plain = tmp_path / "plain.jsonl"
    code, _, err = run_inprocess("run", *base, "--out", str(plain), "--max-wall-time", "0.001")
    assert code == EXIT_EXPIRED, err
    code, _, err = run_inprocess("run", *base, "--out", str(plain), "--retry-errors")
    assert code == 2 and "run the same command without --retry-errors" in err
    code, _, err = run_inprocess("run", *base, "--out", str(tmp_path / "o2.jsonl"), "--max-wall-time", "soon")
    assert code == 2 and err.strip().splitlines()[-1] == (
        "cbatch: error: --max-wall-time 'soon': not a duration; write e.g. 90m, 2h, 1h30m or 3600 (seconds)")


def test_durations_and_times_of_day():
    assert parse_duration("1h30m", "--x") == 5400 and parse_duration("90", "--x") == 90
    assert parse_duration("2d", "--x") == 172800 and parse_duration("45s", "--x") == 45
    for bad in ("1x", "h", "1h 30m", "-5"):
        with pytest.raises(UserError, match="^--x"):
            parse_duration(bad, "--x")
    now = datetime(2026, 11, 26, 23, 10)
    assert parse_clock("06:00", now) == datetime(2026, 11, 27, 6, 0)  # the next 06:00: tomorrow
    assert parse_clock("23:30", now) == datetime(2026, 11, 26, 23, 30)
    assert parse_clock("2026-11-28T01:00", now) == datetime(2026, 11, 28, 1, 0)
    with pytest.raises(UserError, match="has passed already"):
        parse_clock("2026-11-20T01:00", now)
    with pytest.raises(UserError, match="not a time of day"):
        parse_clock("25:00", now)


def test_plan_warns_when_the_prediction_does_not_fit(job, tmp_path):
    base = ["plan", str(job["source"]), "--model", str(job["model"]), "--device", "cpu", "--no-search",
            "--max-num-seqs", "4", "--report", str(tmp_path / "plan.json")]
    code, _, err = run_inprocess(*base, "--max-wall-time", "0.001")
    assert code == 1 and "does not fit --max-wall-time 0.001" in err  # (1: the job's bad rows)
    assert "deadline_warning" in json.loads((tmp_path / "plan.json").read_text())
    code, _, err = run_inprocess(*base, "--deadline", "2099-01-01T00:00")
    assert code == 1 and "does not fit" not in err
