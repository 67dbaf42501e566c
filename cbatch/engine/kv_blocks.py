"""The KV block pool: which of the preallocated fixed-size blocks are free, and who holds the rest.

The pool only does accounting; the KV tensors live in the runner. A block id indexes dimension 0
of every layer's K and V cache.

Prefix caching: a full block whose KV has been computed can be registered under the chained hash
of its tokens (`block_hash(parent_hash, tokens)`), so a later sequence with the same token prefix
takes a reference on it instead of computing it again. A registered block whose last reference
goes away stays cached in an LRU of evictable blocks; `allocate` takes never-cached free blocks
first and evicts the least recently used cached block only when none is left.

NOTE (invariants):
- A block is in exactly one of: `_free` (ref 0, no hash), `_evictable` (ref 0, hashed), or held
  (ref >= 1, hashed or not). `num_free` counts both ref-0 kinds: allocating may evict.
- Only full blocks are ever registered, and nobody writes into a full block, so a shared block
  never changes under its readers (no copy-on-write needed).
- A hash hit is accepted only if the block's stored (parent hash, token ids) equal the query's:
  a hash collision is a miss, never a wrong KV.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import Iterable

from cbatch.engine.sequence import Sequence

# (parent block's hash, this block's token ids); a first block's parent is the row's LoRA adapter (None: the base
# model), so rows of different adapters never share KV: the same tokens make different keys under another adapter.
# A block holding image placeholders has the digests of those images after its token ids (engine/images.py: the
# same placeholder ids with other images make another key).
BlockKey = tuple[int | str | None, tuple[int | str, ...]]


def block_hash(parent: int | str | None, tokens: tuple[int, ...]) -> int:
    """Chained hash of one full block: depends on every token of the prefix it ends. Python's own tuple
    hash: the cache lives and dies with its process, and a collision costs a miss, never a wrong KV
    (`lookup` compares the stored key)."""
    return hash((parent, tokens))


class BlockPool:
    """Free list plus reference counts over `num_blocks` blocks of `block_size` tokens, with an
    optional prefix cache (`enable_caching`) of full blocks keyed by chained token hashes."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._key_of: list[BlockKey | None] = [None] * num_blocks
        self._block_of: dict[int, int] = {}  # hash -> block
        self.evictions = 0  # cached blocks reused for something else

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now (plain free plus evictable cached ones)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (held or evictable)."""
        return len(self._block_of)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, count: int) -> list[int]:
        """Takes `count` blocks (ref count 1 each): never-cached ones first, then the least recently
        used cached ones, which lose their hash. The caller checked `num_free` first."""
        if count > self.num_free:
            raise RuntimeError(f"KV pool exhausted: asked for {count} blocks, {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._evictable.popitem(last=False)
                self._forget(block)
                self.evictions += 1
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Iterable[int]) -> None:
        """Drops one reference to each block. A block with no references goes back to the free list,
        or, if cached, to the most-recently-used end of the LRU; blocks are released last first so a
        sequence's tail is evicted before the prefix other sequences are likelier to share."""
        for block in reversed(list(blocks)):
            count = self._ref_counts[block] - 1
            if count < 0:
                raise RuntimeError(f"KV block {block} released more often than allocated")
            self._ref_counts[block] = count
            if count == 0:
                if self._hash_of[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    # ---- prefix cache ---------------------------------------------------------------------------
    def lookup(self, h: int, key: BlockKey) -> int | None:
        """The cached block for hash `h` whose stored key equals `key` (collision-checked), or None."""
        block = self._block_of.get(h)
        if block is None or self._key_of[block] != key:
            return None
        return block

    def is_evictable(self, block: int) -> bool:
        """True for a cached block nobody holds: taking it costs one free block."""
        return self._ref_counts[block] == 0

    def hold(self, block: int) -> None:
        """Takes a reference on a cached block (a prefix hit); an evictable one leaves the LRU."""
        if self._ref_counts[block] == 0:
            del self._evictable[block]
        self._ref_counts[block] += 1

    def register(self, block: int, h: int, key: BlockKey) -> bool:
        """Caches a held, full, computed block under `h`. Returns False (and caches nothing) when the
        block is already cached or `h` is taken (the same prefix computed twice, or a collision)."""
        if not self.enable_caching or self._hash_of[block] is not None or h in self._block_of:
            return False
        assert self._ref_counts[block] > 0, "only a held block can be registered"
        self._hash_of[block] = h
        self._key_of[block] = key
        self._block_of[h] = block
        return True

    def _forget(self, block: int) -> None:
        h = self._hash_of[block]
        if h is not None:
            del self._block_of[h]
            self._hash_of[block] = None
            self._key_of[block] = None


# ---- a sequence's view of the prefix cache ---------------------------------------------------------
def _block_hashes(pool: BlockPool, seq: Sequence, count: int) -> list[int]:
    """The chained hashes of `seq`'s first `count` full blocks, and their keys in `seq.block_keys`
    (extended lazily, kept on `seq`: tokens are only ever appended)."""
    hashes, keys, size = seq.block_hashes, seq.block_keys, pool.block_size
    images = seq.images
    while len(hashes) < count:
        i = len(hashes)
        key = (hashes[i - 1] if i else seq.params.lora), tuple(seq.tokens(i * size, (i + 1) * size))
        if images is not None and (salt := images.salt(i * size, (i + 1) * size)):
            key = key[0], key[1] + salt  # image placeholders: keyed by the images' bytes too
        keys.append(key)
        hashes.append(block_hash(*key))
    return hashes


def prefix_hits(pool: BlockPool, seq: Sequence) -> list[int]:
    """Cached blocks holding the longest run of a starting `seq`'s leading full blocks (not yet held).

    NOTE: never the whole sequence: at least one token is left to compute so the step has the
    logits to sample from (k hit blocks leave num_tokens - k * block_size >= 1 tokens). None for a
    sequence that still needs its prompt's log-probabilities: they come from computing every position.
    """
    if not pool.enable_caching or seq.num_computed or seq.host_block_ids or seq.needs_every_position:
        return []
    count = (seq.num_tokens - 1) // pool.block_size
    hashes = _block_hashes(pool, seq, count)
    hits: list[int] = []
    for i in range(count):
        block = pool.lookup(hashes[i], seq.block_keys[i])
        if block is None:
            break
        hits.append(block)
    return hits


def cache_computed_blocks(pool: BlockPool, seq: Sequence) -> None:
    """Registers `seq`'s blocks that are full and computed (their KV is in the cache tensors)."""
    if not pool.enable_caching:
        return
    full = min(seq.num_computed // pool.block_size, len(seq.block_ids))
    if full <= seq.num_registered_blocks:
        return
    hashes = _block_hashes(pool, seq, full)
    for i in range(seq.num_registered_blocks, full):
        pool.register(seq.block_ids[i], hashes[i], seq.block_keys[i])
    seq.num_registered_blocks = full


def hashes_completed(pool: BlockPool, seq: Sequence, num_new: int) -> list[int]:
    """Hashes of the full blocks that computing `num_new` more tokens of `seq` completes."""
    if not pool.enable_caching:
        return []
    first, end = seq.num_computed // pool.block_size, (seq.num_computed + num_new) // pool.block_size
    return _block_hashes(pool, seq, end)[first:end]


def first_missing_hash(pool: BlockPool, seq: Sequence, num_hits: int) -> int | None:
    """The hash of the first of a starting `seq`'s full blocks the cache did not have (None: no such
    block, or `seq` resumes with KV of its own)."""
    if (not pool.enable_caching or seq.num_computed or seq.host_block_ids or seq.needs_every_position
            or num_hits >= (seq.num_tokens - 1) // pool.block_size):
        return None
    return _block_hashes(pool, seq, num_hits + 1)[num_hits]
