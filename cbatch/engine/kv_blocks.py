"""The KV block pool: which of the preallocated fixed-size blocks are free, and who holds the rest.

The pool only does accounting; the KV tensors live in the runner. A block id indexes dimension 0
of every layer's K and V cache.
"""
from __future__ import annotations

from collections import deque


class BlockPool:
    """Free list plus reference counts over `num_blocks` blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        """Takes `count` free blocks (ref count 1 each). The caller checked `num_free` first."""
        if count > len(self._free):
            raise RuntimeError(f"KV pool exhausted: asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block in blocks:
            self._ref_counts[block] = 1
        return blocks

    def release(self, blocks: list[int]) -> None:
        """Drops one reference to each block; a block with no references goes back to the free list."""
        for block in blocks:
            count = self._ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"KV block {block} released more often than allocated")
            self._ref_counts[block] = count
            if count == 0:
                self._free.append(block)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]
