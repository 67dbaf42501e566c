"""Benchmark the fused-MoE and FP8 weight-only kernels against the torch code they replace, on a CUDA GPU.

    python benchmarks/bench_moe_fp8.py [--out PATH] [--quick] [--cpu-smoke]

Prints (and with --out writes) tables of
  (a) fused_moe (sort by expert + one grouped GEMM per projection) against the torch backend's grouped
      loop (one gathered matmul pair per expert), bf16, expert shapes of qwen3-30b-a3b (128 experts, top-8,
      hidden 2048, expert 768) and mixtral-8x7b (8 experts, top-2, hidden 4096, expert 14336), T = 1 / 16 /
      64 / 256 / 2048 tokens; MB = expert weights the step reads (experts its tokens pick), and that
      over the fused time as a fraction of the copy bandwidth;
  (b) fp8_linear (FP8 weight dequantized per tile, per-channel and 128 x 128 block scales) against
      F.linear on the bf16 weight, 4096 x 4096 and 14336 x 4096, T = 1 / 16 / 256 / 2048;
  (c) fused_moe with MXFP4 experts (gpt-oss: e2m1 pairs + e8m0 scales decoded in the GEMM, per-expert biases, the
      clamped SwiGLU) against the same kernel on the dequantized bf16 experts, gpt-oss-20b's shapes (32 experts,
      top-4, hidden 2880, expert 2880); MB = the MXFP4 bytes the step reads.
Every kernel is checked against its torch reference before it is timed. Timing as in bench_kernels.py
(CUDA-graph replays; the torch MoE loop reads expert counts on the host, so it is timed as plain launches).
--cpu-smoke runs every code path on tiny shapes through the Triton interpreter (checks the script only).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402  (timing, copy bandwidth, tables: one copy of each)

MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}  # E, k, H, I
LINEAR_SHAPES = [(4096, 4096), (14336, 4096)]  # N, K
MXFP4_SHAPES = {"gpt-oss-20b": (32, 4, 2880, 2880)}  # E, k, H, I


def _tol() -> float:
    """bf16 agreement required before timing; the interpreter truncates to bf16 instead of rounding."""
    return 5e-2 if bk.DEVICE == "cpu" else 1e-2


def bench_moe(kernels, copy_bw, shapes, token_counts, rows) -> None:
    from cbatch.model.backend import TorchBackend

    torch_moe = TorchBackend().fused_moe
    for name, (experts, top_k, hidden, inter) in shapes.items():
        g = torch.Generator(device=bk.DEVICE).manual_seed(0)
        w13 = (torch.randn(experts, 2 * inter, hidden, device=bk.DEVICE, generator=g) * 0.02).to(torch.bfloat16)
        w2 = (torch.randn(experts, hidden, inter, device=bk.DEVICE, generator=g) * 0.02).to(torch.bfloat16)
        for tokens in token_counts:
            x = torch.randn(tokens, hidden, device=bk.DEVICE, generator=g).to(torch.bfloat16)
            weights, ids = torch.topk(torch.randn(tokens, experts, device=bk.DEVICE, generator=g).softmax(-1), top_k)
            fused = lambda: kernels.fused_moe(x, w13, w2, weights, ids)  # noqa: E731
            eager = lambda: torch_moe(x, w13, w2, weights, ids, "silu")  # noqa: E731
            bk.check_close(f"fused_moe {name} T={tokens}", fused(), eager(), _tol())
            touched = len(set(ids.flatten().tolist()))
            nbytes = touched * 3 * hidden * inter * 2
            bk.add_row(rows, f"moe {name}", tokens, hidden, nbytes, copy_bw, fused, eager)


def _quantize(weight: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    if block is None:
        scale = weight.abs().amax(1).float() / 448.0
        return (weight / scale[:, None]).to(torch.float8_e4m3fn), scale
    tiles = weight.float().unflatten(1, (-1, block[1])).unflatten(0, (-1, block[0]))
    scale = tiles.abs().amax(dim=(1, 3)) / 448.0
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return (weight / full).to(torch.float8_e4m3fn), scale


def bench_fp8(kernels, copy_bw, shapes, token_counts, rows) -> None:
    from cbatch.model.quant import dequantize

    for n, k in shapes:
        g = torch.Generator(device=bk.DEVICE).manual_seed(1)
        weight = (torch.randn(n, k, device=bk.DEVICE, generator=g) * 0.02).to(torch.bfloat16)
        for block in (None, (128, 128)):
            w8, scale = _quantize(weight, block)
            plain = dequantize(w8, scale, block, torch.bfloat16)  # the same values in bf16: the eager baseline
            for tokens in token_counts:
                x = torch.randn(tokens, k, device=bk.DEVICE, generator=g).to(torch.bfloat16)
                fused = lambda: kernels.fp8_linear(x, w8, scale, block)  # noqa: E731
                eager = lambda: torch.nn.functional.linear(x, plain)  # noqa: E731
                bk.check_close(f"fp8_linear {n}x{k} {block} T={tokens}", fused(), eager(), _tol())
                label = "fp8 channel" if block is None else "fp8 block128"
                bk.add_row(rows, f"{label} {n}x{k}", tokens, k, n * k + tokens * (k + n) * 2, copy_bw, fused, eager)


def bench_mxfp4(kernels, copy_bw, shapes, token_counts, rows) -> None:
    from cbatch.model.backend.clamped_swiglu import ClampedSwiGLU
    from cbatch.model.mxfp4 import dequantize_mxfp4

    act = ClampedSwiGLU(alpha=1.702, limit=7.0)
    for name, (experts, top_k, hidden, inter) in shapes.items():
        g = torch.Generator(device=bk.DEVICE).manual_seed(2)

        def mxfp4(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:  # values up to 6 x 2 ** -6: a 0.02-ish scale
            return (torch.randint(0, 256, (experts, n, k // 32, 16), device=bk.DEVICE, generator=g, dtype=torch.uint8),
                    torch.randint(117, 122, (experts, n, k // 32), device=bk.DEVICE, generator=g, dtype=torch.uint8))

        (w13, s13), (w2, s2) = mxfp4(2 * inter, hidden), mxfp4(hidden, inter)
        b13 = (torch.randn(experts, 2 * inter, device=bk.DEVICE, generator=g) * 0.02).to(torch.bfloat16)
        b2 = (torch.randn(experts, hidden, device=bk.DEVICE, generator=g) * 0.02).to(torch.bfloat16)
        dense13, dense2 = dequantize_mxfp4(w13, s13, torch.bfloat16), dequantize_mxfp4(w2, s2, torch.bfloat16)
        for tokens in token_counts:
            x = torch.randn(tokens, hidden, device=bk.DEVICE, generator=g).to(torch.bfloat16)
            weights, ids = torch.topk(torch.randn(tokens, experts, device=bk.DEVICE, generator=g).softmax(-1), top_k)
            weights = weights.to(torch.bfloat16)
            packed = lambda: kernels.fused_moe(x, w13, w2, weights, ids, act, s13, s2, w13_bias=b13, w2_bias=b2)  # noqa: E731
            dense = lambda: kernels.fused_moe(x, dense13, dense2, weights, ids, act, w13_bias=b13, w2_bias=b2)  # noqa: E731
            bk.check_close(f"fused_moe mxfp4 {name} T={tokens}", packed(), dense(), _tol())
            touched = len(set(ids.flatten().tolist()))
            nbytes = touched * 3 * hidden * inter * 17 // 32  # 4 bits a weight + a scale byte per 32
            bk.add_row(rows, f"moe mxfp4 {name}", tokens, hidden, nbytes, copy_bw, packed, dense)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the tables to this file")
    parser.add_argument("--quick", action="store_true", help="fewer configurations (smoke run)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run tiny shapes on the CPU through the Triton interpreter (checks the script only)")
    args = parser.parse_args()
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        bk.DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print("bench_moe_fp8.py needs a CUDA GPU (or --cpu-smoke to check the script)", file=sys.stderr)
        return 2
    kernels = bk.import_kernels()
    copy_bw = bk.copy_bandwidth()
    out = [f"device: {torch.cuda.get_device_name(0) if bk.DEVICE == 'cuda' else 'CPU (interpreter, --cpu-smoke)'}; "
           f"copy bandwidth {copy_bw / 1e12:.2f} TB/s\n"]
    header = ["kernel", "tokens", "hidden", "MB", "torch us", "triton us", "speedup", "triton of copy BW"]
    if args.cpu_smoke:
        moe_shapes, moe_tokens = {"tiny": (8, 2, 32, 48)}, (3,)
        linear_shapes, linear_tokens = [(256, 256)], (3,)
        mxfp4_shapes = {"tiny": (4, 2, 64, 32)}
    else:
        moe_shapes, linear_shapes, mxfp4_shapes = MOE_SHAPES, LINEAR_SHAPES, MXFP4_SHAPES
        moe_tokens = (1, 64, 2048) if args.quick else (1, 16, 64, 256, 2048)
        linear_tokens = (1, 2048) if args.quick else (1, 16, 256, 2048)
    rows = []
    bench_moe(kernels, copy_bw, moe_shapes, moe_tokens, rows)
    out.append(bk.format_table("(a) fused MoE vs the torch grouped loop, bf16 (MB = expert weights read)", header, rows))
    print(out[-1], flush=True)
    rows = []
    bench_fp8(kernels, copy_bw, linear_shapes, linear_tokens, rows)
    out.append(bk.format_table("(b) FP8 weight-only matmul vs F.linear on bf16 weights (MB = fp8 weight + activations)",
                               header, rows))
    print(out[-1], flush=True)
    rows = []
    bench_mxfp4(kernels, copy_bw, mxfp4_shapes, moe_tokens, rows)
    out.append(bk.format_table("(c) fused MoE with MXFP4 experts vs bf16 experts (torch us: the same kernel on the "
                               "dequantized bf16 weights; MB = MXFP4 bytes read)", header, rows))
    print(out[-1], flush=True)
    bk.write_tables(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
