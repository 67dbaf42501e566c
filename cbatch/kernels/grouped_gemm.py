"""One grouped GEMM kernel for the mixture-of-experts MLP and for FP8 weights.

    fused_moe(x, w13, w2, topk_weights, topk_ids)   every token through its top-k experts
    fp8_linear(x, w, scale)                        x @ dequantize(w).T for an FP8 weight

Layout:
    x            [T, H]                 activations
    w13          [E, 2I, H]             every expert's gate | up rows; w2 [E, H, I] its down projection
    topk_ids     [T, k] int             each token's experts; topk_weights [T, k] their routing weights
    FP8 scales   float32 [E, N] per output channel, or [E, ceil(N / bn), ceil(K / bk)] per (bn, bk) block

fused_moe, after vLLM's fused-MoE design (an independent implementation):
  * The T * k (token, expert) assignments are sorted by expert and each expert's run is padded to a
    multiple of BLOCK_M (`sort_by_expert`, device ops only: no host sync, CUDA-graph safe). A block of
    BLOCK_M sorted rows therefore belongs to one expert; padding rows hold the id T * k and are masked.
  * Projection 1: one launch over the sorted blocks, row r = assignment a reads x[a // k] and writes
    inter[a] = x[a // k] @ w13[e].T. The gated activation runs on inter ([T * k, 2I] -> [T * k, I]).
  * Projection 2: one launch, down[a] = (act[a] @ w2[e].T) x routing weight of a.
  * out[t] = sum over t's k rows of down, each token's experts in ascending order (HF's loop order).
  Experts without tokens get no block: only experts with tokens are computed. The grid is sized for the
  worst padding; blocks past the used rows (a device scalar) return at once.
fp8_linear is the same kernel without the sort: one "expert", rows in order.

FP8: B tiles are loaded as float8_e4m3fn, multiplied by their scales in fp32 and rounded to the
activations' dtype before the dot, i.e. the tensor cores see exactly `quant.dequantize`'s weights.
Packed int experts (AWQ / GPTQ / compressed-tensors, `int4.IntExperts`): B tiles are unpacked from int32 words
and dequantized per group the same way (as kernels/w4a16.py does for a dense layer).
MXFP4 experts (gpt-oss, model/mxfp4.py): B is uint8 [E, N, K / 2], two e2m1 values a byte (element 2j in the low
nibble), with uint8 e8m0 scales [E, N, K / 32]; each value is decoded in registers (sign, 2-bit exponent, 1-bit
mantissa) and multiplied by 2 ** (scale - 127) built from its float32 bits: exactly `dequantize_mxfp4`'s weights,
rounded to the activations' dtype (exact in bf16 and fp32) before the dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._utils import check_launchable, interpreting, next_pow2, on_device
from .activation import gelu_tanh_and_mul, silu_and_mul

_SCALE_NONE, _SCALE_CHANNEL, _SCALE_BLOCK, _SCALE_INT, _SCALE_MXFP4 = 0, 1, 2, 3, 4
MXFP4_BLOCK = 32  # elements per e8m0 scale (model/mxfp4.py)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows of A, K]
    b_ptr,  # [E, N, K] (E = 1 unless SORTED); SCALE == 3: int32 [E, N, K / (32 / BITS)], packed along K;
    #         SCALE == 4: uint8 [E, N, K / 2], two e2m1 values a byte
    c_ptr,  # [rows of C, N]
    scale_ptr,  # SCALE: fp32 [E, N] or [E, ceil(N / SBN), ceil(K / SBK)]; SCALE == 3: fp32 [E, N, groups];
    #             SCALE == 4: uint8 e8m0 [E, N, K / 32]
    zero_ptr,  # SCALE == 3: uint8 [E, N, groups], laid out as the scales
    bias_ptr,  # HAS_BIAS: [E, N] (per expert, stride_bias_e; [N] with stride 0 unless SORTED)
    sorted_ids_ptr,  # SORTED: int32 [padded rows]: an assignment id, or M for padding
    block_expert_ptr,  # SORTED: int32 [row blocks]: the expert of each block of BLOCK_M sorted rows
    used_rows_ptr,  # SORTED: int32 [1]: sorted rows in use; blocks at or past it return
    route_weight_ptr,  # MUL_ROUTE: [M] routing weight of each assignment
    M,  # SORTED: assignments (ids >= M are padding); otherwise rows of A and C
    N,
    K,
    stride_am, stride_be, stride_bn, stride_cm, stride_se, stride_sn, stride_sk, stride_bias_e,
    A_ROW_DIV: tl.constexpr,  # SORTED: A's row = assignment // A_ROW_DIV (top_k for x, 1 for the activations)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SORTED: tl.constexpr,
    MUL_ROUTE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SCALE: tl.constexpr,  # 0: plain weights; 1: FP8 per channel; 2: FP8 per block; 3: packed ints per group; 4: MXFP4
    SBN: tl.constexpr,  # block scale rows (SCALE == 2)
    SBK: tl.constexpr,  # block scale columns (SCALE == 2)
    GROUP: tl.constexpr,  # SCALE == 3: input rows per group; BLOCK_K divides it (or one group spans K)
    BITS: tl.constexpr,  # SCALE == 3: 4 or 8
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,  # interpreter only: bf16 dots in fp32 (numpy has no bf16 matmul)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    if SORTED:
        if pid_m * BLOCK_M >= tl.load(used_rows_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + offs_m).to(tl.int64)  # [BLOCK_M]
        row_ok = ids < M
        a_rows = ids // A_ROW_DIV
        c_rows = ids
    else:
        expert = 0
        c_rows = (pid_m * BLOCK_M + offs_m).to(tl.int64)
        row_ok = c_rows < M
        a_rows = c_rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    n_ok = offs_n < N
    b_base = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if SCALE == 3:  # unpack and dequantize in registers (as kernels/w4a16.py)
            words = tl.load(b_base + (offs_k // (32 // BITS))[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
            q = (words >> ((offs_k % (32 // BITS)) * BITS)[:, None]) & ((1 << BITS) - 1)  # [BLOCK_K, BLOCK_N]
            sz = expert * stride_se + offs_n * stride_sn + (k0 // GROUP) * stride_sk
            s = tl.load(scale_ptr + sz, mask=n_ok, other=0.0)[None, :]
            z = tl.load(zero_ptr + sz, mask=n_ok, other=0)[None, :]
            b = ((q.to(tl.float32) - z.to(tl.float32)) * s).to(a.dtype)
        elif SCALE == 4:  # MXFP4: e2m1 nibbles x 2 ** (e8m0 - 127), decoded in registers
            kn_ok = k_ok[:, None] & n_ok[None, :]
            byte = tl.load(b_base + (offs_k // 2)[:, None], mask=kn_ok, other=0).to(tl.int32)  # [BLOCK_K, BLOCK_N]
            nibble = (byte >> ((offs_k % 2) * 4)[:, None]) & 0xF
            exponent = (nibble >> 1) & 3
            mantissa = (nibble & 1).to(tl.float32)
            # e2m1: 0 or 0.5 (exponent 0), else (1 + mantissa / 2) x 2 ** (exponent - 1); bit 3 the sign
            magnitude = tl.where(exponent == 0, mantissa * 0.5,
                                 (1.0 + mantissa * 0.5) * (1 << tl.maximum(exponent - 1, 0)).to(tl.float32))
            value = tl.where((nibble & 8) != 0, -magnitude, magnitude)
            e8m0 = tl.load(scale_ptr + expert * stride_se + offs_n[None, :] * stride_sn
                           + (offs_k // 32)[:, None] * stride_sk, mask=kn_ok, other=127).to(tl.int32)
            # 2 ** (e8m0 - 127) from its float32 bits (e8m0 0 is 2 ** -127, a subnormal: 0x00400000)
            power = tl.where(e8m0 == 0, 0x00400000, e8m0 << 23).to(tl.float32, bitcast=True)
            b = (value * power).to(a.dtype)
        else:
            b = tl.load(b_base + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if SCALE == 1:
            s = tl.load(scale_ptr + expert * stride_se + offs_n * stride_sn, mask=n_ok, other=0.0)
            b = (b.to(tl.float32) * s[None, :]).to(a.dtype)
        elif SCALE == 2:
            s = tl.load(scale_ptr + expert * stride_se + (offs_n // SBN)[None, :] * stride_sn
                        + (offs_k // SBK)[:, None] * stride_sk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            b = (b.to(tl.float32) * s).to(a.dtype)
        if DOT_UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=DOT_PRECISION)
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    out_dtype = c_ptr.dtype.element_ty
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + expert * stride_bias_e + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if MUL_ROUTE:
        # as HF: the expert's output is rounded to the activations' dtype, then scaled by its routing weight
        w = tl.load(route_weight_ptr + c_rows, mask=row_ok, other=0.0).to(tl.float32)
        acc = acc.to(out_dtype).to(tl.float32) * w[:, None]
    tl.store(c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :], acc.to(out_dtype),
             mask=row_ok[:, None] & n_ok[None, :])


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int, spill: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids int32 [padded rows], block_expert int32 [row blocks], used_rows int32 [1]).

    sorted_ids lists the assignments (token * k + j) expert by expert, each expert's run padded with the
    id T * k to a multiple of block_m; block_expert names the expert of each block of block_m rows. `spill`
    (expert parallelism): ids equal to num_experts (another rank's experts) sort last, past used_rows."""
    flat = topk_ids.reshape(-1).long()  # [A]
    assignments, device = flat.numel(), flat.device
    buckets = num_experts + int(spill)
    # [E]; not torch.bincount, which reads its input's max back to the host (no CUDA-graph capture)
    counts = torch.zeros(buckets, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, in order within each
    by_expert = flat[order]
    rank = torch.arange(assignments, device=device) - (torch.cumsum(counts, 0) - counts)[by_expert]
    max_rows = min(assignments * block_m, assignments + buckets * (block_m - 1))
    max_rows = -(-max_rows // block_m) * block_m  # whole blocks: every program reads BLOCK_M ids
    sorted_ids = torch.full((max_rows,), assignments, dtype=torch.int32, device=device)
    sorted_ids[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, block_expert, ends[num_experts - 1 : num_experts].to(torch.int32)


def _tiles(rows: int, n: int, k: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): 16-row blocks for decode-sized batches, 64 otherwise; fp32 (tests)
    keeps tiles small. Untuned: the GPU session measures."""
    block_m = 16 if rows <= 64 else 64
    block_n = min(64 if dtype == torch.float32 else 128, max(16, next_pow2(n)))
    block_k = min(32 if dtype == torch.float32 else 64, max(16, next_pow2(k)))
    return block_m, block_n, block_k


def _launch(a, b, c, rows, *, scale=None, block=None, bias=None, sorted_rows=None, a_row_div=1,
            route_weights=None, block_m=None, zero=None, group=0, bits=4, mxfp4=False) -> None:
    """c[rows, N] = a @ b[e].T per row block (`sorted_rows`: the output of `sort_by_expert`); `zero`: b holds
    packed `bits`-bit ints with per-`group` scales and zeros [E, N, groups]; `mxfp4`: b holds uint8 e2m1 pairs
    [E, N, K / 2] with uint8 e8m0 scales [E, N, K / 32]."""
    num_experts, n, k = b.shape[0], b.shape[1], a.shape[1]
    bm, bn, bk = _tiles(rows, n, k, a.dtype)
    bm = block_m or bm
    if zero is not None and group < k:
        bk = min(bk, group)  # powers of two >= 16: a K step stays inside one group
    sorted_ids, block_expert, used_rows = sorted_rows if sorted_rows is not None else (c, c, c)
    grid_m = block_expert.shape[0] if sorted_rows is not None else triton.cdiv(rows, bm)
    scale_kind = _SCALE_NONE if scale is None else (_SCALE_CHANNEL if block is None else _SCALE_BLOCK)
    scale_kind = _SCALE_INT if zero is not None else scale_kind
    scale_kind = _SCALE_MXFP4 if mxfp4 else scale_kind
    s_strides = (0, 0, 0) if scale is None else (scale.stride(0), scale.stride(1), scale.stride(2) if scale.dim() == 3 else 0)
    with on_device(a.device):
        _grouped_gemm_kernel[(grid_m, triton.cdiv(n, bn))](
            a, b, c, scale if scale is not None else c, zero if zero is not None else c, bias if bias is not None else c,
            sorted_ids, block_expert, used_rows, route_weights if route_weights is not None else c,
            rows, n, k,
            a.stride(0), b.stride(0), b.stride(1), c.stride(0), *s_strides,
            bias.stride(0) if bias is not None and bias.dim() == 2 else 0,
            A_ROW_DIV=a_row_div,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            SORTED=sorted_rows is not None,
            MUL_ROUTE=route_weights is not None,
            HAS_BIAS=bias is not None,
            SCALE=scale_kind,
            SBN=block[0] if block else 1,
            SBK=block[1] if block else 1,
            GROUP=group or 1,
            BITS=bits,
            DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
            DOT_UPCAST=interpreting() and a.dtype == torch.bfloat16,
            num_warps=4,
        )


def _check(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, block) -> None:
    if x.dim() != 2 or x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"x must be [rows, K] and x, w contiguous in their last dimension; got x {tuple(x.shape)}")
    if w.shape[-1] != x.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(w.shape)}")
    if (scale is not None) != (w.dtype == torch.float8_e4m3fn):
        raise ValueError(f"weights of {w.dtype} {'need' if scale is None else 'take no'} scales")
    if scale is not None and scale.dim() != w.dim() - (1 if block is None else 0):
        raise ValueError(f"scale {tuple(scale.shape)} does not fit weight {tuple(w.shape)} with block {block}")


def _int_args(k: int, w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, int_experts) -> dict:
    """`_launch`'s arguments for packed int experts of K inputs, after checking their shapes."""
    bits = int_experts.bits
    if w.dtype != torch.int32 or w.shape[2] * (32 // bits) != k or scale.shape != zero.shape or \
            scale.shape[:2] != w.shape[:2] or not (scale.is_contiguous() and zero.is_contiguous()):
        raise ValueError(f"packed {bits}-bit experts {tuple(w.shape)} {w.dtype} with scale {tuple(scale.shape)} and "
                         f"zero {tuple(zero.shape)} do not fit {k} inputs")
    group = k if int_experts.group_size == -1 else int_experts.group_size
    return {"zero": zero, "group": group, "bits": bits}


def _mxfp4_args(k: int, w: torch.Tensor, scale: torch.Tensor) -> dict:
    """`_launch`'s arguments for MXFP4 experts of K inputs (w uint8 [E, N, K / 32, 16], scale uint8 [E, N, K / 32],
    as the checkpoint stores them), after checking their shapes."""
    if (w.dtype != torch.uint8 or scale is None or scale.dtype != torch.uint8 or w.dim() != 4 or w.shape[3] != 16
            or tuple(scale.shape) != tuple(w.shape[:3]) or w.shape[2] * MXFP4_BLOCK != k
            or not (w.is_contiguous() and scale.is_contiguous())):
        raise ValueError(f"MXFP4 experts {tuple(w.shape)} {w.dtype} with scales "
                         f"{None if scale is None else tuple(scale.shape)} do not fit {k} inputs")
    return {"mxfp4": True}


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ dequantize(weight [N, K], scale).T (+ bias) -> [T, N] in x's dtype."""
    _check(x, weight, scale, block)
    check_launchable(x, weight, scale)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _launch(x, weight.unsqueeze(0), out, x.shape[0], scale=scale.unsqueeze(0), block=block, bias=bias)
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, activation: str = "silu", w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
              int_experts=None, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] through each token's top-k experts (w13 [E, 2I, H], w2 [E, H, I]) -> [T, H] in x's dtype.
    `activation`: silu | gelu_tanh (kernels), or a callable on [T * k, 2I] (gpt-oss's `ClampedSwiGLU`, torch ops);
    w13_bias [E, 2I] / w2_bias [E, H]: each expert's biases, added in the GEMMs' epilogues (gpt-oss). uint8 w13 / w2
    are MXFP4 experts: [E, N, K / 32, 16] e2m1 pairs with their uint8 e8m0 scales [E, N, K / 32] (w13_scale /
    w2_scale), as gpt-oss checkpoints store them.
    `int_experts` (int4.IntExperts): w13 / w2 are packed ints [E, N, K * bits / 32] with float32 scales
    (w13_scale / w2_scale) and its uint8 zeros, [E, N, groups] each."""
    if topk_ids.shape[0] == 0:
        return torch.zeros_like(x)
    return fused_moe_slots(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block, int_experts,
                           None, w13_bias, w2_bias).sum(dim=1)


def fused_moe_slots(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, activation: str = "silu", w13_scale: torch.Tensor | None = None,
                    w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                    int_experts=None, first_expert: int | None = 0, w13_bias: torch.Tensor | None = None,
                    w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe` before its sum: each token's k weighted expert outputs [T, k, H], in ascending expert order.
    w13 / w2 hold experts [first_expert, first_expert + E) (expert parallelism: the slots of other experts are
    zeros, never computed); None: every expert."""
    if w13.dtype == torch.uint8:  # MXFP4: the launches read the pairs as [E, N, K / 2]
        int_args13 = _mxfp4_args(x.shape[1], w13, w13_scale)
        int_args2 = _mxfp4_args(w2.shape[2] * MXFP4_BLOCK, w2, w2_scale)
        w13, w2 = w13.flatten(2), w2.flatten(2)
    elif int_experts is None:
        _check(x, w13, w13_scale, block)
        _check(x.new_empty(0, w2.shape[2]), w2, w2_scale, block)
        int_args13 = int_args2 = {}
    else:
        int_args13 = _int_args(x.shape[1], w13, w13_scale, int_experts.w13_zero, int_experts)
        int_args2 = _int_args(w2.shape[2] * (32 // int_experts.bits), w2, w2_scale, int_experts.w2_zero, int_experts)
    check_launchable(x, w13, w2, topk_weights, topk_ids)
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return x.new_zeros(0, top_k, w2.shape[1])
    ids, perm = topk_ids.sort(dim=1)  # each token's experts in ascending order: HF's summation order
    weights = topk_weights.gather(1, perm).reshape(-1).contiguous()  # [T * k]
    local = w13.shape[0]
    if first_expert is not None:  # another rank's experts: bucket `local`, past the rows the kernels run
        ids = ids - first_expert
        ids = torch.where((ids >= 0) & (ids < local), ids, local)
    assignments = num_tokens * top_k
    block_m = 16 if assignments <= 64 * local else 64  # rows per expert on average: few in decode steps
    sorted_rows = sort_by_expert(ids, local, block_m, spill=first_expert is not None)
    make = torch.empty if first_expert is None else torch.zeros  # (the slots no kernel writes stay zero)
    inter = make((assignments, w13.shape[1]), dtype=x.dtype, device=x.device)  # [T * k, 2I]
    _launch(x, w13, inter, assignments, scale=w13_scale, block=block, sorted_rows=sorted_rows,
            a_row_div=top_k, block_m=block_m, bias=w13_bias, **int_args13)
    if callable(activation):
        act = activation(inter).contiguous()  # [T * k, I]
    else:
        act = gelu_tanh_and_mul(inter) if activation == "gelu_tanh" else silu_and_mul(inter)  # [T * k, I]
    down = make((assignments, w2.shape[1]), dtype=x.dtype, device=x.device)  # [T * k, H]
    _launch(act, w2, down, assignments, scale=w2_scale, block=block, sorted_rows=sorted_rows,
            route_weights=weights, block_m=block_m, bias=w2_bias, **int_args2)
    return down.view(num_tokens, top_k, -1)
