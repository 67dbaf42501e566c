"""Prefix-aware admission on a real CPU run (issue 39): rows over a few dozen long system prompts, shuffled, a KV
pool that holds only a handful of those prompts. `cbatch run` once with the default policy and once with
`--policy prefix`, same rows, same flags: output tok/s, wall, prefix-cache hit rate, prompt tokens computed, and
whether the two OUTPUT files are byte-identical (greedy).

    PYTHONPATH=. python benchmarks/prefix_workload.py [--rows 4096 --prefixes 64 --prefix-len 1024
        --pool-prefixes 8 --max-tokens 16 --model tiny|FOLDER]

Each row: one of the system prompts (random token ids) + 16..64 tokens of its own; `max_tokens` generated
(EOS ignored). The pool: `--pool-prefixes` prefixes' blocks plus room for the running rows' own tokens.
Each run is its own process (no warm caches shared); the machine's load average and CPU flags are printed.
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

from cbatch.model.cpu_features import cpu_flags, vector_isa_flags

HERE = Path(__file__).resolve().parent
BLOCK = 16


def write_rows(path: Path, rows: int, prefixes: int, prefix_len: int, max_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    systems = [[rng.randrange(3, 300) for _ in range(prefix_len)] for _ in range(prefixes)]
    items = []
    for i in range(rows):
        own = [rng.randrange(3, 300) for _ in range(rng.randint(16, 64))]
        items.append({"id": f"r{i}", "prompt_token_ids": systems[i % prefixes] + own})
    rng.shuffle(items)
    with open(path, "w") as f:
        for item in items:
            f.write(json.dumps(item) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--prefixes", type=int, default=64)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--pool-prefixes", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--model", default="tiny", help="a checkpoint folder, or a preset name for a random one")
    p.add_argument("--policies", nargs="+", default=["longest-first", "prefix"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    print(f"cpu flags: {' '.join(vector_isa_flags(cpu_flags())) or '?'}; load average before: {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = Path(args.model)
        if not model.is_dir():
            model = tmp / "model"
            subprocess.run([sys.executable, str(HERE / "make_random_model.py"), args.model, str(model)], check=True,
                           capture_output=True, env=env)
        rows = tmp / "rows.jsonl"
        write_rows(rows, args.rows, args.prefixes, args.prefix_len, args.max_tokens, args.seed)
        own_blocks = args.max_num_seqs * -(-(64 + args.max_tokens + BLOCK) // BLOCK)
        blocks = args.pool_prefixes * -(-args.prefix_len // BLOCK) + own_blocks
        flags = ["--model", str(model), "--device", "cpu", "--max-tokens", str(args.max_tokens), "--ignore-eos",
                 "--token-ids", "--num-kv-blocks", str(blocks), "--block-size", str(BLOCK), "--max-num-seqs",
                 str(args.max_num_seqs), "--seed", "1", "--quiet"]
        print(f"{args.rows} rows over {args.prefixes} system prompts of {args.prefix_len} tokens, shuffled; pool "
              f"{blocks} blocks of {BLOCK} (~{args.pool_prefixes} prefixes + the running rows); max_tokens "
              f"{args.max_tokens}, max_num_seqs {args.max_num_seqs}")
        print("| policy | wall s | output tok/s | prefix hits | prompt tokens computed | preemptions |")
        print("|---|---|---|---|---|---|")
        results = {}
        for policy in args.policies:
            out, report = tmp / f"{policy}.jsonl", tmp / f"{policy}.json"
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "cbatch.cli", "run", str(rows), "--out", str(out), *flags,
                                   "--policy", policy, "--report", str(report)], capture_output=True, text=True, env=env)
            elapsed = time.perf_counter() - start
            if proc.returncode != 0:
                print(proc.stderr[-3000:], file=sys.stderr)
                return 1
            r = json.loads(report.read_text())
            u = r["utilization"]
            results[policy] = (r["throughput"]["output_tokens_per_s"], out.read_bytes())
            print(f"| {policy} | {r['time']['wall_seconds']:,.1f} ({elapsed:,.1f} with start-up) | "
                  f"{r['throughput']['output_tokens_per_s']:,.0f} | {u['prefix_cache_hit_rate']:.1%} | "
                  f"{u.get('computed_prompt_tokens', '?'):,} | {u['preemptions']} |", flush=True)
        base = results[args.policies[0]]
        for policy in args.policies[1:]:
            tps, output = results[policy]
            print(f"{policy} against {args.policies[0]}: {tps / base[0]:.2f}x output tok/s; OUTPUT "
                  f"{'byte-identical' if output == base[1] else 'DIFFERENT'}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
