"""The same greedy outputs whatever the batching: sizes, order, chunking, preemption, policy."""
from __future__ import annotations

import random

import pytest

from cbatch.config import SamplingParams
from helpers import generate, make_engine, random_prompts

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def workload(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    prompts = random_prompts(12, vocab=384, seed=5, max_len=50)
    reference = generate(make_engine(path, max_num_seqs=1), prompts, PARAMS)
    return path, prompts, reference


def test_one_vs_many_sequences(workload):
    path, prompts, reference = workload
    assert generate(make_engine(path, max_num_seqs=64), prompts, PARAMS) == reference


def test_shuffled_input_order(workload):
    path, prompts, reference = workload
    order = list(range(len(prompts)))
    random.Random(0).shuffle(order)
    got = generate(make_engine(path), [prompts[i] for i in order], PARAMS)
    assert [got[order.index(i)] for i in range(len(prompts))] == reference


def test_tiny_token_budget_forces_chunked_prefill(workload):
    path, prompts, reference = workload
    engine = make_engine(path, max_num_batched_tokens=5)
    assert generate(engine, prompts, PARAMS) == reference
    assert engine.scheduler.stats.steps > sum(len(p) for p in prompts) // 5  # prompts really went in chunks


def test_tiny_kv_pool_forces_preemption(workload):
    path, prompts, reference = workload
    engine = make_engine(path, num_kv_blocks=20, block_size=4)
    assert generate(engine, prompts, PARAMS) == reference
    assert engine.scheduler.stats.preemptions > 0
    assert engine.scheduler.stats.recomputed_tokens > 0
    assert engine.pool.num_free == engine.pool.num_blocks  # every block came back


@pytest.mark.parametrize("policy", ["longest-first", "fcfs", "static"])
def test_each_policy(workload, policy):
    path, prompts, reference = workload
    engine = make_engine(path, policy=policy, max_num_seqs=4)
    assert generate(engine, prompts, PARAMS) == reference


def test_static_batching_pays_padding(tiny_checkpoints):
    """Static groups run to their longest member: finished rows keep computing (the baseline's cost)."""
    path = tiny_checkpoints["llama"]
    prompts = random_prompts(8, vocab=384, seed=6, max_len=10)
    params = [SamplingParams(max_tokens=2 if i % 2 else 20, ignore_eos=True) for i in range(8)]
    static = make_engine(path, policy="static", max_num_seqs=4)
    continuous = make_engine(path, policy="fcfs", max_num_seqs=4)
    assert generate(static, prompts, params) == generate(continuous, prompts, params)
    assert static.scheduler.stats.padding_tokens > 0
    assert continuous.scheduler.stats.padding_tokens == 0
    assert static.scheduler.stats.steps > continuous.scheduler.stats.steps


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_seeded_sampling_is_batch_invariant(tiny_checkpoints, backend):
    """Temperature sampling with per-row seeds: the same tokens alone, in a full batch and with chunked
    prefill, on the torch sampler (torch backend) and on the one-pass kernel (triton backend: the decode
    path that runs inside the CUDA graphs on a GPU)."""
    if backend == "triton":
        pytest.importorskip("triton")
    path = tiny_checkpoints["qwen3"]
    prompts = random_prompts(4, vocab=384, seed=8, max_len=16)
    params = [SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.9, seed=100 + i) for i in range(len(prompts))]
    alone = generate(make_engine(path, attention_backend=backend, max_num_seqs=1), prompts, params)
    together = generate(make_engine(path, attention_backend=backend, max_num_seqs=4, max_num_batched_tokens=7),
                        prompts, params)
    assert together == alone
    if backend == "torch":
        greedy = generate(make_engine(path, max_num_seqs=4), prompts, [SamplingParams(max_tokens=4, ignore_eos=True)] * 4)
        assert alone != greedy  # the rows really sampled


def test_fused_and_torch_samplers_draw_the_same_tokens(tiny_checkpoints):
    """The GPU path's kernel and the torch sampler share the noise: same seeded tokens end to end."""
    pytest.importorskip("triton")
    path = tiny_checkpoints["llama"]
    prompts = random_prompts(4, vocab=384, seed=9, max_len=20)
    params = [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7 + 0.2 * i, seed=7 * i) for i in range(4)]
    torch_tokens = generate(make_engine(path, attention_backend="torch"), prompts, params)
    engine = make_engine(path, attention_backend="triton")
    assert engine.runner.fused_sampling
    assert generate(engine, prompts, params) == torch_tokens
