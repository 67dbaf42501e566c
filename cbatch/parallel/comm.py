"""The collectives a tensor-parallel model calls: one all-reduce after each row-parallel block, one after the
vocab-parallel embedding, one all-gather of the sampling rows' logits, and a broadcast of rank 0's image embeddings
in a step that has some (engine/image_rows.py). The model holds a communicator as it holds its compute backend (no
globals); on one rank it is `SINGLE_RANK`, whose calls return their input.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class Communicator:
    """One rank's view of its tensor-parallel group. The base class is the single-rank group."""

    rank: int = 0
    world: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks (in place)."""
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., world * n]: the ranks' slices side by side along the last dimension."""
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place: the others pass a tensor of its shape and dtype)."""
        return x


SINGLE_RANK = Communicator()


class ProcessGroupComm(Communicator):
    """torch.distributed's default group: gloo on CPU, NCCL on CUDA. Collectives give up after the group's
    timeout (a dead rank never hangs the job: `cbatch.engine.tensor_parallel` turns the error into a clear message)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        dist.broadcast(x, src=0)
        return x


def init_process_group(rank: int, world: int, port: int, device: torch.device, timeout_s: float) -> ProcessGroupComm:
    """Joins the group rendezvousing on localhost:`port` (rank 0 hosts the store). The default group carries the
    model's collectives (NCCL on CUDA, gloo on CPU); a gloo group beside it carries each step's plan."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return ProcessGroupComm(rank, world)
