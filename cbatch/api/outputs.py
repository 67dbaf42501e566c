"""The library's results in vLLM's shapes and field names: `RequestOutput` (a prompt and its `CompletionOutput`s),
and the prefill-only tasks' `EmbeddingRequestOutput`, `ClassificationRequestOutput`, `ScoringRequestOutput` and
`PoolingRequestOutput` (`.outputs.embedding`, `.probs`, `.score`, `.data`); built from the engine's outputs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cbatch.engine.engine import RequestOutput as EngineOutput
from cbatch.engine.logprobs import Logprobs


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position; `rank` is its place among the position's most likely tokens
    (1 = most likely), None for the sampled token when it is not among the `logprobs` asked for."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]  # token id -> its Logprob: the position's token and its top k


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a prompt. `cumulative_logprob` and `logprobs` only when the sampling params ask `logprobs`;
    `stop_reason`: the stop string or stop token id that ended it (None for EOS, a grammar's end or a length)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # stop | length
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A prompt's result: its `n` samples in `outputs` (sample order). `prompt` is the text given (a chat's
    rendered template), None for token ids; `prompt_logprobs` starts with None (the first token has none)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass(slots=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class ClassificationOutput:
    """`probs`: softmax over the head's labels; `label` (cbatch's): the most likely one's name (id2label)."""

    probs: list[float]
    label: str | None = None

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ScoringOutput:
    """A cross-encoder's sigmoid(logit) of the pair, or an embedding model's cosine of the two texts."""

    score: float


@dataclass(slots=True)
class PoolingOutput:
    """The raw result: an embedding, or the head's outputs (a reward model's one logit), as a float32 tensor."""

    data: Any  # torch.Tensor


@dataclass(slots=True)
class PoolingRequestOutput:
    """One input's prefill-only result; `outputs` is the task's output object (`PoolingOutput` here)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True


class EmbeddingRequestOutput(PoolingRequestOutput):
    """`outputs`: an `EmbeddingOutput`."""

    __slots__ = ()


class ClassificationRequestOutput(PoolingRequestOutput):
    """`outputs`: a `ClassificationOutput`."""

    __slots__ = ()


class ScoringRequestOutput(PoolingRequestOutput):
    """`outputs`: a `ScoringOutput`; `prompt_token_ids` are the pair's (a bi-encoder's: both texts')."""

    __slots__ = ()


def position_logprobs(lp: Logprobs, token_ids: list[int], decode) -> list[PositionLogprobs]:
    """vLLM's per-position dicts from cbatch's `Logprobs` of `token_ids`: each position's top k by rank, and the
    position's own token (rank None when it is not among them). `decode(id)`: a token's text, or None."""
    out = []
    for token, own, ids, values in zip(token_ids, lp.token, lp.top_ids, lp.top_values):
        position = {t: Logprob(v, rank, decode(t)) for rank, (t, v) in enumerate(zip(ids, values), start=1)}
        if token not in position:
            position[token] = Logprob(own, None, decode(token))
        out.append(position)
    return out


def completion(index: int, out: EngineOutput, stop_reason: int | str | None, decode) -> CompletionOutput:
    """A sample's `CompletionOutput` from the engine's output of it."""
    logprobs = None if out.logprobs is None else position_logprobs(out.logprobs, out.token_ids, decode)
    return CompletionOutput(
        index=index, text=out.text if out.text is not None else "", token_ids=list(out.token_ids),
        cumulative_logprob=None if out.logprobs is None else float(sum(out.logprobs.token)), logprobs=logprobs,
        finish_reason=out.finish_reason, stop_reason=stop_reason)


def prompt_logprobs(out: EngineOutput, decode) -> list[PositionLogprobs | None] | None:
    """The prompt's per-position dicts, None first (nothing predicts the first token)."""
    if out.prompt_logprobs is None:
        return None
    return [None, *position_logprobs(out.prompt_logprobs, out.prompt_token_ids[1:], decode)]


__all__ = ["ClassificationOutput", "ClassificationRequestOutput", "CompletionOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput", "Logprob", "PoolingOutput", "PoolingRequestOutput", "RequestOutput",
           "ScoringOutput", "ScoringRequestOutput", "completion", "prompt_logprobs"]
