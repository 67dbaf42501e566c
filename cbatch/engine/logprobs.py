"""Log-probabilities of generated and prompt tokens, as vLLM v1 returns them by default (`raw_logprobs`):
log_softmax of the model's raw logits, before logit_bias, penalties, temperature and the top-k/top-p/min_p
filters. A token's own log-probability is given with the k most likely tokens of its position (sorted,
best first; the token itself is among them when it is in the top k).

Prompt log-probabilities come from the logits of every prompt position, computed in slices of at most
`PROMPT_SLICE_BYTES` of logits, so a long prompt never holds a [prompt tokens x vocab] tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

PROMPT_SLICE_BYTES = 32 << 20  # float32 logits computed at once for prompt log-probabilities


@dataclass(slots=True)
class Logprobs:
    """Per position: the actual token's log-probability and its position's k most likely tokens."""

    token: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)  # [positions][k], most likely first
    top_values: list[list[float]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token)

    def extend(self, other: "Logprobs") -> None:
        self.token.extend(other.token)
        self.top_ids.extend(other.top_ids)
        self.top_values.extend(other.top_values)

    def at(self, position: int) -> "Logprobs":
        """Position `position` alone (a verified draft's)."""
        i = position
        return Logprobs(self.token[i : i + 1], self.top_ids[i : i + 1], self.top_values[i : i + 1])

    def head(self, count: int) -> "Logprobs":
        """The first `count` positions (static batching's padding tokens cut off)."""
        return Logprobs(self.token[:count], self.top_ids[:count], self.top_values[:count])

    def top(self) -> list[list[dict[str, float | int]]]:
        """[{token_id, logprob}, ...] per position, most likely first: the output columns' form."""
        return [[{"token_id": i, "logprob": v} for i, v in zip(ids, values)]
                for ids, values in zip(self.top_ids, self.top_values)]


def score(logprobs: torch.Tensor, targets: torch.Tensor, ks: list[int]) -> list[Logprobs]:
    """One single-position `Logprobs` per row: the target token's log-probability and the row's top k.

    logprobs: float32 [R, vocab] (log_softmax already applied); targets: int64 [R]."""
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    values, ids = logprobs.topk(max(ks, default=0), dim=-1)  # sorted, most likely first
    values, ids = values.tolist(), ids.tolist()
    return [Logprobs([chosen[r]], [ids[r][:ks[r]]], [values[r][:ks[r]]]) for r in range(len(ks))]


def prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    targets: list[int], k: int, vocab_size: int) -> Logprobs:
    """Log-probabilities of `targets` (the tokens after each of `hidden`'s positions) and the top k of
    each position, with the logits computed `PROMPT_SLICE_BYTES` at a time. hidden: [M, hidden_size]."""
    out = Logprobs()
    rows = max(1, PROMPT_SLICE_BYTES // (4 * vocab_size))
    target_ids = torch.tensor(targets, dtype=torch.int64, device=hidden.device)
    for start in range(0, len(targets), rows):
        logits = compute_logits(hidden[start : start + rows])  # float32 [rows, vocab]
        scored = score(torch.log_softmax(logits, dim=-1), target_ids[start : start + rows], [k] * logits.shape[0])
        for position in scored:
            out.extend(position)
    return out
