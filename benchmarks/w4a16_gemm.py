"""W4A16: the packed-weight GEMM against bf16 `torch.matmul`, and a 4-bit job against bf16 end to end.

    python benchmarks/w4a16_gemm.py [--out PATH]     GPU: the W4A16 GEMM (AWQ-like: group 128, zeros) against
                                                     x @ W.T in bf16 on a 70B layer's shapes (8192x8192,
                                                     28672x8192, 8192x28672) at decode M = 1..256 and prefill
                                                     M = 4096; after a correctness check against
                                                     dequantize-then-matmul on each shape
    python benchmarks/w4a16_gemm.py --cpu-smoke      the same code paths, tiny shapes, Triton interpreter
    python benchmarks/w4a16_gemm.py --cpu-e2e        CPU: one generation job on a random model in bf16 and on
                                                     its AWQ-g128 copy (dequantized at load), interleaved
                                                     repeats; tok/s of each and their median ratio

GPU timing: CUDA events around graph replays of back-to-back calls (bench_kernels.time_ms), median per call;
the weight-stream bandwidth (packed bytes + scales/zeros, or bf16 bytes, over time) beside each. The CPU e2e
ratio compares two runs side by side on the same machine: on a shared machine only the ratio means anything.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

SHAPES = [(8192, 8192), (28672, 8192), (8192, 28672)]  # (N, K): o_proj-like, gate/up, down of Llama-3-70B
ROWS = [1, 4, 16, 64, 128, 256, 4096]
GROUP = 128


def packed_weight(n: int, k: int, device: str, seed: int = 0):
    """A random AWQ-like layer in Int4Linear's layout: (weight int32 [N, K/8], scale float32 [N, G], zero uint8 [N, G])."""
    gen = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randint(-2**31, 2**31 - 1, (n, k // 8), generator=gen, device=device, dtype=torch.int32)
    scale = torch.rand(n, k // GROUP, generator=gen, device=device) * 0.01 + 0.001
    zero = torch.randint(0, 16, (n, k // GROUP), generator=gen, device=device, dtype=torch.uint8)
    return weight, scale, zero


def gemm_table(shapes, rows, device: str, out_lines: list[str]) -> None:
    import bench_kernels
    from cbatch.kernels import w4a16_linear
    from cbatch.model.int4 import dequantize_kept

    bench_kernels.DEVICE = device
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    header = f"{'M':>6} {'N':>6} {'K':>6} {'w4a16 us':>10} {'bf16 us':>10} {'speedup':>8} {'w4 GB/s':>8} {'bf16 GB/s':>9}"
    out_lines.append(header)
    print(header, flush=True)
    for n, k in shapes:
        weight, scale, zero = packed_weight(n, k, device)
        dense = dequantize_kept(weight, scale, zero, None, GROUP, 4, dtype)  # [N, K]: the bf16 baseline's weight
        x = torch.randn(8, k, device=device, dtype=dtype)
        ref = (x.float() @ dense.float().t())
        got = w4a16_linear(x, weight, scale, zero, None, GROUP, 4).float()
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        if err > 2e-2:
            raise SystemExit(f"w4a16 {n}x{k}: max relative error {err:.3e} against dequantize-then-matmul; not timing it")
        w4_bytes = weight.numel() * 4 + scale.numel() * 4 + zero.numel()
        for m in rows:
            x = torch.randn(m, k, device=device, dtype=dtype)
            t_w4 = bench_kernels.time_ms(lambda: w4a16_linear(x, weight, scale, zero, None, GROUP, 4), inner=10)
            t_bf = bench_kernels.time_ms(lambda: torch.matmul(x, dense.t()), inner=10)
            line = (f"{m:>6} {n:>6} {k:>6} {t_w4 * 1e3:>10.1f} {t_bf * 1e3:>10.1f} {t_bf / t_w4:>7.2f}x "
                    f"{w4_bytes / (t_w4 * 1e-3) / 1e9:>8.0f} {dense.numel() * 2 / (t_bf * 1e-3) / 1e9:>9.0f}")
            out_lines.append(line)
            print(line, flush=True)
        del weight, scale, zero, dense


def cpu_e2e(repeats: int, out_lines: list[str]) -> None:
    """tok/s of one greedy job on a random Llama-shaped model (hidden 512, 4 layers) in bf16 and on its AWQ-g128
    copy: the CPU path dequantizes at load, so the two should match; interleaved, median of `repeats`."""
    import transformers

    from cbatch.config import EngineConfig, SamplingParams
    from cbatch.engine.build import build_engine
    from cbatch.engine.engine import run_to_completion
    from helpers import random_prompts
    from int_checkpoints import make_int_checkpoint

    root = Path(tempfile.mkdtemp(prefix="w4a16-e2e-"))
    config = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                                      initializer_range=0.05, tie_word_embeddings=False, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / "bf16")
    make_int_checkpoint(root / "bf16", root / "awq", "awq-g128")
    prompts = random_prompts(16, 4096, seed=1, min_len=32, max_len=128)
    params = [SamplingParams(max_tokens=32, ignore_eos=True)] * len(prompts)
    rates: dict[str, list[float]] = {"bf16": [], "awq-g128": []}
    engines = {name: build_engine(EngineConfig(model=str(root / folder), device="cpu", dtype="bfloat16"))
               for name, folder in (("bf16", "bf16"), ("awq-g128", "awq"))}
    for name, engine in engines.items():  # warm-up
        run_to_completion(engine, prompts[:2], params[:2])
    for _ in range(repeats):
        for name, engine in engines.items():
            t0 = time.perf_counter()
            outputs = run_to_completion(engine, prompts, params)
            rates[name].append(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - t0))
    for name, values in rates.items():
        line = f"cpu e2e {name:>9}: {statistics.median(values):8.1f} tok/s (median of {repeats}: {', '.join(f'{v:.1f}' for v in values)})"
        out_lines.append(line)
        print(line, flush=True)
    ratio = statistics.median(a / b for a, b in zip(rates["awq-g128"], rates["bf16"]))
    line = f"cpu e2e 4-bit / bf16 tok/s: {ratio:.3f} (per-repeat ratios' median; dequantized at load, so ~1 is expected)"
    out_lines.append(line)
    print(line, flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes through the Triton interpreter")
    p.add_argument("--cpu-e2e", action="store_true", help="a 4-bit job's tok/s against bf16 on this CPU")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    lines: list[str] = []
    if args.cpu_e2e:
        cpu_e2e(args.repeats, lines)
    elif args.cpu_smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import
        gemm_table([(64, 256), (32, 512)], [1, 80], "cpu", lines)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: use --cpu-smoke or --cpu-e2e")
        lines.append(f"device: {torch.cuda.get_device_name()}")
        gemm_table(SHAPES, ROWS, "cuda", lines)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
