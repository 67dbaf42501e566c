"""Admission order: which waiting request joins the batch next.

A policy is a small object the scheduler consults; it never touches blocks or budgets.
`group` policies (static batching) admit a whole group when the batch is empty and nothing else
until that group has finished.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from cbatch.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    name: str
    key: Callable[[Sequence], tuple]  # smaller key = admitted sooner
    group: bool = False  # static batching: fixed groups that run to their longest member


def _longest_first(seq: Sequence) -> tuple:
    # Offline jobs know every request up front: starting the long ones early keeps the batch full
    # to the end instead of finishing on a lone straggler.
    return (-seq.estimated_work, seq.seq_id)


def _arrival(seq: Sequence) -> tuple:
    return (seq.seq_id,)


POLICY_BY_NAME: dict[str, AdmissionPolicy] = {
    "longest-first": AdmissionPolicy("longest-first", _longest_first),
    "fcfs": AdmissionPolicy("fcfs", _arrival),
    "static": AdmissionPolicy("static", _arrival, group=True),
}


def get_policy(name: str) -> AdmissionPolicy:
    try:
        return POLICY_BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICY_BY_NAME)}") from None
