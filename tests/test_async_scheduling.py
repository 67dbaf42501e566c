"""Asynchronous scheduling (step N+1 scheduled and launched before step N's tokens reach the host): the same
outputs as the synchronous loop, whatever the rows ask for, under chunked prefill and preemption, and the
overlap really happens (by the order of calls, not by timing). On a CPU the model call itself is synchronous,
but the engine's order of operations is the GPU's."""
from __future__ import annotations

import json

import pytest
import torch

from cbatch.config import ConfigError, Constraint, EngineConfig, SamplingParams
from cbatch.engine import runner as runner_module
from cbatch.engine.engine import run_to_completion
from cbatch.engine.runner import PendingStep
from cbatch.engine.sampler import sample_step
from cbatch.model.decoder import ForwardContext
from helpers import make_engine, random_prompts


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy, seeded and job-seeded sampling, stop tokens, several max_tokens, and rows whose next step needs
    the last token on the host (n samples, logprobs, penalties): those steps fall back to the synchronous order."""
    kinds = [
        SamplingParams(max_tokens=14),
        SamplingParams(max_tokens=9, temperature=0.8, seed=11),
        SamplingParams(max_tokens=1),
        SamplingParams(max_tokens=20, temperature=1.0, top_k=20),  # seeded from (job seed, row)
        SamplingParams(max_tokens=16, stop_token_ids=list(range(3, 60))),  # stops early, at different steps
        SamplingParams(max_tokens=6, ignore_eos=True),
    ]
    special = {7: SamplingParams(max_tokens=5, n=3, temperature=0.7, seed=3),
               9: SamplingParams(max_tokens=6, logprobs=2),
               10: SamplingParams(max_tokens=6, repetition_penalty=1.3)}
    return [special.get(i, kinds[i % len(kinds)]) for i in range(n)]


def outputs(engine, prompts, params):
    return [(o.token_ids, o.finish_reason, o.text) for o in run_to_completion(engine, prompts, params)]


@pytest.mark.parametrize("settings", [
    dict(),
    dict(max_num_batched_tokens=16),  # chunked prefill
    dict(num_kv_blocks=24, block_size=4, max_num_seqs=8),  # preemption
    dict(policy="static", max_num_seqs=4),  # static groups: never ahead
], ids=["plain", "chunked", "preemption", "static"])
def test_async_gives_the_outputs_of_the_synchronous_loop(tiny_checkpoints, settings):
    path = tiny_checkpoints["llama"]
    prompts = random_prompts(16, 384, seed=8, min_len=3, max_len=40)
    params = mixed_params(len(prompts))
    sync_engine = make_engine(path, async_scheduling=False, **settings)
    expected = outputs(sync_engine, prompts, params)
    engine = make_engine(path, async_scheduling=True, **settings)
    assert outputs(engine, prompts, params) == expected
    assert len({tuple(t) for t, _, _ in expected}) > 8 and {r for _, r, _ in expected} == {"stop", "length"}
    assert engine.pool.num_free == engine.pool.num_blocks  # every block came back
    ahead, stats = engine.steps_ahead, engine.scheduler.stats
    if settings.get("policy") == "static":
        assert ahead == 0
    else:
        assert ahead > 0
    if "num_kv_blocks" in settings:
        assert stats.preemptions > 0 and sync_engine.scheduler.stats.preemptions > 0


def test_step_n_plus_1_is_launched_before_step_n_resolves(tiny_checkpoints, monkeypatch):
    """The order of calls: schedule(2), launch(2), result(1), account(2), schedule(3), ... for plain decodes."""
    engine = make_engine(tiny_checkpoints["llama"], async_scheduling=True)
    events: list[tuple[str, int]] = []
    schedule, launch, result = engine.scheduler.schedule, engine.runner.launch, PendingStep.result

    def logged_schedule():
        plan = schedule()
        events.append(("schedule", plan.step))
        return plan

    step_of: dict[int, int] = {}  # id(pending step) -> its plan's step number

    def logged_launch(plan):
        pending = launch(plan)
        step_of[id(pending)] = plan.step
        events.append(("launch", plan.step))
        return pending

    def logged_result(self):
        events.append(("result", step_of[id(self)]))
        return result(self)

    monkeypatch.setattr(engine.scheduler, "schedule", logged_schedule)
    monkeypatch.setattr(engine.runner, "launch", logged_launch)
    monkeypatch.setattr(PendingStep, "result", logged_result)
    outs = run_to_completion(engine, random_prompts(4, 384, seed=2, min_len=5, max_len=9),
                             [SamplingParams(max_tokens=6, ignore_eos=True)] * 4)
    assert all(len(o.token_ids) == 6 for o in outs)
    for n in range(2, 6):
        order = [events.index(("launch", n)), events.index(("result", n - 1))]
        assert order == sorted(order), events  # step n was on its way before step n-1's tokens were read


def test_stop_strings_and_structured_rows_match(tiny_chat_model):
    """Rows with stop strings (resolved one step late: the extra token is discarded) and constrained rows
    (their next mask needs the token: synchronous steps) beside plain ones."""
    choice = Constraint("choice", json.dumps(["alpha", "beta gamma", "delta"]), "choice")
    params = [SamplingParams(max_tokens=24, temperature=0.9, seed=i, stop=["e", "a"]) if i % 3 == 0 else
              SamplingParams(max_tokens=12, constraint=choice) if i % 3 == 1 else
              SamplingParams(max_tokens=18, temperature=0.9, seed=i) for i in range(9)]
    prompts = random_prompts(9, 49152, seed=4, min_len=3, max_len=20)
    expected = outputs(make_engine(tiny_chat_model, async_scheduling=False), prompts, params)
    assert outputs(make_engine(tiny_chat_model, async_scheduling=True), prompts, params) == expected
    assert any(r == "stop" and t is not None for _, r, t in expected[::3])
    assert {t for _, _, t in expected[1::3]} <= {"alpha", "beta gamma", "delta"}


def test_async_with_tensor_parallel_is_refused():
    with pytest.raises(ConfigError, match="tensor-parallel-size"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)


def test_auto_is_off_on_cpu(tiny_checkpoints):
    assert make_engine(tiny_checkpoints["llama"]).config.async_scheduling is False


class ReplayedGraphs:
    """Stands in for `DecodeGraphs` on the CPU with its contract: decode-only steps run "in a graph" that samples
    in place, and the tokens it returns are a view of one static buffer that the next replay overwrites."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.static_tokens = torch.full((4096,), -7, dtype=torch.int64)
        self.replays = 0

    def can_run(self, meta, num_tokens: int) -> bool:
        return meta.max_query_len == 1

    def run(self, input_ids, positions, meta, sampling):
        runner, num = self.runner, input_ids.shape[0]
        runner.backend.prepare(meta)
        hidden = runner.model(input_ids, positions, ForwardContext(runner.kv_cache.view, meta))
        self.static_tokens[:num] = sample_step(runner.model.compute_logits(hidden), sampling).tokens
        self.replays += 1
        return hidden, self.static_tokens[:num]


def test_tokens_sampled_in_a_graph_outlive_the_next_replay(tiny_checkpoints, monkeypatch):
    """With asynchronous scheduling step N's tokens are read after step N+1 was launched: a decode graph's
    tokens (a view of its static output, rewritten by the next replay) must be kept apart at launch."""
    path = tiny_checkpoints["llama"]
    prompts = random_prompts(6, 384, seed=5, min_len=3, max_len=12)
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=0.9, seed=4, ignore_eos=True)] * 3
    expected = outputs(make_engine(path, async_scheduling=False), prompts, params)
    engine = make_engine(path, async_scheduling=True)
    graphs = engine.runner.graphs = ReplayedGraphs(engine.runner)
    engine.runner.fused_sampling = True  # the graph's tokens are the step's (as with the Triton backend on a GPU)
    monkeypatch.setattr(runner_module, "fused_covers", lambda batch: True)
    monkeypatch.setattr(runner_module, "sample_batch", lambda logits, batch, fused, **_: (sample_step(logits, batch).tokens,
                                                                                       [None] * logits.shape[0]))
    assert outputs(engine, prompts, params) == expected
    assert graphs.replays > 10 and engine.steps_ahead > 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the wait it checks is a CUDA stream's")
def test_a_steps_tokens_wait_for_that_step_alone():
    """A launched step's tokens reach the host without waiting for the step launched after it: asynchronous
    scheduling launches step N+1 before it reads step N's tokens, and a plain `.tolist()` of N's device tensor
    would wait for N+1 too (the GPU then idles while the host schedules N+2). Here a ~1 s sleep kernel queued
    after the copy stands for step N+1; the wait returns with it still queued or running."""
    from cbatch.engine.runner import tokens_to_host

    sampled = torch.randint(0, 50_000, (37,), device="cuda")
    host, ready = tokens_to_host(sampled)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of one SM's cycles: the next step
    ready.synchronize()
    assert not torch.cuda.current_stream().query(), "the wait drained the stream (it waited for the next step)"
    assert host.device.type == "cpu" and host.tolist() == sampled.tolist()
    torch.cuda.synchronize()
