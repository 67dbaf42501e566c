"""`--task score`: each row's pair of texts scored (vLLM's /v1/score): by a cross-encoder (a classification head
with one output, sigmoid of its logit over the pair) or a bi-encoder (the cosine of the two texts' embeddings, each
its own request). A row of lists (one text against a list, or two lists item by item) scores each of its pairs as a
pair row is scored, into a `scores` column. How pairs become requests and scores (`PairPlan`) is shared with
--task rerank. With --score-template a pair is rendered through it (vLLM's score template: messages of roles
`query` and `document`) for a cross-encoder or an LM-head reranker."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from cbatch.config import SamplingParams
from cbatch.engine.pooling import PoolingHead, PoolingParams
from cbatch.io.pooling_rows import Pair, PoolingRow, RowFormat
from cbatch.tasks.base import ParsedRow, Request, RowWork, TaskError, TaskOptions, register
from cbatch.tasks.pooled import PooledTask, embedding_pooling, head_pooling, input_ids, job_classifier_tokens

if TYPE_CHECKING:
    from cbatch.engine.engine import Engine
    from cbatch.model.spec import ModelSpec


class PairTask(PooledTask):
    """A task scoring pairs (score, rerank): its pooling and, with --score-template, the template each pair is
    rendered through."""

    def __init__(self, pooling: PoolingParams, defaults: SamplingParams = SamplingParams(),
                 template: str | None = None) -> None:
        super().__init__(pooling, defaults)
        self.template = template  # --score-template: each pair rendered through it (None: the pair as it is)

    def identity(self) -> dict[str, Any]:
        return {**super().identity(), **({"score_template": self.template} if self.template is not None else {})}


@register
class ScoreTask(PairTask):
    name: ClassVar[str] = "score"
    row_format: ClassVar[RowFormat] = RowFormat(name, "/v1/score", ("model", "text_1", "text_2", "queries", "documents",
                                                                     "user"), pair=True, aliases=("/score",))
    columns: ClassVar[tuple[str, ...]] = ("score", "scores")  # a pair row's `score`; a row of lists' `scores`
    data_object: ClassVar[str] = "score"

    @classmethod
    def for_job(cls, options: TaskOptions, spec: "ModelSpec", model_dir: Path | None) -> "ScoreTask":
        return cls(pair_scoring(cls.name, options, spec, model_dir), options.defaults, options.score_template)

    def requests(self, engine: "Engine", parsed: ParsedRow) -> RowWork:
        """Each pair as `PairPlan` makes it: a cross-encoder one request per pair, a bi-encoder one per distinct text."""
        row: PoolingRow = parsed.request
        plan = PairPlan.of(row.pairs or [row.pair], self.pooling.head, self.template)
        prompts = plan.prompts(engine, parsed)
        key_ids = plan.key_ids(prompts, listed=row.pairs is not None)
        return RowWork(parsed, [Request(ids, self.defaults, self.pooling) for ids in prompts], (key_ids, self.defaults))

    def row_columns(self, vectors: list[list[float]], engine: "Engine", parsed: ParsedRow) -> dict[str, Any]:
        row: PoolingRow = parsed.request
        scores = PairPlan.of(row.pairs or [row.pair], self.pooling.head, self.template).scores(vectors)
        return {"scores": scores} if row.pairs is not None else {"score": scores[0]}

    def data_items(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """vLLM's /score data: one `{"index", "object": "score", "score"}` per pair, in order."""
        if record.get("scores") is None:
            return super().data_items(record)
        return [{"index": i, "object": self.data_object, "score": score} for i, score in enumerate(record["scores"])]


@dataclass(frozen=True, slots=True)
class PairPlan:
    """How a row's (text_1, text_2) pairs are scored: the inputs of its requests (a cross-encoder: each pair; a
    bi-encoder: each distinct text once, in order of first use) and, per pair, the requests whose vectors score it.
    Made from the row alone, so the requests and the scores agree."""

    inputs: list[Pair | str]
    slots: list[tuple[int, ...]]  # per pair: its request (cross-encoder), or its two texts' requests (bi-encoder)
    joined: bool = False  # a pair is read as one text, text_1 + text_2 (an LM-head reranker), not as a text pair
    template: str | None = None  # a score template each pair is rendered through (a cross-encoder's, an LM head's)

    @classmethod
    def of(cls, pairs: list[Pair], head: PoolingHead | None, template: str | None = None) -> "PairPlan":
        """`head`: the job's (None: a bi-encoder's embeddings); `template`: --score-template's text."""
        if head is not None:
            return cls(list(pairs), [(i,) for i in range(len(pairs))], head.joins_pair, template)
        at: dict[str, int] = {}
        for text in (text for pair in pairs for text in pair):
            at.setdefault(text, len(at))
        return cls(list(at), [(at[a], at[b]) for a, b in pairs])

    def prompts(self, engine: "Engine", parsed: ParsedRow) -> list[list[int]]:
        """Each request's token ids (`input_ids`), in request order."""
        return [self._ids(engine, parsed, x) for x in self.inputs]

    def _ids(self, engine: "Engine", parsed: ParsedRow, item: Pair | str) -> list[int]:
        """A bi-encoder's text: its own ids; a pair: rendered through the template, else read as one text (an LM-head
        reranker), else the tokenizer's pair encoding (a cross-encoder)."""
        if isinstance(item, str):
            return input_ids(engine, PoolingRow(parsed.index, parsed.row_id), item)
        if self.joined and self.template is None:
            return input_ids(engine, PoolingRow(parsed.index, parsed.row_id), item[0] + item[1])
        return input_ids(engine, PoolingRow(parsed.index, parsed.row_id, pair=item), None, self.template)

    def key_ids(self, prompts: list[list[int]], listed: bool) -> list[int]:
        """The result cache's ids: the prompts; a row of lists also its marker and which requests score each pair
        (negative ids, never token ids)."""
        ids = [t for p in prompts for t in [*p, -1]]
        return ids + [-2, *(t for slot in self.slots for t in (*(-3 - j for j in slot), -2))] if listed else ids

    def scores(self, vectors: list[list[float]]) -> list[float]:
        """Each pair's score, in order, from the requests' vectors (in request order)."""
        return [pair_score([vectors[j] for j in slot]) for slot in self.slots]


def pair_scoring(task: str, options: TaskOptions, spec: "ModelSpec", model_dir: Path | None) -> PoolingParams:
    """A score's or a rerank's pooling: a head (a cross-encoder's, an LM-head reranker's) or a bi-encoder's
    embeddings; --score-template only with a head (a bi-encoder embeds each text alone)."""
    if spec.head == "classify" or job_classifier_tokens(options, model_dir) is not None:
        return head_pooling(task, options, spec, one_output=True, model_dir=model_dir)
    if options.score_template is not None:
        raise TaskError(f"--score-template renders a pair into one input; this {spec.architecture} is scored as a "
                        "bi-encoder (each text embedded alone): leave it out")
    return embedding_pooling(task, options, spec, model_dir)


def pair_score(vectors: list[list[float]]) -> float:
    """A pair's score from its requests' vectors: a cross-encoder's one (sigmoid of its logit; an LM-head reranker's
    logit is logit(true) - logit(false): vLLM's score), or a bi-encoder's two embeddings (their cosine)."""
    if len(vectors) == 2:
        return cosine(vectors[0], vectors[1])
    return 1.0 / (1.0 + math.exp(-vectors[0][0]))


def cosine(a: list[float], b: list[float]) -> float:
    """A bi-encoder's score: the cosine of two embeddings (float64)."""
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(torch.nn.functional.cosine_similarity(x, y, dim=0))
