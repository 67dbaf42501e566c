"""The collectives a tensor-parallel model calls: one all-reduce after each row-parallel block, one after the
vocab-parallel embedding, one all-gather of the sampling rows' logits, and a broadcast of rank 0's image embeddings
in a step that has some (engine/image_rows.py); with --expert-parallel, an all-to-all of the experts' slot outputs
and an all-gather of the tokens' rows per MoE layer (parallel/expert_combine.py). The model holds a communicator as
it holds its compute backend (no globals); on one rank it is `SINGLE_RANK`, whose calls return their input.
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

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """[..., n, ...] per rank -> [..., world * n, ...]: the ranks' slices side by side along `dim` (the last
        by default), in rank order."""
        return x

    def all_to_all(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
        """x [sum(send_rows), ...]: its first send_rows[0] rows go to rank 0, the next send_rows[1] to rank 1, ...;
        returns [sum(recv_rows), ...]: recv_rows[s] rows from each rank s, in rank order. Every rank's send_rows[r]
        must equal rank r's recv_rows[rank]."""
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

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)

    def all_to_all(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
        out = x.new_empty(sum(recv_rows), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), recv_rows, send_rows)
        return out

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
