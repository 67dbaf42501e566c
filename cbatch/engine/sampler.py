"""Token selection: greedy, temperature, top-k, top-p, with batch-independent randomness.

Random rows draw from an exponential race (argmax of p / E, E ~ Exp(1), is a sample from p) whose
noise E comes from a counter-based hash of (seed, output position, vocabulary id). A seeded request
therefore gets the same tokens alone or inside any batch, on any device, after any preemption.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK32 = 0xFFFFFFFF


@dataclass(slots=True)
class SamplingBatch:
    """Per-row settings of the rows that sample this step (host lists; tensors built on demand)."""

    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    seeds: list[int]  # effective seed: the request's, else derived from the job seed and the row's id
    positions: list[int]  # index of the token being sampled within the completion

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)


def effective_seed(request_seed: int | None, job_seed: int, seq_id: int) -> int:
    """The seed a sampled row draws from: its own, else one from (job seed, row index), so reruns of a
    job reproduce it (the result cache keys sampled rows by it)."""
    return request_seed if request_seed is not None else (job_seed << 32) ^ seq_id


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values < 2**32 (products stay below 2**59)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """E ~ Exp(1) of shape [N, vocab], a pure function of (seed, position, vocab id)."""
    device = seeds.device
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    row = _hash32(_hash32(lo) ^ hi)
    row = _hash32(row ^ (positions * 0x61C88647 & _MASK32))  # [N]
    col = _hash32(torch.arange(vocab_size, device=device, dtype=torch.int64) * 0x27D4EB2D & _MASK32)  # [V]
    bits = _hash32(row[:, None] ^ col[None, :])  # [N, V] uniform in [0, 2**32)
    uniform = (bits.double() + 0.5) / 4294967296.0  # (0, 1), never 0
    return (-torch.log(uniform)).float()


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits float32 [N, vocab] -> token ids int64 [N]."""
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    device = logits.device
    temps = torch.tensor(batch.temperatures, device=device, dtype=torch.float32)
    random_rows = (temps > 0).nonzero().squeeze(1)
    rows = logits[random_rows] / temps[random_rows, None]
    probs = torch.softmax(rows, dim=-1)
    probs = _top_k_top_p(probs, [batch.top_ks[i] for i in random_rows.tolist()], [batch.top_ps[i] for i in random_rows.tolist()])
    seeds = torch.tensor([batch.seeds[i] for i in random_rows.tolist()], device=device, dtype=torch.int64)
    positions = torch.tensor([batch.positions[i] for i in random_rows.tolist()], device=device, dtype=torch.int64)
    noise = exponential_noise(seeds, positions, logits.shape[-1])
    chosen = (probs / noise).argmax(dim=-1)
    out = greedy.clone()
    out[random_rows] = chosen
    return out


def _top_k_top_p(probs: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Zeroes the probabilities outside each row's top-k and top-p nucleus (kept in vocab order)."""
    if all(k == 0 for k in top_ks) and all(p >= 1.0 for p in top_ps):
        return probs
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=probs.device)
    ps = torch.tensor(top_ps, device=probs.device, dtype=probs.dtype)
    rank = torch.arange(vocab, device=probs.device)
    cumulative = sorted_probs.cumsum(dim=-1)
    # keep a token while the mass before it is below p: the token that crosses p stays in
    keep = (rank[None, :] < ks[:, None]) & ((cumulative - sorted_probs) < ps[:, None])
    keep[:, 0] = True
    kept = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
    return kept
