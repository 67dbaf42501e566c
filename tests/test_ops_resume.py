"""Crash safety and resume of `cbatch run`: SIGKILL at several points, SIGINT / SIGTERM, a failed final
write, and the refusals when a partial run or an existing OUTPUT does not match this job."""
from __future__ import annotations

import os
import signal

import pytest

from ops_jobs import (
    cbatch_process, leftovers, listing, part_lines, read_jsonl, run_inprocess, signal_and_continue, token_rows,
    wait_until_stopped, write_jsonl,
)

N_ROWS = 300


@pytest.fixture(scope="module")
def job(tiny_checkpoints, tmp_path_factory):
    """A 300-row job (greedy rows, seeded and unseeded sampled rows, a few bad rows) and its
    uninterrupted output, the reference every interrupted-and-resumed run must reproduce exactly."""
    root = tmp_path_factory.mktemp("ops-resume")
    rows = token_rows(N_ROWS, vocab=384, seed=11, bad_every=37)
    source = write_jsonl(root / "in.jsonl", rows)
    flags = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--max-num-seqs", "32", "--token-ids", "--seed", "7",
             "--progress-interval", "0.5"]
    reference = root / "reference.jsonl"
    code, out, err = run_inprocess("run", str(source), "--out", str(reference), *flags)
    assert code == 1, err  # the bad rows are error rows
    ref = read_jsonl(reference)
    assert [r["id"] for r in ref] == [r["id"] if isinstance(r, dict) else str(i) for i, r in enumerate(rows)]
    n_bad = sum(1 for r in ref if r["finish_reason"] == "error")
    assert n_bad == N_ROWS // 37
    sampled = [r for r, src in zip(ref, rows) if isinstance(src, dict) and src.get("temperature")]
    assert len(sampled) > 50 and all(r["completion_token_ids"] for r in sampled)
    return {"rows": rows, "input": source, "flags": flags, "reference": ref}


def _start_stopping_at(job, out, rows: int):
    """The job as a real process that stops itself (SIGSTOP) once `rows` more rows are on disk."""
    proc = cbatch_process("run", str(job["input"]), "--out", str(out), *job["flags"], stop_after_rows=rows)
    wait_until_stopped(proc)
    return proc


def _sigkill_at(job, out, rows: int) -> int:
    """Runs the job until `rows` more rows are on disk, SIGKILLs it there (mid-run: the rest of its batch
    is in flight); returns the lines on disk."""
    before = part_lines(out)
    proc = _start_stopping_at(job, out, rows)
    proc.kill()
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists()  # never a half-written OUTPUT
    return part_lines(out)


def test_sigkill_at_three_points_then_resume_equals_uninterrupted(job, tmp_path):
    out = tmp_path / "out.jsonl"
    seen = [_sigkill_at(job, out, 40)]
    # a torn last line, as a power loss mid-write leaves it: ignored, that row runs again
    state = tmp_path / ".out.jsonl.cbatch"
    with open(sorted(state.glob("part-*.jsonl"))[-1], "ab") as f:
        f.write(b'{"index": 299, "id": "r299", "compl')
    seen.append(_sigkill_at(job, out, 60))
    seen.append(_sigkill_at(job, out, 50))
    assert seen == [40, 100, 150], seen  # three distinct points, job unfinished, each run's rows kept

    # a temp file as a kill during the final write leaves it
    (tmp_path / f".out.jsonl.tmp-{2**22 + 17}").write_text("partial")

    code, stdout, stderr = run_inprocess("run", str(job["input"]), "--out", str(out), *job["flags"])
    assert code == 1, stderr  # finished; the bad rows are errors
    assert "resuming: 150 of 300 rows" in stderr
    got = read_jsonl(out)
    assert [r["id"] for r in got] == [r["id"] for r in job["reference"]]  # every row once, in input order
    assert got == job["reference"]  # identical completions, sampled rows included
    assert leftovers(out) == set()  # no state dir, lock, part or temp file after success
    assert f"{N_ROWS - len([r for r in got if r['error']])}/{N_ROWS} rows ok" in stdout


@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_saves_rows_and_rerun_completes(job, tmp_path, signum, code):
    out = tmp_path / "out.jsonl"
    proc = _start_stopping_at(job, out, 20)  # mid-run: 20 rows saved, the rest of the batch in flight
    signal_and_continue(proc, signum)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == code, stderr
    assert "Run the same command again to resume" in stderr
    assert "Traceback" not in stderr
    assert not out.exists()
    saved = part_lines(out)
    assert 20 <= saved < N_ROWS  # the rows of the step under way when the signal came are kept too
    assert f"{saved} of {N_ROWS} rows are saved" in stderr  # what finished is on disk, all of it
    assert not (tmp_path / ".out.jsonl.cbatch.lock").exists()  # an orderly exit drops its lock

    code2, stdout2, stderr2 = run_inprocess("run", str(job["input"]), "--out", str(out), *job["flags"])
    assert code2 == 1, stderr2
    assert f"resuming: {saved} of {N_ROWS} rows" in stderr2
    assert read_jsonl(out) == job["reference"]
    assert leftovers(out) == set()


def _sigterm_after(monkeypatch, updates: int) -> None:
    """Makes the next in-process job receive a real SIGTERM after `updates` steps."""
    import cbatch.run.job as job_module

    class Killer:
        def __init__(self) -> None:
            self.n = 0

        def update(self):
            self.n += 1
            if self.n == updates:
                os.kill(os.getpid(), signal.SIGTERM)

        def close(self):
            pass

    monkeypatch.setattr(job_module, "make_display", lambda metrics, options: Killer())


def test_changed_input_or_settings_refuse_a_partial_run(job, tmp_path, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", job["rows"][:80])
    out = tmp_path / "out.jsonl"
    _sigterm_after(monkeypatch, 3)
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"])
    assert code == 143, err
    monkeypatch.undo()
    partial = listing(tmp_path)

    # other generation settings: refused, nothing touched
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"], "--temperature", "0.5")
    assert code == 2 and "different generation settings" in err and "--overwrite" in err, err
    assert err.count("\n") == 1
    assert listing(tmp_path) == partial

    # another input file at the same path
    write_jsonl(source, job["rows"][:81])
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"])
    assert code == 2 and "different input file" in err and "--overwrite" in err, err
    assert listing(tmp_path) == partial

    # --overwrite starts over and finishes; the rows match the reference run's
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"], "--overwrite")
    assert code == 1, err
    assert "resuming" not in err
    assert read_jsonl(out) == job["reference"][:81]
    assert leftovers(out) == set()


def test_complete_output_exits_0_without_loading_the_model(job, tmp_path, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", job["rows"][:20])
    out = tmp_path / "out.jsonl"
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"], "--allow-errors")
    assert code == 0, err
    first = out.read_bytes()
    assert read_jsonl(out) == job["reference"][:20]

    import cbatch.run.job as job_module

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded for a complete output")

    monkeypatch.setattr(job_module, "build_engine", no_load)
    code, stdout, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"])
    assert code == 0 and "already complete" in err, err
    assert out.read_bytes() == first
    code, stdout, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"], "--quiet")
    assert code == 0 and err == "" and stdout == ""

    # the same OUTPUT asked for with other settings: refused before loading, and --overwrite replaces it
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"], "--max-tokens", "3")
    assert code == 2 and "written by an earlier cbatch job from different generation settings" in err and "--overwrite" in err, err
    assert out.read_bytes() == first
    # another input file; then an OUTPUT edited after the job wrote it
    other = write_jsonl(tmp_path / "other.jsonl", job["rows"][:21])
    code, _, err = run_inprocess("run", str(other), "--out", str(out), *job["flags"])
    assert code == 2 and "written by an earlier cbatch job from a different input file" in err, err
    out.write_bytes(first + b"\n")
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"])
    assert code == 2 and "the file has been changed since; pass --overwrite" in err, err


def test_output_not_written_by_cbatch_is_refused_then_overwritten(job, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", job["rows"][:10])
    out = tmp_path / "out.jsonl"
    out.write_text("my precious results\n")
    before = listing(tmp_path)
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"])
    assert code == 2, err
    assert err == f"cbatch: error: --out {out} already exists and was not written by cbatch; pass --overwrite to replace it, or choose another --out\n"
    assert listing(tmp_path) == before and out.read_text() == "my precious results\n"
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"], "--overwrite", "--allow-errors")
    assert code == 0, err
    assert read_jsonl(out) == job["reference"][:10]


def test_failed_final_write_keeps_rows_and_leaves_no_output(job, tmp_path, monkeypatch):
    import errno

    import cbatch.run.job

    source = write_jsonl(tmp_path / "in.jsonl", job["rows"][:30])
    out = tmp_path / "out.jsonl"
    real_write = cbatch.run.job.write_output

    def disk_full(path, fmt, records, token_ids, **options):
        path.write_text('{"id": "r0", "compl')  # half a file, then the disk fills up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cbatch.run.job, "write_output", disk_full)
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"])
    assert code == 74, err  # the environment failed the job's files: sysexits' EX_IOERR, not a usage error
    assert "No space left on device" in err and "run the same command again" in err and "Traceback" not in err
    assert not out.exists()
    assert not list(tmp_path.glob(".out.jsonl.tmp-*")) and not (tmp_path / ".out.jsonl.cbatch.lock").exists()
    assert part_lines(out) == 30

    monkeypatch.setattr(cbatch.run.job, "write_output", real_write)
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"])
    assert code == 0 and "resuming: 30 of 30 rows" in err, err  # no bad row among the first 30
    assert read_jsonl(out) == job["reference"][:30]
    assert leftovers(out) == set()


def test_parquet_job_interrupted_and_resumed_equals_uninterrupted(job, tmp_path, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [r for r in job["rows"] if isinstance(r, dict) and r.get("max_tokens", 1) > 0][:120]
    source = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)  # missing temperature / seed become nulls
    reference, out = tmp_path / "ref.parquet", tmp_path / "out.parquet"
    reference_code, _, err = run_inprocess("run", str(source), "--out", str(reference), *job["flags"])
    assert reference_code in (0, 1), err  # 1 if a bad row is among them
    _sigterm_after(monkeypatch, 4)
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"])
    assert code == 143 and not out.exists(), err
    monkeypatch.undo()
    saved = part_lines(out)
    assert 0 < saved < len(rows)
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"])
    assert code == reference_code and f"resuming: {saved} of {len(rows)} rows" in err, err
    got, want = pq.read_table(out).to_pylist(), pq.read_table(reference).to_pylist()
    assert [r["id"] for r in got] == [r["id"] for r in rows]
    assert got == want
    sampled = [g for g, r in zip(got, rows) if r.get("temperature")]
    assert sampled and all(g["completion_token_ids"] for g in sampled)
    assert leftovers(out) == set()


def test_internal_error_exits_70_keeps_rows_and_resumes(job, tmp_path, monkeypatch):
    """A bug mid-job (here: the engine's step raising) is exit 70 with its traceback, not exit 1 (which
    means "some rows are error rows"); the rows finished before it are kept and a rerun completes."""
    from cbatch.engine.engine import Engine

    source = write_jsonl(tmp_path / "in.jsonl", job["rows"][:120])
    out = tmp_path / "out.jsonl"
    real_step = Engine.step
    calls = {"n": 0}

    def failing_step(self):
        calls["n"] += 1
        if calls["n"] > 8:
            raise RuntimeError("simulated bug in a model step")
        return real_step(self)

    monkeypatch.setattr(Engine, "step", failing_step)
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"])
    assert code == 70, err
    assert "simulated bug in a model step" in err and "Traceback" in err and "internal error" in err
    assert "run the same command again" in err
    assert not out.exists()
    kept = part_lines(out)
    assert 0 < kept < 120

    monkeypatch.setattr(Engine, "step", real_step)
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"])
    assert code == 1, err  # the first 120 rows hold bad ones: error rows, exit 1 as uninterrupted
    assert f"resuming: {kept} of 120 rows" in err, err
    assert read_jsonl(out) == job["reference"][:120]
    assert leftovers(out) == set()
