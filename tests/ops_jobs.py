"""Helpers for the `cbatch run` operations tests (resume, signals, locks, bad input): write inputs, run
the CLI in-process or as a real process, read outputs, and list what a job left on disk."""
from __future__ import annotations

import contextlib
import io
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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


def read_jsonl(path: Path) -> list[dict]:
    """One object per "\n"-terminated line (str.splitlines would also split inside strings holding U+2028)."""
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


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


def cbatch_process(*args: str) -> subprocess.Popen:
    """A real `cbatch` process (stdout and stderr are pipes: not a terminal, as under cron)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "cbatch.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def part_lines(output: Path) -> int:
    """Complete lines in the job's part files (what has reached the disk)."""
    state = output.parent / f".{output.name}.cbatch"
    return sum(p.read_bytes().count(b"\n") for p in state.glob("part-*.jsonl")) if state.is_dir() else 0


def wait_for(condition, timeout: float = 240.0, proc: subprocess.Popen | None = None, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"cbatch exited ({proc.returncode}) before the condition held:\n{out}\n{err}")
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(poll)


def listing(folder: Path) -> set[str]:
    """Every path under `folder`, hidden ones included: to check what a job left behind."""
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


def leftovers(output: Path) -> set[str]:
    """Files a job keeps next to OUTPUT besides OUTPUT itself and its completion record."""
    keep = {output.name, f".{output.name}.cbatch.json"}
    return {p.name for p in output.parent.iterdir() if p.name.startswith(f".{output.name}") and p.name not in keep}
