"""The rotary angles of one step, built once per step by the backend and shared by every layer."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RotaryStep:
    positions: torch.Tensor  # int64 [T]
    cos_sin: torch.Tensor  # the model's float32 [max_positions, D] table (what the fused kernel reads)
    cos: torch.Tensor | None = None  # [T, 1, D] in the activations' dtype (the torch backend)
    sin: torch.Tensor | None = None  # [T, 1, D], rotate_half's sign folded in: (-sin | +sin)
