"""Prefill-only requests (embed, score, rerank, classify, reward): what a pooling request asks for
(`PoolingParams`). The runner's pooling stage, which turns each such request's prompt hidden states into one float32
vector, is `engine/pooler.py` (above `Sequence`, which holds the `PoolingParams`); how the vectors become a row's
columns is its task's (cbatch/tasks/).

A pooling request is an ordinary sequence with one output position: the scheduler runs its prompt (chunked
prefill, prefix cache where its pooling allows), the runner hands it a dummy token at the end of its prompt,
and `max_tokens = 1` ends it there, its KV blocks freed in the same update. No decode step ever runs for it.
"""
from __future__ import annotations

from dataclasses import dataclass

POOLING_MODES = ("last", "mean", "cls")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """What a prefill-only request returns. `head`: the model's classification head is applied to the pooled
    vector (classify, reward, a cross-encoder's score); otherwise the vector is an embedding, truncated to
    `dimensions` (Matryoshka) and then L2-normalized when `normalize`."""

    task: str  # the task that asked (embed | score | rerank | classify | reward)
    pooling: str = "last"  # last | mean | cls
    normalize: bool = False
    dimensions: int | None = None
    head: bool = False

    @property
    def every_position(self) -> bool:
        """The pooled vector needs the hidden state of every prompt position (no prefix-cache hits)."""
        return self.pooling != "last"


__all__ = ["POOLING_MODES", "PoolingParams"]
