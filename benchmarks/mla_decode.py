"""MLA decode attention on a CUDA GPU: `cbatch.kernels.mla_decode_attention` against the torch path
(`torch_latent_attention`), DeepSeek-V3 / Kimi K2 shapes (rank 512, rope 64; 128 or 64 heads), bf16 latent cache,
block size 16, shuffled block tables.

    python benchmarks/mla_decode.py [--heads 128] [--cpu-smoke]

Prints per (batch, context): the kernel's time, its achieved bandwidth (latent bytes read once per program:
heads / 16 programs per sequence each stream the sequence's latents) and the torch path's time. The kernel is
checked against the torch path first (a wrong kernel is not timed). --cpu-smoke runs one tiny shape under the
Triton interpreter to check the script itself (no timing claims). Not yet run on a GPU.
"""
from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=128)
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    from cbatch.kernels import mla_decode_attention
    from cbatch.kernels.mla_decode import MIN_DOT
    from cbatch.model.backend.mla import torch_latent_attention

    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    rank, rope, block_size, dtype = (16, 8, 4, torch.float32) if args.cpu_smoke else (512, 64, 16, torch.bfloat16)
    heads = 4 if args.cpu_smoke else args.heads
    shapes = [(2, 20)] if args.cpu_smoke else [(b, c) for b in (16, 64, 256) for c in (1024, 4096)]
    print(f"{'batch':>6} {'context':>8} {'kernel us':>10} {'GB/s':>8} {'torch us':>10}")
    for batch, context in shapes:
        blocks = -(-context // block_size)
        table = torch.randperm(batch * blocks, device=device).to(torch.int32).view(batch, blocks)
        cache = torch.randn(batch * blocks, block_size, 1, rank + rope, device=device, dtype=dtype)
        query = torch.randn(batch, heads, rank + rope, device=device, dtype=dtype)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        got = mla_decode_attention(query, cache, table, lens, rank, 0.1)
        want = torch_latent_attention(query.float(), cache.float(), table, lens, rank, 0.1)
        if not torch.allclose(got, want, rtol=2e-2, atol=2e-2):
            sys.exit(f"mla_decode_attention differs from the torch path at batch {batch}, context {context}")
        if args.cpu_smoke:
            print(f"{batch:>6} {context:>8} {'(checked)':>10}")
            continue
        kernel = _time(lambda: mla_decode_attention(query, cache, table, lens, rank, 0.1))
        reference = _time(lambda: torch_latent_attention(query, cache, table, lens, rank, 0.1))
        programs_per_seq = -(-heads // MIN_DOT)
        read = batch * context * (rank + rope) * cache.element_size() * programs_per_seq
        print(f"{batch:>6} {context:>8} {kernel * 1e6:>10.1f} {read / kernel / 1e9:>8.0f} {reference * 1e6:>10.1f}")


def _time(fn, repeats: int = 20) -> float:
    """Median seconds per call, CUDA events, after warm-up."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    main()
