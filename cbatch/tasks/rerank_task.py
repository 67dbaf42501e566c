"""`--task rerank`: a query against a list of documents, the documents sorted by relevance (vLLM's and Cohere's
/rerank). A row is `{"query", "documents": [...], "top_n"?, "return_documents"?}` or an OpenAI batch line whose url
is /rerank, /v1/rerank or /v2/rerank with those fields in its body. Each (query, document) pair is scored exactly as
`--task score` scores it, one prefill-only request per pair: a cross-encoder reads the pair (an LM-head reranker
query + document as one text), a bi-encoder embeds the query once and each document (the cosine of the two). The
row's `results` lists `{index, relevance_score, document?}`, best first, the first `top_n` (0 or none: all, as vLLM).
A row's documents come back when it asks (`return_documents`); an OpenAI line's unless it says false (vLLM's
/rerank always returns them, Cohere's when asked).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from cbatch.io.openai import RequestError, batch_body, request_digest
from cbatch.io.pooling_rows import Pair
from cbatch.io.row_fields import RowError, row_id_of, text_field
from cbatch.tasks.base import ParsedRow, Request, RowWork, TaskOptions, register
from cbatch.tasks.score_task import PairPlan, PairTask, ScoreTask

if TYPE_CHECKING:
    from cbatch.engine.engine import Engine
    from cbatch.model.spec import ModelSpec

URLS = ("/rerank", "/v1/rerank", "/v2/rerank")
BODY_FIELDS = ("model", "query", "documents", "top_n", "return_documents", "user")


@dataclass(slots=True)
class RerankRow:
    query: str
    documents: list[str]
    top_n: int | None = None  # keep the best `top_n` (None: all)
    return_documents: bool = False  # each result repeats its document's text (an OpenAI line's default: true)
    echo: dict[str, Any] = field(default_factory=dict)

    @property
    def pairs(self) -> list[Pair]:
        return [(self.query, document) for document in self.documents]


@register
class RerankTask(PairTask):
    name: ClassVar[str] = "rerank"
    input_fields: ClassVar[tuple[str, ...]] = ("query", "body")
    columns: ClassVar[tuple[str, ...]] = ("results",)
    data_object: ClassVar[str] = "rerank"

    @classmethod
    def for_job(cls, options: TaskOptions, spec: "ModelSpec", model_dir: Path | None) -> "RerankTask":
        scoring = ScoreTask.for_job(options, spec, model_dir)  # the pairs are scored as --task score scores them
        return cls(scoring.pooling, options.defaults, scoring.template)

    def column_types(self) -> dict[str, Any]:
        import pyarrow as pa

        result = pa.struct([("index", pa.int64()), ("relevance_score", pa.float64()), ("document", pa.string())])
        return {"results": pa.list_(result)}

    def parse(self, index: int, raw: dict[str, Any] | str) -> ParsedRow:
        row = parse_rerank_row(raw)
        return ParsedRow(index, row_id_of(index, raw), row, 1, row.echo)

    def requests(self, engine: "Engine", parsed: ParsedRow) -> RowWork:
        """The (query, document) pairs as --task score makes a row of lists' requests (`PairPlan`): a cross-encoder one
        request per pair; a bi-encoder the query's, then each distinct document's."""
        row: RerankRow = parsed.request
        plan = PairPlan.of(row.pairs, self.pooling.head, self.template)
        prompts = plan.prompts(engine, parsed)
        key_ids = plan.key_ids(prompts, listed=True)  # (the settings that shape `results` are not ids:)
        key_ids += [-2 - (row.top_n or 0), -2 - int(row.return_documents)]
        return RowWork(parsed, [Request(ids, self.defaults, self.pooling) for ids in prompts], (key_ids, self.defaults))

    def row_columns(self, vectors: list[list[float]], engine: "Engine", parsed: ParsedRow) -> dict[str, Any]:
        """`results`: each document's score as --task score gives it for the pair, best first."""
        row: RerankRow = parsed.request
        return {"results": ranked(PairPlan.of(row.pairs, self.pooling.head, self.template).scores(vectors), row)}

    def openai_body(self, samples: list[dict[str, Any]], model: str, created: int) -> dict[str, Any]:
        """vLLM's and Cohere's rerank response: `{"id", "model", "usage", "results": [...]}`."""
        record = samples[0]
        echo = record.get("echo") or {}
        results = [{k: v for k, v in r.items() if k != "document" or v is not None} for r in record.get("results") or []]
        for r in results:
            if "document" in r:
                r["document"] = {"text": r["document"]}
        tokens = record["prompt_tokens"]
        return {"id": f"rerank-{request_digest(record)}", "model": echo.get("model") or model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results}


def ranked(scores: list[float], row: RerankRow) -> list[dict[str, Any]]:
    """The documents best first (ties: input order), the first `top_n`."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[: row.top_n]
    return [{"index": i, "relevance_score": scores[i], "document": row.documents[i] if row.return_documents else None}
            for i in order]


def parse_rerank_row(raw: dict[str, Any] | str) -> RerankRow:
    """Raises RowError naming the field."""
    if isinstance(raw, str):
        raise RowError(raw)
    echo: dict[str, Any] = {}
    fields = raw
    if "body" in raw:
        try:
            fields = batch_body(raw)
        except RequestError as exc:
            raise RowError(str(exc)) from None
        url = raw.get("url")
        if url is not None and url not in URLS:
            raise RowError(f"url: --task rerank takes {', '.join(URLS)} lines, got {url!r}")
        unknown = next((k for k in fields if k not in BODY_FIELDS), None)
        if unknown is not None:
            raise RowError(f"body.{unknown}: not a field cbatch knows for /rerank; remove it")
        echo["openai"] = True
        if isinstance(fields.get("model"), str):
            echo["model"] = fields["model"]
    if fields.get("query") is None:
        raise RowError("missing `query`: a rerank row gives `query` (text) and `documents` (a list of texts)")
    query = text_field("query", fields["query"])
    documents = fields.get("documents")
    if not isinstance(documents, list) or not documents:
        raise RowError("`documents` must be a non-empty list of texts")
    documents = [text_field(f"documents[{i}]", d.get("text") if isinstance(d, dict) else d) for i, d in enumerate(documents)]
    top_n = fields.get("top_n")
    if top_n is not None and (not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0):
        raise RowError(f"`top_n` must be a non-negative integer (0: every document), got {top_n!r}")
    return_documents = fields.get("return_documents", bool(echo.get("openai")))
    if not isinstance(return_documents, bool):
        raise RowError(f"`return_documents` must be true or false, got {return_documents!r}")
    return RerankRow(query, documents, top_n or None, return_documents, echo)


__all__ = ["RerankTask", "parse_rerank_row", "ranked"]
