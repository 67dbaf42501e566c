"""Qwen3-VL's vision tower (`model.visual` of `Qwen3VLForConditionalGeneration`) on our layers: every image of a step
in one call, as model/vision.py's Qwen2-VL tower (same input, same varlen attention within each frame, same 2-D
rotary), with what Qwen3-VL adds:

- learned positions: a square table of `num_position_embeddings` entries, resampled bilinearly (corners aligned) to
  each image's patch grid and added to the patch embeddings;
- LayerNorm blocks with a plain GELU MLP (`linear_fc1`, `linear_fc2`), and a patch embedding with a bias;
- deepstack: after each block of `deepstack_layers` a merger of its own (LayerNorm over the merged patches, then
  fc1, GELU, fc2) turns the hidden states into one feature per language-model token; the decoder adds feature k to
  the hidden states after its layer k, at the image's placeholder tokens (model/decoder.py).

Output: [N / merge^2, out_hidden * (1 + len(deepstack_layers))], the merger's embeddings then each deepstack
feature side by side, so that the engine's encoder cache and its slicing of a chunk's rows (engine/image_rows.py)
carry the features with the embeddings.
"""
from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from cbatch.model.backend import Backend
from cbatch.model.layers import Linear
from cbatch.model.vision import PatchEmbed, VisionBlock, activation, frame_seqlens, grid_positions, rotary_cos_sin
from cbatch.model.vision_spec import VisionSpec

_EPS = 1e-6


class Qwen3VisionMLP(nn.Module):
    def __init__(self, vs: VisionSpec) -> None:
        super().__init__()
        self.activation = vs.activation
        self.linear_fc1 = Linear(vs.hidden_size, vs.intermediate_size, bias=True)
        self.linear_fc2 = Linear(vs.intermediate_size, vs.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(activation(self.activation, self.linear_fc1(x)))


class Qwen3PatchMerger(nn.Module):
    """Each block of merge x merge patches (consecutive rows) -> one language-model token: LayerNorm (over each patch,
    or with `postshuffle` over the concatenated block: the deepstack mergers'), Linear, exact GELU, Linear."""

    def __init__(self, vs: VisionSpec, postshuffle: bool) -> None:
        super().__init__()
        self.width = vs.hidden_size * vs.merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else vs.hidden_size, eps=_EPS)
        self.linear_fc1 = Linear(self.width, self.width, bias=True)
        self.linear_fc2 = Linear(self.width, vs.out_hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(-1, self.width)) if self.postshuffle else self.norm(x).reshape(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """The tower, its merger and deepstack mergers (transformers' names, so the checkpoint maps one to one)."""

    def __init__(self, vs: VisionSpec, backend: Backend) -> None:
        super().__init__()
        self.vs = vs
        self.side = int(vs.num_position_embeddings**0.5)  # the learned position grid is side x side
        self.patch_embed = PatchEmbed(vs, bias=True)
        self.pos_embed = nn.Embedding(vs.num_position_embeddings, vs.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(vs, backend, Qwen3VisionMLP(vs)) for _ in range(vs.depth))
        self.merger = Qwen3PatchMerger(vs, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(Qwen3PatchMerger(vs, postshuffle=True) for _ in vs.deepstack_layers)

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [N, patch_dim] of every image, grids [(t, h, w)] -> [N / merge^2, out_hidden * (1 + deepstack)]."""
        vs = self.vs
        hidden = self.patch_embed(patches)  # [N, E]
        hidden = hidden + self._positions(grids, hidden.device).to(hidden.dtype)
        cos, sin = rotary_cos_sin(grids, vs, hidden.device)
        cu = frame_seqlens(grids)
        features, residual = [], None
        for i, block in enumerate(self.blocks):
            hidden, residual = block(hidden, residual, cos, sin, cu)
            if i in vs.deepstack_layers:  # its merger reads the whole stream
                hidden, residual = hidden + residual, None
                features.append(self.deepstack_merger_list[vs.deepstack_layers.index(i)](hidden))
        if residual is not None:
            hidden = hidden + residual
        return torch.cat([self.merger(hidden), *features], dim=1)

    def _positions(self, grids: list[tuple[int, int, int]], device: torch.device) -> torch.Tensor:
        """float32 [N, E]: each patch's learned position, the 4 nearest table entries weighted bilinearly."""
        taps = [_grid_taps(tuple(grid), self.vs.merge_size, self.side) for grid in grids]
        index = torch.as_tensor(np.concatenate([t[0] for t in taps]), device=device)  # [N, 4]
        weight = torch.as_tensor(np.concatenate([t[1] for t in taps]), device=device)  # [N, 4] float32
        return (self.pos_embed.weight[index] * weight[..., None]).sum(1)


@functools.lru_cache(maxsize=4096)
def _grid_taps(grid: tuple[int, int, int], merge: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """One image's (table rows int64 [t * h * w, 4], bilinear weights float32 [t * h * w, 4]) in processor order:
    the image's patch grid laid over the side x side table, corners on corners (cached by grid)."""
    _, h, w = grid
    positions = grid_positions(grid, merge)  # [n, 2]: (row, col)
    row_taps, row_weights = _axis_taps(positions[:, 0], h, side)
    col_taps, col_weights = _axis_taps(positions[:, 1], w, side)
    index = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)
    weight = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)
    return index, weight


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Along one axis of `size` patches: the two table entries around each patch's source coordinate (clamped to the
    table) and their linear weights [n, 2], in float32 as transformers computes them."""
    source = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    low = np.floor(source)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(low.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.maximum(np.float32(1) - np.abs(source[:, None] - low[:, None] - offsets), np.float32(0))
    return taps, weights.astype(np.float32)
