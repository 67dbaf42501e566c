"""Scheduler and block pool on fake requests: no model, no tensors."""
from __future__ import annotations

import pytest

from cbatch.engine.kv_blocks import BlockPool
from cbatch.engine.sequence import FinishReason
from helpers import advance
from helpers import fake_scheduler as make
from helpers import fake_seq as seq


def test_block_pool_ref_counts():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert pool.num_free == 1 and all(pool.ref_count(b) == 1 for b in a)
    pool.release(a[:1])
    assert pool.num_free == 2
    with pytest.raises(RuntimeError):
        pool.release(a[:1])
    with pytest.raises(RuntimeError):
        pool.allocate(3)


def test_budget_and_chunked_prefill():
    sched, pool = make(budget=10)
    sched.add(seq(0, 25))
    plan = sched.schedule()
    assert plan.scheduled[0][1] == 10
    advance(sched, plan)
    plan = sched.schedule()
    assert plan.scheduled[0][1] == 10 and plan.num_tokens <= 10


def test_decodes_come_first_and_are_not_starved():
    sched, _ = make(budget=8)
    a, b = seq(0, 3), seq(1, 40)
    sched.add(a)
    advance(sched, sched.schedule())  # a's prompt done, it now decodes
    sched.add(b)
    for _ in range(4):
        plan = sched.schedule()
        assert plan.scheduled[0] == (a, 1)  # decode first, every step
        assert plan.num_tokens <= 8
        advance(sched, plan)


def test_longest_first_admits_by_estimated_work():
    sched, _ = make(policy="longest-first", max_seqs=1, budget=1000)
    short, long_ = seq(0, 5, max_tokens=4), seq(1, 50, max_tokens=400)
    sched.add(short)
    sched.add(long_)
    assert sched.schedule().scheduled[0][0] is long_


def test_fcfs_admits_in_arrival_order():
    sched, _ = make(policy="fcfs", max_seqs=1, budget=1000)
    first, second = seq(0, 5), seq(1, 50)
    sched.add(first)
    sched.add(second)
    assert sched.schedule().scheduled[0][0] is first


def test_preemption_takes_the_newest_and_requeues_it_first():
    sched, pool = make(blocks=6, block_size=4, budget=100)
    a, b, c = seq(0, 7), seq(1, 7), seq(2, 7)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert [s for s, _ in plan.scheduled] == [a, b, c]  # 2 blocks each: pool full
    advance(sched, plan)
    advance(sched, sched.schedule())  # position 7 still fits the second block
    advance(sched, plan := sched.schedule())  # position 8 needs a third block each: c is preempted
    assert c.num_preemptions == 1 and c in plan.preempted and c.num_computed == 0
    assert all(s is not c for s, _ in plan.scheduled)
    waiting_head = sched.peek_waiting()
    assert waiting_head is c
    assert sched.stats.preemptions == 1
    assert sched.stats.recomputed_tokens == 8


def test_no_admission_in_a_step_that_preempted():
    sched, pool = make(blocks=4, block_size=4, budget=100)
    a, b = seq(0, 8), seq(1, 7)
    sched.add(a)
    sched.add(b)
    advance(sched, sched.schedule())
    sched.add(seq(2, 1))
    plan = sched.schedule()
    assert plan.preempted
    assert all(s.seq_id != 2 for s, _ in plan.scheduled)


def test_max_num_seqs_limits_running():
    sched, _ = make(max_seqs=3, budget=1000)
    for i in range(10):
        sched.add(seq(i, 4))
    assert len(sched.schedule().scheduled) == 3


def test_static_group_runs_to_its_longest_member():
    sched, pool = make(policy="static", max_seqs=2, budget=100)
    a, b, c = seq(0, 3), seq(1, 3), seq(2, 3)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert {s.seq_id for s, _ in plan.scheduled} == {0, 1}
    advance(sched, plan)
    assert sched.finish(a, FinishReason.STOP) == []  # a keeps its slot
    plan = sched.schedule()
    assert {s.seq_id for s, _ in plan.scheduled} == {0, 1}  # a computes padding, c waits
    assert sched.stats.padding_tokens == 1
    advance(sched, plan)
    left = sched.finish(b, FinishReason.LENGTH)
    assert set(left) == {a, b}
    assert pool.num_free == pool.num_blocks
    assert [s for s, _ in sched.schedule().scheduled] == [c]


def test_blocks_return_when_everything_finishes():
    sched, pool = make(blocks=30, block_size=4, budget=16, max_seqs=4)
    seqs = [seq(i, 5 + 3 * i, max_tokens=3) for i in range(6)]
    for s in seqs:
        sched.add(s)
    while sched.has_work():
        plan = sched.schedule()
        advance(sched, plan)
        for s, _ in plan.scheduled:
            if len(s.output_ids) >= s.params.max_tokens and not s.is_finished:
                sched.finish(s, FinishReason.LENGTH)
    assert pool.num_free == pool.num_blocks
    assert all(s.is_finished for s in seqs)


def test_prefix_policy_admits_rows_of_one_opening_together():
    """`--policy prefix`: rows that open with the same 16 tokens are admitted one after another (the later ones
    find the blocks cached), groups longest-first by their first row; rows sharing nothing: longest-first's order."""
    from cbatch.config import SamplingParams
    from cbatch.engine.sequence import Sequence

    def admitted(policy: str, prompts: list[list[int]]) -> list[int]:
        sched, _ = make(policy, blocks=1000, max_seqs=1, budget=10_000)
        for i, prompt in enumerate(prompts):
            sched.add(Sequence(seq_id=i, prompt_ids=prompt, params=SamplingParams(max_tokens=4)))
        order = []
        while sched.has_work():
            plan = sched.schedule()
            order += [s.seq_id for s, n in plan.scheduled if n > 1]
            advance(sched, plan)
        return order

    a, b = list(range(100, 116)), list(range(200, 216))  # two openings of 16 tokens
    prompts = [a + [1] * 9, b + [2] * 30, a + [3] * 20, b + [4] * 2, a + [5] * 5, [7] * 40]
    # work (prompt + max_tokens): 0: 29, 1: 50, 2: 40, 3: 22, 4: 25, 5: 44. Groups by their first row's work: b (row
    # 1: 50), then row 5 alone (44), then a (row 0: 29); longest-first inside each
    assert admitted("prefix", prompts) == [1, 3, 5, 2, 0, 4]
    assert admitted("longest-first", prompts) == [1, 5, 2, 0, 4, 3]
    unique = [[i] * (5 + 3 * (i % 7)) + [i + 1] * 16 for i in range(12)]
    assert admitted("prefix", unique) == admitted("longest-first", unique)
