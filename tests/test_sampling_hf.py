"""Greedy decoding with repetition_penalty, min_tokens, stop_token_ids and logit_bias is token-identical to HF
transformers `generate` with the equivalent logits processors (float32, CPU); logprobs equal HF's log_softmax."""
from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
)

from cbatch.config import SamplingParams
from cbatch.engine.engine import run_to_completion
from helpers import make_engine, random_prompts
from tiny_models import hf_model

EOS = 2


def hf_generate(model, prompt: list[int], max_new: int, params: SamplingParams, eos: list[int]) -> list[int]:
    """HF greedy `generate` with vLLM's processor order (logit_bias, min_tokens, repetition penalty); it
    stops at EOS or a stop token (kept in the output, as cbatch keeps it in token ids)."""
    stops = [*eos, *params.stop_token_ids]
    processors = []
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in params.logit_bias.items()]))
    if params.min_tokens:
        processors.append(MinNewTokensLengthLogitsProcessor(len(prompt), params.min_tokens, stops))
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new, do_sample=False, pad_token_id=0, eos_token_id=stops,
                             logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_processors_match_hf_generate_on_tiny_checkpoints(tiny_checkpoints, arch):
    path = tiny_checkpoints[arch]
    model = hf_model(path)
    engine = make_engine(path)
    prompts = random_prompts(3, vocab=384, seed=40, min_len=8, max_len=30)
    plain = run_to_completion(engine, prompts, [SamplingParams(max_tokens=20)] * 3)
    first = plain[0].token_ids
    cases = [
        SamplingParams(max_tokens=20, repetition_penalty=1.3),
        SamplingParams(max_tokens=20, stop_token_ids=[first[3]]),  # greedy reaches it: stops there
        SamplingParams(max_tokens=20, stop_token_ids=[first[3]], min_tokens=8),  # banned until 8 tokens
        SamplingParams(max_tokens=20, logit_bias={first[1]: -100.0, first[4]: 3.5, 7: 2.0}),
        SamplingParams(max_tokens=20, repetition_penalty=0.9, min_tokens=5, stop_token_ids=[first[2], 11],
                       logit_bias={first[0]: -1.5}),
    ]
    for params in cases:
        got = run_to_completion(engine, prompts, [params] * 3)
        for prompt, out in zip(prompts, got):
            assert out.token_ids == hf_generate(model, prompt, 20, params, [EOS]), params
        assert [o.token_ids for o in got] != [o.token_ids for o in plain], params  # each case changes the output
    stopped = run_to_completion(engine, prompts[:1], [cases[1]])[0]
    assert stopped.token_ids == first[:4] and stopped.finish_reason == "stop"
    held = run_to_completion(engine, prompts[:1], [cases[2]])[0]
    assert len(held.token_ids) >= 8 and first[3] not in held.token_ids[:7]


def test_processors_and_logprobs_match_hf_on_smollm2(smollm2_dir):
    """The real model: the processors against HF `generate`, and logprobs / prompt_logprobs against HF's
    log_softmax of its own logits (within 1e-4), top_logprobs sorted, k of them, the greedy token first."""
    from cbatch.tokenizer import encode_messages, load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    prompt = encode_messages(tokenizer, [{"role": "user", "content": "Name three colours of the rainbow."}])
    model = hf_model(smollm2_dir)
    engine = make_engine(smollm2_dir, max_num_batched_tokens=16)  # the prompt in chunks
    eos = sorted(engine.spec.eos_token_ids)
    plain = run_to_completion(engine, [prompt], [SamplingParams(max_tokens=12)])[0].token_ids
    params = SamplingParams(max_tokens=12, repetition_penalty=1.2, logit_bias={plain[1]: -100.0}, min_tokens=6,
                            stop_token_ids=[plain[5]], logprobs=5, prompt_logprobs=3)
    out = run_to_completion(engine, [prompt], [params])[0]
    assert out.token_ids == hf_generate(model, prompt, 12, params, eos)
    assert out.token_ids != plain

    greedy = run_to_completion(engine, [prompt], [SamplingParams(max_tokens=8, logprobs=5, prompt_logprobs=3)])[0]
    ids = prompt + greedy.token_ids
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)  # [len, vocab]
    wanted = reference[:-1].gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)  # each token given its prefix
    n = len(prompt)
    torch.testing.assert_close(torch.tensor(greedy.logprobs.token), wanted[n - 1:], rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.tensor(greedy.prompt_logprobs.token), wanted[: n - 1], rtol=0, atol=1e-4)
    for position, (top_ids, top_values) in enumerate(zip(greedy.logprobs.top_ids, greedy.logprobs.top_values)):
        assert len(top_ids) == 5 and top_values == sorted(top_values, reverse=True)
        assert top_ids[0] == greedy.token_ids[position]  # greedy: the sampled token is the most likely
        torch.testing.assert_close(torch.tensor(top_values), reference[n - 1 + position, top_ids], rtol=0, atol=1e-4)
    assert all(len(top) == 3 for top in greedy.prompt_logprobs.top_ids)
    # the processors leave logprobs alone (raw logits, vLLM v1's default)
    assert abs(out.logprobs.token[0] - float(reference[n - 1, out.token_ids[0]])) < 1e-4
