"""One row's outcome, as every executor returns it, and the record the job keeps for it.

The record (a dict) is what the crash-safe part files hold and OUTPUT is written from; its keys are
the output columns plus `index` (the row's place in the input). A row with n > 1 samples has one record
per sample, with `sample_index` and `num_samples` (what a resume needs to tell a row with some samples
missing); the optional columns (reasoning, log-probabilities: cbatch/io/writer.py) are keys only of
the records that have them, so a job without them writes exactly the records (and OUTPUT) it always did.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cbatch.io.outcomes import FAILED
from cbatch.observe.metrics import RequestTiming

Record = dict[str, Any]
_BASE_KEYS = frozenset({"index", "id", "completion", "finish_reason", "prompt_tokens", "completion_tokens", "error",
                        "completion_token_ids", "sample_index", "num_samples", "echo", "kept", "image_digests"})


def _writable(text: str | None) -> str | None:
    """JSON input may carry lone surrogates, which UTF-8 output cannot hold: replace them."""
    return text.encode("utf-8", "replace").decode("utf-8") if isinstance(text, str) else text


@dataclass(slots=True)
class RowResult:
    index: int  # the row's place in the input (its seq_id in the engine, so its seed)
    row_id: str
    finish_reason: str  # stop | length | error | expired
    completion: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    completion_token_ids: list[int] = field(default_factory=list)
    timing: RequestTiming | None = None  # for the latency report; not kept in the record
    cached: bool = False  # copied from the result cache (cbatch/run/result_cache.py), not generated
    sample_index: int = 0
    num_samples: int = 1  # the row's n (an error row stands for its whole row: 1)
    last: bool = True  # the last of its row's samples this run: the row is done (progress counts rows)
    # optional output columns (reasoning, logprobs, ...) and record-only keys (reasoning_tokens: OpenAI usage)
    columns: dict[str, Any] = field(default_factory=dict)
    echo: dict[str, Any] = field(default_factory=dict)  # request fields an OpenAI output line repeats (io/openai.py)
    kept: dict[str, Any] = field(default_factory=dict)  # --keep-columns: input columns carried to the output
    # the digests of the images the row read (io/images.digest_of), in its order: kept in the part files (not OUTPUT)
    # so that a resume notices an image file changed since (run/resumed_images.py)
    image_digests: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.finish_reason not in FAILED

    @classmethod
    def failed(cls, index: int, row_id: str, error: str, prompt_tokens: int = 0) -> "RowResult":
        return cls(index, row_id, "error", prompt_tokens=prompt_tokens, error=error)

    @classmethod
    def from_record(cls, record: Record, index: int, row_id: str, cached: bool = False) -> "RowResult":
        """The result `record` of a one-sample row describes, as row `index` (the inverse of `record`, row
        fields aside), optional columns included."""
        columns = {k: v for k, v in record.items() if k not in _BASE_KEYS}
        return cls(index, row_id, record["finish_reason"], completion=record["completion"],
                   prompt_tokens=record["prompt_tokens"], completion_tokens=record["completion_tokens"],
                   error=record["error"], completion_token_ids=list(record["completion_token_ids"]), cached=cached,
                   columns=columns)

    def record(self) -> Record:
        record = {
            "index": self.index, "id": _writable(self.row_id), "completion": _writable(self.completion),
            "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens, "error": _writable(self.error),
            "completion_token_ids": self.completion_token_ids,
            **({"echo": self.echo} if self.echo else {}), **({"kept": self.kept} if self.kept else {}),
            **({"image_digests": self.image_digests} if self.image_digests else {}),
        }
        if self.num_samples > 1:
            record.update(sample_index=self.sample_index, num_samples=self.num_samples)
        record.update({k: _writable(v) for k, v in self.columns.items()})
        return record
