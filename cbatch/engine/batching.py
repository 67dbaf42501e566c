"""The two admission variants as objects the scheduler consults, not flags it tests.

Batching (chosen by the admission policy: `static` takes StaticGroups, the others ContinuousBatching):
- ContinuousBatching: a finished sequence leaves at once and waiting ones take its place, in queue order.
- StaticGroups (the static-batching baseline): a group is admitted when the batch is empty and runs to its
  longest member; members that finished keep their slot and compute padding until the group ends. Its steps
  are never scheduled ahead, taken as quiet rows (quiet_rows.py), or swapped out (a group's admission step may preempt a member,
  and a swap_out of blocks whose swap_in is planned in the same step would copy garbage).

Admission (--admission):
- OptimisticAdmission: a request starts when its next chunk's blocks are free.
- ReserveAdmission: only when its whole prompt + max_tokens (and its samples') fits in the blocks nobody
  running has a claim on, so it never preempts.
- ClosedAdmission: nothing starts (`Engine.close_admission`: a job's deadline came).

Each hook takes the scheduler (`sched`) and reads its running list, waiting queue and KV manager.
"""
from __future__ import annotations

from typing import Protocol

from cbatch.engine.encoder_budget import EncoderBudget
from cbatch.engine.images import whole_images
from cbatch.engine.kv_blocks import prefix_hits
from cbatch.engine.kv_manager import KVManager
from cbatch.engine.sequence import Sequence
from cbatch.engine.step import StepPlan


class Scheduler(Protocol):
    """What the hooks below use of the scheduler (`engine.scheduler.Scheduler`, which imports this module)."""

    running: list[Sequence]
    kv_manager: KVManager
    encoder: EncoderBudget
    admission: "OptimisticAdmission"
    max_model_len: int

    @property
    def num_waiting(self) -> int: ...
    def peek_waiting(self) -> Sequence | None: ...
    def pop_waiting(self) -> Sequence: ...
    def has_slots(self, seq: Sequence) -> bool: ...
    def start(self, seq: Sequence) -> None: ...
    def grow(self, seq: Sequence, num_new: int, plan: StepPlan) -> bool: ...
    def stall(self, reason: str) -> None: ...
    def admit_in_order(self, plan: StepPlan, budget: int) -> int: ...


class ContinuousBatching:
    schedules_ahead = True  # asynchronous scheduling may run its steps ahead
    quiet_rows = True  # quiet decodes scheduled, accounted and given their tokens in one pass (quiet_rows.py)
    may_swap = True  # preemption may swap a victim to host memory

    def admit(self, sched: Scheduler, plan: StepPlan, budget: int) -> int:
        return sched.admit_in_order(plan, budget)

    def leaving(self, sched: Scheduler, seq: Sequence) -> list[Sequence]:
        """Who leaves the batch when `seq` finishes."""
        return [seq]

    def stranded(self, sched: Scheduler) -> list[Sequence]:
        """Who must leave after a step that preempted (see StaticGroups)."""
        return []

    def padding_tokens(self, plan: StepPlan) -> int:
        return 0

    def padding_blocked(self, sched: Scheduler, seq: Sequence, num_new: int) -> bool:
        return False


class StaticGroups(ContinuousBatching):
    schedules_ahead = False
    quiet_rows = False
    may_swap = False

    def admit(self, sched: Scheduler, plan: StepPlan, budget: int) -> int:
        """A new group only when the previous one has completely left: every waiting sequence that has a
        slot (and, under reserve admission, its lifetime blocks), then the group's chunks."""
        if sched.running:
            if sched.num_waiting:
                sched.stall("static_group")
            return budget
        while (seq := sched.peek_waiting()) is not None:
            if not sched.has_slots(seq):
                sched.stall("max_num_seqs")
                break
            if (reason := sched.admission.refuses(sched, seq, [])) is not None:
                sched.stall(reason)
                break
            sched.pop_waiting()
            # (never a host copy: groups recompute)
            sched.kv_manager.restore(seq, prefix_hits(sched.kv_manager.pool, seq), plan)
            sched.start(seq)
        for seq in sched.running:
            if budget == 0:
                break
            num_new = whole_images(seq, min(seq.num_uncomputed, budget))  # (0: an image computed whole: the next step)
            if num_new:
                num_new = sched.encoder.fit(seq, seq.num_computed, num_new)
            if not num_new or not sched.grow(seq, num_new, plan):
                continue
            plan.scheduled.append((seq, num_new))
            budget -= num_new
            sched.encoder.take(seq, seq.num_computed, num_new)
        return budget

    def leaving(self, sched: Scheduler, seq: Sequence) -> list[Sequence]:
        """The whole group once its last member finished; nobody before (`seq` keeps its slot, padding)."""
        if seq not in sched.running:  # a sample that finished before it joined
            return [seq]
        if any(s.num_result_tokens is None for s in sched.running):
            return []
        return list(sched.running)

    def stranded(self, sched: Scheduler) -> list[Sequence]:
        """When preemption took a group's last unfinished members, the finished ones leave now. Otherwise they
        would pad forever, holding the blocks the preempted members wait for: a deadlock. (After the step:
        their KV writes are done.)"""
        if not sched.running or any(s.num_result_tokens is None for s in sched.running):
            return []
        return list(sched.running)

    def padding_tokens(self, plan: StepPlan) -> int:
        """Tokens computed for members that already finished (only static groups keep those running)."""
        return sum(n for s, n in plan.scheduled if s.num_result_tokens is not None)

    def padding_blocked(self, sched: Scheduler, seq: Sequence, num_new: int) -> bool:
        """A finished member computes padding only while that costs nobody else blocks and stays inside the
        model's context."""
        need = sched.kv_manager.blocks_needed(seq, num_new)
        return need > sched.admission.spare_blocks(sched) or seq.num_tokens >= sched.max_model_len


class OptimisticAdmission:
    name = "optimistic"

    def refuses(self, sched: Scheduler, seq: Sequence, hits: list[int]) -> str | None:
        """Why `seq` may not start although its first chunk's blocks are free (None: it may)."""
        return None

    def spare_blocks(self, sched: Scheduler) -> int:
        """Free blocks nobody has a claim on."""
        return sched.kv_manager.pool.num_free


class ReserveAdmission(OptimisticAdmission):
    name = "reserve"

    def refuses(self, sched: Scheduler, seq: Sequence, hits: list[int]) -> str | None:
        return "reserved" if sched.kv_manager.lifetime_blocks(seq, hits) > self.spare_blocks(sched) else None

    def spare_blocks(self, sched: Scheduler) -> int:
        """Running sequences' future growth is claimed. NOTE: that is what makes reserve admission never preempt."""
        return sched.kv_manager.pool.num_free - sched.kv_manager.claimed_blocks(sched.running)


class ClosedAdmission(OptimisticAdmission):
    """Nothing new starts (a job's deadline came: the running rows finish, the waiting ones stay waiting)."""

    name = "closed"

    def refuses(self, sched: Scheduler, seq: Sequence, hits: list[int]) -> str | None:
        return "closed"


ADMISSIONS = {"optimistic": OptimisticAdmission, "reserve": ReserveAdmission}
