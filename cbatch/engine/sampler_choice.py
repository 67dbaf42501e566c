"""Where the GPU path samples: the one-pass kernel (`cbatch.kernels.fused_sample`: greedy and temperature
with the torch sampler's counter-based noise) for batches it covers, `cbatch.engine.sampler.sample` otherwise.

The kernel reads only temperatures, seeds and positions. Every other field of `SamplingBatch` must hold
its neutral value for the kernel to take the batch; a field this module does not know (a sampling option
added later) sends the batch to the torch sampler, so a new option is never silently ignored here.
"""
from __future__ import annotations

from dataclasses import fields

import torch

from cbatch.engine.logprobs import Logprobs
from cbatch.engine.sampler import SamplingBatch, sample_step

KERNEL_FIELDS = frozenset({"temperatures", "seeds", "positions", "put"})  # (`put` is how they reach the device)
NEUTRAL = {  # field -> "every row leaves this option off"
    "top_ps": lambda values: all(p >= 1.0 for p in values),
    "top_ks": lambda values: all(k == 0 for k in values),
    "min_ps": lambda values: not any(values),
    "logprobs": lambda values: all(k is None for k in values),
    "processors": lambda processors: not processors,
    "grammar_masks": lambda masks: masks is None,
    # speculative verify rows: their drafts are already folded into `positions`, `processors` and `grammar_masks`
    "draft_offsets": lambda offsets: True,
    "drafts": lambda drafts: True,
}


def fused_covers(batch: SamplingBatch) -> bool:
    """True when the kernel computes exactly what `sample` would for every row of `batch`."""
    for f in fields(batch):
        if f.name in KERNEL_FIELDS:
            continue
        neutral = NEUTRAL.get(f.name)
        if neutral is None or not neutral(getattr(batch, f.name)):
            return False
    return True


def kernel_inputs(batch: SamplingBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(temperatures float32, seeds int64, positions int64), each [N], on `device`."""
    return (batch.on_device(batch.temperatures, torch.float32, device),
            batch.on_device(batch.seeds, torch.int64, device),
            batch.on_device(batch.positions, torch.int64, device))


def sample_batch(logits: torch.Tensor, batch: SamplingBatch, fused: bool,
                 num_splits: int | None = None) -> tuple[torch.Tensor, list[Logprobs | None]]:
    """(token ids int64 [N], each row's log-probabilities or None) for float32 logits [N, vocab]: the kernel
    when `fused` and it covers the batch (no row asks for log-probabilities then), else `sample_step`.
    num_splits: the kernel's programs per row (None: as many as fill the GPU; 1: no split)."""
    if fused and fused_covers(batch):
        from cbatch.kernels import fused_sample

        tokens = fused_sample(logits, *kernel_inputs(batch, logits.device), num_splits=num_splits)
        return tokens, [None] * logits.shape[0]
    out = sample_step(logits, batch)
    return out.tokens, out.logprobs
