"""Gemma 2/3 (text-only and multimodal checkpoints), Phi-3 and the mixtures of experts (gpt-oss too) against HF transformers (float32, tiny random checkpoints):
greedy tokens identical under chunked prefill and preemption with both attention backends, and the
prefill logits close (soft-capping keeps the argmax, so only the logits show it)."""
from __future__ import annotations

import pytest
import torch

from cbatch.config import SamplingParams
from cbatch.engine.sequence import Sequence
from helpers import generate, make_engine, random_prompts
from tiny_models import FAMILIES, hf_greedy, hf_model

# prompts longer than the sliding windows (8) and than phi3-longrope's original context (16); ids below
# 380 (gemma3-multimodal's image tokens are 381-383)
PROMPTS = random_prompts(3, vocab=380, seed=1, min_len=18, max_len=30)
# chunked prefill (24-token budget) and a pool of 14 blocks of 4 tokens: the three rows cannot all fit
PRESSURE = dict(max_num_batched_tokens=24, block_size=4, num_kv_blocks=14)


@pytest.fixture(scope="module")
def references(family_checkpoint):
    """name -> HF's greedy completions of PROMPTS (8 tokens)."""
    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            model = hf_model(family_checkpoint(name))
            cache[name] = [hf_greedy(model, p, 8) for p in PROMPTS]
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_matches_hf_under_chunking_and_preemption(name, family_checkpoint, references):
    engine = make_engine(family_checkpoint(name), **PRESSURE)
    got = generate(engine, PROMPTS, SamplingParams(max_tokens=8))
    assert got == references(name)
    assert engine.scheduler.stats.preemptions > 0
    assert sum(map(len, got)) > 3 * 5  # real completions, not early stops everywhere


# What the Triton path adds for these families, covered by four checkpoints (the interpreter is slow):
# per-layer windows, soft-capping, (1 + w) norms, GELU-tanh and the embedding scale (gemma2); q/k norms and
# two RoPE tables (gemma3); partial rotary with longrope (phi3-longrope); the fused-MoE kernels with a shared
# expert and a dense layer (qwen2_moe); attention sinks beside a window and the experts' biases (gpt_oss). Mixtral's
# and Qwen3-MoE's routing is the same torch code on both.
TRITON_FAMILIES = ["gemma2", "gemma3", "phi3-longrope", "qwen2_moe", "gpt_oss"]


@pytest.mark.parametrize("name", TRITON_FAMILIES)
def test_triton_backend_matches_hf(name, family_checkpoint, references):
    """Under the Triton interpreter, with chunked prefills and a preemption (12 blocks of 4 hold either
    sequence, not both)."""
    engine = make_engine(family_checkpoint(name), attention_backend="triton", max_num_batched_tokens=16,
                         block_size=4, num_kv_blocks=12)
    got = generate(engine, PROMPTS[:2], SamplingParams(max_tokens=3))
    assert got == [r[:3] for r in references(name)[:2]]
    assert engine.scheduler.stats.preemptions > 0


@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefill_logits_match_hf(name, family_checkpoint):
    path = family_checkpoint(name)
    prompt = PROMPTS[0]
    with torch.no_grad():
        expected = hf_model(path)(torch.tensor([prompt])).logits[0, -1]
    engine = make_engine(path)
    engine.scheduler.add(Sequence(seq_id=0, prompt_ids=prompt, params=SamplingParams(max_tokens=1)))
    got = engine.runner.forward(engine.scheduler.schedule()).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_longrope_short_factors_within_the_original_context(family_checkpoint):
    """With --max-model-len at the original context (16) every sequence uses the short factors, as HF does
    for sequences that never pass it (docs/models.md: longrope)."""
    path = family_checkpoint("phi3-longrope")
    prompts = random_prompts(3, vocab=380, seed=2, min_len=6, max_len=10)
    model = hf_model(path)
    expected = [hf_greedy(model, p, 5) for p in prompts]
    assert generate(make_engine(path, max_model_len=16), prompts, SamplingParams(max_tokens=5)) == expected
    assert generate(make_engine(path), prompts, SamplingParams(max_tokens=5)) != expected  # long factors differ
