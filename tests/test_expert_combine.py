"""Expert parallelism's combine (parallel/expert_combine.py): each rank's experts' slots, sent to their tokens'
owners, summed there and all-gathered, are bitwise one rank's `.sum(dim=1)`, in both layouts (routed: only the
computed slots travel; padded: fixed blocks, for CUDA graphs), including uneven routing: ranks whose experts take no
slot, ranks owning no token (fewer tokens than ranks), token counts the ranks do not divide. The ranks are threads
exchanging tensors as gloo's collectives do (milliseconds; tests/test_expert_parallel.py runs the combine over gloo
processes inside whole models)."""
from __future__ import annotations

import threading

import pytest
import torch

from cbatch.parallel.comm import SINGLE_RANK, Communicator
from cbatch.parallel.expert_combine import combine_slots, owned_rows, padded_sums

EXPERTS, HIDDEN = 8, 6


class _ThreadRank(Communicator):
    """One rank of a group of threads: the collectives' contract (comm.py) over a shared board; records the rows
    each all-to-all sends to the other ranks."""

    def __init__(self, rank: int, world: int, board: list, barrier: threading.Barrier) -> None:
        self.rank, self.world, self.board, self.barrier = rank, world, board, barrier
        self.rows_sent: list[int] = []

    def _exchange(self, item) -> list:
        self.board[self.rank] = item
        self.barrier.wait()
        items = list(self.board)
        self.barrier.wait()  # every rank has read the board before the next exchange writes it
        return items

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=dim)

    def all_to_all(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int]) -> torch.Tensor:
        assert x.shape[0] == sum(send_rows)
        self.rows_sent.append(sum(send_rows) - send_rows[self.rank])
        pieces = [sent[self.rank] for sent in self._exchange(x.split(send_rows))]
        assert [p.shape[0] for p in pieces] == recv_rows
        return torch.cat(pieces)


def _case(name: str, num_tokens: int, top_k: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(one rank's slots [T, k, H] float32 of mixed magnitudes (the summation order shows in the bits), expert ids
    [T, k] ascending in each row, as `fused_moe_slots` orders the slots)."""
    gen = torch.Generator().manual_seed(num_tokens * 31 + top_k)
    per_rank = EXPERTS // world
    if name == "even":
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(num_tokens)])
    elif name == "first rank only":  # the other ranks' experts take nothing: they send no slot
        ids = torch.stack([torch.randperm(per_rank, generator=gen)[:top_k] for _ in range(num_tokens)])
    else:  # "last rank only"
        ids = EXPERTS - per_rank + torch.stack([torch.randperm(per_rank, generator=gen)[:top_k]
                                                for _ in range(num_tokens)])
    scale = 10.0 ** torch.randint(-3, 4, (num_tokens, top_k, HIDDEN), generator=gen)
    return torch.randn(num_tokens, top_k, HIDDEN, generator=gen) * scale, ids.sort(dim=1).values


def _combine_on_rank(comm: _ThreadRank) -> None:
    rank, world = comm.rank, comm.world
    per_rank = EXPERTS // world
    for name, num_tokens, top_k in [("even", 7, 3), ("even", 16, 2), ("first rank only", 5, 2),
                                    ("last rank only", 9, 2), ("even", 1, 2), ("even", world + 1, 2)]:
        whole, ids = _case(name, num_tokens, top_k, world)
        expected = whole.sum(dim=1)  # one rank's combine
        expert_ranks = ids // per_rank
        mine = whole.masked_fill(expert_ranks[..., None] != rank, 0.0)  # what this rank's experts computed
        label = f"{name}, {num_tokens} tokens, top-{top_k}, rank {rank} of {world}"
        comm.rows_sent.clear()
        routed = combine_slots(mine, expert_ranks, comm)
        assert torch.equal(routed, expected), label
        # only the slots this rank computed for other ranks' tokens travel
        owner = torch.arange(num_tokens)[:, None] // owned_rows(num_tokens, world)
        assert comm.rows_sent == [int(((expert_ranks == rank) & (owner != rank)).sum())], label
        padded = comm.all_gather(padded_sums(mine, comm), dim=0)[:num_tokens]
        assert torch.equal(padded, expected), label
        assert comm.rows_sent[1] == owned_rows(num_tokens, world) * top_k * (world - 1), label


def _run_ranks(world: int, work) -> None:
    """`work(comm)` on `world` threads; the first failure is raised (the others' barriers break instead of hanging)."""
    board, barrier, errors = [None] * world, threading.Barrier(world, timeout=60), []

    def run(rank: int) -> None:
        try:
            work(_ThreadRank(rank, world, board, barrier))
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0] if errors else None)
    if first is not None:
        raise first


@pytest.mark.parametrize("world", [2, 4])
def test_the_combine_sums_each_token_as_one_rank_does(world):
    _run_ranks(world, _combine_on_rank)


def test_the_summation_order_shows_in_the_bits():
    """What makes the bitwise checks above able to fail: another order of the same slots gives other bits."""
    whole, _ = _case("even", 7, 3, 2)
    assert not torch.equal(whole.flip(1).sum(dim=1), whole.sum(dim=1))


def test_one_rank_sums_its_own_slots():
    whole, ids = _case("even", 5, 2, 1)
    assert torch.equal(combine_slots(whole, ids // EXPERTS, SINGLE_RANK), whole.sum(dim=1))
