"""Tensor parallelism's vision tower: every rank holds it whole and encodes a share of the images a step encodes.

Rank 0 alone reads images and keeps the encoder cache, so it decides a step's images to encode (those the cache
lacks) and their ranks (`assign_ranks`: the largest first, each to the rank with the fewest patches so far). Then
every rank, in every step that has image rows (so the collectives pair up even when nothing is to encode):
    1. broadcast   the step's images to encode: [K, 5] int64 (rank, t, h, w, tokens); K = 0 ends the exchange
    2. all-to-all  rank 0 sends each worker its images' patches (float32, [patches, patch width]); only those
    3. each rank runs the tower over its own share (engine/tower_calls.encode: calls of at most the step's budget)
    4. all-to-all  the workers send rank 0 their embeddings ([tokens, hidden x features]), rank order
Rank 0 then has every image's embeddings, caches them, and broadcasts the step's gathered rows as with one tower
(engine/image_rows.py). A tower call's patches are one image's (or a video's temporal patches): each image gets
the bits its own rank's tower gives it, which is the bits one rank's tower gives (the same weights and code).
A step's tower time falls with the ranks (an OCR step's few page images spread over them) at the cost of the
pixels' all-to-all (a 1,280-token page: ~24 MB of float32 patches) and the tower's weights on every rank.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from cbatch.engine.tower_calls import Item
from cbatch.parallel.comm import Communicator


def assign_ranks(patches: list[int], world: int) -> list[int]:
    """Each image's rank, balancing the patches each rank encodes: the largest image first, to the rank holding the
    fewest patches so far (the lowest rank on ties); deterministic."""
    load = [0] * world
    ranks = [0] * len(patches)
    for index in sorted(range(len(patches)), key=lambda i: -patches[i]):
        rank = min(range(world), key=lambda r: load[r])
        ranks[index] = rank
        load[rank] += patches[index]
    return ranks


def encode_shared(comm: Communicator, items: list[Item] | None, owners: list[int] | None,
                  run: Callable[[list[Item]], list[torch.Tensor]], patch_width: int, row_width: int,
                  dtype: torch.dtype, device: torch.device) -> list[torch.Tensor] | None:
    """The exchange above, on every rank of a step with image rows. Rank 0 passes its images to encode (`items`,
    perhaps none) and their ranks (`owners`: `assign_ranks`), and gets each one's embeddings in order; a worker
    passes None twice and gets None. `run` encodes a rank's own items; `row_width` and `dtype` are its embeddings'."""
    world, rank = comm.world, comm.rank
    header = torch.zeros(1, dtype=torch.int64, device=device)
    if rank == 0:
        table = torch.tensor([[owner, *grid, tokens] for owner, (_, grid, tokens) in zip(owners, items)],
                             dtype=torch.int64).reshape(-1, 5)
        header.fill_(table.shape[0])
    comm.broadcast(header)
    count = int(header.item())
    if count == 0:
        return [] if rank == 0 else None
    if rank != 0:
        table = torch.empty(count, 5, dtype=torch.int64, device=device)
    table = comm.broadcast(table.to(device)).cpu().numpy()
    owners, grids, tokens = table[:, 0], [tuple(map(int, row)) for row in table[:, 1:4]], table[:, 4]
    patches = np.prod(table[:, 1:4], axis=1)
    per_rank = [int(patches[owners == r].sum()) for r in range(world)]
    # 2. the workers' patches: rank 0 sends, in rank order then the images' order; the rest receive
    if rank == 0:
        sent = [items[i][0] for r in range(1, world) for i in np.flatnonzero(owners == r)]
        pixels = torch.cat(sent).to(device) if sent else torch.empty(0, patch_width, device=device)
        comm.all_to_all(pixels, [0, *per_rank[1:]], [0] * world)
        mine = [items[i] for i in np.flatnonzero(owners == 0)]
    else:
        empty = torch.empty(0, patch_width, device=device)
        pixels = comm.all_to_all(empty, [0] * world, [per_rank[rank]] + [0] * (world - 1))
        index = np.flatnonzero(owners == rank)
        sizes = [int(patches[i]) for i in index]
        mine = [(part, grids[i], int(tokens[i])) for i, part in zip(index, pixels.split(sizes))]
    # 3. this rank's share
    encoded = run(mine) if mine else []
    # 4. the workers' embeddings to rank 0
    tokens_per_rank = [int(tokens[owners == r].sum()) for r in range(world)]
    if rank != 0:
        out = torch.cat(encoded) if encoded else torch.empty(0, row_width, dtype=dtype, device=device)
        comm.all_to_all(out.to(dtype), [tokens_per_rank[rank]] + [0] * (world - 1), [0] * world)
        return None
    received = comm.all_to_all(torch.empty(0, row_width, dtype=dtype, device=device), [0] * world,
                               [0, *tokens_per_rank[1:]])
    results: list[torch.Tensor | None] = [None] * count
    for i, part in zip(np.flatnonzero(owners == 0), encoded):
        results[i] = part
    others = [i for r in range(1, world) for i in np.flatnonzero(owners == r)]
    for i, part in zip(others, received.split([int(tokens[i]) for i in others])):
        results[i] = part.clone() if len(others) > 1 else part  # (the cache may drop one before another)
    return results
