"""A GEMM for decode-sized batches: x [M, K] @ W.T (+ bias) with W [N, K] as nn.Linear stores it (bf16 / fp16;
float32 for tests), fp32 accumulation, the output in x's dtype. M is a decode step's rows (<= 256).

    decode_linear(x, weight, bias, config)   one launch (two with split-K)
    DecodeGemm                                a layer's choice per batch size: a Triton config or cuBLAS

Why: a decode step of Qwen3-0.6B at ~190 rows spent 0.86 ms in 113 cuBLAS GEMMs on an H200 against a 0.28 ms
floor for their weight bytes (benchmarks/NOTES.md): each GEMM is a few microseconds and 4-13 MB, too small for
cuBLAS's large tiles to fill 132 SMs. Here a program computes a [BLOCK_M, BLOCK_N] tile over its share of K;
with few rows one M tile covers the batch, so the weights stream once, and split-K cuts K into SPLIT_K
segments to give narrow layers (N = 1024) enough programs. Split-K is atomic-free: each segment writes its
fp32 partial tile to a workspace [segments, M, N], then a second launch sums the segments in order (plus the
bias) and rounds once: the same bits on every run.

Which config (or cuBLAS) runs for a layer shape and batch size is measured on the device at start-up
(`kernels/tuning.tune_decode_gemms`). A row's result never depends on M within one config (its dot products
run over K in the same steps whatever the other rows). No host syncs, fixed-size allocations, M not
specialised on (one compiled variant per config for every batch size): the launch is CUDA-graph safe.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ._utils import check_launchable, interpreting, on_device

ROW_BUCKETS = (16, 32, 64, 128, 256)  # batch sizes are tuned at these; a batch takes the smallest bucket >= it
MAX_ROWS = ROW_BUCKETS[-1]  # the largest batch a Triton GEMM is tuned for (and used at); above it, cuBLAS
_REDUCE_BLOCK = 256


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    bias_ptr,  # HAS_BIAS: [N]
    out_ptr,  # not SPLIT: [M, N] in x's dtype; SPLIT: float32 partials [segments, M, N]
    M, N, K,
    k_per_split,  # K elements per segment, a multiple of BLOCK_K (K itself without split-K)
    stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,  # K cut into segments (program_id(2)): partials for _split_k_reduce_kernel
    HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # interpreter only: bf16 dots in fp32 (numpy has no bf16 matmul)
):
    # axis 0 runs fastest: programs launched together share their N tile (one weight tile, M tiles from L2)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_lo = pid_k * k_per_split
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        offs_k = k_lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_N]: W's rows read along K, as stored
        if DOT_UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    mask = m_ok[:, None] & n_ok[None, :]
    if not SPLIT:
        if HAS_BIAS:
            acc = acc + tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = out_ptr + pid_k.to(tl.int64) * M * N
        tl.store(part + offs_m[:, None] * N + offs_n[None, :], acc, mask=mask)


@triton.jit(do_not_specialize=["M", "num_splits"])
def _split_k_reduce_kernel(
    part_ptr,  # float32 [num_splits, M, N]
    bias_ptr,  # HAS_BIAS: [N]
    out_ptr,  # [M, N]
    M, N, stride_om, num_splits,
    BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """One row's BLOCK columns: the segments summed in order 0..num_splits-1 (deterministic), the bias, one rounding."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.load(part_ptr + row * N + offs, mask=ok, other=0.0)
    for s in range(1, num_splits):
        acc += tl.load(part_ptr + (s * M + row) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@dataclass(frozen=True)
class GemmConfig:
    """One tile configuration of the decode GEMM (a tuning candidate)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1

    def __str__(self) -> str:
        split = f" split-K {self.split_k}" if self.split_k > 1 else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}{split}"

    def fits(self, bucket: int) -> bool:
        """Worth timing at batches up to `bucket` rows: its M tile is no taller than the batch, and at most 4 M
        tiles re-read each weight tile (from L2)."""
        return self.block_m <= bucket <= 4 * self.block_m


# The candidates start-up tuning times against cuBLAS (each checked against torch's matmul in the tests):
# 16-row tiles with long K steps for a few rows (the weight stream is everything), split-K where N alone
# gives too few programs (N = 1024: 16-32 tiles for 132 SMs), taller tiles for 128-256 rows.
GEMM_CANDIDATES = (
    GemmConfig(16, 64, 128, 4, 4),
    GemmConfig(16, 32, 128, 4, 4, split_k=4),
    GemmConfig(32, 64, 128, 4, 4),
    GemmConfig(32, 32, 128, 4, 4, split_k=2),
    GemmConfig(64, 64, 64, 4, 4),
    GemmConfig(64, 128, 64, 8, 3),
    GemmConfig(64, 64, 128, 4, 3, split_k=2),
)


def gemm_candidates(bucket: int) -> list[GemmConfig]:
    """The candidates worth timing for batches of up to `bucket` rows (`GemmConfig.fits`)."""
    return [c for c in GEMM_CANDIDATES if c.fits(bucket)]


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemmConfig) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype, with `config`'s tiles."""
    if x.dim() != 2 or x.stride(-1) != 1 or weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"x must be [rows, K] and x, weight contiguous in their last dimension; got x "
                         f"{tuple(x.shape)}, weight {tuple(weight.shape)}")
    if weight.shape[1] != x.shape[1] or weight.dtype != x.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1):
        raise ValueError(f"bias {tuple(bias.shape)} must be [{weight.shape[0]}], contiguous")
    check_launchable(x, weight, *(() if bias is None else (bias,)))
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    bm, bn, bk, split = config.block_m, config.block_n, config.block_k, config.split_k
    k_steps = triton.cdiv(k, bk)
    split = max(1, min(split, k_steps))  # every segment has at least one K step
    k_per_split = triton.cdiv(k_steps, split) * bk
    split = triton.cdiv(k, k_per_split)  # (a short K may need fewer segments of that length)
    target = out if split == 1 else torch.empty((split, rows, n), dtype=torch.float32, device=x.device)
    bias_arg = bias if bias is not None else out
    with on_device(x.device):
        _gemm_kernel[(triton.cdiv(rows, bm), triton.cdiv(n, bn), split)](
            x, weight, bias_arg, target, rows, n, k, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=split > 1, HAS_BIAS=bias is not None,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            DOT_UPCAST=interpreting() and x.dtype == torch.bfloat16,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        if split > 1:
            _split_k_reduce_kernel[(rows, triton.cdiv(n, _REDUCE_BLOCK))](
                target, bias_arg, out, rows, n, out.stride(0), split,
                BLOCK=_REDUCE_BLOCK, HAS_BIAS=bias is not None, num_warps=4,
            )
    return out


# set while the eager passes before a CUDA graph capture run (`graph_warmup`): they take the graph's kernels
_WARMING_UP_A_GRAPH: contextvars.ContextVar[bool] = contextvars.ContextVar("cbatch_graph_warmup", default=False)


@contextlib.contextmanager
def graph_warmup():
    """The eager passes just before a CUDA graph capture launch the kernels the capture will record (a graphs-only
    Triton GEMM too), so Triton loads their modules there: loading a module during a capture is an error
    ("operation not permitted when stream is capturing"), and when the tuning came from the cache nothing else
    has launched them in this process."""
    token = _WARMING_UP_A_GRAPH.set(True)
    try:
        yield
    finally:
        _WARMING_UP_A_GRAPH.reset(token)


def in_graph(x: torch.Tensor) -> bool:
    """Whether the work on `x` is being captured into a CUDA graph, or is the eager warm-up just before a capture
    (which must take the same paths, so that the capture finds every module loaded and connection made)."""
    return _WARMING_UP_A_GRAPH.get() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


class DecodeGemm:
    """One layer shape's choice per batch bucket: a `GemmConfig` where the Triton kernel timed faster than cuBLAS
    at start-up, None (cuBLAS) elsewhere. `layers.Linear` calls it in place of F.linear.

    `graphs_only` (the engine's): the Triton kernel runs only inside a CUDA graph capture, which is where it was
    timed (a decode step's replay); an eager launch pays Triton's host-side launch (tens of microseconds, more
    than these few-microsecond GEMMs take), so eager steps keep cuBLAS. Tests set it False to run the kernel
    under the interpreter."""

    def __init__(self, choices: dict[int, GemmConfig | None], graphs_only: bool = True) -> None:
        self.table = tuple(sorted(choices.items()))  # (bucket, config or None), smallest bucket first
        self.graphs_only = graphs_only

    def config_for(self, rows: int) -> GemmConfig | None:
        """The choice of the smallest tuned bucket that holds `rows` (None: cuBLAS, or more rows than any bucket)."""
        return next((c for b, c in self.table if rows <= b), None)

    @property
    def uses_triton(self) -> bool:
        return any(c is not None for _, c in self.table)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        config = self.config_for(x.shape[0]) if x.dim() == 2 else None
        if config is not None and self.graphs_only:
            config = config if in_graph(x) else None
        if config is None or x.stride(-1) != 1:
            return F.linear(x, weight, bias)
        return decode_linear(x, weight, bias, config)


__all__ = ["DecodeGemm", "GEMM_CANDIDATES", "GemmConfig", "MAX_ROWS", "ROW_BUCKETS", "decode_linear",
           "gemm_candidates", "graph_warmup", "in_graph"]
