"""Helpers for the tests of `cbatch` as a command: write inputs, run the CLI in-process or as a real
process (and stop one mid-job at a chosen row), read outputs, and list what a job left on disk."""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "sample_data"


# ---- inputs and outputs -------------------------------------------------------------------------------
def token_rows(n: int, vocab: int, seed: int, bad_every: int = 0) -> list[dict | str]:
    """`prompt_token_ids` rows (fast on a tokenizer-less tiny model): greedy rows, sampled rows with a
    row seed, sampled rows without one (they draw from the job seed and the row index); every
    `bad_every`-th row is a bad one (a string is written as a raw, invalid line)."""
    rng = random.Random(seed)
    rows: list[dict | str] = []
    for i in range(n):
        if bad_every and i % bad_every == bad_every - 1:
            rows.append(rng.choice(['{"id": "broken', {"id": f"r{i}", "max_tokens": -1, "prompt_token_ids": [5]},
                                    {"id": f"r{i}", "prompt_token_ids": [vocab + 7]}]))
            continue
        row = {"id": f"r{i}", "prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))],
               "max_tokens": rng.randint(2, 8)}
        if i % 3 == 1:
            row["temperature"] = 0.9
            if i % 2:
                row["seed"] = rng.randrange(1 << 30)
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: list) -> Path:
    with open(path, "wb") as f:
        for row in rows:
            line = row if isinstance(row, bytes) else (row if isinstance(row, str) else json.dumps(row)).encode()
            f.write(line + b"\n")
    return path


def jsonl_records(text: str) -> list[dict]:
    """One object per "\n"-terminated line (str.splitlines would also split inside strings holding U+2028)."""
    return [json.loads(line) for line in text.split("\n") if line]


def read_jsonl(path: Path) -> list[dict]:
    return jsonl_records(path.read_text(encoding="utf-8"))


def read_output(path: Path) -> list[dict]:
    """A job's OUTPUT, JSONL or Parquet, as row dicts."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return read_jsonl(path)


# ---- running cbatch -----------------------------------------------------------------------------------
def run_inprocess(*args: str) -> tuple[int, str, str]:
    """`cbatch ARGS` through the real entry point (`cbatch.cli.main`), in this process: (exit code, stdout, stderr)."""
    from cbatch.cli import main

    out, err = io.StringIO(), io.StringIO()
    old_argv = sys.argv
    sys.argv = ["cbatch", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = old_argv
    return code, out.getvalue(), err.getvalue()


def cbatch_env(**extra: str) -> dict[str, str]:
    """The environment of a `cbatch` child process: this checkout's package, unbuffered output."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT), **extra}


def cbatch(*args: str, timeout: int = 300, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """`cbatch ARGS` as a real process, run to its end (a generous timeout guards against a hang)."""
    return subprocess.run([sys.executable, "-m", "cbatch.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=cbatch_env(**env))


# `cbatch ARGV[2:]`, stopping itself with SIGSTOP right after the ARGV[1]-th row of this run is on disk
STOPPING_CBATCH = """
import os, signal, sys
from cbatch.io.state import JobState
stop_after, sys.argv[1:] = int(sys.argv[1]), sys.argv[2:]
real_append, appended = JobState.append, 0
def append(self, record, *args, **kwargs):
    global appended
    real_append(self, record, *args, **kwargs)
    appended += 1
    if appended == stop_after:
        self.sync()
        os.kill(os.getpid(), signal.SIGSTOP)
JobState.append = append
from cbatch.cli import main
main()
"""


def sigterm_after_rows(monkeypatch, rows: int) -> None:
    """An in-process job (`run_inprocess`) gets a real SIGTERM once `rows` rows are on disk (its JobState.append
    patched through `monkeypatch`; `monkeypatch.undo()` ends it)."""
    import os
    import signal

    from cbatch.io.state import JobState

    append = JobState.append

    def append_then_stop(state, record, *args, **kwargs):
        append(state, record, *args, **kwargs)
        if state.num_rows == rows:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(JobState, "append", append_then_stop)


def cbatch_process(*args: str, stop_after_rows: int | None = None) -> subprocess.Popen:
    """A real `cbatch` process (stdout and stderr are pipes: not a terminal, as under cron).

    With `stop_after_rows=N` the job stops itself (SIGSTOP) once N rows of this run are saved: wait for
    that with `wait_until_stopped`, then act on a job that is provably mid-run (it holds its lock, exactly
    N more rows are on disk, and it cannot finish before it is continued)."""
    command = ["-m", "cbatch.cli"] if stop_after_rows is None else ["-c", STOPPING_CBATCH, str(stop_after_rows)]
    return subprocess.Popen([sys.executable, *command, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=cbatch_env())


def wait_until_stopped(proc: subprocess.Popen, timeout: float = 240.0) -> None:
    """Waits until `proc` (from `cbatch_process(..., stop_after_rows=N)`) has stopped itself; the timeout
    only guards against a hang."""
    deadline = time.monotonic() + timeout
    while True:
        pid, status = os.waitpid(proc.pid, os.WUNTRACED | os.WNOHANG)
        if pid and os.WIFSTOPPED(status):
            return
        if pid:  # it ended (and is reaped): it never reached the row it was to stop at
            proc.returncode = os.waitstatus_to_exitcode(status)
            out, err = proc.communicate()
            raise AssertionError(f"cbatch exited ({proc.returncode}) before it stopped:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("cbatch did not reach the row it was to stop at")
        time.sleep(0.02)


def signal_and_continue(proc: subprocess.Popen, signum: int) -> None:
    """Sends `signum` to a stopped job, then SIGCONT: the job meets the signal as soon as it runs again."""
    if proc.poll() is None:
        proc.send_signal(signum)
        proc.send_signal(signal.SIGCONT)


# ---- what a job left on disk ----------------------------------------------------------------------------
def part_files(output: Path) -> list[Path]:
    state = output.parent / f".{output.name}.cbatch"
    return sorted(state.glob("part-*.jsonl")) if state.is_dir() else []


def part_lines(output: Path) -> int:
    """Complete lines in the job's part files (what has reached the disk)."""
    return sum(p.read_bytes().count(b"\n") for p in part_files(output))


def part_records(output: Path) -> list[dict]:
    """The rows in the job's part files, a torn last line (a killed writer's) left out."""
    return [json.loads(line) for p in part_files(output) for line in p.read_text().split("\n")[:-1]]


def listing(folder: Path) -> set[str]:
    """Every path under `folder`, hidden ones included: to check what a job left behind."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def leftovers(output: Path) -> set[str]:
    """Files a job keeps next to OUTPUT besides OUTPUT itself and its completion record."""
    keep = {output.name, f".{output.name}.cbatch.json"}
    return {p.name for p in output.parent.iterdir() if p.name.startswith(f".{output.name}") and p.name not in keep}
