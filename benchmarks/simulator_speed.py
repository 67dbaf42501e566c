"""How fast the simulator is at sizes no machine here can run: 10k `chat` requests over 1024 sequences.

    PYTHONPATH=. python benchmarks/simulator_speed.py [--num-prompts 10000] [--max-num-seqs 1024] [--profile]

Prints CPU seconds per policy (process time: less sensitive to other jobs than wall time) and, with
--profile, the functions that dominate.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from cbatch.bench.simulator import CostModel, simulate
from cbatch.bench.workload import parse_distribution, synthetic_workload
from cbatch.config import EngineConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=10000)
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--policies", default="longest-first,fcfs,static")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    chat = parse_distribution("chat", "--output-len")
    requests = synthetic_workload(args.num_prompts, chat, chat, seed=0)
    print(f"load average: {open('/proc/loadavg').read().split()[:3]}")
    for policy in args.policies.split(","):
        config = EngineConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, policy=policy)
        profiler = cProfile.Profile() if args.profile else None
        cpu, wall = time.process_time(), time.perf_counter()
        if profiler:
            profiler.enable()
        run = simulate(requests, config, CostModel(), max_model_len=4096)
        if profiler:
            profiler.disable()
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        seq_steps = sum(s.running for s in run.metrics.series)
        print(f"{policy:>14}: {args.num_prompts} requests x {args.max_num_seqs} seqs: {run.stats.steps} steps, "
              f"{seq_steps / 1e6:.1f} M sequence-steps, {cpu:.1f} s CPU ({wall:.1f} s wall), "
              f"{1e6 * cpu / max(seq_steps, 1):.2f} us per sequence-step")
        if profiler:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(8)


if __name__ == "__main__":
    main()
