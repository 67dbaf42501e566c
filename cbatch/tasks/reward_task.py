"""`--task reward`: a reward model's score of each row (its head's one logit; vLLM's /v1/pooling), a text or a chat."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from cbatch.io.pooling_rows import RowFormat
from cbatch.tasks.base import ParsedRow, TaskOptions, register
from cbatch.tasks.pooled import PooledTask, head_pooling

if TYPE_CHECKING:
    from cbatch.engine.engine import Engine
    from cbatch.model.spec import ModelSpec


@register
class RewardTask(PooledTask):
    name: ClassVar[str] = "reward"
    row_format: ClassVar[RowFormat] = RowFormat(name, "/v1/pooling", ("model", "input", "messages", "user"), chats=True)
    columns: ClassVar[tuple[str, ...]] = ("reward",)
    data_object: ClassVar[str] = "reward"

    @classmethod
    def for_job(cls, options: TaskOptions, spec: "ModelSpec", model_dir: Path | None) -> "RewardTask":
        return cls(head_pooling(cls.name, options, spec, one_output=True, model_dir=model_dir), options.defaults)

    def row_columns(self, vectors: list[list[float]], engine: "Engine", parsed: ParsedRow) -> dict[str, Any]:
        return {"reward": vectors[0][0]}
