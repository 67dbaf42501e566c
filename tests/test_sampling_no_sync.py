"""On a GPU, asynchronous scheduling builds a step's sampling inputs while the step before it runs: a tensor
made from host values with `torch.tensor(..., device=cuda)` (a pageable copy) or a read of a device value
(`.tolist()`, `.item()`, `.nonzero()`, `bool(t)`) would make the host wait for that step and undo the overlap.
So every tensor the sampler makes from host values goes through the batch's `put` (the pinned staging arenas
on a GPU) and it reads nothing back. Checked here on the CPU by refusing those calls while the sampling
settings are built and the tokens selected (the steps that may be scheduled ahead: no log-probabilities,
penalties or grammars), against the same batch sampled without the guard."""
from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch

from cbatch.config import SamplingParams
from cbatch.engine.sampler_choice import kernel_inputs, sample_batch
from cbatch.engine.sampling_inputs import SamplingInputs
from cbatch.engine.sequence import Sequence

VOCAB = 97
_NUMPY = {torch.float32: np.float32, torch.int64: np.int64, torch.int32: np.int32}


class RecordingPut:
    """A `put` that makes tensors without `torch.tensor` (as the staging arenas do) and counts its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, values, dtype: torch.dtype) -> torch.Tensor:
        self.calls += 1
        return torch.from_numpy(np.asarray(values, dtype=_NUMPY[dtype]).reshape(-1))


@contextlib.contextmanager
def no_host_sync():
    """Fails the test at any call that would wait for the device (on a GPU) or copy from pageable memory."""
    def refuse(name):
        def call(*args, **kwargs):
            raise AssertionError(f"{name} while building or sampling a step that may run ahead")
        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "tensor", refuse("torch.tensor (a pageable host-to-device copy)"))
        for name in ("tolist", "item", "nonzero", "cpu", "numpy", "__bool__"):
            mp.setattr(torch.Tensor, name, refuse(f"Tensor.{name} (a device read)"))
        yield


def _rows(seed: int) -> list[Sequence]:
    """Sequences with every setting a step scheduled ahead may have, mixed: greedy, temperature, top-k, top-p,
    min_p, logit_bias, min_tokens (EOS and stop tokens banned), per-request seeds."""
    rng = random.Random(seed)
    options = [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=11),
        SamplingParams(temperature=1.1, top_k=5),
        SamplingParams(temperature=0.7, top_p=0.6),
        SamplingParams(temperature=0.9, min_p=0.05, top_k=20, top_p=0.9),
        SamplingParams(temperature=0.6, logit_bias={3: 5.0, 40: -100.0}),
        SamplingParams(temperature=1.0, min_tokens=30, stop_token_ids=[5]),
    ]
    seqs = []
    for i in range(24):
        seq = Sequence(seq_id=i, prompt_ids=[rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))],
                       params=options[i % len(options)], eos_ids=frozenset({2}))
        seq.output_ids = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 12))]
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_a_step_ahead_never_waits_for_the_device(seed):
    logits = torch.randn(24, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    expected, _ = sample_batch(logits, SamplingInputs(VOCAB, torch.device("cpu"), job_seed=seed).build(_rows(seed)), fused=False)

    put = RecordingPut()
    inputs = SamplingInputs(VOCAB, torch.device("cpu"), job_seed=seed, put=put)
    with no_host_sync():
        batch = inputs.build(_rows(seed))
        assert batch.plain is False and not batch.all_greedy  # the processors and the race both ran
        tokens, logprobs = sample_batch(logits, batch, fused=False)
    assert torch.equal(tokens, expected)
    assert logprobs == [None] * 24
    assert put.calls >= 8  # bias and banned entries (3 each), rows, temperatures, seeds, positions, k, p, min_p


def test_the_fused_kernels_inputs_go_through_put():
    seqs = [Sequence(seq_id=i, prompt_ids=[4, 5], params=SamplingParams(temperature=0.5 * (i % 3))) for i in range(6)]
    put = RecordingPut()
    batch = SamplingInputs(VOCAB, torch.device("cpu"), job_seed=3, put=put).build(seqs)
    with no_host_sync():
        temperatures, seeds, positions = kernel_inputs(batch, torch.device("cpu"))
    assert put.calls == 3
    assert temperatures.tolist() == [0.0, 0.5, 1.0] * 2
    assert seeds.tolist() == batch.seeds and positions.tolist() == [0] * 6


def test_the_guard_catches_a_pageable_copy():
    """The check above can fail: the default (no `put`) makes its tensors with `torch.tensor`."""
    batch = SamplingInputs(VOCAB, torch.device("cpu"), job_seed=0).build(_rows(0))
    with no_host_sync(), pytest.raises(AssertionError, match="torch.tensor"):
        kernel_inputs(batch, torch.device("cpu"))
