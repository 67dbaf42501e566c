"""The Qwen2-VL / Qwen2.5-VL vision tower and patch merger on our layers: every image of a step in one call.

Input: the image processor's flattened patches of all images, concatenated ([N, C * T * P * P], each image's in
its processor order: blocks of merge x merge patches, row-major), and each image's patch grid (t, h, w). Output:
the language-model embeddings of the merged patches ([N / merge^2, out_hidden]), images in order.

Attention is bidirectional within an image (Qwen2-VL: each frame of each image; Qwen2.5-VL: within windows of
window_size pixels, except the `full_attention_blocks`), never across images: a varlen attention over the packed
patches with block-diagonal segments (`Segments`: flash attention's varlen kernel on CUDA in 16 bits, the compiled
prefill kernel on the CPU, else one batched SDPA per distinct segment length, so the images of a step run together
whatever their number). The GEMMs
run in the model's dtype (bfloat16 on the GPU; float32 on CPU). The numerics are transformers' (float32 rotary,
LayerNorm eps 1e-6, exact GELU in the merger).
"""
from __future__ import annotations

import functools
import warnings
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cbatch.model.backend import Backend, cpu_kernels
from cbatch.model.layers import Linear, RMSNorm
from cbatch.model.vision_spec import VisionSpec

_EPS = 1e-6


class Segments:
    """Block-diagonal attention's segments [cu[i], cu[i+1]) of the packed patches (each image, frame or window),
    prepared once per tower call for every layer: on CUDA in 16 bits, flash attention's varlen kernel over the
    whole pack (one launch, no gather; `torch.nn.attention.varlen`); on the CPU the compiled prefill kernel the
    decoder uses, each segment a chunk whose every row sees the whole segment (`key_ends`: no gather either);
    elsewhere the segments of one length gathered into one batched SDPA ([S, H, L, D]), a call per distinct
    length, each length's gather index made once, not per layer. Each path gives a segment the same bits whatever
    else the step encodes."""

    def __init__(self, cu_seqlens: np.ndarray, device: torch.device, dtype: torch.dtype) -> None:
        self.cu_seqlens, self.device = cu_seqlens, device
        self.flash = _flash_varlen() if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) else None
        if self.flash is not None:
            self.cu = torch.as_tensor(cu_seqlens, dtype=torch.int32).to(device)
            self.max_len = int(np.diff(cu_seqlens).max())
        self.chunks: tuple[torch.Tensor, torch.Tensor] | None = None  # (chunks [4, S], key_ends [N]) for the kernel
        if device.type == "cpu" and cpu_kernels.supports(dtype) and cpu_kernels.available() is None:
            starts, lengths = cu_seqlens[:-1], np.diff(cu_seqlens)
            zeros = np.zeros_like(starts)
            self.chunks = (torch.as_tensor(np.stack([starts, lengths, zeros, zeros]), dtype=torch.int32),
                           torch.as_tensor(np.repeat(lengths, lengths), dtype=torch.int32))  # a row's keys: its segment
        self._groups: list[torch.Tensor] | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Bidirectional attention within each segment of packed q, k, v [N, H, D] -> [N, H, D]."""
        if self.flash is not None and scale == q.shape[-1] ** -0.5:  # (the kernel's default scale)
            try:
                q, k, v = (x.contiguous() for x in (q, k, v))  # (v is a strided slice of the packed qkv)
                return self.flash(q, k, v, self.cu, self.cu, self.max_len, self.max_len)
            except (RuntimeError, TypeError) as exc:  # a torch whose kernel refuses this shape or these arguments
                warnings.warn(f"cbatch: the vision tower's flash varlen attention failed ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''}); it runs on SDPA per segment length")
                global _FLASH_FAILED
                _FLASH_FAILED = True
                self.flash = None
        if self.chunks is not None:
            out = torch.empty(q.shape, dtype=q.dtype)
            cpu_kernels.prefill_attention(q, k, v, out, self.chunks[0], scale, key_ends=self.chunks[1])
            return out
        # (one segment too goes through its gather: plain SDPA on the strided [H, L, D] view rounds differently, and
        # an image must get the same bits alone in a step as beside others)
        out = torch.empty_like(q)
        for index in self.groups():
            qs, ks, vs = (x[index].transpose(1, 2) for x in (q, k, v))  # [S, H, L, D]
            out[index] = F.scaled_dot_product_attention(qs, ks, vs, scale=scale).transpose(1, 2)
        return out

    def groups(self) -> list[torch.Tensor]:
        """Per distinct segment length: int64 [S, L], the rows of its segments (made at the first layer)."""
        if self._groups is None:
            lengths, starts = np.diff(self.cu_seqlens), self.cu_seqlens[:-1]
            self._groups = [torch.as_tensor(starts[lengths == n][:, None] + np.arange(n)).to(self.device)
                            for n in np.unique(lengths).tolist()]
        return self._groups


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments | np.ndarray,
                     scale: float) -> torch.Tensor:
    """Bidirectional attention within each segment of packed q, k, v [N, H, D] -> [N, H, D]; `segments`: prepared
    (`Segments`), or cu_seqlens [S + 1] (prepared here)."""
    if isinstance(segments, np.ndarray):
        segments = Segments(segments, q.device, q.dtype)
    return segments.attend(q, k, v, scale)


_FLASH_FAILED = False  # the kernel failed once in this process: SDPA per segment length from then on


def _flash_varlen() -> Callable | None:
    """torch's flash-attention varlen kernel (CUDA, 16-bit), or None where this torch has none (or it failed)."""
    if _FLASH_FAILED:
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] * cos + rotate_half(x) * sin in float32, back in x's dtype: transformers' bits. cos, sin
    float32 [N, 1, D] from `rotary_cos_sin` (rotate_half's sign folded into sin: (-x2) * s == x2 * (-s) exactly).
    The CPU runs the compiled kernel the decoder uses (one pass, no copies; float32 math for bfloat16 x too);
    elsewhere three torch ops."""
    if x.device.type == "cpu" and cpu_kernels.supports(x.dtype) and cpu_kernels.available() is None:
        out = cpu_kernels.rotary(x, cos, sin)
        if out is not None:
            return out
    xf = x.float()
    swapped = xf.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2 | x1)
    return (xf * cos).add_(swapped.mul_(sin)).to(x.dtype)


def _norm(vs: VisionSpec, size: int, backend: Backend) -> nn.Module:
    return RMSNorm(size, _EPS, backend) if vs.rms_norm else nn.LayerNorm(size, eps=_EPS)


class _PatchWeight(nn.Module):
    """The patch embedding: transformers' Conv3d with kernel = stride = the patch is a linear map of each
    flattened patch; its weight is kept in the checkpoint's shape [E, C, T, P, P] (a bias: Qwen3-VL's)."""

    def __init__(self, vs: VisionSpec, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vs.hidden_size, vs.in_channels, vs.temporal_patch_size,
                                               vs.patch_size, vs.patch_size))
        self.bias = nn.Parameter(torch.empty(vs.hidden_size)) if bias else None

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return F.linear(patches.to(self.weight.dtype), self.weight.reshape(self.weight.shape[0], -1), self.bias)


class PatchEmbed(nn.Module):
    def __init__(self, vs: VisionSpec, bias: bool = False) -> None:
        super().__init__()
        self.proj = _PatchWeight(vs, bias)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches)


class VisionAttention(nn.Module):
    def __init__(self, vs: VisionSpec) -> None:
        super().__init__()
        self.num_heads, self.head_dim = vs.num_heads, vs.head_dim
        self.qkv = Linear(vs.hidden_size, 3 * vs.hidden_size, bias=True)
        self.proj = Linear(vs.hidden_size, vs.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: Segments | np.ndarray) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)  # [N, H, D] each
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        out = varlen_attention(q, k, v, segments, self.head_dim**-0.5)
        return self.proj(out.reshape(n, -1))


class VisionMLP(nn.Module):
    """Qwen2-VL: fc2(act(fc1(x))); Qwen2.5-VL (gated): down(act(gate(x)) * up(x)), gate and up packed into one
    matmul (`gate_up_proj` [2 * I, E]: the checkpoint's gate_proj rows, then up_proj's; weights.place) and, with
    SiLU, the activation and product one backend op (`silu_and_mul`); biases on every matmul."""

    def __init__(self, vs: VisionSpec, backend: Backend) -> None:
        super().__init__()
        self.gated = vs.gated_mlp
        self.activation = vs.activation
        self.backend = backend
        if self.gated:
            self.gate_up_proj = Linear(vs.hidden_size, 2 * vs.intermediate_size, bias=True)
            self.down_proj = Linear(vs.intermediate_size, vs.hidden_size, bias=True)
        else:
            self.fc1 = Linear(vs.hidden_size, vs.intermediate_size, bias=True)
            self.fc2 = Linear(vs.intermediate_size, vs.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gated:
            return self.fc2(activation(self.activation, self.fc1(x)))
        gate_up = self.gate_up_proj(x)  # [N, 2 * I]: gate | up
        if self.activation == "silu":
            return self.down_proj(self.backend.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(activation(self.activation, gate) * up)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """The vision MLP's activation `name` (VisionSpec.activation) of x."""
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): the residual add before a pre-norm, in one pass where `norm` is an
    RMSNorm (the backend's `add_rms_norm`: Qwen2.5-VL); residual None: x is the whole stream already."""
    if residual is None:
        return norm(x), x
    if isinstance(norm, RMSNorm):
        return norm.add_forward(x, residual)
    stream = x + residual
    return norm(stream), stream


class VisionBlock(nn.Module):
    """Pre-norm ViT block; `mlp`: the family's MLP (Qwen2-VL's and Qwen2.5-VL's `VisionMLP` when None). The residual
    is carried as the decoder's layers carry it, so each add runs with the norm after it (`add_norm`)."""

    def __init__(self, vs: VisionSpec, backend: Backend, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.norm1 = _norm(vs, vs.hidden_size, backend)
        self.norm2 = _norm(vs, vs.hidden_size, backend)
        self.attn = VisionAttention(vs)
        self.mlp = mlp if mlp is not None else VisionMLP(vs, backend)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                segments: Segments | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream hidden + residual (residual None: hidden alone) in; out (the MLP's output, the stream before
        it), whose sum is the stream after the block: x + attn(norm1(x)), then + mlp(norm2(.))."""
        normed, residual = add_norm(self.norm1, hidden, residual)
        normed, residual = add_norm(self.norm2, self.attn(normed, cos, sin, segments), residual)
        return self.mlp(normed), residual


class PatchMerger(nn.Module):
    """Each block of merge x merge patches (consecutive rows) -> one language-model token: norm, concatenate,
    Linear, GELU, Linear (`mlp.0`, `mlp.2`: transformers' names)."""

    def __init__(self, vs: VisionSpec, backend: Backend) -> None:
        super().__init__()
        self.width = vs.hidden_size * vs.merge_size**2
        self.ln_q = _norm(vs, vs.hidden_size, backend)
        self.mlp = nn.ModuleList([Linear(self.width, self.width, bias=True), nn.GELU(),
                                  Linear(self.width, vs.out_hidden_size, bias=True)])

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The stream hidden + residual [N, E] (the last block's carried pair) -> [N / merge^2, out_hidden]."""
        x = add_norm(self.ln_q, hidden, residual)[0].reshape(-1, self.width)
        return self.mlp[2](F.gelu(self.mlp[0](x)))


class VisionTower(nn.Module):
    """The vision tower + merger (`model.visual` in transformers' checkpoints)."""

    def __init__(self, vs: VisionSpec, backend: Backend) -> None:
        super().__init__()
        self.vs = vs
        self.patch_embed = PatchEmbed(vs)
        self.blocks = nn.ModuleList(VisionBlock(vs, backend) for _ in range(vs.depth))
        self.merger = PatchMerger(vs, backend)

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [N, patch_dim] of every image, grids [(t, h, w)] -> [N / merge^2, out_hidden]."""
        vs = self.vs
        hidden = self.patch_embed(patches)  # [N, E]
        cos, sin = rotary_cos_sin(grids, vs, hidden.device)
        full = Segments(frame_seqlens(grids), hidden.device, hidden.dtype)
        order = None
        windows = full
        if vs.window_size:
            order, window_cu = _window_order(grids, vs)
            windows = Segments(window_cu, hidden.device, hidden.dtype)
            unit = vs.merge_size**2
            hidden, cos, sin = (_permute(t, order, unit) for t in (hidden, cos, sin))
        residual = None
        for i, block in enumerate(self.blocks):
            segments = full if (not vs.window_size or i in vs.full_attention_blocks) else windows
            hidden, residual = block(hidden, residual, cos, sin, segments)
        merged = self.merger(hidden, residual)  # [N / merge^2, out_hidden]
        if order is not None:  # back to the processor's order
            merged = merged[torch.as_tensor(np.argsort(order), device=merged.device)]
        return merged


def rotary_cos_sin(grids: list[tuple[int, int, int]], vs: VisionSpec, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The 2-D rotary's cos, sin float32 [N, 1, head_dim] of every patch (processor order), rotate_half's sign
    folded into sin's first half (`rotate`): a patch's row turns the first half of each half-head's frequency pairs,
    its column the second."""
    positions = torch.as_tensor(_patch_positions(grids, vs.merge_size), device=device)  # [N, 2]: (row, col)
    spatial = vs.head_dim // 2  # rows and columns each turn half of the head's rotary pairs
    inv_freq = 1.0 / (vs.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))
    freqs = positions[..., None].float() * inv_freq  # [N, 2, D/4]
    freqs = freqs.reshape(freqs.shape[0], -1)  # [N, D/2]: rows' then columns'
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], dim=-1)[:, None, :], torch.cat([-sin, sin], dim=-1)[:, None, :]  # [N, 1, D] each


def _permute(x: torch.Tensor, order: np.ndarray, unit: int) -> torch.Tensor:
    """Rows of `x` regrouped by merged token: the tokens' `unit` rows each, in `order`."""
    shape = x.shape
    grouped = x.reshape(shape[0] // unit, unit, -1)[torch.as_tensor(order, device=x.device)]
    return grouped.reshape(shape)


def _patch_positions(grids: list[tuple[int, int, int]], merge: int) -> np.ndarray:
    """int64 [N, 2]: each patch's (row, col) in its image, in the processor's order (merge x merge blocks)."""
    return np.concatenate([grid_positions(tuple(grid), merge) for grid in grids])


@functools.lru_cache(maxsize=4096)
def grid_positions(grid: tuple[int, int, int], merge: int) -> np.ndarray:
    """int64 [t * h * w, 2]: (row, col) of each patch of one image of patch grid (t, h, w), in processor order."""
    t, h, w = grid
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    cols = cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
    return np.tile(np.stack([rows, cols], axis=-1), (t, 1))


def frame_seqlens(grids: list[tuple[int, int, int]]) -> np.ndarray:
    """cu_seqlens [F + 1] of the frames of every image: each image frame attends within itself."""
    lengths = [h * w for t, h, w in grids for _ in range(t)]
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _window_order(grids: list[tuple[int, int, int]], vs: VisionSpec) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's windows: (merged tokens in window order [N / merge^2], cu_seqlens of the windows in patches).
    Windows of window_size pixels tile each frame's grid of merged tokens row by row; edge windows are smaller."""
    side = vs.window_size // vs.merge_size // vs.patch_size  # merged tokens per window side
    orders, lengths, base = [], [], 0
    for grid in grids:
        order, sizes = _grid_windows(tuple(grid), vs.merge_size, side)
        orders.append(order + base)
        lengths.append(sizes)
        base += order.size
    cu = np.concatenate([[0], np.cumsum(np.concatenate(lengths)) * vs.merge_size**2])
    return np.concatenate(orders), cu.astype(np.int64)


@functools.lru_cache(maxsize=4096)
def _grid_windows(grid: tuple[int, int, int], merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """One image's merged tokens in window order and each window's size in merged tokens (cached by grid: pages
    come in few sizes)."""
    t, h, w = grid
    gh, gw = h // merge, w // merge
    index = np.arange(t * gh * gw).reshape(t, gh, gw)
    windows = [frame[r : r + side, c : c + side].reshape(-1) for frame in index
               for r in range(0, gh, side) for c in range(0, gw, side)]
    return np.concatenate(windows), np.array([len(x) for x in windows], dtype=np.int64)
