"""The CPU KV pool's memory: zero-filled, writable, and private to the process that made it."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from cbatch.engine.cpu_memory import lazily_zeroed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lazily_zeroed_reads_zero_and_takes_writes(dtype) -> None:
    pool = lazily_zeroed((4, 16, 3, 8), dtype)
    assert pool.shape == (4, 16, 3, 8) and pool.dtype == dtype and pool.is_contiguous()
    assert torch.count_nonzero(pool) == 0
    pool[2, 5] = 1.5
    view = pool.view(-1, 3, 8)  # the attention's slot view shares the memory
    assert torch.equal(view[2 * 16 + 5], torch.full((3, 8), 1.5, dtype=dtype))
    assert torch.count_nonzero(pool) == 24


@pytest.mark.skipif(not hasattr(os, "fork") or sys.platform != "linux", reason="needs fork")
def test_forked_child_writes_do_not_reach_the_parent() -> None:
    pool = lazily_zeroed((8, 8), torch.float32)
    pid = os.fork()
    if pid == 0:  # child: write and leave without running pytest's teardown
        pool.fill_(7.0)
        os._exit(0 if float(pool.sum()) == 7.0 * 64 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.count_nonzero(pool) == 0  # private mapping: the child's pages were its own
