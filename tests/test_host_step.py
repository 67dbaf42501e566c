"""The host step's quiet rows are only rows whose general per-row code would do exactly the same: with them
switched off (every row through the general code) a workload gives the same plans, block ids, step inputs,
sampling settings, tokens and counters. This is what keeps the quiet-row tests (`Scheduler._quiet_schedule`,
`quiet_rows.quiet_decodes` and `quiet_samples`, the runner's `quiet_decode_tokens`) in step with the code they skip."""
from __future__ import annotations

import random

import numpy as np
import pytest

from cbatch.config import SamplingParams
from cbatch.engine import input_builder
from cbatch.engine import scheduler as scheduler_module
from cbatch.engine.engine import run_to_completion
from cbatch.engine.scheduler import Scheduler
from helpers import fake_scheduler, fake_seq, make_engine


def _general_path_only(monkeypatch) -> None:
    monkeypatch.setattr(Scheduler, "_quiet_schedule", lambda self, decodes, budget: None)
    monkeypatch.setattr(scheduler_module, "quiet_decodes", lambda plan, max_len: [False] * len(plan.scheduled))
    monkeypatch.setattr(scheduler_module, "quiet_samples", lambda plan, *args: [False] * len(plan.scheduled))
    monkeypatch.setattr(input_builder, "quiet_decode_tokens", lambda rows: [None] * len(rows))


def _scheduler_trace(caching: bool, async_order: bool) -> list:
    """Many fake requests through a tight pool (preemption), EOS and stop tokens drawn at random."""
    sched, _ = fake_scheduler("fcfs", blocks=120, block_size=4, max_seqs=48, budget=96, max_len=200, caching=caching)
    rng = random.Random(3)
    shared = [rng.randrange(3, 40) for _ in range(12)]
    seqs = []
    for i in range(150):
        prompt = shared[: rng.choice([0, 4, 9, 12])] + [rng.randrange(3, 40) for _ in range(rng.randint(1, 20))]
        seq = fake_seq(i, prompt, max_tokens=rng.randint(1, 40))
        seq.params = SamplingParams(max_tokens=seq.params.max_tokens, stop_token_ids=rng.choice([[], [5]]),
                                    min_tokens=rng.choice([0, 2]))
        seq.eos_ids = frozenset({2})
        seqs.append(seq)
        sched.add(seq)
    trace, inflight = [], None
    while sched.has_work() or inflight is not None:
        if async_order and inflight is not None and not sched.can_schedule_ahead(inflight[0]):
            sched.apply_tokens(*inflight)
            inflight = None
            continue
        plan = sched.schedule()
        tokens = {s.seq_id: rng.choice([2, 5] + list(range(6, 40))) for s, _ in plan.scheduled}
        tokens.update({c.seq_id: 7 for s, _ in plan.scheduled for c in s.children})
        if async_order:
            finished = sched.apply_tokens(*inflight) if inflight is not None else []
            sched.account(plan)
            inflight = (plan, tokens) if plan else None
        else:
            finished = sched.update(plan, tokens) if plan else []
        trace.append(([(s.seq_id, n, list(s.block_ids)) for s, n in plan.scheduled], [s.seq_id for s in plan.preempted],
                      [s.seq_id for s in finished], plan.info))
    return trace + [[(s.output_ids, s.finish_reason, s.first_token_step, s.finish_step) for s in seqs], sched.stats]


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("async_order", [False, True])
def test_scheduler_quiet_rows_change_nothing(monkeypatch, caching, async_order):
    quiet = _scheduler_trace(caching, async_order)
    _general_path_only(monkeypatch)
    assert _scheduler_trace(caching, async_order) == quiet


def _engine_trace(path, settings: dict) -> list:
    """A tiny model's run with the features that are never quiet rows (forks, log-probabilities, stop tokens,
    min_tokens, prefix sharing, preemption); every step's inputs and sampling settings, and the outputs."""
    engine = make_engine(path, max_num_seqs=12, max_num_batched_tokens=48, num_kv_blocks=48, block_size=4, **settings)
    steps = []
    build = engine.runner._build

    def recording_build(plan):
        inputs, sampling_seqs, prompt_seqs, *pool_rows = build(plan)
        steps.append(([np.asarray(getattr(inputs, k)).tolist() if k not in ("prompt_rows",) else inputs.prompt_rows
                       for k in inputs.__slots__], [s.seq_id for s in sampling_seqs], [s.seq_id for s in prompt_seqs]))
        return (inputs, sampling_seqs, prompt_seqs, *pool_rows)

    engine.runner._build = recording_build
    rng = random.Random(11)
    shared = [rng.randrange(3, 300) for _ in range(20)]
    prompts = [shared[: rng.choice([0, 8, 17])] + [rng.randrange(3, 300) for _ in range(rng.randint(1, 30))] for _ in range(30)]
    params = [SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 0.9]), seed=i,
                             ignore_eos=rng.random() < 0.3, min_tokens=rng.choice([0, 3]),
                             stop_token_ids=rng.choice([[], [5, 9, 77]]), n=rng.choice([1, 1, 2]),
                             logprobs=rng.choice([None, None, 2]), prompt_logprobs=rng.choice([None] * 5 + [1]))
              for i in range(30)]
    outputs = run_to_completion(engine, prompts, params)
    return steps + [[(o.seq_id, o.token_ids, o.finish_reason, repr(o.logprobs)) for o in outputs],
                    engine.scheduler.stats]


@pytest.mark.parametrize("settings", [{}, {"async_scheduling": True}, {"preemption": "swap", "swap_space_gb": 0.01}],
                         ids=["sync", "async", "swap"])
def test_engine_quiet_rows_change_nothing(monkeypatch, tiny_checkpoints, settings):
    quiet = _engine_trace(tiny_checkpoints["llama"], settings)
    _general_path_only(monkeypatch)
    assert _engine_trace(tiny_checkpoints["llama"], settings) == quiet
