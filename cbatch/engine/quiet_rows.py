"""The host step's quiet rows: the rows of a step that need nothing but the common case, so the scheduler can
account them and apply their tokens in one pass (at 256-1024 decoding rows, the per-row code is most of the host
step). Scheduling (`Scheduler._quiet_schedule`) and the step's inputs (the runner's `quiet_decode_tokens`) take
their quiet rows the same way.

NOTE: each predicate is the negation of every other branch of the per-row code it stands in for
(`Scheduler._account_row`; `Scheduler.apply_tokens`, `_append` and `finish.finish_reason`): a change there must be
mirrored here. tests/test_host_step.py runs every kind of row through both and compares.
One pass of inlined attribute tests each: they run every step over every row.
"""
from __future__ import annotations

from typing import Mapping

from cbatch.engine.sequence import Sequence, SequenceStatus
from cbatch.engine.step import StepPlan


def quiet_decodes(plan: StepPlan, max_model_len: int) -> list[bool]:
    """Per row of `plan`: True for a decode whose accounting is only "computed + 1, placeholder appended": not
    finished, one token that is its last (it samples), no samples to fork, its first token behind it, and still
    short of its length limit after the placeholder."""
    finished = SequenceStatus.FINISHED
    return [
        n == 1 and s.status is not finished
        and (num_tokens := s.prompt_len + (num_out := len(s.output_ids))) == s.num_computed + 1
        and not (s.children and not s.forked) and s.first_token_step is not None
        and num_out + 1 < s.params.max_tokens and num_tokens + 1 < max_model_len
        for s, n in plan.scheduled
    ]


def quiet_samples(plan: StepPlan, sampled: Mapping[int, int], stop_tokens: set[int], allowed: bool) -> list[bool]:
    """Per row of `plan`: True for a row whose token needs only "it replaces its placeholder". Among the
    rows `quiet_decodes` found quiet at `account` (each holds a placeholder, has its first token behind it and
    no samples to fork, and is short of its length limit: nothing between `account` and `apply_tokens` changes that;
    the engine's asynchronous order never preempts in between), those still running with no log-probabilities
    (of either kind), stop strings or grammar, and whose token cannot stop them (`stop_tokens`: every token that
    may stop some sequence). None where the batching takes no quiet rows (`allowed` False: static groups, where a
    finishing member can release the others mid-step)."""
    quiet = plan.accounted_quiet
    if not allowed or quiet is None:
        return [False] * len(plan.scheduled)
    finished = SequenceStatus.FINISHED
    return [
        q and s.status is not finished and s.logprobs is None and s.prompt_logprobs is None and s.stop is None
        and s.grammar is None and s.num_result_tokens is None and sampled[s.seq_id] not in stop_tokens
        for (s, _), q in zip(plan.scheduled, quiet)
    ]


def split_quiet(rows: list[tuple[Sequence, int]], quiet: list[bool]) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
    """(the quiet rows' sequences, the other rows in plan order)."""
    if all(quiet):
        return [s for s, _ in rows], []
    return [s for (s, _), q in zip(rows, quiet) if q], [r for r, q in zip(rows, quiet) if not q]
