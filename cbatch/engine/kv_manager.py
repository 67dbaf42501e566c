"""The scheduler's KV bookkeeping: which blocks each sequence holds, and what it will need.

The scheduler decides who runs and who is preempted; this object does what those decisions mean for blocks:
a starting sequence's prefix-cache hits or swapped-out copy, new blocks as a sequence grows, swaps to host
memory, a forked sample's share of its parent's prompt, the blocks a sequence frees, and the sums admission
and scheduling-ahead need (a sequence's lifetime blocks, the next tokens' blocks). Only accounting: the KV
tensors are the runner's, and block copies travel in the StepPlan (`swap_out`, `swap_in`, `copies`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cbatch.config import SamplingParams
from cbatch.engine.kv_blocks import BlockPool, cache_computed_blocks, first_missing_hash, hashes_completed, prefix_hits
from cbatch.engine.sequence import Sequence
from cbatch.engine.stats import SchedulerStats
from cbatch.engine.step import StepPlan


@dataclass(slots=True)
class Start:
    """What a waiting sequence would start with (`KVManager.prepare_start`)."""

    hits: list[int]  # cached prefix blocks it reuses (not held yet)
    num_new: int  # tokens it computes in its first step
    fresh: int  # new blocks it takes


class KVManager:
    def __init__(self, pool: BlockPool, num_host_blocks: int, max_model_len: int, stats: SchedulerStats) -> None:
        self.pool = pool
        self.host = BlockPool(num_host_blocks, pool.block_size)  # swap slots in host memory (accounting)
        self.max_model_len = max_model_len
        self.stats = stats
        self._host_to_free: list[int] = []  # host slots read by the last step's swap_in
        self._inflight: set[int] = set()  # hashes of the full blocks this step's prefill chunks complete
        self._fork_copies: list[tuple[Sequence, int, int]] = []  # (child, source, its copy) for the next plan

    def begin_step(self) -> None:
        """A new plan: the host slots the last one read are free again; no prefix block is being computed."""
        self.host.release(self._host_to_free)
        self._host_to_free = []
        self._inflight.clear()

    # ---- growing ----------------------------------------------------------------------------
    def blocks_needed(self, seq: Sequence, num_new: int) -> int:
        """New blocks `seq` needs to compute `num_new` more tokens (<= 0: none)."""
        return self.pool.blocks_for(seq.num_computed + num_new) - len(seq.block_ids)

    def grow(self, seq: Sequence, need: int) -> None:
        """Gives `seq` `need` new blocks (the caller made sure they are free)."""
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))

    def note_chunk(self, seq: Sequence, num_new: int) -> None:
        """`seq` computes `num_new` tokens this step: the full blocks they complete are in flight (a sequence
        starting on the same prefix waits a step for them instead of computing them twice)."""
        self._inflight.update(hashes_completed(self.pool, seq, num_new))

    def growing_decodes(self, decodes: list[tuple[Sequence, int]]) -> tuple[list[Sequence], int]:
        """(the decodes, (sequence, 1) pairs, whose one token needs a new block; the blocks they need). NOTE:
        computed tokens are always in the sequence's blocks, so a new block is needed only when num_computed %
        block_size == 0 (tested first: a slot, not a list; this runs every step over every decoding row)."""
        size = self.pool.block_size
        growing = [s for s, _ in decodes if not s.num_computed % size and s.num_computed >= len(s.block_ids) * size]
        return growing, sum(self.pool.blocks_for(s.num_computed + 1) - len(s.block_ids) for s in growing)

    def next_tokens_blocks(self, running: list[Sequence], at_limit: set[int]) -> int:
        """Blocks the running sequences' next tokens need (`blocks_needed` where positive, inlined: this runs
        every step over every row), but those of `at_limit` (they are not scheduled again)."""
        size = self.pool.block_size
        return sum([-(-num_tokens // size) - num_blocks for s in running
                    if (num_tokens := s.prompt_len + len(s.output_ids)) > (num_blocks := len(s.block_ids)) * size
                    and s.seq_id not in at_limit])

    def trim(self, seq: Sequence) -> int | None:
        """Gives back the blocks `seq` holds beyond its tokens' (rejected drafts' KV: never registered, never
        shared); returns the blocks it keeps, None when it held none extra."""
        keep = self.pool.blocks_for(seq.num_tokens)
        if len(seq.block_ids) <= keep:
            return None
        self.pool.release(seq.block_ids[keep:])
        del seq.block_ids[keep:]
        return keep

    # ---- starting ---------------------------------------------------------------------------
    def prepare_start(self, seq: Sequence, budget: int, fit: Callable[[Sequence, int, int], int] | None = None
                      ) -> Start | str:
        """What starting `seq` now would take, or why it cannot: "prefix_pending" (its next prefix block is
        being computed this step by another sequence: waiting one step turns it and the rest of the shared
        prefix into hits; never a deadlock, `_inflight` holds this step's blocks only), "token_budget" (its next
        chunk is an image to compute whole, past the budget left), "encoder_budget" (`fit`, the step's encoder
        budget, gives its first chunk no token: encoder_budget.py) or "no_free_blocks"."""
        hits = prefix_hits(self.pool, seq)
        if first_missing_hash(self.pool, seq, len(hits)) in self._inflight:
            return "prefix_pending"
        reused = len(seq.host_block_ids) + len(hits)  # blocks it starts with before new ones
        computed = seq.num_computed + len(hits) * self.pool.block_size
        num_new = min(seq.num_tokens - computed, budget)
        if seq.images is not None:  # (a bidirectional model's images are computed whole: engine/images.py)
            num_new = seq.images.chunk_tokens(computed, num_new)
            if num_new == 0:
                return "token_budget"
        if fit is not None and not (num_new := fit(seq, computed, num_new)):
            return "encoder_budget"
        fresh = max(0, self.pool.blocks_for(computed + num_new) - reused)
        cost = fresh + len(seq.host_block_ids) + sum(1 for b in hits if self.pool.is_evictable(b))
        return "no_free_blocks" if cost > self.pool.num_free else Start(hits, num_new, fresh)

    def start(self, seq: Sequence, start: Start, plan: StepPlan) -> None:
        """Gives `seq` what `prepare_start` found: its KV to reuse and fresh blocks for its first chunk."""
        self.restore(seq, start.hits, plan)
        seq.block_ids.extend(self.pool.allocate(start.fresh))
        self.note_chunk(seq, start.num_new)

    def restore(self, seq: Sequence, hits: list[int], plan: StepPlan) -> None:
        """Gives a starting `seq` the KV it can reuse: its swapped-out copy (the caller checked that its
        blocks are free), or cached prefix blocks (held here, before any allocation could evict them)."""
        if seq.host_block_ids:
            blocks = self.pool.allocate(len(seq.host_block_ids))
            plan.swap_in.extend(zip(seq.host_block_ids, blocks))
            self._host_to_free.extend(seq.host_block_ids)
            self.stats.swapped_in_blocks += len(blocks)
            seq.host_block_ids = []
            seq.block_ids = blocks
            return
        for block in hits:
            self.pool.hold(block)  # NOTE: before any allocate, which could evict an unheld hit
        seq.block_ids = list(hits)
        seq.num_computed = len(hits) * self.pool.block_size
        seq.num_registered_blocks = len(hits)
        if self.pool.enable_caching:
            self.stats.prefix_cache_queries += 1
            self.stats.prefix_cache_query_tokens += seq.num_tokens
            self.stats.prefix_cache_hit_tokens += seq.num_computed
            if seq.images is not None:
                self.stats.prefix_cache_hit_image_tokens += sum(
                    end - first for _, _, first, end in seq.images.overlapping(0, seq.num_computed))

    # ---- leaving ----------------------------------------------------------------------------
    def swap_out(self, seq: Sequence, plan: StepPlan) -> None:
        """Plans the copy of `seq`'s blocks (holding its `num_computed` tokens) to host slots."""
        seq.host_block_ids = self.host.allocate(len(seq.block_ids))
        plan.swap_out.extend(zip(seq.block_ids, seq.host_block_ids))
        self.stats.swap_preemptions += 1
        self.stats.swapped_out_blocks += len(seq.block_ids)

    def free(self, seq: Sequence) -> None:
        """`seq` gives its blocks back; its full computed ones stay in the prefix cache (LRU) for others."""
        cache_computed_blocks(self.pool, seq)
        self.pool.release(seq.block_ids)
        seq.block_ids = []

    def cache_computed(self, seq: Sequence) -> None:
        """Registers `seq`'s newly full, computed blocks in the prefix cache: from the next step on, others share them."""
        cache_computed_blocks(self.pool, seq)

    # ---- forks ------------------------------------------------------------------------------
    def share_prompt(self, parent: Sequence, child: Sequence) -> None:
        """`child` runs on `parent`'s computed prompt: the full blocks held by reference (nobody writes a full
        block), the partial last one copied (in the next plan, before anything writes)."""
        full, partial = divmod(parent.num_computed, self.pool.block_size)
        for block in parent.block_ids[:full]:
            self.pool.hold(block)
        child.block_ids = parent.block_ids[:full]
        if partial:
            copy = self.pool.allocate(1)[0]
            child.block_ids.append(copy)
            self._fork_copies.append((child, parent.block_ids[full], copy))
        child.num_computed = parent.num_computed
        child.block_hashes, child.block_keys = parent.block_hashes[:full], parent.block_keys[:full]
        child.num_registered_blocks = min(parent.num_registered_blocks, full)

    def can_share_prompt(self, parent: Sequence) -> bool:
        """A block for the copy of `parent`'s partial last block, if it has one."""
        return not parent.num_computed % self.pool.block_size or self.pool.num_free > 0

    def take_copies(self) -> list[tuple[int, int]]:
        """The forks' block copies for the next plan (a child that finished at its first token needs none:
        its block was freed)."""
        copies = [(src, dst) for child, src, dst in self._fork_copies if not child.is_finished]
        self._fork_copies = []
        return copies

    # ---- what a sequence will need --------------------------------------------------------
    def never_fits(self, prompt_len: int, params: SamplingParams) -> str | None:
        """Why a request can never run (too long for the model, or for the KV pool even alone), or None."""
        if prompt_len == 0:
            return "the prompt is empty"
        if prompt_len >= self.max_model_len:
            return f"the prompt has {prompt_len} tokens; the model's context is {self.max_model_len}"
        need = self.pool.blocks_for(min(prompt_len + params.max_tokens, self.max_model_len))
        if need > self.pool.num_blocks:
            return (
                f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) needs {need} KV blocks "
                f"but the pool has {self.pool.num_blocks}; lower max_tokens or raise --num-kv-blocks"
            )
        return None

    def final_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` holds at most: its prompt plus max_tokens, within the model's context."""
        return self.pool.blocks_for(min(seq.prompt_len + seq.params.max_tokens, self.max_model_len))

    def children_blocks(self, seq: Sequence) -> int:
        """Blocks the samples `seq` will fork take beyond the prompt's full blocks they share."""
        return seq.pending_children * (self.final_blocks(seq) - seq.prompt_len // self.pool.block_size)

    def lifetime_blocks(self, seq: Sequence, hits: list[int]) -> int:
        """Free blocks `seq` (and the samples it will fork) will take from now to its end (cached hits held by
        others cost none)."""
        shared = sum(1 for b in hits if not self.pool.is_evictable(b))
        return self.final_blocks(seq) - shared + self.children_blocks(seq)

    def claimed_blocks(self, running: list[Sequence]) -> int:
        """The blocks `running` will still take to their ends."""
        return sum(max(0, self.final_blocks(s) - len(s.block_ids)) + self.children_blocks(s) for s in running)


__all__ = ["KVManager", "Start", "prefix_hits"]
