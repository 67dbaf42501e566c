"""CPU memory for the engine: freed activations kept in the process, and a KV pool that costs nothing until used.

`keep_freed_memory`: keeps freed activation memory in the process on Linux/glibc.

Why: a CPU step allocates and frees many activation tensors of 1-30 MB. glibc serves large requests
with fresh mmap()s and hands freed heap tops back to the kernel, so every step page-faults its
activations in again (measured: 400k minor faults and 0.6 s of system time in one 2048-token
prefill step of SmolLM2-135M, about 18% of the step). Raising glibc's mmap and trim thresholds
makes such blocks come from, and return to, the heap, so later steps reuse resident pages. The cost
is that the process keeps its peak activation memory mapped, which a batch job reaches anyway.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import sys

import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit
_done = False


def keep_freed_memory() -> bool:
    """Tunes glibc malloc once per process; returns False where there is no glibc (nothing changed)."""
    global _done
    if _done or not sys.platform.startswith("linux"):
        return _done
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl or another libc without mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
    ok = mallopt(_M_TRIM_THRESHOLD, 2**30) == 1 and ok  # 1 GiB: beyond what a step frees
    _done = ok
    return ok


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages become resident only when first written.

    Anonymous mmap memory reads as zeros and the kernel maps a page on its first write, so a KV pool
    sized for the whole memory budget costs only what the job's sequences fill, and the attention,
    which reads whole blocks (padding masked), never meets non-finite garbage. No transparent huge pages
    are requested: on the VMs measured a fresh process's first huge-page faults cost 0.5-1.2 s per GB the
    pool fills (4 KiB pages: 0.18 s), and the TLB misses they save were not measurable in the decode steps
    (benchmarks/NOTES.md, "cbatch against vLLM's CPU build on 2026-11-26").
    """
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: no private anonymous mappings; zero it up front
        return torch.zeros(shape, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    # private: a forked child (a Ray or multiprocessing worker) gets its own copy-on-write pages, not shared ones
    buffer = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps `buffer` alive for as long as the tensor (or any view of it) lives
    return torch.frombuffer(buffer, dtype=torch.uint8)[:nbytes].view(dtype).view(shape)
