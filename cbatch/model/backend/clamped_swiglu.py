"""gpt-oss's expert activation: a SwiGLU with clamped inputs and a sigmoid gain, as HF's GptOssExperts computes it
(the torch op every backend runs; elementwise, so the GPU path runs it too)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ClampedSwiGLU:
    """gate <= limit, -limit <= up <= limit, then (up + 1) * gate * sigmoid(alpha * gate)."""

    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] (gate | up halves; the loader de-interleaves gpt-oss's gate/up columns) -> [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))  # HF's order of operations
