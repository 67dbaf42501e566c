"""Admission order and the prefix cache under KV pressure: rows of several shared system prompts, shuffled.

    PYTHONPATH=. python benchmarks/prefix_admission.py [--groups 8 --rows 64 --prefix 512 --blocks 600]

The simulator (the real scheduler and block pool, a cost model for the step: 1 unit a step + 0.01 a prefill
token + 0.0005 a KV token read, so recomputed prefixes cost time) runs the same rows under fcfs, longest-first
and prefix (rows that open with the same tokens admitted together). The pool is tight: it holds a few groups'
prefixes besides the running rows, so an order that interleaves groups evicts and recomputes prefixes.
Prints, per policy: simulated time, prefill tokens computed, prefix-cache hit rate, steps, and the tail (the last
row's finish against the mean finish: a lone straggler shows as a long tail).
"""
from __future__ import annotations

import argparse
import random
import statistics

from cbatch.bench.simulator import CostModel, simulated_engine
from cbatch.bench.trial import run_trial
from cbatch.bench.workload import BenchRequest
from cbatch.config import EngineConfig


def workload(groups: int, rows: int, prefix: int, seed: int) -> tuple[list[BenchRequest], list[list[int]]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 30000) for _ in range(prefix)] for _ in range(groups)]
    items = []
    for g in range(groups):
        for _ in range(rows):
            suffix = [rng.randrange(10, 30000) for _ in range(rng.randint(16, 128))]
            items.append((prefixes[g] + suffix, rng.randint(16, 256)))
    rng.shuffle(items)
    return [BenchRequest(len(p), o) for p, o in items], [p for p, _ in items]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--blocks", type=int, default=600, help="KV pool, 16-token blocks")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    requests, prompts = workload(args.groups, args.rows, args.prefix, args.seed)
    cost = CostModel(per_step=1.0, per_prefill_token=0.01, per_context_token=0.0005)
    config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048, num_kv_blocks=args.blocks)
    engine = simulated_engine(config, cost, 8192, max(r.prompt_len + r.output_len for r in requests))
    print(f"{len(requests)} rows: {args.groups} groups x {args.rows}, a {args.prefix}-token shared prefix each, "
          f"pool {args.blocks} blocks x 16, max_num_seqs {args.max_num_seqs}")
    print("| policy | sim time | prefill tokens | prefix hits | steps | last finish / mean finish |")
    print("|---|---|---|---|---|---|")
    for policy in ("fcfs", "longest-first", "prefix"):
        run = run_trial(engine, requests, prompts, policy, lambda: engine.runner.forward_seconds)
        stats = run.stats
        finish = [t for t in run.finish_time if t is not None]
        print(f"| {policy} | {run.wall:,.0f} | {stats.computed_prompt_tokens:,} | {stats.prefix_cache_hit_rate:.0%} | "
              f"{stats.steps:,} | {max(finish) / statistics.mean(finish):.2f} |")


if __name__ == "__main__":
    main()
