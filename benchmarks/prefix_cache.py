"""Prefix caching on a workload where one shared preamble dominates every prompt.

Usage: PYTHONPATH=. python benchmarks/prefix_cache.py [--rows 16] [--prefix 384] [--suffix 16] [--layers 30]

Model: SmolLM2-135M's shape (30 layers, 576 hidden, 9 heads / 3 KV heads, vocab 49152) with random
weights, on CPU in float32. Rows: the same `--prefix` random tokens followed by `--suffix` tokens of
their own, `--max-tokens` generated each (EOS ignored). Runs the same rows with and without the
cache (after one warm-up run each), checks the greedy outputs are identical and prints wall times,
prompt tokens actually computed, and the hit rate. Timings depend on the machine's load: the
1-minute load average is printed with them.
"""
from __future__ import annotations

import argparse
import os
import random
import time

import torch

from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.engine import Engine, run_to_completion
from cbatch.engine.resolve import resolve_model
from cbatch.model.spec import parse_spec

SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2,
}


def run(enable: bool, prompts, params, args) -> tuple[float, list[list[int]], Engine]:
    config = EngineConfig(device="cpu", dtype="float32", enable_prefix_cache=enable, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.budget, num_kv_blocks=args.kv_blocks, num_threads=args.threads)
    spec = parse_spec({**SMOLLM2_135M, "num_hidden_layers": args.layers})
    engine = build_engine(config, resolve_model(config, spec))
    run_to_completion(engine, prompts[:2], params[:2])  # warm-up (first-call overheads)
    stats_before = engine.scheduler.stats.scheduled_tokens, engine.scheduler.stats.prefix_cache_hit_tokens
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = run_to_completion(engine, prompts, params)
    seconds = time.perf_counter() - start
    engine.bench_cpu = time.process_time() - cpu_start  # less sensitive to other load than wall time
    engine.bench_tokens = engine.scheduler.stats.scheduled_tokens - stats_before[0]
    engine.bench_hits = engine.scheduler.stats.prefix_cache_hit_tokens - stats_before[1]
    return seconds, [o.token_ids for o in outputs], engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=384, help="shared preamble tokens")
    ap.add_argument("--suffix", type=int, default=16, help="each row's own tokens after the preamble")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--kv-blocks", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--layers", type=int, default=30, help="fewer than SmolLM2's 30 for a quick run on a busy machine")
    args = ap.parse_args()
    rng = random.Random(0)
    preamble = [rng.randrange(3, 49152) for _ in range(args.prefix)]
    # the warm-up rows use another preamble, so the timed run starts with a cold cache
    warm = [[rng.randrange(3, 49152) for _ in range(args.prefix + args.suffix)] for _ in range(2)]
    prompts = warm + [preamble + [rng.randrange(3, 49152) for _ in range(args.suffix)] for _ in range(args.rows)]
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)] * len(prompts)
    print(f"{args.rows} rows x ({args.prefix} shared + {args.suffix} own) prompt tokens, {args.max_tokens} output tokens each; "
          f"SmolLM2-135M shape ({args.layers} layers), random weights, CPU float32, torch threads {torch.get_num_threads() if args.threads is None else args.threads}")
    load_before = os.getloadavg()[0]
    results = {}
    for enable in (False, True):
        seconds, outputs, engine = run(enable, prompts, params, args)
        results[enable] = (seconds, outputs, engine)
        label = "prefix cache on " if enable else "prefix cache off"
        stats = engine.scheduler.stats
        print(f"{label}: {seconds:7.2f} s wall, {engine.bench_cpu:7.2f} s CPU  tokens computed {engine.bench_tokens:6d}  cache hit tokens {engine.bench_hits:6d}"
              f"  hit rate (whole run) {stats.prefix_cache_hit_rate:.1%}  steps {stats.steps}")
    identical = results[True][1][2:] == results[False][1][2:]
    print(f"greedy outputs identical: {identical}")
    cpu = results[False][2].bench_cpu / results[True][2].bench_cpu
    print(f"speedup with the cache: {results[False][0] / results[True][0]:.2f}x wall, {cpu:.2f}x CPU time  "
          f"(loadavg 1-min {load_before:.2f} before, {os.getloadavg()[0]:.2f} after)")
    if not identical:
        raise SystemExit("outputs differ between cached and uncached runs")


if __name__ == "__main__":
    main()
