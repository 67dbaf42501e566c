"""How close `cbatch plan` comes to the measured `cbatch run` (issue 19: within 15% on a 300-row job).

    PYTHONPATH=. python benchmarks/plan_accuracy.py [--rows 300] [--calibration-rows 100] [--model DIR]
                                                    [--threads N] [--eos] [--quick] [--workdir DIR]

1. writes two inputs of chat rows with mixed prompt and output lengths, from different seeds: a calibration
   input and the job;
2. `cbatch run` on the calibration input with --report: the earlier run, on another input;
3. `cbatch plan` on the job with --cost-from that report (its own duration is printed: it must take
   seconds, and it loads no weights);
4. `cbatch run` on the job with --report: the measurement.
Prints predicted and measured wall seconds (each report's time.wall_seconds: model loading excluded on
both sides), output tok/s and steps, and the error. Rows ignore EOS by default, so output lengths are exact
and the figure measures the cost model and the schedule; with --eos rows stop at EOS and the plan draws
lengths (--lengths-from) from a first run of the job itself (yesterday's run of a nightly job), and the
second run is the measurement. Run it on a quiet machine: every process here competes for the same cores.
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

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the of and a to in is you that it he was for on are as with his they at be this have from or one had "
         "by word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part").split()
MAX_TOKENS = (16, 32, 64, 128, 256)


def chat_rows(n: int, seed: int, eos: bool, max_tokens: tuple[int, ...] = MAX_TOKENS) -> list[dict]:
    """Chat rows: prompts of 5..400 words (most short, a long tail), max_tokens spread over `max_tokens`."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        words = min(400, max(5, int(rng.lognormvariate(3.5, 1.0))))
        content = " ".join(rng.choice(WORDS) for _ in range(words))
        row = {"id": f"{seed}-{i}", "messages": [{"role": "user", "content": f"Continue this text: {content}"}],
               "max_tokens": rng.choice(max_tokens)}
        if not eos:
            row["ignore_eos"] = True
        rows.append(row)
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cbatch(*args: str) -> float:
    """Runs `cbatch ARGS` in a fresh process (as a user would); returns its wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "cbatch.cli", *args], capture_output=True, text=True, env=env)
    if proc.returncode not in (0, 1):
        sys.exit(f"cbatch {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=300)
    parser.add_argument("--calibration-rows", type=int, default=100)
    parser.add_argument("--model", default=None, help="checkpoint folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--eos", action="store_true", help="rows stop at EOS; lengths from a first run of the job")
    parser.add_argument("--quick", action="store_true", help="a few small rows: checks that the script works")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.calibration_rows = 24, 16
    work = args.workdir or Path(tempfile.mkdtemp(prefix="plan-accuracy-"))
    work.mkdir(parents=True, exist_ok=True)
    engine = (["--model", args.model] if args.model else []) + (["--threads", str(args.threads)] if args.threads else [])
    lengths = (4, 8) if args.quick else MAX_TOKENS
    calibration = write_rows(work / "calibration.jsonl", chat_rows(args.calibration_rows, 1, args.eos, lengths))
    job = write_rows(work / "job.jsonl", chat_rows(args.rows, 2, args.eos, lengths))
    cbatch("run", str(calibration), "--out", str(work / "calibration-out.jsonl"), *engine, "--overwrite", "--quiet",
           "--report", str(work / "calibration-report.json"))
    plan_flags = ["--cost-from", str(work / "calibration-report.json"), "--report", str(work / "plan.json"), "--no-search"]
    if args.eos:
        cbatch("run", str(job), "--out", str(work / "job-earlier.jsonl"), *engine, "--overwrite", "--quiet",
               "--report", str(work / "job-earlier-report.json"))
        plan_flags += ["--lengths-from", str(work / "job-earlier-report.json")]
    plan_seconds = cbatch("plan", str(job), *engine, *plan_flags)
    load = open("/proc/loadavg").read().split()[:3]
    cbatch("run", str(job), "--out", str(work / "job-out.jsonl"), *engine, "--overwrite", "--quiet",
           "--report", str(work / "job-report.json"))
    predicted = json.loads((work / "plan.json").read_text())["predicted"]
    measured = json.loads((work / "job-report.json").read_text())
    result = {
        "rows": args.rows, "calibration_rows": args.calibration_rows, "eos": args.eos,
        "predicted_wall_s": predicted["wall_seconds"], "measured_wall_s": measured["time"]["wall_seconds"],
        "predicted_output_tok_s": predicted["output_tokens_per_s"],
        "measured_output_tok_s": measured["throughput"]["output_tokens_per_s"],
        "predicted_steps": predicted["steps"], "measured_steps": measured["utilization"]["steps"],
        "plan_process_seconds": plan_seconds, "load_average_before_run": load, "workdir": str(work),
    }
    result["wall_error"] = result["predicted_wall_s"] / result["measured_wall_s"] - 1
    print(f"load average before the measured run: {load}")
    print(f"predicted wall {result['predicted_wall_s']:.2f} s vs measured {result['measured_wall_s']:.2f} s: "
          f"{result['wall_error']:+.1%}; output tok/s {result['predicted_output_tok_s']:.1f} vs "
          f"{result['measured_output_tok_s']:.1f}; steps {result['predicted_steps']} vs {result['measured_steps']}; "
          f"`cbatch plan` took {plan_seconds:.1f} s (process start included)")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
