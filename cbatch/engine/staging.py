"""Persistent pinned host memory the step's inputs cross to the GPU through, with non-blocking copies.

A copy from pageable memory makes the host wait for everything queued on the stream (the step in flight),
which would undo asynchronous scheduling; from pinned memory it is queued like a kernel. Two arenas
alternate by step: the one a step writes was last read by the copies of the step before the previous one,
which has resolved (its tokens came back), so its copies are done.
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import numpy as np
import torch

_ALIGN = 64  # bytes: every staged array starts on a cache line


class HostStaging:
    def __init__(self, device: torch.device, nbytes: int = 1 << 20) -> None:
        self.device = device
        self.arenas = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.turn = 0
        self.used = 0

    def next_step(self) -> None:
        """Switches to the other arena (call once per step, before its first `to_device`)."""
        self.turn ^= 1
        self.used = 0

    def to_device(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        """`array` (host memory) on the GPU: copied into this step's arena, then a non-blocking copy is queued."""
        src = array.contiguous() if isinstance(array, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(array))
        nbytes = src.numel() * src.element_size()
        arena = self.arenas[self.turn]
        if self.used + nbytes > arena.numel():  # grow; the old arena lives on in the caching host allocator
            arena = torch.empty(2 * (self.used + nbytes), dtype=torch.uint8, pin_memory=True)
            self.arenas[self.turn] = arena
            self.used = 0
        staged = arena[self.used : self.used + nbytes].view(src.dtype).view(src.shape)
        staged.copy_(src)
        self.used += -(-nbytes // _ALIGN) * _ALIGN
        return staged.to(self.device, non_blocking=True)

    def tensor(self, values: Sequence, dtype: torch.dtype) -> torch.Tensor:
        """`torch.tensor(values, dtype=dtype, device=gpu)` without its wait for the step in flight."""
        return self.to_device(torch.tensor(values, dtype=dtype))


def host_tensor(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values as a tensor on `device` by `torch.tensor` (the way where there are no pinned arenas)."""
    return torch.tensor(values, dtype=dtype, device=device)


def host_values(device: torch.device, staging: HostStaging | None) -> Callable[[Sequence, torch.dtype], torch.Tensor]:
    """How a step's host values (lists of settings, rows, token ids) become tensors on `device`: through the
    pinned arenas on a GPU (`HostStaging.tensor`), else `host_tensor` (no copy to wait for)."""
    if staging is not None:
        return staging.tensor
    return partial(host_tensor, device=device)
