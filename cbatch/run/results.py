"""One row's outcome, as every executor returns it, and the record the job keeps for it.

The record (a dict) is what the crash-safe part files hold and OUTPUT is written from; its keys are
the output columns plus `index` (the row's place in the input).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cbatch.observe.metrics import RequestTiming

Record = dict[str, Any]


def _writable(text: str | None) -> str | None:
    """JSON input may carry lone surrogates, which UTF-8 output cannot hold: replace them."""
    return text.encode("utf-8", "replace").decode("utf-8") if isinstance(text, str) else text


@dataclass(slots=True)
class RowResult:
    index: int  # the row's place in the input (its seq_id in the engine, so its seed)
    row_id: str
    finish_reason: str  # stop | length | error
    completion: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    completion_token_ids: list[int] = field(default_factory=list)
    timing: RequestTiming | None = None  # for the latency report; not kept in the record
    echo: dict[str, Any] = field(default_factory=dict)  # request fields an OpenAI output line repeats (io/openai.py)
    kept: dict[str, Any] = field(default_factory=dict)  # --keep-columns: input columns carried to the output

    @property
    def ok(self) -> bool:
        return self.finish_reason != "error"

    @classmethod
    def failed(cls, index: int, row_id: str, error: str, prompt_tokens: int = 0) -> "RowResult":
        return cls(index, row_id, "error", prompt_tokens=prompt_tokens, error=error)

    def record(self) -> Record:
        return {
            "index": self.index, "id": _writable(self.row_id), "completion": _writable(self.completion),
            "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "error": _writable(self.error),
            "completion_token_ids": self.completion_token_ids,
            **({"echo": self.echo} if self.echo else {}), **({"kept": self.kept} if self.kept else {}),
        }
