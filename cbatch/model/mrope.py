"""M-RoPE (Qwen2-VL's multimodal rotary positions): each token has three positions (temporal, height, width), and
the rotary frequencies are split in sections, each turned by one of the three.

Text tokens have the same position on all three axes (so a text-only prompt is plain RoPE); an image's merged
patches sit on a grid starting where the image starts: temporal = start, height = start + row, width = start + col,
and the text after it continues at start + max(rows, cols). A video's temporal patches step the temporal axis:
temporal patch k sits at start + floor(k * interval) (Qwen2-VL: interval 1; Qwen2.5-VL: seconds per temporal
patch x tokens_per_second), and the text after it still continues at start + max(rows, cols). The prompt's last
position is then below its length: `delta` = (last position + 1) - prompt length, which every later token (the
completion) adds to its index, as transformers' `generate` continues the prompt's positions. The prompt's positions
are transformers' `get_rope_index`'s, with each extent known from its patch grid.
"""
from __future__ import annotations

import numpy as np
import torch


def mrope_positions(prompt_len: int, images: list[tuple[int, tuple[int, int, int], float]], merge_size: int
                    ) -> tuple[np.ndarray, int]:
    """(int64 [3, prompt_len] positions, delta). `images`: (first placeholder index, patch grid (t, h, w), temporal
    interval) of each image or video in prompt order; its placeholder run is t * (h / merge) * (w / merge) tokens."""
    out = np.empty((3, prompt_len), dtype=np.int64)
    index = position = 0  # the next token's index and the position it gets
    for start, (t, h, w), interval in images:
        text = start - index  # text tokens before the image: the same position on every axis
        out[:, index:start] = np.arange(position, position + text)
        position += text
        gh, gw = h // merge_size, w // merge_size
        grid_t, grid_h, grid_w = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        count = t * gh * gw
        # (float32 and truncated, as transformers computes the temporal step: the same integer at every k)
        temporal = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
        out[0, start : start + count] = temporal[grid_t.reshape(-1)] + position
        out[1, start : start + count] = grid_h.reshape(-1) + position
        out[2, start : start + count] = grid_w.reshape(-1) + position
        position += max(gh, gw)
        index = start + count
    out[:, index:] = np.arange(position, position + prompt_len - index)
    # the completion continues from the prompt's last token (text: one position on every axis), as transformers'
    # `generate` extends its position ids; a long video's temporal positions may pass it (get_rope_index's own
    # rope_deltas, and vLLM's, take the largest position instead: the same where the text after the video is longer)
    last = int(out[:, -1].max()) if prompt_len else -1
    return out, last + 1 - prompt_len


def section_axes(section: tuple[int, ...], rotary_dim: int, interleaved: bool = False) -> torch.Tensor:
    """int64 [rotary_dim]: which axis (0 temporal, 1 height, 2 width) turns each column of a cos | sin table row.
    In sections (Qwen2-VL): the first section[0] frequency pairs temporal, the next section[1] height, then width.
    Interleaved (Qwen3-VL): pair c turned by axis c % 3 while that axis has pairs left (c < 3 * section[axis]), the
    rest temporal."""
    if sum(section) * 2 != rotary_dim:
        raise ValueError(f"mrope_section {section} covers {2 * sum(section)} rotary dimensions, the model has {rotary_dim}")
    if interleaved:
        axes = torch.zeros(rotary_dim // 2, dtype=torch.int64)
        for axis in (1, 2):
            axes[axis : 3 * section[axis] : 3] = axis
    else:
        axes = torch.repeat_interleave(torch.arange(len(section)) % 3, torch.tensor(section))
    return torch.cat([axes, axes])


def mrope_cos_sin(table: torch.Tensor, positions: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """Each token's cos | sin row [T, R] for 3-D `positions` int64 [3, T]: column c read at the position of axis
    axes[c] (`section_axes`). `table`: [max_positions, R] (rope.rope_table)."""
    per_column = positions.t()[:, axes]  # [T, R]: the position each column turns by
    columns = torch.arange(table.shape[1], device=table.device)
    return table[per_column, columns]
