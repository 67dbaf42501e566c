"""The CPU backend's compiled kernels against the plain-torch path they replace.

    python benchmarks/cpu_kernels.py                       # kernels, then the whole workload, 1 thread, CPU time
    python benchmarks/cpu_kernels.py --threads 2 --wall    # 2 threads, wall time (needs a quiet machine)
    python benchmarks/cpu_kernels.py --skip-workload --dtype bfloat16
    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 python benchmarks/cpu_kernels.py   # as an AVX2 CPU

1. Decode attention, SmolLM2-135M's heads (9 query, 3 KV, head dim 64), `--rows` rows at each context: the
   compiled kernel (CpuBackend) against TorchBackend's decode groups, and the floor: one read of the rows' K
   and V at the rate torch sums the same bytes here.
2. The whole compare_peers.py workload (64 requests, SmolLM2-135M-Instruct, EOS ignored), `--attention-backend
   torch` against `cpu`, alternated `--repeats` times; medians.
CPU time (`time.process_time`) with one thread is the default: it holds on a loaded machine, where wall time
with several threads does not (an OpenMP region waits for its slowest thread).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from cbatch.model.backend import AttentionMetadata, CpuBackend, KVLayer, TorchBackend, kv_cache_shape  # noqa: E402
from cbatch.model.cpu_features import cpu_flags, vector_isa_flags  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def clock(wall: bool) -> float:
    return time.perf_counter() if wall else time.process_time()


def timed(fn, repeats: int, wall: bool) -> float:
    """Median seconds of one call."""
    fn()
    runs = []
    for _ in range(repeats):
        start = clock(wall)
        fn()
        runs.append(clock(wall) - start)
    return statistics.median(runs)


def decode_attention(rows: int, context: int, dtype: torch.dtype, repeats: int, wall: bool) -> dict[str, float]:
    gen = torch.Generator().manual_seed(context)
    cols = -(-context // BLOCK)
    num_blocks = rows * cols + 1
    kv = KVLayer(*(torch.randn(kv_cache_shape(num_blocks, BLOCK, KV_HEADS, HEAD_DIM), generator=gen).to(dtype)
                   for _ in range(2)))
    table = torch.randperm(num_blocks, generator=gen)[: rows * cols].view(rows, cols).int()
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    new_kv = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    slots = table[:, -1].long() * BLOCK + (context - 1) % BLOCK
    meta = AttentionMetadata(query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
                             seq_lens=torch.full((rows,), context, dtype=torch.int32), block_table=table,
                             slot_mapping=slots, max_query_len=1, max_seq_len=context,
                             query_lens_host=[1] * rows, seq_lens_host=[context] * rows, block_size=BLOCK)
    seconds = {}
    for name, backend in (("torch", TorchBackend()), ("cpu", CpuBackend())):
        backend.prepare(meta)
        seconds[name] = timed(lambda: backend.attend(q, new_kv, new_kv, kv, meta, HEAD_DIM**-0.5, None), repeats, wall)
    seconds["read floor"] = timed(lambda: (kv.k.sum(), kv.v.sum()), repeats, wall)
    return seconds


def workload(dtype: str, threads: int, repeats: int, wall: bool) -> dict[str, list[float]]:
    from compare_peers import make_workload
    from cbatch.config import EngineConfig, SamplingParams
    from cbatch.engine.build import build_engine
    from cbatch.engine.engine import run_to_completion
    from cbatch.model.default_model import default_model_dir

    wl = make_workload(64, 0, (16, 256), 49152)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in wl.output_lens]
    engines = {}
    for backend in ("torch", "cpu"):
        config = EngineConfig(model=str(default_model_dir()), dtype=dtype, num_threads=threads, device="cpu",
                              attention_backend=backend)
        engines[backend] = build_engine(config)
    runs: dict[str, list[float]] = {"torch": [], "cpu": []}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for backend, engine in engines.items():
            engine.reset()
            start = clock(wall)
            outs = run_to_completion(engine, wl.prompts, params)
            runs[backend].append(clock(wall) - start)
            tokens[backend] = [o.token_ids for o in outs]
    same = sum(a == b for a, b in zip(tokens["torch"], tokens["cpu"]))
    print(f"greedy outputs identical for {same}/{len(wl.prompts)} requests ({dtype})")
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--wall", action="store_true", help="wall time instead of process CPU time")
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--contexts", default="128,512,2048")
    p.add_argument("--repeats", type=int, default=3, help="whole-workload runs per backend (kernels: 20 calls)")
    p.add_argument("--skip-workload", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    what = "wall" if args.wall else "CPU"
    print(f"CPU flags: {' '.join(vector_isa_flags(cpu_flags())) or '(none found)'}; ATen capability "
          f"{torch.backends.cpu.get_cpu_capability()}; {args.threads} thread(s); {what} time, medians")
    print(f"\n| decode attention, {args.rows} rows, {args.dtype} | torch path ms | compiled ms | speed-up "
          f"| read floor ms | compiled / floor |")
    print("|---|---|---|---|---|---|")
    for context in (int(c) for c in args.contexts.split(",")):
        s = decode_attention(args.rows, context, dtype, 20, args.wall)
        print(f"| context {context} | {s['torch'] * 1e3:.3f} | {s['cpu'] * 1e3:.3f} | {s['torch'] / s['cpu']:.2f}x "
              f"| {s['read floor'] * 1e3:.3f} | {s['cpu'] / s['read floor']:.2f}x |")
    if args.skip_workload:
        return
    runs = workload(args.dtype, args.threads, args.repeats, args.wall)
    torch_s, cpu_s = statistics.median(runs["torch"]), statistics.median(runs["cpu"])
    print(f"\n| whole workload ({args.dtype}) | seconds ({what}), median of {args.repeats} | runs |")
    print("|---|---|---|")
    for name, s in (("--attention-backend torch", torch_s), ("--attention-backend cpu", cpu_s)):
        key = name.split()[-1]
        print(f"| {name} | {s:.2f} | {', '.join(f'{x:.2f}' for x in runs[key])} |")
    print(f"cpu / torch: {torch_s / cpu_s:.2f}x faster")


if __name__ == "__main__":
    main()
