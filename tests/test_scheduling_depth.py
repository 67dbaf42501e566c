"""Scheduling beyond the admission order: priorities with aging, swap/auto preemption, reserve admission,
admission stall reasons. Scheduler rules on fake requests; identical greedy outputs through the real
engine under KV pressure."""
from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

from cbatch.config import ConfigError, EngineConfig, SamplingParams
from cbatch.engine.policy import PreemptionPolicy, PriorityOrder
from cbatch.io.rows import RowError, sampling_from_row
from helpers import fake_scheduler, generate, make_engine, random_prompts, step
from helpers import fake_seq as seq

make = partial(fake_scheduler, budget=64)


# ---- priorities and aging -----------------------------------------------------------------------
def test_urgent_row_behind_many_backfill_rows_starts_first():
    sched, _ = make(max_seqs=2)
    backfill = [seq(i, 6, priority=5) for i in range(10)]
    for s in backfill:
        sched.add(s)
    urgent = seq(10, 6, priority=0)
    sched.add(urgent)
    assert [s for s, _ in sched.schedule().scheduled][0] is urgent


def test_urgent_row_arriving_later_takes_the_next_free_slot():
    sched, _ = make(max_seqs=2, priority=PriorityOrder(None))
    backfill = [seq(i, 6, max_tokens=3, priority=5) for i in range(10)]
    for s in backfill:
        sched.add(s)
    step(sched)
    urgent = seq(10, 6, max_tokens=3, priority=0)
    sched.add(urgent)
    while urgent.first_scheduled_step is None:
        step(sched)
    started_after = [s for s in backfill if s.first_scheduled_step and s.first_scheduled_step > 1]
    assert all(s.first_scheduled_step >= urgent.first_scheduled_step for s in started_after)
    assert sum(1 for s in backfill if s.first_scheduled_step is None) >= 6  # it overtook the queue


def run_stream(aging_steps, steps=80):
    """One slot; a favoured row arrives every step; one disfavoured row waits from step 0."""
    sched, _ = make(max_seqs=1, priority=PriorityOrder(aging_steps))
    loner = seq(0, 4, max_tokens=2, priority=3)
    sched.add(loner)
    for i in range(1, steps + 1):
        sched.add(seq(i, 4, max_tokens=2, priority=0))
        step(sched)
    return loner, sched


def test_aging_lets_a_disfavoured_row_finish_behind_a_stream_of_favoured_rows():
    loner, sched = run_stream(aging_steps=5)
    assert loner.is_finished
    # it waits only for the favoured rows that arrived within (3 - 0) classes x 5 steps after it
    # (15 rows of 2 steps each on the one slot), not for the endless rest of the stream
    assert loner.first_scheduled_step - loner.arrival_step <= 2 * 15 + 2
    waits = sched.stats.wait_steps_by_priority
    assert max(waits[3]) >= 3 * 5 - 5 and len(waits[0]) > 10
    starved, _ = run_stream(aging_steps=0)  # strict classes: the same stream starves it
    assert starved.first_scheduled_step is None


def test_preemption_takes_the_lowest_priority_even_when_older():
    sched, pool = make(blocks=6, block_size=4, budget=100)
    low = seq(0, 7, priority=9)
    sched.add(low)
    step(sched)
    high_a, high_b = seq(1, 7, priority=0), seq(2, 7, priority=0)
    sched.add(high_a)
    sched.add(high_b)
    victims = []
    for _ in range(4):
        victims += step(sched).preempted
    assert victims and victims[0] is low  # not the newest (high_b): the worst class goes first


# ---- swap preemption ----------------------------------------------------------------------------
def test_swap_out_and_in_keeps_computed_tokens_and_frees_host_slots_after_the_copy():
    sched, pool = make(blocks=6, block_size=4, budget=100, preemption=PreemptionPolicy("swap"), num_host_blocks=8)
    a, b, c = seq(0, 7, max_tokens=4), seq(1, 7, max_tokens=4), seq(2, 7, max_tokens=4)
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    step(sched)
    plan = step(sched)  # position 8 needs a third block each: c is swapped out
    assert plan.preempted == [c] and c.num_computed == 8 and c.block_ids == []
    assert [h for _, h in plan.swap_out] == c.host_block_ids and len(plan.swap_out) == 2
    assert sched.host.num_free == 6 and sched.stats.recomputed_tokens == 0
    while not plan.swap_in:
        plan = step(sched)
    host_ids = [h for h, _ in plan.swap_in]
    assert c.host_block_ids == [] and c.block_ids[:2] == [d for _, d in plan.swap_in]
    assert sched.host.num_free == 6 and all(sched.host.ref_count(h) == 1 for h in host_ids)  # read this step
    step(sched)
    assert sched.host.num_free == 8  # released once the runner has copied them back
    assert sched.stats.swapped_out_blocks == 2 and sched.stats.swapped_in_blocks == 2


@pytest.mark.parametrize("computed,host_free,expect", [(300, 100, True), (100, 100, False), (300, 1, False)])
def test_auto_preemption_swaps_only_long_recomputes_that_fit(computed, host_free, expect):
    s = seq(0, 400)
    s.num_computed = computed
    s.block_ids = list(range(-(-computed // 16)))
    assert PreemptionPolicy("auto", auto_swap_min_tokens=256).swaps(s, host_free) is expect
    assert PreemptionPolicy("recompute").swaps(s, 10**6) is False


def test_runner_swap_copies_blocks_through_a_separate_host_buffer(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"], num_kv_blocks=10, block_size=4, preemption="swap")
    kv = engine.runner.kv_cache
    assert kv.num_host_blocks == 40  # capped at 4 pools' worth
    torch.manual_seed(0)
    kv.tensor.copy_(torch.randn_like(kv.tensor))
    original = kv.tensor.clone()
    dim = kv.block_dim  # the cache's block dimension
    kv.swap([(3, 0), (5, 7)], [])
    kv.tensor.index_fill_(dim, torch.tensor([3, 5]), 0)
    assert kv._host.data_ptr() != kv.tensor.data_ptr()
    kv.swap([], [(7, 2), (0, 9)])
    assert torch.equal(kv.tensor.select(dim, 2), original.select(dim, 5))
    assert torch.equal(kv.tensor.select(dim, 9), original.select(dim, 3))
    assert kv.tensor.select(dim, 3).abs().sum() == 0  # the zeroed source stayed zero: a real copy


# ---- reserve admission and stall reasons ----------------------------------------------------------
def test_reserve_admits_only_what_fits_to_the_end_and_never_preempts():
    seqs = [seq(i, 6, max_tokens=10) for i in range(6)]  # 16 tokens = 4 blocks each at the end
    sched, pool = make(blocks=10, block_size=4, reserve=True)
    for s in seqs:
        sched.add(s)
    plan = step(sched)
    assert len(plan.scheduled) == 2  # 2 x 4 reserved of 10 blocks; a third would need 12
    assert sched.stats.stalled_reserved == 1
    while sched.has_work():
        assert not step(sched).preempted
    assert all(s.is_finished for s in seqs) and pool.num_free == pool.num_blocks


def test_stall_reasons_are_counted():
    sched, _ = make(max_seqs=2, budget=64)
    for i in range(5):
        sched.add(seq(i, 6, max_tokens=50))
    step(sched)
    assert sched.stats.stalled_max_num_seqs == 1
    sched2, _ = make(budget=8)
    for i in range(3):
        sched2.add(seq(i, 6))
    step(sched2)
    assert sched2.stats.stalled_token_budget == 1
    sched3, _ = make(blocks=3, block_size=4)
    for i in range(3):
        sched3.add(seq(i, 6))
    step(sched3)
    assert sched3.stats.stalled_no_free_blocks == 1
    assert sum(sched3.stats.admission_stalls.values()) == 1


# ---- settings and rows ----------------------------------------------------------------------------
def test_priority_row_field_and_flags_are_validated():
    defaults = SamplingParams()
    assert sampling_from_row({"priority": 3}, defaults).priority == 3
    assert sampling_from_row({"priority": 2.0}, defaults).priority == 2
    with pytest.raises(RowError, match="priority must be an integer"):
        sampling_from_row({"priority": "high"}, defaults)
    # the library names the field; the command line names its flag (cbatch.cli.flag_of, one table)
    from cbatch.cli import flag_of

    for settings, field, flag in ((dict(preemption="sometimes"), "preemption", "--preemption"),
                                  (dict(admission="greedy"), "admission", "--admission"),
                                  (dict(swap_space_gb=-1), "swap_space_gb", "--swap-space")):
        with pytest.raises(ConfigError, match=f"^{field}: ") as caught:
            EngineConfig(**settings)
        assert caught.value.field == field and flag_of(caught.value.field) == flag


# ---- through the engine: identical greedy outputs under heavy KV pressure -------------------------
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def pressure_workload(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    prompts = random_prompts(12, vocab=384, seed=21, min_len=10, max_len=50)
    reference = generate(make_engine(path, max_num_seqs=1, enable_prefix_cache=False), prompts, PARAMS)
    return path, prompts, reference


@pytest.mark.parametrize("settings", [
    dict(preemption="recompute"),
    dict(preemption="swap"),
    dict(preemption="swap", swap_space_gb=8 * 2048 / 2**30),  # room for 8 blocks: long victims recompute
    dict(preemption="swap", enable_prefix_cache=False, max_num_batched_tokens=9),
])
def test_outputs_identical_across_preemption_modes(pressure_workload, settings):
    path, prompts, reference = pressure_workload
    engine = make_engine(path, num_kv_blocks=20, block_size=4, **settings)
    assert generate(engine, prompts, PARAMS) == reference
    stats = engine.scheduler.stats
    assert stats.preemptions > 0
    if settings["preemption"] == "swap":
        assert stats.swapped_out_blocks > 0 and stats.swapped_in_blocks == stats.swapped_out_blocks
    if "swap_space_gb" in settings:
        assert stats.recomputed_tokens > 0  # victims too big for the host space fell back to recompute
    assert engine.pool.num_free == engine.pool.num_blocks and engine.scheduler.host.num_free == engine.scheduler.host.num_blocks


def test_reserve_admission_identical_and_without_preemption(pressure_workload):
    path, prompts, reference = pressure_workload
    engine = make_engine(path, num_kv_blocks=20, block_size=4, admission="reserve")
    assert generate(engine, prompts, PARAMS) == reference
    assert engine.scheduler.stats.preemptions == 0 and engine.scheduler.stats.stalled_reserved > 0


def test_mixed_priorities_identical(pressure_workload):
    path, prompts, reference = pressure_workload
    params = [dataclasses.replace(PARAMS, priority=i % 3) for i in range(len(prompts))]
    engine = make_engine(path, num_kv_blocks=20, block_size=4, preemption="swap", priority_aging_steps=4)
    assert generate(engine, prompts, params) == reference
    assert set(engine.scheduler.stats.wait_steps_by_priority) == {0, 1, 2}


def test_cli_run_with_priorities_reports_waits_per_class(tiny_chat_model, tmp_path):
    import json

    from ops_jobs import read_output, run_inprocess, write_jsonl

    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    rows = [{"prompt": f"Tell me about number {i}", "priority": i % 2} for i in range(6)] + [{"prompt": "x", "priority": "high"}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    code, _, err = run_inprocess("run", str(src), "--out", str(out), "--model", str(tiny_chat_model), "--max-tokens", "4",
                                 "--report", str(report), "--preemption", "auto", "--admission", "reserve", "--priority", "1",
                                 "--max-num-seqs", "2", "--allow-errors", "--display", "none")
    assert code == 0, err
    results = read_output(out)
    assert [r["finish_reason"] for r in results[:6]] == ["length"] * 6
    assert results[6]["finish_reason"] == "error" and "priority must be an integer" in results[6]["error"]
    data = json.loads(report.read_text())
    waits = data["latency"]["queue_wait_steps_by_priority"]
    assert set(waits) == {"0", "1"} and waits["0"]["requests"] == 3 and waits["1"]["requests"] == 3
    assert waits["0"]["max"] <= waits["1"]["max"]  # the urgent class went first
    assert data["latency"]["oldest_wait_steps"] == waits["1"]["max"]
    assert {"prefix_cache_hit_rate", "prefix_cache_saved_tokens", "admission_stalls"} <= set(data["utilization"])
    code, _, err = run_inprocess("run", str(src), "--out", str(tmp_path / "o2.jsonl"), "--model", str(tiny_chat_model),
                                 "--preemption", "sometimes")
    assert code == 2 and "--preemption" in err and "Traceback" not in err
