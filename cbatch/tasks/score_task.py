"""`--task score`: each row's pair of texts scored (vLLM's /v1/score): by a cross-encoder (a classification head
with one output, sigmoid of its logit over the pair) or a bi-encoder (the cosine of the two texts' embeddings, each
its own request)."""
from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from cbatch.io.pooling_rows import RowFormat
from cbatch.tasks.base import ParsedRow, TaskOptions, register
from cbatch.tasks.pooled import PooledTask, embedding_pooling, head_pooling

if TYPE_CHECKING:
    from cbatch.engine.engine import Engine
    from cbatch.model.spec import ModelSpec


@register
class ScoreTask(PooledTask):
    name: ClassVar[str] = "score"
    row_format: ClassVar[RowFormat] = RowFormat(name, "/v1/score", ("model", "text_1", "text_2", "user"), pair=True)
    input_fields: ClassVar[tuple[str, ...]] = row_format.input_fields
    columns: ClassVar[tuple[str, ...]] = ("score",)
    data_object: ClassVar[str] = "score"

    @classmethod
    def for_job(cls, options: TaskOptions, spec: "ModelSpec", model_dir: Path | None) -> "ScoreTask":
        if spec.head == "classify":
            return cls(head_pooling(cls.name, options, spec, one_output=True), options.defaults)
        return cls(embedding_pooling(cls.name, options, spec, model_dir), options.defaults)

    def row_columns(self, vectors: list[list[float]], engine: "Engine", parsed: ParsedRow) -> dict[str, Any]:
        return {"score": pair_score(vectors)}


def pair_score(vectors: list[list[float]]) -> float:
    """A pair's score from its requests' vectors: a cross-encoder's one (sigmoid of its logit), or a bi-encoder's
    two embeddings (their cosine)."""
    if len(vectors) == 2:
        return cosine(vectors[0], vectors[1])
    return 1.0 / (1.0 + math.exp(-vectors[0][0]))


def cosine(a: list[float], b: list[float]) -> float:
    """A bi-encoder's score: the cosine of two embeddings (float64)."""
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0))
