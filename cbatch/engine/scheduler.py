"""Iteration-level scheduler: decides, every step, which sequences run and how many tokens each gets.

One token budget (vLLM v1's rule): a sequence has `num_computed` of `num_tokens` tokens in the KV
cache; each step gives it tokens so that computed catches up. Decode (1 token), chunked prefill
(k tokens), recompute after preemption and prefix-cache hits all fall out of that rule.

Order inside a step: running decodes first (they are never starved), then running prefills that
were chunked, then admission of waiting requests while budget, sequence slots and KV blocks last.
When blocks run out, the least important running sequence (lowest priority class, newest admitted
among equals) is preempted: by recompute (its blocks are freed) or by swap (its blocks are copied
to host memory first); it goes back to the waiting queue ahead of never-started work of its class.
No admission happens in a step that preempted.

The policies are objects (policy.py): admission order, priority classes with aging, preemption
mode; `reserve` admission admits a request only when its whole prompt + max_tokens fits.

The scheduler never touches tensors: swaps are (device block, host block) pairs in the StepPlan,
which the runner copies before the model call.

One direction per step: `schedule()` -> StepPlan -> the runner computes it -> `update(plan, sampled)`
applies the sampled tokens, decides who finished (EOS, stop strings, max_tokens, context) and returns
them. Every change to a sequence's state happens here; the runner frees its per-sequence rows only as
a plan says (`preempted`, and `finished`: the sequences that left in the previous update).
"""
from __future__ import annotations

import heapq
from typing import Mapping

from cbatch.config import SamplingParams, distinct_params
from cbatch.engine.finish import at_length_limit, finish_reason
from cbatch.engine.kv_blocks import BlockPool, cache_computed_blocks, first_missing_hash, hashes_completed, prefix_hits
from cbatch.engine.policy import AdmissionPolicy, PreemptionPolicy, PriorityOrder
from cbatch.engine.sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus
from cbatch.engine.stats import SchedulerStats
from cbatch.engine.step import StepInfo, StepLogprobs, StepOutput, StepPlan

class Scheduler:
    def __init__(
        self,
        policy: AdmissionPolicy,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        *,
        priority: PriorityOrder = PriorityOrder(),
        preemption: PreemptionPolicy = PreemptionPolicy(),
        reserve: bool = False,
        num_host_blocks: int = 0,
    ) -> None:
        self.policy = policy
        self.priority = priority
        self.preemption = preemption
        self.reserve = reserve  # admit only when prompt + max_tokens fits (never preempts)
        self.pool = pool
        self.host = BlockPool(num_host_blocks, pool.block_size)  # swap slots in host memory (accounting)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.running: list[Sequence] = []  # admission order: newest last
        self._waiting: list[tuple[tuple, Sequence]] = []  # heap: (priority class, resumed first, order)
        self._num_requeued = 0
        self._host_to_free: list[int] = []  # host slots read by the last step's swap_in
        self._inflight: set[int] = set()  # hashes of the full blocks this step's prefill chunks complete
        self._left: list[Sequence] = []  # finished since the last plan with work: the next plan tells the runner
        self._reserved_slots = 0  # batch slots admitted parents hold for the samples they will fork
        self._fork_copies: list[tuple[Sequence, int, int]] = []  # (child, source, its copy) for the next plan
        self.stats = SchedulerStats()
        self.last_step = StepInfo()
        self._at_limit: set[int] = set()  # sequences a placeholder took to max_tokens / the context: not scheduled again
        self._resolving_step = 0  # the step whose tokens `resolve` applies (1-based): first-token and finish steps
        # every token that may stop some sequence this scheduler has seen (EOS ids, stop_token_ids): a sampled
        # token outside it cannot stop its sequence, whatever the sequence's own settings
        self._stop_tokens: set[int] = set()

    def admission_error(self, prompt_len: int, params: SamplingParams) -> str | None:
        """Why a request can never run here (too long for the model, or for the KV pool even alone), or None."""
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

    # ---- queue ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._watch_stop_tokens(seq)
        seq.status = SequenceStatus.WAITING
        seq.arrival_step = self.stats.steps
        heapq.heappush(self._waiting, ((self.priority.rank(seq), 1, 0, self.policy.key(seq)), seq))

    def _watch_stop_tokens(self, seq: Sequence) -> None:
        """Keeps `_stop_tokens` a superset of `seq`'s (and its samples') stop tokens."""
        for sample in seq.samples:
            self._stop_tokens.update(sample.eos_ids, sample.params.stop_token_ids)

    def _requeue(self, seq: Sequence) -> None:
        """A preempted sequence goes ahead of never-started work of its class, latest preempted first."""
        self._num_requeued += 1
        heapq.heappush(self._waiting, ((self.priority.rank(seq), 0, -self._num_requeued, ()), seq))

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self.running or self._waiting)

    def _peek_waiting(self) -> Sequence | None:
        return self._waiting[0][1] if self._waiting else None

    def _pop_waiting(self) -> Sequence:
        return heapq.heappop(self._waiting)[1]

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan(scheduled=[])
        budget = self.max_num_batched_tokens
        self.host.release(self._host_to_free)
        self._host_to_free = []
        self._inflight.clear()

        # Running sequences: decodes first, then chunked prefills continuing, both in admission order.
        decodes, prefills = self._pending()
        growing = self._decodes_in_bulk(decodes, budget)
        if growing is not None:  # the steady decode state: no row can be cut, skipped or preempted
            for seq in growing:
                self._grow(seq, 1, plan)  # never preempts: the free blocks cover every growing row
            plan.scheduled.extend(decodes)
            budget -= len(decodes)
            decodes = []
        budget = self._schedule_running(decodes + prefills, plan, budget)

        if plan.preempted:
            # NOTE: no admission after a preemption: the freed blocks go to the running sequences
            # first, and a swap_in never shares a step with a swap_out.
            if self._waiting:
                self.stats.stalled_after_preemption += 1
        elif self.policy.group:
            budget = self._admit_group(plan, budget)
        else:
            budget = self._admit(plan, budget)

        if plan.scheduled:  # NOTE: an empty plan never reaches the runner: its news waits for the next one
            self._count(plan)  # (an idle step is counted by `count_idle`, when the engine idles)
            plan.finished, self._left = self._left, []
            # a child that finished at its first token needs no copy (its block was freed)
            plan.copies = [(src, dst) for child, src, dst in self._fork_copies if not child.is_finished]
            self._fork_copies = []
        return plan

    def _pending(self) -> tuple[list[tuple[Sequence, int]], list[tuple[Sequence, int]]]:
        """The running sequences to schedule as (sequence, uncomputed tokens): the decodes (1), then the
        prefills (> 1), each in admission order. Those a placeholder took to their limit are left out
        (asynchronous scheduling: they finish when the step in flight resolves).
        NOTE (speed: this runs every step over every running row): `num_uncomputed` is inlined."""
        pending = [(s, s.prompt_len + len(s.output_ids) - s.num_computed) for s in self.running]
        if self._at_limit:
            pending = [p for p in pending if p[0].seq_id not in self._at_limit]
        decodes = [p for p in pending if p[1] == 1]
        prefills = [p for p in pending if p[1] > 1] if len(decodes) < len(pending) else []
        return decodes, prefills

    def _decodes_in_bulk(self, decodes: list[tuple[Sequence, int]], budget: int) -> list[Sequence] | None:
        """The decodes that need a new block, when `decodes` can be scheduled all at once: the budget covers
        them, none is a static group's finished member (only groups keep those running), and the free blocks
        cover every one that grows, so `_schedule_running` would schedule each of them, in this order,
        without a preemption. None otherwise (`_schedule_running` takes them one by one)."""
        if len(decodes) > budget or self.policy.group:
            return None
        # the 1 token needs a block when the computed ones fill theirs; NOTE: computed tokens are always in the
        # sequence's blocks, so that needs num_computed % block_size == 0 (tested first: a slot, not a list)
        size = self.pool.block_size
        growing = [s for s, _ in decodes if not s.num_computed % size and s.num_computed >= len(s.block_ids) * size]
        need = sum(self.pool.blocks_for(s.num_computed + 1) - len(s.block_ids) for s in growing)
        return growing if need <= self.pool.num_free else None

    def _schedule_running(self, pending: list[tuple[Sequence, int]], plan: StepPlan, budget: int) -> int:
        """Schedules `pending` (running sequences, uncomputed tokens) in order, one by one, while the budget
        lasts; grows their blocks, preempting less important sequences where needed. Returns the budget left."""
        capacity = self.pool.block_size
        for seq, uncomputed in pending:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            num_new = min(uncomputed, budget)
            if seq.num_result_tokens is not None and self._padding_blocked(seq, num_new):
                continue
            fits = seq.num_computed + num_new <= len(seq.block_ids) * capacity  # no new block needed
            if not fits and not self._grow(seq, num_new, plan):
                continue  # `seq` itself was preempted
            plan.scheduled.append((seq, num_new))
            budget -= num_new
            if num_new > 1:
                self._inflight.update(hashes_completed(self.pool, seq, num_new))
        return budget

    def _padding_blocked(self, seq: Sequence, num_new: int) -> bool:
        """Static batching's finished members compute padding only while that costs nobody else blocks
        and stays inside the model's context."""
        if seq.num_result_tokens is None:
            return False
        need = self.pool.blocks_for(seq.num_computed + num_new) - len(seq.block_ids)
        return need > self._spare_blocks() or seq.num_tokens >= self.max_model_len

    def _grow(self, seq: Sequence, num_new: int, plan: StepPlan) -> bool:
        """Gives `seq` the blocks for `num_new` more tokens, preempting less important sequences if needed.

        Returns False when `seq` itself had to be preempted.
        """
        need = self.pool.blocks_for(seq.num_computed + num_new) - len(seq.block_ids)
        while need > self.pool.num_free:
            victim = self._pick_victim(seq, plan)
            self._preempt(victim, plan)
            if victim is seq:
                return False
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))
        return True

    # ---- preemption -------------------------------------------------------------------------
    def _pick_victim(self, seq: Sequence, plan: StepPlan) -> Sequence:
        """The running sequence of the worst priority class not yet scheduled this step, newest first
        among equals; `seq` itself when there is none or every candidate outranks it."""
        rank = self.priority.rank
        scheduled_ids = {s.seq_id for s, _ in plan.scheduled}  # (built here: preemption is rare, steps are not)
        victim: Sequence | None = None
        for other in reversed(self.running):
            if other is seq or other.seq_id in scheduled_ids:
                continue
            if victim is None or rank(other) > rank(victim):
                victim = other
        if victim is None or rank(victim) < rank(seq):
            return seq
        return victim

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self._reserved_slots -= seq.pending_children
        cache_computed_blocks(self.pool, seq)  # NOTE: its cached blocks outlive it in the LRU
        # NOTE: static groups always recompute: a group's admission step may also preempt a member,
        # and a swap_out of blocks whose swap_in is planned in the same step would copy garbage.
        if not self.policy.group and self.preemption.swaps(seq, self.host.num_free):
            self._swap_out(seq, plan)
        else:
            self.stats.recomputed_tokens += seq.num_computed
            seq.num_computed = 0
        self.pool.release(seq.block_ids)
        seq.block_ids = []
        seq.num_registered_blocks = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._requeue(seq)
        plan.preempted.append(seq)
        self.stats.preemptions += 1

    def _swap_out(self, seq: Sequence, plan: StepPlan) -> None:
        """Plans the copy of `seq`'s blocks (holding its `num_computed` tokens) to host slots."""
        seq.host_block_ids = self.host.allocate(len(seq.block_ids))
        plan.swap_out.extend(zip(seq.block_ids, seq.host_block_ids))
        self.stats.swap_preemptions += 1
        self.stats.swapped_out_blocks += len(seq.block_ids)

    # ---- admission --------------------------------------------------------------------------
    def _admit(self, plan: StepPlan, budget: int) -> int:
        """Starts waiting sequences in queue order while budget, slots and blocks last.

        NOTE: admission stops at the first request that does not fit (never skips it): skipping would
        starve long requests and the priority order.
        """
        while self._waiting:
            seq = self._waiting[0][1]
            reason = self._admission_blocker(budget, seq) or self._try_start(seq, budget, plan)
            if reason is not None:
                self._stall(reason)
                break
            self._pop_waiting()
            budget -= plan.scheduled[-1][1]
        return budget

    def _admission_blocker(self, budget: int, seq: Sequence) -> str | None:
        if budget == 0:
            return "token_budget"
        return None if self._has_slots(seq) else "max_num_seqs"

    def _has_slots(self, seq: Sequence) -> bool:
        """Batch slots for `seq` and the samples it will fork. NOTE: a row with more samples than
        max_num_seqs starts alone: the children without a slot wait and are recomputed.
        A sequence a placeholder took to its limit holds no slot: it is never scheduled again and leaves when the
        step in flight resolves (asynchronous scheduling admits in its place one step sooner, as the synchronous
        order does; the runner has rows for 2 x max_num_seqs)."""
        used = len(self.running) - len(self._at_limit) + self._reserved_slots
        return used + 1 + seq.pending_children <= self.max_num_seqs or (used == 0 and not self.running)

    def _try_start(self, seq: Sequence, budget: int, plan: StepPlan) -> str | None:
        """Starts `seq` with the blocks for its next chunk (reusing cached prefix blocks or its swapped
        copy) and schedules that chunk; returns why not instead when the blocks are not there."""
        hits = prefix_hits(self.pool, seq)
        if first_missing_hash(self.pool, seq, len(hits)) in self._inflight:
            # NOTE: its next prefix block is being computed this step by another sequence: waiting one
            # step turns that block (and the rest of the shared prefix) into cache hits instead of
            # computing it twice. At most one step per new shared prefix; never a deadlock, since
            # `_inflight` only holds blocks scheduled in this step.
            return "prefix_pending"
        reused = len(seq.host_block_ids) + len(hits)  # blocks it starts with before new ones
        computed = seq.num_computed + len(hits) * self.pool.block_size
        num_new = min(seq.num_tokens - computed, budget)
        fresh = max(0, self.pool.blocks_for(computed + num_new) - reused)
        cost = fresh + len(seq.host_block_ids) + sum(1 for b in hits if self.pool.is_evictable(b))
        if cost > self.pool.num_free:
            return "no_free_blocks"
        if self.reserve and self._lifetime_blocks(seq, hits) > self._spare_blocks():
            return "reserved"
        self._restore_kv(seq, hits, plan)
        seq.block_ids.extend(self.pool.allocate(fresh))
        self._start(seq)
        plan.scheduled.append((seq, num_new))
        self._inflight.update(hashes_completed(self.pool, seq, num_new))
        return None

    def _admit_group(self, plan: StepPlan, budget: int) -> int:
        """Static batching: a new group only when the previous one has completely left."""
        if self.running:
            if self._waiting:
                self._stall("static_group")
            return budget
        while self._waiting:
            seq = self._waiting[0][1]
            if not self._has_slots(seq):
                self._stall("max_num_seqs")
                break
            if self.reserve and self._lifetime_blocks(seq, []) > self._spare_blocks():
                self._stall("reserved")
                break
            self._pop_waiting()
            self._restore_kv(seq, prefix_hits(self.pool, seq), plan)  # (never a host copy: groups recompute)
            self._start(seq)
        for seq in self.running:
            if budget == 0:
                break
            num_new = min(seq.num_uncomputed, budget)
            if not self._grow(seq, num_new, plan):
                continue
            plan.scheduled.append((seq, num_new))
            budget -= num_new
        return budget

    def _restore_kv(self, seq: Sequence, hits: list[int], plan: StepPlan) -> None:
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

    def _start(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self._reserved_slots += seq.pending_children
        if seq.first_scheduled_step is None:
            seq.first_scheduled_step = self.stats.steps + 1  # the step being built (1-based)
            waits = self.stats.wait_steps_by_priority.setdefault(seq.params.priority, [])
            waits.append(self.stats.steps - seq.arrival_step)
        self.running.append(seq)

    def _stall(self, reason: str) -> None:
        name = f"stalled_{reason}"
        setattr(self.stats, name, getattr(self.stats, name) + 1)

    # ---- reserve admission ------------------------------------------------------------------
    def _final_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` holds at most: its prompt plus max_tokens, within the model's context."""
        return self.pool.blocks_for(min(seq.prompt_len + seq.params.max_tokens, self.max_model_len))

    def _lifetime_blocks(self, seq: Sequence, hits: list[int]) -> int:
        """Free blocks `seq` (and the samples it will fork) will take from now to its end (cached hits
        held by others cost none)."""
        shared = sum(1 for b in hits if not self.pool.is_evictable(b))
        return self._final_blocks(seq) - shared + self._children_blocks(seq)

    def _children_blocks(self, seq: Sequence) -> int:
        """Blocks the samples `seq` will fork take beyond the prompt's full blocks they share."""
        return seq.pending_children * (self._final_blocks(seq) - seq.prompt_len // self.pool.block_size)

    def _spare_blocks(self) -> int:
        """Free blocks nobody has a claim on. In reserve mode, running sequences' future growth is
        claimed: NOTE: that is what makes reserve admission never preempt."""
        if not self.reserve:
            return self.pool.num_free
        claimed = sum(max(0, self._final_blocks(s) - len(s.block_ids)) + self._children_blocks(s) for s in self.running)
        return self.pool.num_free - claimed

    # ---- bookkeeping ------------------------------------------------------------------------
    def count_idle(self) -> None:
        """A step with nothing to run (waiting for arrivals): counted like any step. An empty schedule while a
        step is in flight (asynchronous scheduling: its rows are at their limits) is no step: it only waits."""
        self._count(StepPlan(scheduled=[]))

    def _count(self, plan: StepPlan) -> None:
        plan.info = StepInfo.of(plan.scheduled)
        stats = self.stats
        stats.steps += 1
        plan.step = stats.steps
        stats.scheduled_tokens += plan.info.scheduled_tokens
        stats.computed_prompt_tokens += plan.info.prompt_tokens
        if self.policy.group:  # only static groups keep finished members (num_result_tokens set) running
            stats.padding_tokens += sum(n for s, n in plan.scheduled if s.num_result_tokens is not None)
        stats.occupancy_sum += len(self.running) / self.max_num_seqs
        stats.kv_usage_sum += self.pool.num_used / self.pool.num_blocks
        stats.peak_kv_blocks = max(stats.peak_kv_blocks, self.pool.num_used)

    # ---- after the step ---------------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: Mapping[int, int], logprobs: StepLogprobs | None = None) -> list[Sequence]:
        """Applies a computed step: returns the sequences that left the batch finished.

        `sampled` maps seq_id -> token for every sequence whose chunk reached its last token (those
        sample; the others computed part of a prompt), and for the samples such a sequence forks;
        `logprobs` has the log-probabilities of the sequences that ask. The step's counters go to `last_step`.
        The two halves, `account` (what the step computed) then `resolve` (what it sampled), run apart under
        asynchronous scheduling: the next step is scheduled between them.
        """
        self.account(plan)
        return self.resolve(plan, sampled, logprobs)

    def account(self, plan: StepPlan) -> None:
        """What a launched step computes, before its tokens are known: the computed counts advance, and each
        sequence that samples holds a PLACEHOLDER output token (the next step's input, read on the device
        from this step's sampled tokens). A sequence the placeholder takes to its length limit is not
        scheduled again: it finishes when the step resolves. Then the blocks the step completed go to the
        prefix cache, in plan order: from the next step on, others may share them."""
        plan.accounted_quiet = self._quiet_decodes(plan)
        quiet, rest = self._split(plan.scheduled, plan.accounted_quiet)
        for seq in quiet:  # `_account_row`'s whole effect on these rows
            seq.num_computed += 1
            seq.output_ids.append(PLACEHOLDER)
        for seq, num_new in rest:
            self._account_row(seq, num_new, plan.step)
        if self.pool.enable_caching:
            size, finished = self.pool.block_size, SequenceStatus.FINISHED
            for seq in [s for s, _ in plan.scheduled if s.num_computed // size > s.num_registered_blocks]:
                if seq.status is not finished:  # (its work was discarded: see `_account_row`)
                    cache_computed_blocks(self.pool, seq)

    def _quiet_decodes(self, plan: StepPlan) -> list[bool]:
        """Per row of `plan`: True for a decode whose accounting is only "computed + 1, placeholder appended":
        not finished, one token that is its last (it samples), no samples to fork, its first token behind it,
        and still short of its length limit after the placeholder.
        NOTE: this is `_account_row`'s every other branch, negated: keep the two in step.
        (One pass of inlined attribute tests: it runs every step over every row.)"""
        finished, max_len = SequenceStatus.FINISHED, self.max_model_len
        return [
            n == 1 and s.status is not finished
            and (num_tokens := s.prompt_len + (num_out := len(s.output_ids))) == s.num_computed + 1
            and not (s.children and not s.forked) and s.first_token_step is not None
            and num_out + 1 < s.params.max_tokens and num_tokens + 1 < max_len
            for s, n in plan.scheduled
        ]

    def _account_row(self, seq: Sequence, num_new: int, step: int) -> None:
        """`account` for one row (see there), but the prefix cache's."""
        if seq.is_finished:  # finished when the previous step resolved: this step's work is discarded
            return
        seq.num_computed += num_new
        if seq.num_computed < seq.num_tokens or seq.pending_children:
            return  # a prompt chunk short of the end (or a fork: `resolve` appends its tokens)
        seq.output_ids.append(PLACEHOLDER)
        if seq.first_token_step is None:
            seq.first_token_step = step
        if seq.num_result_tokens is None and at_length_limit(seq, self.max_model_len):
            self._at_limit.add(seq.seq_id)

    def resolve(self, plan: StepPlan, sampled: Mapping[int, int], logprobs: StepLogprobs | None = None) -> list[Sequence]:
        """A step's sampled tokens replace its placeholders; returns the sequences that left the batch finished
        (EOS, stop, grammar, length). See `update`."""
        info = plan.info
        finished: list[Sequence] = []
        self._resolving_step = plan.step
        quiet, rest = self._split(plan.scheduled, self._quiet_samples(plan, sampled))
        for seq in quiet:  # `_append`'s whole effect on these rows (none of them is in `_at_limit`)
            seq.output_ids[-1] = sampled[seq.seq_id]
        info.sampled_tokens += len(quiet)
        for seq, num_new in rest:
            if logprobs is not None and seq.seq_id in logprobs.prompt:
                seq.prompt_logprobs.extend(logprobs.prompt[seq.seq_id])
            if seq.is_finished:
                continue  # discarded work (see `account`)
            if seq.pending_children:  # NOTE: before the parent's token, which may finish it and free its blocks
                if seq.num_computed < seq.num_tokens:
                    continue  # a prompt chunk short of the end
                finished.extend(self._fork(seq, sampled, logprobs, info))
            elif not seq.output_ids or seq.output_ids[-1] != PLACEHOLDER:
                continue  # a prompt chunk short of the end: nothing sampled
            self._at_limit.discard(seq.seq_id)
            finished.extend(self._append(seq, sampled[seq.seq_id], logprobs, info))
        if plan.preempted:  # a static group may have lost its last unfinished members
            finished.extend(self._release_stranded_group())
        self.last_step = info
        self._left.extend(finished)
        return finished

    def _quiet_samples(self, plan: StepPlan, sampled: Mapping[int, int]) -> list[bool]:
        """Per row of `plan`: True for a row whose resolving is only "its token replaces its placeholder". Among
        the rows `account` found quiet (each holds a placeholder, has its first token behind it and no samples
        to fork, and is short of its length limit: nothing between `account` and `resolve` changes that; the
        engine's asynchronous order never preempts in between), those still running with no log-probabilities
        (of either kind), stop strings or grammar, not a static group's (a finishing member can release the
        others mid-step), and whose token cannot stop them (`_stop_tokens`).
        NOTE: this and `_quiet_decodes` are `resolve`'s and `_append`'s (`finish.finish_reason`'s) every other
        branch, negated: keep them in step. (One pass of inlined tests: it runs every step over every row.)"""
        quiet = plan.accounted_quiet
        if self.policy.group or quiet is None:
            return [False] * len(plan.scheduled)
        finished, stop_tokens = SequenceStatus.FINISHED, self._stop_tokens
        return [
            q and s.status is not finished and s.logprobs is None and s.prompt_logprobs is None and s.stop is None
            and s.grammar is None and s.num_result_tokens is None and sampled[s.seq_id] not in stop_tokens
            for (s, _), q in zip(plan.scheduled, quiet)
        ]

    @staticmethod
    def _split(rows: list[tuple[Sequence, int]], quiet: list[bool]) -> tuple[list, list]:
        """(the quiet rows' sequences, the other rows in plan order)."""
        if all(quiet):
            return [s for s, _ in rows], []
        return [s for (s, _), q in zip(rows, quiet) if q], [r for r, q in zip(rows, quiet) if not q]

    def can_schedule_ahead(self, inflight: StepPlan) -> bool:
        """Whether the next step may be scheduled before `inflight` resolves (asynchronous scheduling): no
        sequence in it needs its sampled token on the host to prepare its next step (a grammar's mask, the
        penalties' counts, log-probabilities, the samples it forks), no static group, and enough free blocks
        that the next schedule cannot preempt (a victim's in-flight token would land on a waiting sequence)."""
        if self.policy.group:
            return False
        seqs = [seq for seq, _ in inflight.scheduled]
        if any([s.grammar is not None or s.prompt_logprobs is not None or (s.children and not s.forked) for s in seqs]):
            return False
        if any(p.penalized or p.logprobs is not None for p in distinct_params([s.params for s in seqs])):
            return False
        # the blocks the running sequences' next tokens need (those a placeholder took to their limit need none);
        # `blocks_for(num_tokens) - len(block_ids)` where positive, inlined: this runs every step over every row
        size, at_limit = self.pool.block_size, self._at_limit
        need = sum([-(-num_tokens // size) - num_blocks for s in self.running
                    if (num_tokens := s.prompt_len + len(s.output_ids)) > (num_blocks := len(s.block_ids)) * size
                    and s.seq_id not in at_limit])
        return need <= self.pool.num_free

    def _append(self, seq: Sequence, token: int, logprobs: StepLogprobs | None, info: StepInfo) -> list[Sequence]:
        """Puts a sampled token in its placeholder, or appends it (a forked sample's first token), with its
        log-probabilities; returns the sequences that leave the batch finished because of it."""
        if seq.output_ids and seq.output_ids[-1] == PLACEHOLDER:
            seq.output_ids[-1] = token
        else:
            seq.output_ids.append(token)
        if seq.logprobs is not None and logprobs is not None:
            seq.logprobs.extend(logprobs.sampled[seq.seq_id])
        if seq.first_token_step is None:
            seq.first_token_step = self._resolving_step
        if seq.num_result_tokens is not None:
            return []  # static batching: a finished member computing padding
        info.sampled_tokens += 1
        reason = finish_reason(seq, token, self.max_model_len)
        return self.finish(seq, reason) if reason is not None else []

    def _fork(self, parent: Sequence, sampled: Mapping[int, int], logprobs: StepLogprobs | None,
              info: StepInfo) -> list[Sequence]:
        """Starts the other samples of `parent`'s row on its prompt KV, each with its own first token (drawn
        from the same logits with its own seed): the full blocks are shared by reference, the partial last
        block is copied for each child (in the next plan, before anything writes). A child that finds no
        free slot or block waits and is recomputed, like a preempted sequence. Returns the children that
        finished at their first token."""
        parent.forked = True
        self._watch_stop_tokens(parent)  # (its children, in case they were given after `add`)
        self._reserved_slots -= len(parent.children)
        full, partial = divmod(parent.num_computed, self.pool.block_size)
        finished: list[Sequence] = []
        for child in parent.children:
            child.arrival_step, child.first_scheduled_step = parent.arrival_step, parent.first_scheduled_step
            child.prompt_logprobs = parent.prompt_logprobs  # complete: computed once, by the parent
            attached = len(self.running) < self.max_num_seqs and (not partial or self.pool.num_free > 0)
            if attached:
                self._share_prompt_kv(parent, child, full, partial)
            finished.extend(self._append(child, sampled[child.seq_id], logprobs, info))
            if not attached and not child.is_finished:
                child.status = SequenceStatus.WAITING
                self._requeue(child)
        return finished

    def _share_prompt_kv(self, parent: Sequence, child: Sequence, full: int, partial: int) -> None:
        """`child` runs on `parent`'s computed prompt: its `full` blocks held by reference, a copy of the
        partial one (if `partial` tokens are in it)."""
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
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        self.stats.forked_samples += 1

    def finish(self, seq: Sequence, reason: FinishReason) -> list[Sequence]:
        """Marks `seq` done; returns the sequences that now leave the batch (static groups leave together)."""
        seq.finish_reason = reason
        seq.num_result_tokens = len(seq.output_ids)
        seq.finish_step = self._resolving_step
        if not self.policy.group or seq not in self.running:  # (a sample that finished before it joined)
            self._release(seq)
            return [seq]
        if any(s.num_result_tokens is None for s in self.running):
            return []  # the group runs on to its longest member; `seq` keeps its slot
        group = list(self.running)
        for member in group:
            self._release(member)
        return group

    def _release_stranded_group(self) -> list[Sequence]:
        """Static batching: when preemption took a group's last unfinished members, the finished ones
        leave now. Otherwise they would pad forever, holding the blocks the preempted members wait for:
        a deadlock. Runs after the step (their KV writes are done)."""
        if not self.policy.group or not self.running or any(s.num_result_tokens is None for s in self.running):
            return []
        group = list(self.running)
        for member in group:
            self._release(member)
        return group

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        cache_computed_blocks(self.pool, seq)
        self.pool.release(seq.block_ids)
        seq.block_ids = []
        seq.status = SequenceStatus.FINISHED
