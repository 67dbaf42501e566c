"""The deadline end to end, in real time (issue 39): a job that `cbatch plan` predicts at N seconds, run with
`--max-wall-time N/4`, must exit 75 within N/4 plus the grace (plus model loading, which the plan leaves out),
every row done or `expired`; the rerun must run only the expired rows, and the final OUTPUT must equal an
uninterrupted run's byte for byte.

    PYTHONPATH=. python benchmarks/deadline_check.py [--rows 3000 --max-tokens 48 --grace 2]

A tiny random model on the CPU, greedy rows of 4..64 token ids; the plan's costs are fitted to a calibration run
of 300 other rows (`--cost-from`). Prints each step's figures and PASS/FAIL per condition.
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


def write_rows(path: Path, n: int, max_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            ids = [rng.randrange(3, 500) for _ in range(rng.randint(4, 64))]
            f.write(json.dumps({"id": f"r{i}", "prompt_token_ids": ids, "max_tokens": rng.randint(8, max_tokens)}) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--grace", type=float, default=2.0)
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    cli = [sys.executable, "-m", "cbatch.cli"]
    checks: list[tuple[str, bool]] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = tmp / "model"
        subprocess.run([sys.executable, str(HERE / "make_random_model.py"), "tiny", str(model)], check=True,
                       capture_output=True, env=env)
        common = ["--model", str(model), "--device", "cpu", "--ignore-eos", "--seed", "3", "--quiet"]
        flags = [*common, "--token-ids"]

        def run(*extra: str) -> tuple[int, float, str]:
            start = time.perf_counter()
            proc = subprocess.run([*cli, *extra], capture_output=True, text=True, env=env)
            return proc.returncode, time.perf_counter() - start, proc.stderr

        write_rows(tmp / "calibration.jsonl", 300, args.max_tokens, seed=1)
        code, _, err = run("run", str(tmp / "calibration.jsonl"), "--out", str(tmp / "calibration.out.jsonl"), *flags,
                           "--report", str(tmp / "calibration.json"))
        assert code == 0, err
        job = tmp / "job.jsonl"
        write_rows(job, args.rows, args.max_tokens, seed=2)
        code, _, err = run("plan", str(job), *common, "--cost-from", str(tmp / "calibration.json"), "--no-search",
                           "--report", str(tmp / "plan.json"))
        assert code == 0, err
        n = json.loads((tmp / "plan.json").read_text())["predicted"]["wall_seconds"]
        code, whole_s, err = run("run", str(job), "--out", str(tmp / "whole.jsonl"), *flags, "--report", str(tmp / "whole.json"))
        assert code == 0, err
        measured = json.loads((tmp / "whole.json").read_text())["time"]["wall_seconds"]
        print(f"plan: N = {n:.1f} s predicted; the uninterrupted run took {measured:.1f} s ({whole_s:.1f} s with start-up)")
        limit = n / 4
        code, cut_s, err = run("run", str(job), "--out", str(tmp / "cut.jsonl"), *flags, "--max-wall-time", f"{limit:.2f}",
                               "--deadline-grace", f"{args.grace}s", "--report", str(tmp / "cut.json"))
        rows = [json.loads(line) for line in (tmp / "cut.jsonl").read_text().splitlines()]
        expired = sum(r["finish_reason"] == "expired" for r in rows)
        done = sum(r["finish_reason"] == "length" for r in rows)
        load = json.loads((tmp / "whole.json").read_text())["time"].get("load_seconds")
        print(f"--max-wall-time {limit:.1f}s --deadline-grace {args.grace}s: exit {code} after {cut_s:.1f} s "
              f"(process start-up and model loading included); {done} rows done, {expired} expired, {len(rows)} rows")
        checks.append(("exit 75", code == 75))
        startup = whole_s - measured  # the uninterrupted run's time outside its wall clock (imports, load, writing)
        checks.append((f"ended within the limit + grace + start-up ({limit + args.grace + startup:.1f} s)",
                       cut_s <= limit + args.grace + startup))
        checks.append(("every row done or expired", done + expired == len(rows) == args.rows and expired > 0))
        code, rerun_s, err = run("run", str(job), "--out", str(tmp / "cut.jsonl"), *flags, "--report", str(tmp / "rerun.json"))
        ran = json.loads((tmp / "rerun.json").read_text())["requests"]
        print(f"rerun: exit {code} after {rerun_s:.1f} s; it ran {ran['total'] - ran['resumed']} rows, resumed {ran['resumed']}")
        checks.append(("the rerun ran only the expired rows", code == 0 and ran["total"] - ran["resumed"] == expired))
        checks.append(("final OUTPUT equals the uninterrupted run's",
                       (tmp / "cut.jsonl").read_bytes() == (tmp / "whole.jsonl").read_bytes()))
    for name, ok in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {name}")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
