"""`--task classify`: each row's class from the model's sequence classification head, or an LM head read at
--classifier-from-token's tokens (vLLM's /v1/classify): the softmax over its labels (one label: its sigmoid, as
vLLM) and the most likely one, named by the model's id2label (the tokens, for an LM head)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from cbatch.io.pooling_rows import RowFormat
from cbatch.tasks.base import ParsedRow, TaskOptions, register
from cbatch.tasks.pooled import PooledTask, head_pooling

if TYPE_CHECKING:
    from cbatch.engine.engine import Engine
    from cbatch.model.spec import ModelSpec


@register
class ClassifyTask(PooledTask):
    name: ClassVar[str] = "classify"
    row_format: ClassVar[RowFormat] = RowFormat(name, "/v1/classify", ("model", "input", "messages", "user"), chats=True)
    columns: ClassVar[tuple[str, ...]] = ("label", "probs")
    data_object: ClassVar[str] = "classification"

    @classmethod
    def for_job(cls, options: TaskOptions, spec: "ModelSpec", model_dir: Path | None) -> "ClassifyTask":
        return cls(head_pooling(cls.name, options, spec, one_output=False, model_dir=model_dir), options.defaults)

    def row_columns(self, vectors: list[list[float]], engine: "Engine", parsed: ParsedRow) -> dict[str, Any]:
        return class_columns(vectors[0], self.pooling.head.labels)

    def add_to_item(self, item: dict[str, Any], record: dict[str, Any]) -> None:
        item["num_classes"] = len(record.get("probs") or [])


def class_columns(logits: list[float], labels: tuple[str, ...]) -> dict[str, Any]:
    """`label` + `probs`: the softmax over the head's logits (one logit: its sigmoid, vLLM's), the best label named
    by `labels`."""
    values = torch.tensor(logits, dtype=torch.float32)
    probs = torch.sigmoid(values) if len(logits) == 1 else torch.softmax(values, dim=0)
    best = int(probs.argmax())
    return {"label": labels[best] if best < len(labels) else str(best), "probs": probs.tolist()}
