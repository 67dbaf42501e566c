"""The CPU path's compiled kernels (cpu_kernels.cpp): paged decode attention, prefill chunks' causal attention
(Gemma 3's image tokens seeing their whole image too), RMSNorm with the residual add, rotary, SiLU-and-multiply,
the KV store.
Built once per machine kind with the system C++ compiler and called through ctypes.

Why compiled: the plain-torch decode attention gathers every row's blocks into a padded copy, transposes it and
runs two tiny batched matmuls and a softmax, per layer: about five passes over K and V where one suffices
(benchmarks/NOTES.md). The kernel reads each row's K and V once, in place, with no torch headers to compile
(about a second). The fused elementwise kernels replace 3-6 torch ops (and their dispatch) each. Without a
compiler nothing is built and the engine keeps the plain-torch path.

The build targets the vector ISA that ATen itself runs at (`torch.backends.cpu.get_cpu_capability()`, which
`ATEN_CPU_CAPABILITY` caps), so an AVX-512 machine run as an AVX2 one gets AVX2 code here too. The library is
cached under `$CBATCH_CACHE/kernels`, named by the source's hash and that ISA. OpenMP: it links libgomp, the
runtime torch's CPU build has already loaded, so its threads are torch's (`torch.get_num_threads()`).
"""
from __future__ import annotations

import ctypes
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

from cbatch.config import cache_root

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HEAD_DIM = 512  # decode attention's per-head buffers (cpu_kernels.cpp): larger heads go to the torch path
_I32, _I64, _F32, _PTR = ctypes.c_int32, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {  # each kernel's argument types (cpu_kernels.cpp); every kernel returns an int status, 0 = done
    "cbatch_decode_attention": [_I32, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _I32, _PTR,
                                _I32, _I32, _I32, _I32, _F32, _I32, _F32, _PTR, _I32],
    "cbatch_prefill_attention": [_I32, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I32, _PTR, _PTR,
                                 _PTR, _PTR, _PTR, _PTR, _I32, _I32, _I32, _I32, _F32, _I32, _F32, _PTR, _I32],
    "cbatch_rms_norm": [_I32, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I32, _F32, _I32, _I32],
    "cbatch_rotary": [_I32, _PTR, _I64, _I64, _I32, _PTR, _PTR, _PTR, _I64, _I32, _I32, _I32],
    "cbatch_silu_and_mul": [_I32, _PTR, _I64, _PTR, _I64, _I32, _I32],
    "cbatch_store_kv": [_I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I32],
}


class KernelBuildError(RuntimeError):
    """The kernel could not be built or loaded here (no compiler, a failed compile): the message says why."""


def target_isa() -> tuple[str, list[str]]:
    """(name, compiler flags) of the vector ISA to build for: the one ATen runs at on this CPU."""
    machine = platform.machine().lower()
    if machine not in ("x86_64", "amd64"):
        return machine or "unknown", []  # the compiler's default target for this architecture
    capability = torch.backends.cpu.get_cpu_capability().upper()
    if capability.startswith("AVX512"):
        # AVX-512 F/BW/CD/DQ/VL in 256-bit vectors: the dot products' horizontal sums are the decode kernel's
        # cost, and shorter vectors sum faster (10-15% on the kernel, benchmarks/NOTES.md)
        return "x86-64-v4", ["-march=x86-64-v4", "-mprefer-vector-width=256"]
    if capability == "AVX2":
        return "x86-64-v3", ["-march=x86-64-v3"]  # AVX2, FMA
    return "x86-64", []


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def _compile(target: Path, flags: list[str]) -> None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (install g++, or set CXX)")
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: processes building at once (tensor-parallel ranks) never see half a file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        cmd = [compiler, "-O3", *flags, "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-std=c++17", "-shared", "-fPIC", str(SOURCE),
               "-o", str(built)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise KernelBuildError(f"{compiler} could not run: {exc}") from None
        if proc.returncode != 0:
            raise KernelBuildError(f"{compiler} failed: {proc.stderr.strip()[-500:]}")
        os.replace(built, target)


@cache
def _library() -> ctypes.CDLL:
    isa, flags = target_isa()
    digest = hashlib.sha256(SOURCE.read_bytes() + Path(__file__).read_bytes()).hexdigest()[:16]  # source + build flags
    target = _cache_dir() / f"cpu_kernels-{digest}-{isa}.so"
    if not target.is_file():
        _compile(target, flags)
        for stale in target.parent.glob(f"cpu_kernels-*-{isa}.so"):  # builds of other cbatch versions
            if stale != target:
                stale.unlink(missing_ok=True)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        raise KernelBuildError(f"{target} could not be loaded: {exc}") from None
    for name, args in _SIGNATURES.items():
        kernel = getattr(lib, name)
        kernel.argtypes, kernel.restype = args, ctypes.c_int
    return lib


@cache
def available() -> str | None:
    """None when the kernels are ready here (building them on first call), else the reason they are not. The
    outcome is kept for the process: a failed build is not retried by every caller (backend choice, the note)."""
    try:
        _library()
    except (KernelBuildError, OSError) as exc:
        return str(exc)
    return None


def supports(dtype: torch.dtype) -> bool:
    return dtype in _DTYPE_CODES


def _call(name: str, *args: object) -> None:
    """Runs kernel `name`; its nonzero status (arguments it refuses) is a ValueError."""
    status = getattr(_library(), name)(*args)
    if status != 0:
        raise ValueError(f"{name}: bad arguments (status {status})")


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, query_start: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                     scale: float, sliding_window: int | None, softcap: float | None,
                     sinks: torch.Tensor | None = None) -> None:
    """out[query_start[b]] = attention of q[query_start[b]] over sequence b's cached context, for b in `rows`;
    `sinks` (gpt-oss) float32 [Hq]: each head's logit joins its softmax's denominator.

    q [T, Hq, D] (rows may be strided, heads contiguous); out [T, Hq, D] contiguous, same dtype;
    k_cache/v_cache [num_blocks, block_size, Hkv, D] contiguous; block_table int32 [B, cols];
    seq_lens int32 [B] (this token included); query_start int32 [B + 1]; rows int32 [n]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim and out.is_contiguous() and out.dtype == q.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == q.dtype
    for t in (block_table, seq_lens, query_start, rows):
        assert t.dtype == torch.int32 and t.is_contiguous()
    _call(
        "cbatch_decode_attention", _DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), k_cache.data_ptr(),
        v_cache.data_ptr(), block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), query_start.data_ptr(),
        rows.data_ptr(), rows.numel(), out.data_ptr(), num_heads, num_kv_heads, head_dim, block_size, scale,
        sliding_window or 0, softcap or 0.0, _sinks_ptr(sinks, num_heads), torch.get_num_threads())


def _sinks_ptr(sinks: torch.Tensor | None, num_heads: int) -> int | None:
    if sinks is None:
        return None
    assert sinks.dtype == torch.float32 and sinks.is_contiguous() and sinks.shape == (num_heads,)
    return sinks.data_ptr()


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, chunks: torch.Tensor,
                      scale: float, k_cache: torch.Tensor | None = None, v_cache: torch.Tensor | None = None,
                      block_table: torch.Tensor | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None,
                      key_ends: torch.Tensor | None = None) -> None:
    """out[rows of chunk p] = causal attention of chunk p's queries over its sequence's keys, for every p.

    chunks int32 [4, P]: each chunk's first flat row, length, tokens before it in the cache, and block table row.
    q [T, Hq, D], k and v [T, Hkv, D] the step's (rows may be strided, heads contiguous); a chunk's cached keys are
    read from k_cache/v_cache [num_blocks, block_size, Hkv, D] (contiguous) through block_table int32 [B, cols];
    out [T, Hq, D] contiguous, same dtype. sliding_window: a query sees only the last that many keys; softcap:
    scores softcap * tanh(score / softcap) (Gemma 2); sinks (gpt-oss) float32 [Hq]: each head's logit joins its
    softmax's denominator. key_ends (Gemma 3's images) int32 [T]: where each flat row's keys end (exclusive), past its
    own position for a token of an image run (`metadata.image_key_ends`); None: causal. A row's result depends on its
    sequence alone: the same bits in any batch and under any chunking."""
    num_heads, head_dim, num_kv_heads = q.shape[1], q.shape[2], k.shape[1]
    for x in (q, k, v):
        assert x.stride(2) == 1 and x.stride(1) == head_dim and x.dtype == q.dtype
    assert out.is_contiguous() and out.dtype == q.dtype
    assert chunks.dtype == torch.int32 and chunks.is_contiguous() and chunks.shape[0] == 4
    assert key_ends is None or (key_ends.dtype == torch.int32 and key_ends.is_contiguous() and len(key_ends) >= len(q))
    block_size = 1
    if k_cache is not None:
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == q.dtype == v_cache.dtype
        assert block_table.dtype == torch.int32 and block_table.stride(1) == 1
        block_size = k_cache.shape[1]
    else:
        assert not bool(chunks[2].any()), "chunks after cached context need the cache"
    cache_ptr = lambda t: t.data_ptr() if t is not None else None  # noqa: E731
    _call("cbatch_prefill_attention", _DTYPE_CODES[q.dtype], q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
          v.data_ptr(), v.stride(0), cache_ptr(k_cache), cache_ptr(v_cache), cache_ptr(block_table),
          block_table.stride(0) if block_table is not None else 0, block_size, out.data_ptr(), chunks[0].data_ptr(),
          chunks[1].data_ptr(), chunks[2].data_ptr(), chunks[3].data_ptr(), cache_ptr(key_ends), chunks.shape[1],
          num_heads, num_kv_heads, head_dim, scale, sliding_window or 0, softcap or 0.0, _sinks_ptr(sinks, num_heads),
          torch.get_num_threads())


def _rows(x: torch.Tensor) -> int | None:
    """The row stride of x seen as [rows, last dim] with unit inner stride, or None if it is not such a view."""
    layout = _row_groups(x)
    return layout[0] if layout is not None and layout[1] * layout[0] == layout[2] else None


def _row_groups(x: torch.Tensor) -> tuple[int, int, int] | None:
    """x seen as rows of its last dim (unit stride) in groups: (row stride within a group, rows per group, stride
    between groups); None if it is not such a view. A contiguous [R, D] is one run: (D, R, D * R); a per-head view
    [T, H, D] of a packed projection: (D, H, projection width)."""
    if x.dim() < 1 or x.stride(-1) != 1:
        return None
    if x.dim() == 1:
        return x.shape[0], 1, x.shape[0]
    inner = x.stride(-2)
    group_rows = x.shape[-2]
    if x.dim() == 2:
        return inner, group_rows, inner * group_rows
    group_stride = x.stride(-3)
    for dim in range(x.dim() - 3):  # the leading dims must be one uniform run of groups
        if x.stride(dim) != group_stride * math.prod(x.shape[dim + 1 : -2]):
            return None
    return inner, group_rows, group_stride


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(norm(x [+ residual]), x + residual or None) with HF's numerics; None when the layout or dtype is not one
    the kernel takes (the caller then runs the torch ops). x may be a per-head view of a packed projection."""
    x_layout = _row_groups(x)
    r_stride = _rows(residual) if residual is not None else 0
    if (x_layout is None or r_stride is None or not supports(x.dtype) or weight.dtype != x.dtype
            or not weight.is_contiguous() or (residual is not None and residual.dtype != x.dtype)):
        return None
    hidden = x.shape[-1]
    rows = x.numel() // hidden if hidden else 0
    out = torch.empty(x.shape, dtype=x.dtype)
    summed = torch.empty(x.shape, dtype=x.dtype) if residual is not None else None
    _call(
        "cbatch_rms_norm", _DTYPE_CODES[x.dtype], x.data_ptr(), *x_layout,
        residual.data_ptr() if residual is not None else None, r_stride,
        summed.data_ptr() if summed is not None else None, weight.data_ptr(), out.data_ptr(), rows, hidden, eps,
        int(unit_offset), torch.get_num_threads())
    return out, summed


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [T, H, D] rotated (NeoX, rotate_half's sign folded into sin) with the torch path's bits; cos, sin [T, 1, D]
    in x's dtype (each product and the sum rounded to it: the decoder's), or float32 with bfloat16 x (x taken to
    float32 and the result rounded back once: the vision towers'). None when the layout or dtypes are not ones the
    kernel takes."""
    layout = _row_groups(x)
    angles_match = cos.dtype == x.dtype or (cos.dtype == torch.float32 and x.dtype == torch.bfloat16)
    if (layout is None or x.dim() != 3 or not supports(x.dtype) or x.shape[-1] % 2 or not angles_match
            or sin.dtype != cos.dtype or not cos.is_contiguous() or not sin.is_contiguous()
            or cos.shape != (x.shape[0], 1, x.shape[2]) or sin.shape != cos.shape):
        return None
    row_stride, heads, token_stride = layout
    out = torch.empty(x.shape, dtype=x.dtype)
    _call("cbatch_rotary", _DTYPE_CODES[x.dtype], x.data_ptr(), row_stride, token_stride, _DTYPE_CODES[cos.dtype],
          cos.data_ptr(), sin.data_ptr(), out.data_ptr(), x.shape[0], heads, x.shape[2], torch.get_num_threads())
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [..., 2 * width]; None when the layout or dtype is not one the kernel takes."""
    stride = _rows(gate_up)
    if stride is None or not supports(gate_up.dtype):
        return None
    width = gate_up.shape[-1] // 2
    rows = gate_up.numel() // gate_up.shape[-1] if gate_up.shape[-1] else 0
    out = torch.empty((*gate_up.shape[:-1], width), dtype=gate_up.dtype)
    _call("cbatch_silu_and_mul", _DTYPE_CODES[gate_up.dtype], gate_up.data_ptr(), stride, out.data_ptr(), rows, width,
          torch.get_num_threads())
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """k_cache/v_cache slot slot_mapping[i] = row i of k and v [T, Hkv, D] (rows may be strided, heads contiguous),
    k_cache/v_cache [num_blocks, block_size, Hkv, D] contiguous, slot_mapping int64 [T] (a negative slot: a row not
    stored). What `index_copy_` does, in one pass over both and on every thread (index_copy_ took ~120 us a
    layer on one). False, nothing written, where a layout or dtype is not one the kernel takes."""
    if not (supports(k.dtype) and k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and k.dim() == 3
            and k.shape == v.shape and k_cache.shape == v_cache.shape and k_cache.shape[2:] == k.shape[1:]
            and k_cache.is_contiguous() and v_cache.is_contiguous() and slot_mapping.dtype == torch.int64
            and slot_mapping.is_contiguous() and len(slot_mapping) == len(k)):
        return False
    width = k.shape[1] * k.shape[2]
    if any(x.stride(2) != 1 or x.stride(1) != x.shape[2] for x in (k, v)):
        return False
    _call("cbatch_store_kv", k.element_size(), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
          k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(), len(k), width, torch.get_num_threads())
    return True
