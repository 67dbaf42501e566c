"""Expert parallelism's combine (--expert-parallel with tensor-parallel attention): every rank holds every token
of the step and the same routing, and has computed the slot outputs of its own experts ([T, k, H], zeros in the
slots of other ranks' experts). The combine gives every rank each token's output, its k slots summed in the order
one rank sums them (`.sum(dim=1)` over the slots in ascending expert order), so the result is bitwise one rank's.

Tokens are split into `world` contiguous ranges of P = ceil(T / world) rows (the last ones shorter, possibly
empty): rank r owns range r. Each slot goes from the rank holding its expert to its token's owner, the owner sums
its tokens' slots, and the owners' sums are all-gathered. Because the routing is the same on every rank, every rank
computes the whole [world, world] matrix of slot counts from it: no sizes are exchanged. Two layouts:

    routed   (eager steps)  an all-to-all of only the slots a rank computed (~T k / world rows of H, T k (N - 1) / N^2
                            to other ranks when routing is even); the split sizes go to the host (one sync per layer)
    padded   (CUDA graphs)  a graph holds no host-side sizes: each rank sends every owner its whole [P, k, H] block,
                            zeros included (a reduce-scatter's bytes, T k H (N - 1) / N), and the owner adds the N
                            blocks (one non-zero per slot: exact, up to the sign of a zero)

Bytes each rank sends per MoE layer, N ranks: routed ~ (k / N + 1) T H (N - 1) / N, padded (k + 1) T H (N - 1) / N,
against 2 k T H (N - 1) / N for a ring all-reduce of the [T, k, H] slots (docs/tensor-parallel.md).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from cbatch.parallel.comm import Communicator


def owned_rows(num_tokens: int, world: int) -> int:
    """P: the tokens each rank owns for the combine (the last ranks fewer, or none when T < world)."""
    return -(-num_tokens // world)


def combine_slots(slots: torch.Tensor, expert_ranks: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """slots [T, k, H]: this rank's experts' weighted outputs, zeros in the other slots; expert_ranks int64 [T, k]:
    the rank holding each slot's expert (the same on every rank) -> [T, H], each token's slots summed, on every
    rank. The padded layout inside CUDA graphs (and their warm-up), the routed one otherwise."""
    num_tokens = slots.shape[0]
    if comm.world == 1 or num_tokens == 0:
        return slots.sum(dim=1)
    mine = padded_sums(slots, comm) if _in_graph(slots) else routed_sums(slots, expert_ranks, comm)
    return comm.all_gather(mine, dim=0)[:num_tokens]


def routed_sums(slots: torch.Tensor, expert_ranks: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's P tokens' sums [P, H] (rows past T zero), from an all-to-all of only the slots each rank
    computed, each sent to its token's owner."""
    num_tokens, top_k, hidden = slots.shape
    world, rank = comm.world, comm.rank
    rows = owned_rows(num_tokens, world)
    source = expert_ranks.reshape(-1)  # [T * k]: the rank computing each slot
    owner = torch.arange(num_tokens, device=slots.device).div(rows, rounding_mode="floor").repeat_interleave(top_k)
    counts = torch.bincount(source * world + owner, minlength=world * world).view(world, world).tolist()  # [src][dst]
    # a rank's slots in flat (token, slot) order are already grouped by owner: owners hold contiguous tokens
    sent = slots.reshape(-1, hidden)[source == rank]
    received = comm.all_to_all(sent, counts[rank], [counts[s][rank] for s in range(world)])
    # received: each source's slots of this rank's tokens, sources in rank order, each in flat order
    start, stop = min(num_tokens, rank * rows) * top_k, min(num_tokens, (rank + 1) * rows) * top_k
    positions = source[start:stop].argsort(stable=True)
    flat = slots.new_zeros(rows * top_k, hidden)
    flat.index_copy_(0, positions, received)
    return flat.view(rows, top_k, hidden).sum(dim=1)


def padded_sums(slots: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """This rank's P tokens' sums [P, H] (rows past T zero), from an all-to-all of every rank's [P, k, H] block of
    this rank's tokens (fixed sizes: a CUDA graph can hold it)."""
    num_tokens, top_k, hidden = slots.shape
    world = comm.world
    rows = owned_rows(num_tokens, world)
    blocks = F.pad(slots, (0, 0, 0, 0, 0, rows * world - num_tokens)).view(world * rows * top_k, hidden)
    received = comm.all_to_all(blocks, [rows * top_k] * world, [rows * top_k] * world)
    return received.view(world, rows, top_k, hidden).sum(dim=0).sum(dim=1)


def _in_graph(x: torch.Tensor) -> bool:
    if not x.is_cuda:
        return False
    from cbatch.kernels.gemm import in_graph  # (Triton: imported on CUDA only)

    return in_graph(x)
