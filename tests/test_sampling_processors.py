"""The sampler's processors against plain-torch references of vLLM's definitions (penalties, min_p, logit_bias,
min_tokens), the incremental token counts, and batch invariance with every option on."""
from __future__ import annotations

import random

import torch

from cbatch.config import SamplingParams
from cbatch.engine.sampler import SamplingBatch, process_logits, sample_seed, sampling_probs, select_tokens
from cbatch.engine.sampling_inputs import SamplingInputs, TokenCounts
from cbatch.engine.sequence import Sequence
from helpers import make_engine, random_prompts
from tiny_models import hf_model

VOCAB = 50


def reference_penalties(logits, prompts, outputs, repetition, frequency, presence):
    """vLLM's apply_penalties, written out on dense bincounts (HF's division for the repetition penalty)."""
    logits, vocab = logits.clone(), logits.shape[-1]
    for r, (prompt, output) in enumerate(zip(prompts, outputs)):
        counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=vocab).float()
        prompt_mask = torch.bincount(torch.tensor(prompt, dtype=torch.int64), minlength=vocab) > 0
        seen = prompt_mask | (counts > 0)
        row = logits[r]
        row = torch.where(seen, torch.where(row > 0, row / repetition[r], row * repetition[r]), row)
        row = row - frequency[r] * counts
        row = row - presence[r] * (counts > 0).float()
        logits[r] = row
    return logits


def sequences(params: list[SamplingParams], seed: int) -> list[Sequence]:
    rng = random.Random(seed)
    seqs = []
    for i, p in enumerate(params):
        seq = Sequence(seq_id=i, prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))], params=p,
                       eos_ids=frozenset({2}))
        seq.output_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 15))]
        seqs.append(seq)
    return seqs


def test_penalties_match_vllm_definitions():
    torch.manual_seed(0)
    rng = random.Random(1)
    params = [SamplingParams(repetition_penalty=rng.choice([1.0, 1.3, 0.8]), frequency_penalty=rng.uniform(-2, 2),
                             presence_penalty=rng.uniform(-2, 2)) for _ in range(7)]
    params.append(SamplingParams())  # a row without penalties stays untouched
    seqs = sequences(params, seed=2)
    logits = torch.randn(len(seqs), VOCAB) * 3
    batch = SamplingInputs(VOCAB, torch.device("cpu"), job_seed=0).build(seqs)
    got = process_logits(logits, batch.processors)
    want = reference_penalties(logits, [s.prompt_ids for s in seqs], [s.output_ids for s in seqs],
                               [p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                               [p.presence_penalty for p in params])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert torch.equal(got[-1], logits[-1])
    assert (got[:-1] != logits[:-1]).any(dim=1).all()  # every penalised row changed


def test_logit_bias_and_min_tokens_ban():
    torch.manual_seed(1)
    params = [SamplingParams(logit_bias={3: 5.0, 7: -100.0}), SamplingParams(min_tokens=5, stop_token_ids=[9, 11]),
              SamplingParams(min_tokens=5, stop_token_ids=[9], ignore_eos=True), SamplingParams(min_tokens=2)]
    seqs = sequences(params, seed=3)
    seqs[1].output_ids, seqs[2].output_ids, seqs[3].output_ids = [1, 1], [4], [1, 2, 3]  # the last has its 2 tokens
    logits = torch.randn(4, VOCAB)
    got = process_logits(logits, SamplingInputs(VOCAB, torch.device("cpu"), 0).build(seqs).processors)
    want = logits.clone()
    want[0, 3] += 5.0
    want[0, 7] -= 100.0
    want[1, [2, 9, 11]] = -float("inf")  # EOS and the stop tokens, before min_tokens
    want[2, 9] = -float("inf")  # ignore_eos: only the stop token
    assert torch.equal(got, want)


def test_min_p_matches_vllm_definition():
    torch.manual_seed(2)
    logits = torch.randn(6, VOCAB) * 2
    temps = torch.tensor([0.7, 1.0, 1.3, 1.0, 0.5, 2.0])
    min_ps = [0.0, 0.1, 0.3, 0.05, 0.5, 0.2]
    got = sampling_probs(logits, temps, [0] * 6, [1.0] * 6, min_ps)
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    for r, min_p in enumerate(min_ps):  # vLLM: tokens below min_p x the top probability are dropped
        keep = probs[r] >= min_p * probs[r].max()
        want = torch.where(keep, probs[r], 0.0)
        torch.testing.assert_close(got[r], want / want.sum())
        assert min_p == 0.0 or not keep.all()  # the filter really dropped tokens
    # drawn tokens never leave the allowed set
    for pos in range(100):
        batch = SamplingBatch(temps.tolist(), [1.0] * 6, [0] * 6, list(range(6)), [pos] * 6, min_ps=min_ps)
        tokens = select_tokens(logits, batch)
        assert all(got[r, t] > 0 for r, t in enumerate(tokens.tolist()))


def test_token_counts_are_incremental_and_exact():
    """The per-sequence counts, fed a few tokens per step, with rows freed and reused, equal a recount."""
    counts = TokenCounts(VOCAB, torch.device("cpu"))
    rng = random.Random(4)
    live = sequences([SamplingParams(presence_penalty=1.0)] * 12, seed=5)
    for step in range(30):
        picked = rng.sample(live, 6)
        rows = counts.rows(picked)
        for seq, row in zip(picked, rows.tolist()):
            want = torch.bincount(torch.tensor(seq.output_ids, dtype=torch.int64), minlength=VOCAB).int()
            assert torch.equal(counts.counts[row], want)
            mask = torch.bincount(torch.tensor(seq.prompt_ids, dtype=torch.int64), minlength=VOCAB) > 0
            assert torch.equal(counts.prompt_mask[row], mask)
            seq.output_ids.append(rng.randrange(VOCAB))  # the step's sampled token
        if step % 7 == 6:  # a sequence leaves; a new one takes its row
            gone = live.pop(rng.randrange(len(live)))
            counts.release(gone)
            live.append(sequences([SamplingParams(presence_penalty=1.0)], seed=step)[0])
            live[-1].seq_id = 100 + step
    assert counts.counts.shape[0] == 16  # grown by doubling (8 -> 16) for the 12 sequences, never more


def test_sample_seeds_are_distinct_per_sample():
    assert sample_seed(123, 0, 5, 0) == 123 and sample_seed(None, 7, 5, 0) == (7 << 32) ^ 5
    seeds = {sample_seed(s, 0, 0, i) for s in (1, 2, -5) for i in range(64)}
    assert len(seeds) == 3 * 64
    assert all(-(2**63) <= s < 2**63 for s in seeds)


ALL_OPTIONS = dict(temperature=0.9, top_p=0.9, top_k=40, min_p=0.02, repetition_penalty=1.2, presence_penalty=0.4,
                   frequency_penalty=0.3, min_tokens=4, stop_token_ids=[17], logit_bias={5: 2.0, 9: -3.0}, logprobs=3,
                   ignore_eos=True)


def test_seeded_row_with_every_option_is_batch_invariant(tiny_checkpoints):
    path = tiny_checkpoints["qwen2"]
    prompt = random_prompts(1, vocab=384, seed=20, min_len=20, max_len=40)[0]
    seeded = SamplingParams(max_tokens=16, seed=99, **ALL_OPTIONS)
    from cbatch.engine.engine import run_to_completion

    alone = run_to_completion(make_engine(path), [prompt], [seeded])[0]
    others = random_prompts(9, vocab=384, seed=21)
    busy_params = [SamplingParams(max_tokens=10, temperature=1.0, repetition_penalty=1.5, logit_bias={5: 4.0},
                                  ignore_eos=True)] * 9 + [seeded]
    busy = run_to_completion(make_engine(path, max_num_seqs=4, max_num_batched_tokens=24), others + [prompt], busy_params)[-1]
    assert busy.token_ids == alone.token_ids
    # the logits of a row differ by float rounding with the batch around it (not the tokens)
    torch.testing.assert_close(torch.tensor(busy.logprobs.token), torch.tensor(alone.logprobs.token), rtol=0, atol=1e-4)
    assert busy.logprobs.top_ids == alone.logprobs.top_ids
    plain = run_to_completion(make_engine(path), [prompt], [SamplingParams(max_tokens=16, seed=99, temperature=0.9,
                                                                          ignore_eos=True)])[0]
    assert plain.token_ids != alone.token_ids  # the options changed something


def test_greedy_presence_and_frequency_penalties_match_a_torch_reference(tiny_checkpoints):
    """Greedy decoding with vLLM's presence / frequency penalties (and a repetition penalty), step by step on
    HF's logits with the reference penalties, gives cbatch's tokens."""
    path = tiny_checkpoints["llama"]
    model = hf_model(path)
    prompt = random_prompts(1, vocab=384, seed=30, min_len=10, max_len=10)[0]
    settings = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.1)
    from cbatch.engine.engine import run_to_completion

    got = run_to_completion(make_engine(path), [prompt], [SamplingParams(max_tokens=24, ignore_eos=True, **settings)])[0]
    plain = run_to_completion(make_engine(path), [prompt], [SamplingParams(max_tokens=24, ignore_eos=True)])[0]
    output: list[int] = []
    with torch.no_grad():
        for _ in range(24):
            logits = model(torch.tensor([prompt + output])).logits[:, -1].float()  # [1, vocab]
            output.append(int(reference_penalties(logits, [prompt], [output], [1.1], [0.4], [0.7]).argmax()))
    assert got.token_ids == output
    assert plain.token_ids != output
