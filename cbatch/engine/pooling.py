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
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    import torch

POOLING_MODES = ("last", "mean", "cls")


@dataclass(frozen=True, slots=True)
class ClassifierHead:
    """The checkpoint's sequence classification head (`score`, a *ForSequenceClassification)."""

    labels: tuple[str, ...] = ()  # (the model's id2label names its outputs)
    joins_pair = False  # a scored pair is the tokenizer's text pair (its separator tokens)

    def __call__(self, model: Any, pooled: "torch.Tensor") -> "torch.Tensor":
        """pooled [N, hidden] -> float32 logits [N, num_labels]."""
        return model.classify(pooled)

    def identity(self) -> Any:
        return True


@dataclass(frozen=True, slots=True)
class TokenLogitsHead:
    """A causal LM read as a classifier at its last prompt position, as vLLM's `classifier_from_token` does
    (LM-head rerankers: Qwen3-Reranker, mxbai-rerank-v2, bge-reranker-v2-gemma). `token_ids` are the named tokens'
    ids, in the order given. `from_2_way_softmax` (two tokens, [false, true]): one output, logit(true) -
    logit(false), whose sigmoid is the true token's probability in a softmax over the two; `no_post_processing`:
    one output per token, its logit. The logits are the model's own (HF's `logits[:, -1]`, a Gemma 2 soft-cap
    included), computed for the pooled row only."""

    token_ids: tuple[int, ...]
    method: str = "from_2_way_softmax"  # model/pooling_config.CLASSIFIER_METHODS
    labels: tuple[str, ...] = ()  # each output's name: the true token (from_2_way_softmax), or each token
    joins_pair = True  # a scored pair is one text, text_1 + text_2 (vLLM's "LLM as reranker": no separator)

    def __call__(self, model: Any, pooled: "torch.Tensor") -> "torch.Tensor":
        """pooled [N, hidden] -> float32 [N, 1] (from_2_way_softmax) or [N, len(token_ids)]."""
        logits = model.compute_logits(pooled)[:, list(self.token_ids)]  # [N, k] float32
        if self.method == "from_2_way_softmax":
            return logits[:, 1:2] - logits[:, 0:1]
        return logits

    @property
    def num_outputs(self) -> int:
        return 1 if self.method == "from_2_way_softmax" else len(self.token_ids)

    def identity(self) -> Any:
        return {"token_ids": list(self.token_ids), "method": self.method}


PoolingHead = Union[ClassifierHead, TokenLogitsHead]


@dataclass(frozen=True, slots=True)
class PoolingParams:
    """What a prefill-only request returns. `head`: a head turns the pooled vector into logits (classify, reward, a
    cross-encoder's score: the checkpoint's classification head, or named tokens' logits of its LM head); None: the
    vector is an embedding, truncated to `dimensions` (Matryoshka) and then L2-normalized when `normalize`."""

    task: str  # the task that asked (embed | score | rerank | classify | reward)
    pooling: str = "last"  # last | mean | cls
    normalize: bool = False
    dimensions: int | None = None
    head: PoolingHead | None = None

    @property
    def every_position(self) -> bool:
        """The pooled vector needs the hidden state of every prompt position (no prefix-cache hits)."""
        return self.pooling != "last"


__all__ = ["POOLING_MODES", "ClassifierHead", "PoolingHead", "PoolingParams", "TokenLogitsHead"]
