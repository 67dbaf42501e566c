"""Iteration-level scheduler: decides, every step, which sequences run and how many tokens each gets.

One token budget (vLLM v1's rule): a sequence has `num_computed` of `num_tokens` tokens in the KV
cache; each step gives it tokens so that computed catches up. Decode (1 token), chunked prefill
(k tokens) and recompute after preemption all fall out of that rule.

Order inside a step: running decodes first (they are never starved), then running prefills that
were chunked, then admission of waiting requests while budget, sequence slots and KV blocks last.
When blocks run out, the newest-admitted running sequence is preempted by recompute (its blocks
are freed, it goes back to the front of the waiting queue); no admission happens in such a step.

The scheduler never touches tensors.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from cbatch.engine.kv_blocks import BlockPool
from cbatch.engine.policy import AdmissionPolicy
from cbatch.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(slots=True)
class StepPlan:
    """What one model step computes."""

    scheduled: list[tuple[Sequence, int]]  # (sequence, tokens to compute this step), decodes first
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass(slots=True)
class SchedulerStats:
    """Counters the report and the dashboard read; updated once per step, never per token."""

    steps: int = 0
    scheduled_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens computed again because their sequence was preempted
    padding_tokens: int = 0  # static batching: tokens computed for members that already finished
    occupancy_sum: float = 0.0  # sum over steps of running / max_num_seqs
    kv_usage_sum: float = 0.0  # sum over steps of used / total blocks
    peak_kv_blocks: int = 0


class Scheduler:
    def __init__(
        self,
        policy: AdmissionPolicy,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ) -> None:
        self.policy = policy
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.running: list[Sequence] = []  # admission order: newest last (the preemption victim)
        self._resume: deque[Sequence] = deque()  # preempted sequences, ahead of never-started work
        self._waiting: list[tuple[tuple, Sequence]] = []  # heap keyed by the policy
        self.stats = SchedulerStats()

    # ---- queue ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.arrival_step = self.stats.steps
        heapq.heappush(self._waiting, (self.policy.key(seq), seq))

    @property
    def num_waiting(self) -> int:
        return len(self._resume) + len(self._waiting)

    def has_work(self) -> bool:
        return bool(self.running or self._resume or self._waiting)

    def _peek_waiting(self) -> Sequence | None:
        if self._resume:
            return self._resume[0]
        return self._waiting[0][1] if self._waiting else None

    def _pop_waiting(self) -> Sequence:
        return self._resume.popleft() if self._resume else heapq.heappop(self._waiting)[1]

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan(scheduled=[])
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        # Running sequences: decodes first, then chunked prefills continuing, both in admission order.
        # NOTE (speed, the simulator runs this for 1000s of sequences): uncomputed counts are read once,
        # and the helper calls below are skipped on their common no-op path (inline checks).
        pending = [(s, s.num_uncomputed) for s in self.running]
        decodes = [p for p in pending if p[1] == 1]
        prefills = [p for p in pending if p[1] > 1]
        capacity = self.pool.block_size
        for seq, uncomputed in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            num_new = min(uncomputed, budget)
            if seq.num_result_tokens is not None and self._padding_blocked(seq, num_new):
                continue
            fits = seq.num_computed + num_new <= len(seq.block_ids) * capacity  # no new block needed
            if not fits and not self._grow(seq, num_new, scheduled_ids, plan):
                continue  # `seq` itself was preempted
            plan.scheduled.append((seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new

        if not plan.preempted:
            budget = self._admit(plan, budget, scheduled_ids)

        self._count(plan)
        return plan

    def _padding_blocked(self, seq: Sequence, num_new: int) -> bool:
        """Static batching's finished members compute padding only while that costs nobody else blocks
        and stays inside the model's context."""
        if seq.num_result_tokens is None:
            return False
        need = self.pool.blocks_for(seq.num_computed + num_new) - len(seq.block_ids)
        return need > self.pool.num_free or seq.num_tokens >= self.max_model_len

    def _grow(self, seq: Sequence, num_new: int, scheduled_ids: set[int], plan: StepPlan) -> bool:
        """Gives `seq` the blocks for `num_new` more tokens, preempting newer sequences if needed.

        Returns False when `seq` itself had to be preempted.
        """
        need = self.pool.blocks_for(seq.num_computed + num_new) - len(seq.block_ids)
        while need > self.pool.num_free:
            victim = next(
                (s for s in reversed(self.running) if s is not seq and s.seq_id not in scheduled_ids), None
            )
            if victim is None:
                victim = seq
            self._preempt(victim, plan)
            if victim is seq:
                return False
        if need > 0:
            seq.block_ids.extend(self.pool.allocate(need))
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self.pool.release(seq.block_ids)
        seq.block_ids = []
        self.stats.recomputed_tokens += seq.num_computed
        seq.num_computed = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._resume.appendleft(seq)
        plan.preempted.append(seq)
        self.stats.preemptions += 1

    def _admit(self, plan: StepPlan, budget: int, scheduled_ids: set[int]) -> int:
        if self.policy.group:
            return self._admit_group(plan, budget, scheduled_ids)
        while budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._peek_waiting()
            if seq is None:
                break
            num_new = min(seq.num_uncomputed, budget)
            need = self.pool.blocks_for(seq.num_computed + num_new)
            if need > self.pool.num_free:
                break  # wait for blocks; admitting out of order would starve the head of the queue
            self._pop_waiting()
            self._start(seq, self.pool.allocate(need))
            plan.scheduled.append((seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
        return budget

    def _admit_group(self, plan: StepPlan, budget: int, scheduled_ids: set[int]) -> int:
        """Static batching: a new group only when the previous one has completely left."""
        if self.running:
            return budget
        while len(self.running) < self.max_num_seqs and self._peek_waiting() is not None:
            self._start(self._pop_waiting(), [])
        for seq in self.running:
            if budget == 0:
                break
            num_new = min(seq.num_uncomputed, budget)
            if not self._grow(seq, num_new, scheduled_ids, plan):
                continue
            plan.scheduled.append((seq, num_new))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
        return budget

    def _start(self, seq: Sequence, blocks: list[int]) -> None:
        seq.block_ids = blocks
        seq.status = SequenceStatus.RUNNING
        if seq.first_scheduled_step is None:
            seq.first_scheduled_step = self.stats.steps + 1  # the step being built (1-based)
        self.running.append(seq)

    def _count(self, plan: StepPlan) -> None:
        stats = self.stats
        stats.steps += 1
        stats.scheduled_tokens += plan.num_tokens
        stats.padding_tokens += sum(n for s, n in plan.scheduled if s.num_result_tokens is not None)
        stats.occupancy_sum += len(self.running) / self.max_num_seqs
        stats.kv_usage_sum += self.pool.num_used / self.pool.num_blocks
        stats.peak_kv_blocks = max(stats.peak_kv_blocks, self.pool.num_used)

    # ---- after the step ---------------------------------------------------------------------
    def finish(self, seq: Sequence, reason: FinishReason) -> list[Sequence]:
        """Marks `seq` done; returns the sequences that now leave the batch (static groups leave together)."""
        seq.finish_reason = reason
        seq.num_result_tokens = len(seq.output_ids)
        seq.finish_step = self.stats.steps
        if not self.policy.group:
            self._release(seq)
            return [seq]
        if any(s.num_result_tokens is None for s in self.running):
            return []  # the group runs on to its longest member; `seq` keeps its slot
        group = list(self.running)
        for member in group:
            self._release(member)
        return group

    def release_stranded_group(self) -> list[Sequence]:
        """Static batching: when preemption took a group's last unfinished members, the finished ones
        leave now (returned, like `finish`'s). Otherwise they would pad forever, holding the blocks the
        preempted members wait for: a deadlock. Called after the step ran (their KV writes are done)."""
        if not self.policy.group or not self.running or any(s.num_result_tokens is None for s in self.running):
            return []
        group = list(self.running)
        for member in group:
            self._release(member)
        return group

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.pool.release(seq.block_ids)
        seq.block_ids = []
        seq.status = SequenceStatus.FINISHED
