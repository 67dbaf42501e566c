"""Sampling: seeded rows are batch-independent; filters and temperature behave as defined."""
from __future__ import annotations

import math

import torch

from cbatch.config import SamplingParams
from cbatch.engine.sampler import SamplingBatch, exponential_noise, sample
from helpers import generate, make_engine, random_prompts


def test_seeded_row_same_alone_and_in_busy_batch(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    prompt = random_prompts(1, vocab=384, seed=10)[0]
    seeded = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    alone = generate(make_engine(path), [prompt], seeded)[0]
    others = random_prompts(15, vocab=384, seed=11)
    busy_params = [SamplingParams(max_tokens=12, temperature=0.8, ignore_eos=True)] * 15 + [seeded]
    busy = generate(make_engine(path, max_num_seqs=8, max_num_batched_tokens=33), others + [prompt], busy_params)[-1]
    assert busy == alone
    greedy = generate(make_engine(path), [prompt], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert alone != greedy  # it really sampled


def test_different_seeds_differ(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    prompt = random_prompts(1, vocab=384, seed=12)[0]
    outs = {tuple(generate(make_engine(path), [prompt], SamplingParams(max_tokens=12, temperature=1.5, seed=s, ignore_eos=True))[0]) for s in range(4)}
    assert len(outs) > 1


def test_top_k_one_is_greedy():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(1))
    batch = SamplingBatch([1.0] * 5, [1.0] * 5, [1] * 5, list(range(5)), [0] * 5)
    assert sample(logits, batch).tolist() == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(2)) * 3
    batch = SamplingBatch([0.7] * 5, [1e-6] * 5, [0] * 5, list(range(5)), [3] * 5)
    assert sample(logits, batch).tolist() == logits.argmax(-1).tolist()


def test_top_k_never_leaves_the_top_k():
    torch.manual_seed(0)
    logits = torch.randn(1, 100)
    top = set(logits[0].topk(5).indices.tolist())
    for pos in range(200):
        batch = SamplingBatch([2.0], [1.0], [5], [99], [pos])
        assert sample(logits, batch).item() in top


def test_samples_follow_the_softmax():
    """Frequencies over many (seed, position) draws match softmax(logits / T) within sampling error."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    temperature = 0.8
    probs = torch.softmax(logits / temperature, -1)[0]
    draws = 4000
    counts = torch.zeros(5)
    seeds = torch.arange(draws, dtype=torch.int64)
    noise = exponential_noise(seeds, torch.zeros(draws, dtype=torch.int64), 5)  # [draws, 5]
    picks = (probs[None, :] / noise).argmax(-1)
    counts += torch.bincount(picks, minlength=5)
    chi2 = float((((counts - draws * probs) ** 2) / (draws * probs)).sum())
    assert chi2 < 20.5  # p ~ 0.0004 for 4 degrees of freedom


def test_noise_is_a_pure_function():
    a = exponential_noise(torch.tensor([7, 2**40 + 3]), torch.tensor([0, 5]), 1000)
    b = exponential_noise(torch.tensor([7, 2**40 + 3]), torch.tensor([0, 5]), 1000)
    assert torch.equal(a, b)
    assert torch.isfinite(a).all() and (a > 0).all()
    assert abs(float(a.mean()) - 1.0) < 0.1  # Exp(1) has mean 1
    c = exponential_noise(torch.tensor([7]), torch.tensor([1]), 1000)
    assert not torch.equal(a[0], c[0])
    assert not math.isclose(float(a[0].mean()), float(a[1].mean()), rel_tol=1e-9)
