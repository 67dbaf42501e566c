"""Scheduling policies: small objects the scheduler consults; none touches blocks, budgets or tensors.

- `AdmissionPolicy`: which waiting request joins the batch next (`longest-first`, `fcfs`, `static`, `prefix`:
  rows opening with the same tokens together), and how the batch is kept (`batching`): continuously, or in
  static groups admitted when the batch is empty that run to their longest member (batching.py).
- `PriorityOrder`: per-request priority classes with aging, the first part of every queue key.
- `PreemptionPolicy`: what happens to a victim's KV: recompute later, or swap to host memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cbatch.engine.batching import ContinuousBatching, StaticGroups
from cbatch.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    name: str
    # a fresh key for each scheduler (a key may remember what it saw): smaller key = admitted sooner
    new_key: Callable[[], Callable[[Sequence], tuple]]
    batching: type[ContinuousBatching] = ContinuousBatching  # StaticGroups: fixed groups that run to their longest member


def _longest_first(seq: Sequence) -> tuple:
    # Offline jobs know every request up front: starting the long ones early keeps the batch full
    # to the end instead of finishing on a lone straggler.
    return (-seq.estimated_work, seq.seq_id)


def _arrival(seq: Sequence) -> tuple:
    return (seq.seq_id,)


PREFIX_TOKENS = 16  # rows that open with the same this many tokens (one default KV block) form a group


def _prefix_groups() -> Callable[[Sequence], tuple]:
    """Rows that open with the same PREFIX_TOKENS tokens (a shared system prompt) are admitted together, so the
    later ones find its KV blocks still cached. Groups go longest-first by the work of the first row seen of each
    (so rows that share nothing, each a group of its own, go in longest-first order), longest-first inside."""
    groups: dict[tuple[int, ...], tuple[int, int]] = {}  # opening tokens -> (-first row's work, group number)

    def key(seq: Sequence) -> tuple:
        group = groups.setdefault(tuple(seq.prompt_ids[:PREFIX_TOKENS]), (-seq.estimated_work, len(groups)))
        return (*group, -seq.estimated_work, seq.seq_id)

    return key


def _always(key: Callable[[Sequence], tuple]) -> Callable[[], Callable[[Sequence], tuple]]:
    return lambda: key


POLICY_BY_NAME: dict[str, AdmissionPolicy] = {
    "longest-first": AdmissionPolicy("longest-first", _always(_longest_first)),
    "fcfs": AdmissionPolicy("fcfs", _always(_arrival)),
    "static": AdmissionPolicy("static", _always(_arrival), batching=StaticGroups),
    "prefix": AdmissionPolicy("prefix", _prefix_groups),
}


def get_policy(name: str) -> AdmissionPolicy:
    return POLICY_BY_NAME[name]  # EngineConfig checked the name


@dataclass(frozen=True, slots=True)
class PriorityOrder:
    """Effective priority = priority - waited_steps / aging_steps (lower = sooner).

    Every waiting request ages at the same rate, so comparing effective priorities at any step is
    comparing `priority + arrival_step / aging_steps`: a key fixed at arrival, which a heap can
    keep. The arrival term is floored (`// aging_steps`) so requests arriving within one window of
    `aging_steps` steps keep the admission policy's order among themselves.
    NOTE: rows of a better priority p' < p that arrive more than (p - p') * aging_steps steps after
    a row of priority p rank behind it, so its wait is bounded by the work of the rows that arrived
    before then: no request waits forever behind a stream of favoured ones.
    """

    aging_steps: int | None = None  # None or 0: no aging (strict priority classes)

    def rank(self, seq: Sequence) -> int:
        age = seq.arrival_step // self.aging_steps if self.aging_steps else 0
        return seq.params.priority + age


@dataclass(frozen=True, slots=True)
class PreemptionPolicy:
    """`recompute` frees a victim's blocks (it prefills again later); `swap` copies them to host
    memory and back; `auto` swaps only victims whose recompute would be long."""

    mode: str = "recompute"  # recompute | swap | auto
    auto_swap_min_tokens: int = 256  # auto: swap victims with at least this many computed tokens

    def swaps(self, seq: Sequence, host_free_blocks: int) -> bool:
        """True when `seq` should be swapped out (and its blocks fit the free host space)."""
        if self.mode == "recompute" or seq.num_computed == 0 or len(seq.block_ids) > host_free_blocks:
            return False
        return self.mode == "swap" or seq.num_computed >= self.auto_swap_min_tokens
