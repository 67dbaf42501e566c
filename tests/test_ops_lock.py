"""One job per OUTPUT: a second run refuses (before loading the model); a lock left by a dead job is taken over."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from ops_jobs import (
    cbatch_process, leftovers, read_jsonl, run_inprocess, signal_and_continue, token_rows, wait_until_stopped, write_jsonl,
)


@pytest.fixture()
def small_job(tiny_checkpoints, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", token_rows(40, vocab=384, seed=5))
    flags = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--token-ids"]
    return source, tmp_path / "out.jsonl", flags


def test_second_concurrent_run_refuses(small_job):
    source, out, flags = small_job
    first = cbatch_process("run", str(source), "--out", str(out), *flags, stop_after_rows=1)
    try:
        wait_until_stopped(first)  # it holds the lock (taken before its first row was saved) and cannot finish
        code, stdout, stderr = run_inprocess("run", str(source), "--out", str(out), *flags)
        assert code == 2, stderr
        assert stderr.startswith(f"cbatch: error: {out} is already being written by another cbatch job (pid {first.pid} on ")
        assert stderr.count("\n") == 1 and stdout == ""
        assert first.poll() is None  # the first job was not disturbed
        assert json.loads((out.parent / ".out.jsonl.cbatch.lock").read_text())["pid"] == first.pid
    finally:
        signal_and_continue(first, signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 143


# holds the lock as a live job on another host would, until the test closes its stdin (or kills it)
HOLD_LOCK = textwrap.dedent("""
    import fcntl, json, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": "elsewhere"}).encode())
    print("locked", flush=True)
    sys.stdin.read()
""")


def test_lock_is_checked_before_the_model_loads(small_job, monkeypatch):
    source, out, flags = small_job
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out.parent / ".out.jsonl.cbatch.lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        import cbatch.run.job as job_module

        def no_load(*args, **kwargs):
            raise AssertionError("the model was loaded although the output is locked")

        monkeypatch.setattr(job_module, "build_engine", no_load)
        code, stdout, err = run_inprocess("run", str(source), "--out", str(out), *flags)
        assert code == 2, err
        assert f"already being written by another cbatch job (pid {holder.pid} on elsewhere)" in err
        assert not out.exists() and not (out.parent / ".out.jsonl.cbatch").exists()
        # --overwrite does not take a live job's output either
        code, stdout, err = run_inprocess("run", str(source), "--out", str(out), *flags, "--overwrite")
        assert code == 2 and f"pid {holder.pid}" in err, err
    finally:
        holder.kill()
        holder.wait()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("content", ["pid", "garbage", "empty"])
def test_stale_lock_from_a_dead_job_is_taken_over(small_job, content):
    source, out, flags = small_job
    lock = out.parent / ".out.jsonl.cbatch.lock"
    lock.write_text({"pid": json.dumps({"pid": _dead_pid(), "host": "here"}), "garbage": "{not json", "empty": ""}[content])
    code, stdout, err = run_inprocess("run", str(source), "--out", str(out), *flags)
    assert code == 0, err
    assert len(read_jsonl(out)) == 40
    assert not lock.exists() and leftovers(out) == set()
