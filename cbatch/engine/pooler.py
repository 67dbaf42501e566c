"""The runner's pooling stage (prefill-only requests, engine/pooling.py): each such request's prompt hidden states
become one float32 vector, exactly, however its prompt was chunked.

Per chunk the pooler keeps what the mode needs: `last` the last prompt position's hidden state, `cls` the first
one's, `mean` a float64 running sum (float32 sums of different chunkings round differently; float64 sums of
float32 values do not, in practice, once cast back), divided by the prompt length at the end.
"""
from __future__ import annotations

from typing import Any

import torch

from cbatch.engine.pooling import PoolingParams
from cbatch.engine.sequence import Sequence

PoolRow = tuple[Sequence, int, int]  # (sequence, tokens of its chunk this step, its first flat row)


class Pooler:
    """The runner's pooling stage. Holds, per sequence part-way through its prompt, what its earlier chunks left
    (a mean's float64 sum, a cls vector); `pool` returns the finished vectors of the sequences whose prompt
    ends in this step."""

    def __init__(self) -> None:
        self._partial: dict[int, torch.Tensor] = {}  # seq_id -> [hidden] float64 sum (mean) or float32 (cls)

    def forget(self, seq: Sequence) -> None:
        """`seq` finished, or was preempted: a recomputed one (num_computed 0) starts its sums over; a swapped-out
        one keeps them (its computed positions stay computed)."""
        if seq.num_computed == 0 or seq.is_finished:
            self._partial.pop(seq.seq_id, None)

    def pool(self, hidden: torch.Tensor, rows: list[PoolRow], model: Any) -> dict[int, torch.Tensor]:
        """hidden [T, H] (the step's final hidden states) -> {seq_id: float32 vector on hidden's device} for every row
        whose chunk reaches the end of its prompt. Each vector is finished row by row (its head, `PoolingParams.head`,
        on `model` one row at a time), so a row's result never depends on the others in the batch."""
        done: dict[int, torch.Tensor] = {}
        for seq, num_new, first in rows:
            start, prompt_len = seq.num_computed, seq.prompt_len
            if start >= prompt_len or seq.pooling is None:
                continue  # static batching's padding work past the prompt
            take = min(num_new, prompt_len - start)
            mode = seq.pooling.pooling
            if mode == "mean":
                chunk = hidden[first : first + take].to(torch.float64).sum(0)
                partial = self._partial.get(seq.seq_id)
                self._partial[seq.seq_id] = chunk if partial is None else partial + chunk
            elif mode == "cls" and start == 0:
                self._partial[seq.seq_id] = hidden[first].float()
            if start + take < prompt_len:
                continue
            if mode == "last":
                vector = hidden[first + take - 1].float()
            elif mode == "mean":
                vector = (self._partial.pop(seq.seq_id) / prompt_len).float()
            else:
                vector = self._partial.pop(seq.seq_id)
            done[seq.seq_id] = finish_vector(vector, seq.pooling, model, hidden.dtype)
        return done


def finish_vector(vector: torch.Tensor, params: PoolingParams, model: Any, dtype: torch.dtype) -> torch.Tensor:
    """A pooled float32 [H] vector -> the request's result: its head's float32 logits [num_labels] (on `model`, the
    runner's), or the embedding (truncated to `dimensions`, then normalized where asked)."""
    if params.head is not None:
        return params.head(model, vector.to(dtype)[None])[0].float()
    if params.dimensions is not None:
        vector = vector[: params.dimensions]
    if params.normalize:
        vector = torch.nn.functional.normalize(vector, dim=0)
    return vector


__all__ = ["PoolRow", "Pooler", "finish_vector"]
