"""Prefill-only requests (embed, score, classify, reward): what a pooling request asks for (`PoolingParams`) and
how its result becomes output columns. The runner's pooling stage, which turns each such request's prompt hidden
states into one float32 vector, is `engine/pooler.py` (above `Sequence`, which holds the `PoolingParams`).

A pooling request is an ordinary sequence with one output position: the scheduler runs its prompt (chunked
prefill, prefix cache where its pooling allows), the runner hands it a dummy token at the end of its prompt,
and `max_tokens = 1` ends it there, its KV blocks freed in the same update. No decode step ever runs for it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TASKS = ("generate", "embed", "score", "classify", "reward")
POOLING_MODES = ("last", "mean", "cls")


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """What a prefill-only request returns. `head`: the model's classification head is applied to the pooled
    vector (classify, reward, a cross-encoder's score); otherwise the vector is an embedding, truncated to
    `dimensions` (Matryoshka) and then L2-normalized when `normalize`."""

    task: str  # embed | score | classify | reward
    pooling: str = "last"  # last | mean | cls
    normalize: bool = False
    dimensions: int | None = None
    head: bool = False

    @property
    def every_position(self) -> bool:
        """The pooled vector needs the hidden state of every prompt position (no prefix-cache hits)."""
        return self.pooling != "last"


def task_columns(task: str, result: list[float], labels: tuple[str, ...] = ()) -> dict[str, object]:
    """A finished request's output columns: `embedding`; `score` (a cross-encoder's one logit through a sigmoid);
    `label` + `probs` (softmax over the labels, the label named by the model's id2label); `reward` (the one logit)."""
    if task == "embed":
        return {"embedding": result}
    if task == "reward":
        return {"reward": result[0]}
    if task == "score":
        return {"score": 1.0 / (1.0 + math.exp(-result[0]))}
    probs = torch.softmax(torch.tensor(result, dtype=torch.float32), dim=0)
    best = int(probs.argmax())
    return {"label": labels[best] if best < len(labels) else str(best), "probs": probs.tolist()}


def cosine(a: list[float], b: list[float]) -> float:
    """A bi-encoder's score: the cosine of two embeddings (float64)."""
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0))


__all__ = ["POOLING_MODES", "TASKS", "PoolingParams", "cosine", "task_columns"]
