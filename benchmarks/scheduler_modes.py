"""Compares scheduling modes by driving the real `Scheduler` with a cost model instead of a model.

Usage: PYTHONPATH=. python benchmarks/scheduler_modes.py [--num-seqs 1024] [--kv-blocks 2048]

Workload (skewed, synthetic): prompt lengths log-normal (median ~200 tokens, long tail to 4k),
output lengths Pareto-like (most short, a few up to 2k); 10% of rows are urgent (priority 0),
the rest backfill (priority 1). Scenario "batch": all rows queued at time 0, as in an offline job;
scenario "stream": rows arrive one per step and half are urgent (aging matters there). Token ids
are distinct per row, so the prefix cache never hits here (it is measured by prefix_cache.py).

Cost model (time units are "ms on a hypothetical GPU", only ratios matter): a step costs
  STEP_MS fixed (weights read, launches) + TOKEN_MS per scheduled token (compute)
  + KV_MS per context token attended (KV reads) + SWAP_MS per block copied host<->device.
Every row finishes at exactly its output length (EOS ignored), so all modes do the same useful work.
"""
from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass

from cbatch.config import SamplingParams
from cbatch.engine.kv_blocks import BlockPool
from cbatch.engine.policy import PreemptionPolicy, PriorityOrder, get_policy
from cbatch.engine.batching import ADMISSIONS
from cbatch.engine.scheduler import Scheduler
from cbatch.engine.sequence import FinishReason, Sequence

# Roughly an 8B GQA model (16 GB bf16 weights, 128 KB of KV per token) on one H100:
# weights read 16 GB / 3.35 TB/s; 2 x 8 GFLOP per token at ~400 TFLOP/s; KV 128 KB / 3.35 TB/s;
# one 16-token block (2 MB) over PCIe at ~25 GB/s, each way.
STEP_MS, TOKEN_MS, KV_MS, SWAP_MS = 4.8, 0.04, 0.00004, 0.08


@dataclass(frozen=True)
class Mode:
    name: str
    preemption: str = "recompute"
    reserve: bool = False
    aging_steps: int | None = 1000
    auto_swap_min_tokens: int = 256


MODES = [
    Mode("optimistic + recompute"),
    Mode("optimistic + swap", preemption="swap"),
    Mode("optimistic + auto", preemption="auto"),
    Mode("reserve", reserve=True),
    Mode("optimistic + recompute, aging 100", aging_steps=100),
    Mode("optimistic + recompute, no aging", aging_steps=None),
]


def workload(num_seqs: int, seed: int, urgent_share: float) -> list[tuple[int, int, int]]:
    """(prompt_len, output_len, priority) per row."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_seqs):
        prompt = min(4096, max(8, int(rng.lognormvariate(5.3, 0.9))))
        output = min(2048, max(1, int(16 * rng.paretovariate(1.2))))
        rows.append((prompt, output, 0 if rng.random() < urgent_share else 1))
    return rows


def simulate(mode: Mode, rows, kv_blocks: int, block_size: int, max_num_seqs: int, budget: int, stream: bool) -> dict:
    pool = BlockPool(kv_blocks, block_size, enable_caching=True)
    sched = Scheduler(
        get_policy("longest-first"), pool, max_num_seqs, budget, 8192,
        priority=PriorityOrder(mode.aging_steps),
        preemption=PreemptionPolicy(mode.preemption, mode.auto_swap_min_tokens),
        admission=ADMISSIONS["reserve" if mode.reserve else "optimistic"](), num_host_blocks=4 * kv_blocks,
    )
    seqs = []
    for i, (prompt, output, priority) in enumerate(rows):
        ids = [1_000_000 * (i + 1) + t for t in range(prompt)]  # distinct per row: no cache hits
        seqs.append(Sequence(seq_id=i, prompt_ids=ids, params=SamplingParams(max_tokens=output, ignore_eos=True, priority=priority)))
    pending = list(reversed(seqs))
    now = 0.0
    arrived_at: dict[int, float] = {}
    finished_at: dict[int, float] = {}
    wall = time.perf_counter()
    while pending or sched.has_work():
        for _ in range(1 if stream else len(pending)):
            if pending:
                s = pending.pop()
                arrived_at[s.seq_id] = now
                sched.add(s)
        plan = sched.schedule()
        context = sum(s.num_computed + n for s, n in plan.scheduled)
        now += STEP_MS + TOKEN_MS * plan.num_tokens + KV_MS * context + SWAP_MS * (len(plan.swap_out) + len(plan.swap_in))
        if not plan:
            continue  # stream: nothing runnable until the next arrival
        for s, n in plan.scheduled:
            s.num_computed += n
            if s.num_computed == s.num_tokens:
                s.output_ids.append(s.seq_id % 1000 + 1)
                if len(s.output_ids) >= s.params.max_tokens:
                    sched.finish(s, FinishReason.LENGTH)
                    finished_at[s.seq_id] = now
    stats = sched.stats
    output_tokens = sum(len(s.output_ids) for s in seqs)
    lat = lambda cls: sorted(finished_at[s.seq_id] - arrived_at[s.seq_id] for s in seqs if s.params.priority == cls)  # noqa: E731
    p99 = lambda xs: xs[min(len(xs) - 1, int(0.99 * len(xs)))] / 1000  # noqa: E731
    return {
        "mode": mode.name,
        "time_s": now / 1000,
        "out_tok_s": output_tokens / (now / 1000),
        "p99_s": p99(sorted(finished_at[i] - arrived_at[i] for i in finished_at)),
        "max_wait_steps": max(max(w) for w in stats.wait_steps_by_priority.values()),
        "p99_urgent_s": p99(lat(0)),
        "p99_backfill_s": p99(lat(1)),
        "steps": stats.steps,
        "preempt": stats.preemptions,
        "swapped_blocks": stats.swapped_out_blocks,
        "recomputed": stats.recomputed_tokens,
        "stalls": stats.admission_stalls,
        "sim_wall_s": time.perf_counter() - wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-seqs", type=int, default=1024)
    ap.add_argument("--kv-blocks", type=int, default=1024, help="KV pool size in blocks (tight: forces preemption)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--budget", type=int, default=2048, help="token budget per step")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"cost model: step {STEP_MS} ms + {TOKEN_MS} ms/token + {KV_MS} ms/context token + {SWAP_MS} ms/block swapped; "
          f"pool {args.kv_blocks} x {args.block_size} tokens, max_num_seqs {args.max_num_seqs}, budget {args.budget}; "
          f"loadavg {os.getloadavg()[0]:.2f} (simulated time does not depend on it)")
    for scenario, urgent_share in (("batch", 0.1), ("stream", 0.5)):
        rows = workload(args.num_seqs, args.seed, urgent_share)
        print(f"\n## {scenario}: {args.num_seqs} rows, prompt tokens {sum(r[0] for r in rows)}, "
              f"output tokens {sum(r[1] for r in rows)}, urgent {sum(1 for r in rows if r[2] == 0)}")
        print(f"| {'mode':32} | sim time s | out tok/s | p99 lat s | p99 urgent | p99 backfill | max wait steps "
              f"| steps | preemptions | swapped blocks | recomputed tok | stalls (blocks/budget/seqs/reserved/after-preempt) |")
        print("|" + "---|" * 12)
        for mode in MODES:
            r = simulate(mode, rows, args.kv_blocks, args.block_size, args.max_num_seqs, args.budget, scenario == "stream")
            st = r["stalls"]
            stalls = "/".join(str(st[k]) for k in ("no_free_blocks", "token_budget", "max_num_seqs", "reserved", "after_preemption"))
            print(f"| {r['mode']:32} | {r['time_s']:.1f} | {r['out_tok_s']:.0f} | {r['p99_s']:.1f} | {r['p99_urgent_s']:.1f} "
                  f"| {r['p99_backfill_s']:.1f} | {r['max_wait_steps']} | {r['steps']} | {r['preempt']} | {r['swapped_blocks']} "
                  f"| {r['recomputed']} | {stalls} |")


if __name__ == "__main__":
    main()
