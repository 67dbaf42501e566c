"""`--task embed`: each row's embedding (OpenAI's /v1/embeddings), pooled as the model's sentence-transformers
config says (docs/tasks.md)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from cbatch.io.pooling_rows import RowFormat
from cbatch.tasks.base import ParsedRow, TaskOptions, register
from cbatch.tasks.pooled import PooledTask, embedding_pooling

if TYPE_CHECKING:
    from cbatch.engine.engine import Engine
    from cbatch.model.spec import ModelSpec


@register
class EmbedTask(PooledTask):
    name: ClassVar[str] = "embed"
    row_format: ClassVar[RowFormat] = RowFormat(name, "/v1/embeddings", ("model", "input", "dimensions", "encoding_format", "user"))
    columns: ClassVar[tuple[str, ...]] = ("embedding",)
    data_object: ClassVar[str] = "embedding"

    @classmethod
    def for_job(cls, options: TaskOptions, spec: "ModelSpec", model_dir: Path | None) -> "EmbedTask":
        return cls(embedding_pooling(cls.name, options, spec, model_dir), options.defaults)

    def row_columns(self, vectors: list[list[float]], engine: "Engine", parsed: ParsedRow) -> dict[str, Any]:
        return {"embedding": vectors[0]}
