"""Compile the kernels for Hopper (sm_90) without a GPU, as real calls would launch them.

    python benchmarks/compile_check.py          # prints one line per kernel variant
    python benchmarks/compile_check.py 90 gemm  # only the variants whose label holds "gemm"

A developer's tool (it drives the model code's wrappers too, so it lives outside the package). Under another
Triton (the GPU machines run 3.6): benchmarks/device_stack_check.sh makes that venv and runs this there.

Triton's interpreter (what the tests use on a CPU machine) never lowers a kernel, so code that runs
there can still fail to compile for a GPU (scalar/tensor type mismatches in loops, unsupported ops, tile
shapes tl.dot rejects). This drives the public wrappers with small CPU tensors, intercepts each kernel
launch, and compiles it with the same signature, constexprs, divisibility specialisation and launch
options the JIT would use, down to a cubin through the ptxas that ships with Triton. It also reports
registers, stack (spills) and shared memory per variant from the cubin.
Exit status 1 if any variant fails to compile.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # cbatch from this checkout, whatever the cwd

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("run without TRITON_INTERPRET: the interpreter's kernels cannot be compiled")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_TL_TYPE = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16",
    torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.uint8: "u8",
}
from cbatch.kernels.jit_stats import KERNEL_MODULES  # noqa: E402  (every kernel module; a test holds it whole)


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kwargs)` records the call."""

    def __init__(self, jit_fn, module: str):
        self.jit_fn = jit_fn
        self.module = module  # its cbatch.kernels module (where a compile worker finds the kernel again)
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((args, dict(kwargs)))

        return launch


def _arg_spec(value):
    """(signature type, divisible-by-16) for a runtime argument, as the JIT would specialise it."""
    if isinstance(value, torch.Tensor):
        return "*" + _TL_TYPE[value.dtype], value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "i1", False
    if isinstance(value, int):
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"unexpected kernel argument {value!r}")


def _cubin_resources(cubin: bytes) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return "(no cuobjdump)"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([cuobjdump, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
    return f"regs={m.group(1):>3} stack={m.group(2):>4}B" if m else text.strip()


def launch_spec(jit_fn, args, kwargs):
    """(signature, constexprs, attrs, options) of a launch, as the JIT specialises it."""
    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    signature, constexprs, attrs = {}, {}, {}
    for i, param in enumerate(jit_fn.params):
        name = param.name
        value = args[i] if i < len(args) else kwargs[name]
        if param.is_constexpr:
            signature[name] = "constexpr"
            constexprs[name] = value
        else:
            signature[name], div16 = _arg_spec(value)
            if div16 and not getattr(param, "do_not_specialize", False):  # as the JIT: no hint for those
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs, options


def _compile_variant(module: str, name: str, spec: tuple, arch: int) -> tuple[bytes, str, int, str] | str:
    """A worker's compile of kernel `name` of cbatch.kernels.`module` with launch `spec`: (cubin, resources, shared
    memory, mma kind), or the error as text."""
    jit_fn = getattr(importlib.import_module(f"cbatch.kernels.{module}"), name)
    signature, constexprs, attrs, options = spec
    try:
        compiled = triton.compile(ASTSource(jit_fn, signature, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                                  options=options)
    except Exception as err:  # reported by the caller, which fails after every variant
        return f"{type(err).__name__}: {err}"
    ptx = compiled.asm["ptx"]
    mma = "wgmma" if "wgmma" in ptx else ("mma" if "mma.sync" in ptx else "-")
    return compiled.asm["cubin"], _cubin_resources(compiled.asm["cubin"]), compiled.metadata.shared, mma


def _drive():
    """Call every wrapper on the shapes the engine will use (bf16 mostly; fp32/fp16 for the tests)."""
    from cbatch.kernels import paged_attention

    fp8 = torch.float8_e4m3fn

    def attention(label, dtype, num_q_heads, num_kv_heads, head_dim, q_lens, seq_len, block_size=16,
                  sliding_window=None, num_splits=None, cache_dtype=None, softcap=None, decode_tiles=None, sinks=False):
        num_seqs = len(q_lens)
        blocks = -(-seq_len // block_size)
        q = torch.empty(sum(q_lens), num_q_heads, head_dim, dtype=dtype)
        cache = torch.empty(blocks * num_seqs, block_size, num_kv_heads, head_dim, dtype=cache_dtype or dtype)
        scales = torch.ones(num_kv_heads) if cache_dtype is not None else None
        qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
        paged_attention(q, cache, cache, torch.empty_like(q), qsl,
                        torch.full((num_seqs,), seq_len, dtype=torch.int32),
                        torch.zeros(num_seqs, blocks, dtype=torch.int32), head_dim ** -0.5,
                        max(q_lens), seq_len, sliding_window=sliding_window, num_splits=num_splits,
                        k_scale=scales, v_scale=scales, softcap=softcap, decode_tiles=decode_tiles,
                        sinks=torch.empty(num_q_heads, dtype=dtype) if sinks else None)
        return label

    yield attention("decode Qwen3-0.6B B64 ctx2048", torch.bfloat16, 16, 8, 128, [1] * 64, 2048)
    yield attention("decode Qwen3-0.6B B4 ctx8192 (auto split)", torch.bfloat16, 16, 8, 128, [1] * 4, 8192)
    yield attention("decode Llama-8B G4 B16", torch.bfloat16, 32, 8, 128, [1] * 16, 4096)
    yield attention("decode G8 block32", torch.bfloat16, 64, 8, 128, [1] * 8, 1024, block_size=32)
    yield attention("mixed Qwen3-0.6B prefill 512 + decode", torch.bfloat16, 16, 8, 128, [512, 1, 1], 1024)
    yield attention("mixed Llama-8B G4 prefill", torch.bfloat16, 32, 8, 128, [256, 1], 512)
    yield attention("mixed G8 sliding window", torch.bfloat16, 64, 8, 128, [128, 1], 4096, sliding_window=1024)
    yield attention("mixed fp16 hd64 G1 forced split", torch.float16, 8, 8, 64, [64, 1], 256, num_splits=3)
    yield attention("mixed bf16 hd96 G4", torch.bfloat16, 16, 4, 96, [64, 1], 256)
    yield attention("mixed bf16 hd256 G8", torch.bfloat16, 16, 2, 256, [64, 1], 256)
    yield attention("mixed fp32 hd128 G4 (tests only)", torch.float32, 8, 2, 128, [64, 1], 256)
    yield attention("decode Qwen3-0.6B B256 fp8 KV", torch.bfloat16, 16, 8, 128, [1] * 256, 2048, cache_dtype=fp8)
    yield attention("decode Qwen3-0.6B B4 fp8 KV split", torch.bfloat16, 16, 8, 128, [1] * 4, 8192, cache_dtype=fp8)
    yield attention("mixed Qwen3-0.6B fp8 KV", torch.bfloat16, 16, 8, 128, [512, 1, 1], 1024, cache_dtype=fp8)
    yield attention("mixed Gemma-2 softcap + window hd256 G2", torch.bfloat16, 8, 4, 256, [64, 1], 8192,
                    sliding_window=4096, softcap=50.0)
    yield attention("decode Gemma-2 softcap B32", torch.bfloat16, 8, 4, 256, [1] * 32, 4096, softcap=50.0)
    # gpt-oss-20b: 64 q / 8 kv heads of 64, sinks, 128-token windows on every other layer (the decode batch splits)
    yield attention("decode gpt-oss sinks + window B64", torch.bfloat16, 64, 8, 64, [1] * 64, 4096,
                    sliding_window=128, sinks=True)
    yield attention("mixed gpt-oss sinks + window prefill", torch.bfloat16, 64, 8, 64, [256, 1], 1024,
                    sliding_window=128, sinks=True)
    # every start-up tuning candidate (kernels/tuning.py) must compile: bf16 and fp8 caches, head_dim 128 and 256
    from cbatch.kernels.paged_attention import decode_tile_candidates

    for head_dim, cache_dtype in ((128, None), (128, fp8), (256, None)):
        for tiles in decode_tile_candidates(head_dim, cache_dtype is not None)[1:]:
            yield attention(f"decode tuning hd{head_dim}{' fp8' if cache_dtype else ''} {tiles}", torch.bfloat16,
                            16, 8, head_dim, [1] * 64, 2048, cache_dtype=cache_dtype, decode_tiles=tiles)
    yield from _drive_small_ops()
    yield from _drive_models()
    yield from _drive_w4a16()
    yield from _drive_gemm()
    yield from _drive_lora()
    yield from _drive_mla()


def _drive_small_ops():
    """The per-layer ops around attention (store, rotary, norms, activation, the fused prologue) and the sampler."""
    from cbatch.kernels import apply_rotary, fused_add_rms_norm, fused_sample, norm_rope_store, rms_norm, silu_and_mul, store_kv

    fp8 = torch.float8_e4m3fn
    qkv = torch.empty(256, (16 + 2 * 8) * 128, dtype=torch.bfloat16)
    k = qkv[:, 16 * 128 : 24 * 128].view(256, 8, 128)
    v = qkv[:, 24 * 128 :].view(256, 8, 128)
    cache = torch.empty(32, 16, 8, 128, dtype=torch.bfloat16)
    store_kv(k, v, cache, cache, torch.zeros(256, dtype=torch.int64))
    yield "store_kv bf16 8x128 (qkv views)"
    q = qkv[:, : 16 * 128].view(256, 16, 128)
    apply_rotary(q, k, torch.zeros(256, dtype=torch.int64), torch.empty(4096, 128))
    yield "rotary bf16 16+8 heads x 128 (qkv views)"
    for hidden in (1024, 4096):
        x = torch.empty(256, hidden, dtype=torch.bfloat16)
        w = torch.empty(hidden, dtype=torch.bfloat16)
        rms_norm(x, w, 1e-6)
        yield f"rms_norm bf16 hidden {hidden}"
        fused_add_rms_norm(x, x, w, 1e-6)
        yield f"fused_add_rms_norm bf16 hidden {hidden}"
    silu_and_mul(torch.empty(256, 2 * 3072, dtype=torch.bfloat16))
    yield "silu_and_mul bf16 I=3072"
    positions, cos_sin = torch.zeros(256, dtype=torch.int64), torch.empty(4096, 128)
    for label, cache_dtype, norms in (("Qwen3 bf16 KV", torch.bfloat16, True), ("Qwen3 fp8 KV", fp8, True),
                                      ("Llama bf16 KV (no q/k norm)", torch.bfloat16, False)):
        kv_cache = torch.empty(32, 16, 8, 128, dtype=cache_dtype)
        weight = torch.empty(128, dtype=torch.bfloat16) if norms else None
        scales = torch.ones(8) if cache_dtype == fp8 else None
        norm_rope_store(qkv, 16, 8, positions, cos_sin, kv_cache, kv_cache, torch.zeros(256, dtype=torch.int64),
                        weight, weight, 1e-6, scales, scales)
        yield f"norm_rope_store {label}"
    store_kv(k, v, torch.empty(32, 16, 8, 128, dtype=fp8), torch.empty(32, 16, 8, 128, dtype=fp8),
             torch.zeros(256, dtype=torch.int64), torch.ones(8), torch.ones(8))
    yield "store_kv fp8"
    fused_sample(torch.empty(256, 151936), torch.empty(256), torch.empty(256, dtype=torch.int64),
                 torch.empty(256, dtype=torch.int64))
    yield "fused_sample vocab 151936 (3 splits + reduce)"
    fused_sample(torch.empty(256, 151936), torch.empty(256), torch.empty(256, dtype=torch.int64),
                 torch.empty(256, dtype=torch.int64), num_splits=1)
    yield "fused_sample vocab 151936 (one program per row)"


def _drive_models():
    """The newer families' variants: Gemma's norm and activation, partial rotary, fused MoE, FP8 weights."""
    from cbatch.kernels import apply_rotary, fp8_linear, fused_add_rms_norm, fused_moe, gelu_tanh_and_mul

    x = torch.empty(256, 2560, dtype=torch.bfloat16)
    fused_add_rms_norm(x, x, torch.empty(2560, dtype=torch.bfloat16), 1e-6, unit_offset=True)
    yield "fused_add_rms_norm (1 + w) bf16 hidden 2560"
    gelu_tanh_and_mul(torch.empty(256, 2 * 10240, dtype=torch.bfloat16))
    yield "gelu_tanh_and_mul bf16 I=10240"
    qkv = torch.empty(64, (24 + 2 * 8) * 128, dtype=torch.bfloat16)  # Phi-4-mini: 96 of 128 dims rotate
    apply_rotary(qkv[:, : 24 * 128].view(64, 24, 128), qkv[:, 24 * 128 : 32 * 128].view(64, 8, 128),
                 torch.zeros(64, dtype=torch.int64), torch.empty(4096, 96))
    yield "rotary partial 96 of 128"
    for tokens in (8, 2048):  # decode-sized (16-row blocks) and prefill-sized (64-row blocks)
        x = torch.empty(tokens, 2048, dtype=torch.bfloat16)
        weights, ids = torch.rand(tokens, 8).to(torch.bfloat16), torch.randint(0, 128, (tokens, 8))
        w13, w2 = torch.empty(128, 2 * 768, 2048, dtype=torch.bfloat16), torch.empty(128, 2048, 768, dtype=torch.bfloat16)
        fused_moe(x, w13, w2, weights, ids)
        yield f"fused_moe Qwen3-30B-A3B bf16 T={tokens}"
        f13, f2 = w13.to(torch.float8_e4m3fn), w2.to(torch.float8_e4m3fn)
        fused_moe(x, f13, f2, weights, ids, "silu", torch.empty(128, 12, 16), torch.empty(128, 16, 6), (128, 128))
        yield f"fused_moe Qwen3-30B-A3B fp8 block 128 T={tokens}"
        w = torch.empty(4096, 2048, dtype=torch.float8_e4m3fn)
        fp8_linear(x, w, torch.empty(4096), None)
        yield f"fp8_linear per channel 4096x2048 T={tokens}"
        fp8_linear(x, w, torch.empty(32, 16), (128, 128), torch.empty(4096, dtype=torch.bfloat16))
        yield f"fp8_linear block 128 + bias 4096x2048 T={tokens}"
    x = torch.empty(64, 256)
    fused_moe(x, torch.empty(8, 96, 256), torch.empty(8, 256, 48), torch.rand(64, 2), torch.randint(0, 8, (64, 2)), "gelu_tanh")
    yield "fused_moe fp32 (tests only)"
    from cbatch.model.backend.clamped_swiglu import ClampedSwiGLU

    for tokens in (8, 2048):  # gpt-oss-20b's experts (8 of its 32 here: the variant does not depend on E)
        x = torch.empty(tokens, 2880, dtype=torch.bfloat16)
        weights, ids = torch.rand(tokens, 4).to(torch.bfloat16), torch.randint(0, 8, (tokens, 4))
        w13, w2 = torch.empty(8, 5760, 90, 16, dtype=torch.uint8), torch.empty(8, 2880, 90, 16, dtype=torch.uint8)
        s13, s2 = torch.full((8, 5760, 90), 127, dtype=torch.uint8), torch.full((8, 2880, 90), 127, dtype=torch.uint8)
        fused_moe(x, w13, w2, weights, ids, ClampedSwiGLU(1.702, 7.0), s13, s2,
                  w13_bias=torch.empty(8, 5760, dtype=torch.bfloat16), w2_bias=torch.empty(8, 2880, dtype=torch.bfloat16))
        yield f"fused_moe gpt-oss MXFP4 + biases T={tokens}"


def _drive_w4a16():
    """The W4A16 GEMM on a 70B layer (8192 -> 28672): decode and prefill tiles, groups in order (128) and
    per channel, act-order, int8, a bias; fp32 for the tests."""
    from cbatch.kernels import w4a16_linear

    n, k = 28672, 8192
    weight = torch.empty(n, k // 8, dtype=torch.int32)
    scale, zero = torch.empty(n, k // 128), torch.empty(n, k // 128, dtype=torch.uint8)
    for tokens in (1, 4096):
        x = torch.empty(tokens, k, dtype=torch.bfloat16)
        w4a16_linear(x, weight, scale, zero, None, 128, 4)
        yield f"w4a16 g128 {n}x{k} T={tokens}"
        w4a16_linear(x, weight, scale, zero, torch.empty(k, dtype=torch.int32), 128, 4)
        yield f"w4a16 g128 act-order {n}x{k} T={tokens}"
    x = torch.empty(16, k, dtype=torch.float16)
    w4a16_linear(x, weight, torch.empty(n, 1), torch.empty(n, 1, dtype=torch.uint8), None, k, 4,
                 torch.empty(n, dtype=torch.float16))
    yield "w4a16 per channel + bias fp16"
    w4a16_linear(x, torch.empty(n, k // 4, dtype=torch.int32), scale, zero, None, 128, 8)
    yield "w8a16 g128 fp16"
    w4a16_linear(torch.empty(80, 128), torch.empty(40, 16, dtype=torch.int32), torch.empty(40, 4),
                 torch.empty(40, 4, dtype=torch.uint8), None, 32, 4)
    yield "w4a16 fp32 (tests only)"
    from cbatch.kernels import fused_moe
    from cbatch.model.int4 import IntExperts

    for tokens in (8, 2048):  # Qwen3-30B-A3B's experts packed, group 128
        x = torch.empty(tokens, 2048, dtype=torch.bfloat16)
        weights, ids = torch.rand(tokens, 8).to(torch.bfloat16), torch.randint(0, 128, (tokens, 8))
        w13, w2 = torch.empty(128, 1536, 256, dtype=torch.int32), torch.empty(128, 2048, 96, dtype=torch.int32)
        s13, s2 = torch.empty(128, 1536, 16), torch.empty(128, 2048, 6)
        fused_moe(x, w13, w2, weights, ids, "silu", s13, s2, None,
                  IntExperts(s13.to(torch.uint8), s2.to(torch.uint8), 128, 4))
        yield f"fused_moe Qwen3-30B-A3B int4 g128 T={tokens}"


def _drive_gemm():
    """The decode GEMM (kernels/gemm.py): every tuning candidate on Qwen3-0.6B's layer shapes at 64 and 256 rows
    (split-K adds the reduce kernel), a bias, fp16; fp32 for the tests."""
    from cbatch.kernels.gemm import GEMM_CANDIDATES, decode_linear

    shapes = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
    for config in GEMM_CANDIDATES:
        for rows in (r for r in (64, 256) if config.fits(r)):  # every candidate fits 64 rows
            for name, (n, k) in shapes.items():
                decode_linear(torch.empty(rows, k, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16),
                              None, config)
                yield f"decode gemm {config} {name} M={rows}"
    decode_linear(torch.empty(8, 1024, dtype=torch.bfloat16), torch.empty(1000, 1024, dtype=torch.bfloat16),
                  torch.empty(1000, dtype=torch.bfloat16), GEMM_CANDIDATES[1])
    yield "decode gemm bf16 + bias, split-K, N=1000"
    decode_linear(torch.empty(8, 896, dtype=torch.float16), torch.empty(4864, 896, dtype=torch.float16), None,
                  GEMM_CANDIDATES[0])
    yield "decode gemm fp16 4864x896"
    decode_linear(torch.empty(8, 96), torch.empty(40, 96), torch.empty(40), GEMM_CANDIDATES[3])
    yield "decode gemm fp32 (tests only)"


def _drive_lora():
    """The LoRA shrink and expand (kernels/lora.py) at rank 16 on Qwen3-0.6B's hidden size, bf16; fp32 for the tests."""
    from cbatch.kernels.lora import lora_expand, lora_shrink

    tokens, slots = torch.zeros(64, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        y = lora_shrink(torch.empty(64, 1024, dtype=dtype), torch.empty(4, 16, 1024, dtype=dtype), tokens, slots,
                        slots, 16)
        yield f"lora shrink {str(dtype).removeprefix('torch.')} rank 16"
        lora_expand(y, torch.empty(4, 4096, 16, dtype=dtype), torch.empty(64, 4096, dtype=dtype), tokens, slots,
                    slots, 16)
        yield f"lora expand {str(dtype).removeprefix('torch.')} rank 16"


def _drive_mla():
    """MLA decode attention (kernels/mla_decode.py): DeepSeek-V3's latent (512 + 64) and 128 heads in bf16, the tests'
    tiny shapes in fp32."""
    from cbatch.kernels import mla_decode_attention

    for dtype, heads, rank, rope, block_size in ((torch.bfloat16, 128, 512, 64, 16), (torch.float32, 5, 16, 8, 4)):
        mla_decode_attention(torch.empty(8, heads, rank + rope, dtype=dtype),
                             torch.empty(32, block_size, 1, rank + rope, dtype=dtype),
                             torch.zeros(8, 4, dtype=torch.int32), torch.ones(8, dtype=torch.int32), rank, 0.1)
        yield f"mla decode {str(dtype).removeprefix('torch.')} {heads} heads, latent {rank}+{rope}"


def main(arch: int = 90, only: str | None = None, jobs: int = os.cpu_count() or 1) -> int:
    """Compiles every variant the wrappers launch (each distinct launch once, `jobs` at a time in fresh processes:
    Triton compiles on one core), then prints one line per launch in the order the wrappers made them."""
    modules = [importlib.import_module(f"cbatch.kernels.{m}") for m in KERNEL_MODULES]
    recorders = {}
    for module_name, mod in zip(KERNEL_MODULES, modules):
        # the wrappers check for CUDA tensors; nothing is launched here, so CPU tensors are fine
        mod.check_launchable = lambda *tensors: torch.device("cpu")
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                recorders[name] = rec = _Recorder(obj, module_name)
                setattr(mod, name, rec)

    launches = []  # (label, kernel name, key of its variant)
    variants = {}  # key -> (module, kernel name, launch spec)
    for label in _drive():
        for name, rec in recorders.items():
            if only is None or only in label:
                for args, kwargs in rec.calls:
                    spec = launch_spec(rec.jit_fn, args, kwargs)
                    key = repr((name, spec))
                    variants.setdefault(key, (rec.module, name, spec))
                    launches.append((label, name, key))
            rec.calls.clear()

    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    started = time.time()
    with ProcessPoolExecutor(max(1, jobs), mp_context=get_context("spawn")) as pool:
        futures = {key: pool.submit(_compile_variant, *variant, arch) for key, variant in variants.items()}
        results = {key: future.result() for key, future in futures.items()}
    failures, seen = 0, set()
    for label, name, key in launches:
        result = results[key]
        if isinstance(result, str):
            failures += 1
            print(f"FAIL  {label:45s} {name}: {result}")
            continue
        cubin, resources, shared, mma = result
        note = "" if cubin not in seen else " (same binary as above)"
        seen.add(cubin)
        print(f"ok    {label:45s} {name:26s} {resources} smem={shared:>6}B mma={mma}{note}")
    print(f"{len(variants)} distinct variants of {len(launches)} launches compiled in {time.time() - started:.1f} s "
          f"on {max(1, jobs)} processes")
    print(f"{failures} variant(s) failed to compile for sm_{arch}" if failures else f"all variants compile for sm_{arch}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 90, sys.argv[2] if len(sys.argv) > 2 else None))
