"""A job of many short rows: peak host memory (RSS) and wall time of `cbatch plan` and of `cbatch run` with a tiny
random model and max_tokens 1, at each row count given (issue 39: bounded memory at 10M rows).

    PYTHONPATH=. python benchmarks/scale_rows.py [--rows 100000 1000000] [--what plan run] [--max-tokens 1]

Each row: 10 random token ids (the tiny model has no tokenizer). Each command runs in its own process under
/usr/bin/time (peak RSS of that process); the input file is written once per row count, outside the timing.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def write_rows(path: Path, n: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for i in range(n):
            ids = ",".join(str(rng.randrange(3, 300)) for _ in range(10))
            f.write(f'{{"id": "r{i}", "prompt_token_ids": [{ids}]}}\n')


def timed(cmd: list[str]) -> tuple[float, float, int]:
    """(wall seconds, peak RSS in MB, exit code) of one command in its own process."""
    start = time.perf_counter()
    proc = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    wall = time.perf_counter() - start
    rss_kb = int(proc.stderr.strip().splitlines()[-1])
    if proc.returncode not in (0, 1):
        print(proc.stderr[-2000:], file=sys.stderr)
    return wall, rss_kb / 1024, proc.returncode


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    p.add_argument("--what", nargs="+", default=["plan", "run"], choices=["plan", "run"])
    p.add_argument("--max-tokens", type=int, default=1)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        subprocess.run([sys.executable, str(HERE / "make_random_model.py"), "tiny", str(model)], check=True,
                       capture_output=True, env={**os.environ, "PYTHONPATH": str(HERE.parent)})
        cli = [sys.executable, "-m", "cbatch.cli"]
        common = ["--model", str(model), "--device", "cpu", "--max-tokens", str(args.max_tokens), "--quiet"]
        print("| rows | command | wall s | peak RSS MB | exit |\n|---|---|---|---|---|")
        for n in args.rows:
            rows = tmp / f"rows-{n}.jsonl"
            write_rows(rows, n)
            for what in args.what:
                if what == "plan":
                    cmd = [*cli, "plan", str(rows), *common, "--report", str(tmp / "plan.json")]
                else:
                    out = tmp / f"out-{n}.parquet"
                    cmd = [*cli, "run", str(rows), "--out", str(out), *common, "--report", str(tmp / "run.json")]
                wall, rss, code = timed(cmd)
                print(f"| {n:,} | {what} | {wall:,.1f} | {rss:,.0f} | {code} |", flush=True)
                if what == "plan" and code == 0:
                    predicted = json.loads((tmp / "plan.json").read_text())["predicted"]
                    print(f"|  | (plan predicted {predicted['wall_seconds']:,.1f} s, simulated "
                          f"{predicted['simulated_rows']:,} rows) |  |  |  |", flush=True)
            rows.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
