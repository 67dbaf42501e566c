"""What the prefill-only tasks (embed, score, classify, reward: one module each) share: a row is a text, a chat or a
pair of texts; each of its requests is one prefill whose hidden states the runner pools into one vector
(engine/pooling.py); the row's columns come from those vectors once all of them are back.

Settings are resolved once per job against the checkpoint: its head (a *ForSequenceClassification, or a causal LM's
head read at named tokens: an LM-head reranker, `classifier_from_token`) or its sentence-transformers pooling
config; a job the model cannot do is refused with one line naming the fix.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from cbatch.config import SamplingParams
from cbatch.engine.pooling import POOLING_MODES, ClassifierHead, PoolingHead, PoolingParams, TokenLogitsHead
from cbatch.io.openai import request_digest
from cbatch.io.pooling_rows import PoolingRow, RowFormat, parse_pooling_row
from cbatch.io.row_fields import RowError
from cbatch.model.errors import UnsupportedModelError
from cbatch.model.pooling_config import ClassifierTokens, model_classifier_tokens, model_pooling
from cbatch.tasks.base import ParsedRow, Part, PendingRow, Request, RowWork, Task, TaskError, TaskOptions
from cbatch.tasks.results import RowResult
from cbatch.tokenizer import encode_messages, encode_score_pair, load_tokenizer

if TYPE_CHECKING:
    from cbatch.engine.engine import Engine, RequestOutput
    from cbatch.model.spec import ModelSpec


class PooledTask(Task):
    """A prefill-only task. A subclass names its row format, its OpenAI data object and its columns, resolves its
    settings (`for_job`) and turns a finished row's vectors into columns (`row_columns`)."""

    decodes: ClassVar[bool] = False
    row_format: ClassVar[RowFormat]
    data_object: ClassVar[str]  # the OpenAI body's `data[0].object`

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A task declaring its `row_format` takes its input fields from it (INPUT's probe)."""
        super().__init_subclass__(**kwargs)
        if "row_format" in cls.__dict__:
            cls.input_fields = cls.row_format.input_fields

    def __init__(self, pooling: PoolingParams, defaults: SamplingParams = SamplingParams()) -> None:
        self.pooling = pooling
        self.defaults = defaults  # the settings its requests run with (one position each; no sampling)

    def identity(self) -> dict[str, Any]:
        head = self.pooling.head
        return {"task": {**asdict(self.pooling), "head": head.identity() if head is not None else False}}

    def column_types(self) -> dict[str, Any]:
        import pyarrow as pa

        types = {"embedding": pa.list_(pa.float32()), "score": pa.float64(), "label": pa.string(),
                 "probs": pa.list_(pa.float32()), "reward": pa.float64(), "scores": pa.list_(pa.float64())}
        return {name: types[name] for name in self.columns}

    # ---- a row's life ---------------------------------------------------------------------------------------
    def parse(self, index: int, raw: dict[str, Any] | str) -> ParsedRow:
        row = parse_pooling_row(index, raw, self.row_format)
        return ParsedRow(index, row.row_id, row, 1, row.echo)

    def requests(self, engine: "Engine", parsed: ParsedRow) -> RowWork:
        """One request: the row's text, chat or token ids (a task of several requests a row makes its own)."""
        row: PoolingRow = parsed.request
        pooling = self.pooling if row.dimensions is None else replace(self.pooling, dimensions=row.dimensions)
        if pooling.dimensions is not None and engine.spec is not None and pooling.dimensions > engine.spec.hidden_size:
            raise RowError(f"body.dimensions must be at most the model's {engine.spec.hidden_size}, got {pooling.dimensions}")
        ids = input_ids(engine, row, None)
        # the cache key: the prompt ids, and a row's own `dimensions` as a negative id
        key_ids = [*ids, -1] + ([-1 - row.dimensions] if row.dimensions else [])
        return RowWork(parsed, [Request(ids, self.defaults, pooling)], (key_ids, self.defaults))

    def collect(self, engine: "Engine", row: PendingRow, part: Part, out: "RequestOutput") -> list[RowResult]:
        row.outputs[part] = out
        if row.left:
            return []  # a bi-encoder's other half is still running
        outs = [row.outputs[p] for p in sorted(row.outputs)]
        vectors = [out.pooled for out in outs]
        prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
        columns = {} if None in vectors else self.row_columns(vectors, engine, row.parsed)  # simulated: no vectors
        return [row.result("stop", prompt_tokens=prompt_tokens, columns=columns)]

    @abstractmethod
    def row_columns(self, vectors: list[list[float]], engine: "Engine", parsed: ParsedRow) -> dict[str, Any]:
        """A finished row's columns from its requests' vectors (in request order)."""

    # ---- OpenAI output ----------------------------------------------------------------------------------------
    def openai_body(self, samples: list[dict[str, Any]], model: str, created: int) -> dict[str, Any]:
        """The response body OpenAI (embeddings) and vLLM (score, classify, pooling) return:
        `{"object": "list", "data": [{"object", "index": 0, ...}], "model", "usage"}`."""
        record = samples[0]
        prompt_tokens = record["prompt_tokens"]
        echo = record.get("echo") or {}
        return {"id": f"{self.name}-{request_digest(record)}", "object": "list", "created": created,
                "model": echo.get("model") or model, "data": self.data_items(record),
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

    def data_items(self, record: dict[str, Any]) -> list[dict[str, Any]]:
        """The body's `data`: one item, the row's columns in it."""
        item: dict[str, Any] = {"object": self.data_object, "index": 0}
        item.update({k: record[k] for k in self.columns if record.get(k) is not None})
        self.add_to_item(item, record)
        return [item]

    def add_to_item(self, item: dict[str, Any], record: dict[str, Any]) -> None:
        """What a task adds to its OpenAI data item beyond its columns."""


# ---- settings ---------------------------------------------------------------------------------------------------
def check_pooling_flag(options: TaskOptions) -> None:
    if options.pooling is not None and options.pooling not in POOLING_MODES:
        raise TaskError(f"--pooling: one of {', '.join(POOLING_MODES)}, not {options.pooling!r}")


def head_pooling(task: str, options: TaskOptions, spec: "ModelSpec", one_output: bool,
                 model_dir: Path | None = None) -> PoolingParams:
    """A head's task (classify, reward, a cross-encoder's score): the checkpoint's classification head, or its LM
    head read at the job's classifier tokens (`token_head`), on the last token (HF's *ForSequenceClassification).
    `one_output`: the head must have one output."""
    check_pooling_flag(options)
    arch = spec.architecture
    head: PoolingHead | None = token_head(task, options, spec, model_dir)
    if head is not None:
        outputs = head.num_outputs
    elif spec.head == "classify":
        head, outputs = ClassifierHead(spec.labels), spec.num_labels
    else:
        raise TaskError(f"--task {task}: needs a sequence classification head (a *ForSequenceClassification "
                        f"checkpoint) or an LM-head reranker's tokens (--classifier-from-token); this is a {arch}, "
                        "use --task embed")
    if one_output and outputs != 1:
        raise TaskError(f"--task {task}: needs a head with one output; this {arch} has {outputs} labels, use --task classify")
    if options.normalize is not None or options.dimensions is not None:
        raise TaskError(f"--normalize and --dimensions are for embeddings; leave them out for --task {task}")
    return PoolingParams(task, options.pooling or "last", head=head)


def job_classifier_tokens(options: TaskOptions, model_dir: Path | None) -> ClassifierTokens | None:
    """The job's classifier tokens: --classifier-from-token (or the library's `hf_overrides`), else the model's
    config.json's `classifier_from_token`; None: neither names any."""
    if options.classifier is not None:
        return options.classifier
    try:
        return model_classifier_tokens(model_dir) if model_dir is not None else None
    except UnsupportedModelError as exc:
        raise TaskError(f"{model_dir}/config.json: {exc}") from None


def token_head(task: str, options: TaskOptions, spec: "ModelSpec", model_dir: Path | None) -> TokenLogitsHead | None:
    """An LM-head reranker's head (vLLM's `classifier_from_token`): the named tokens' ids in the model's vocabulary;
    None when the job and the model name no tokens."""
    classifier = job_classifier_tokens(options, model_dir)
    if classifier is None:
        return None
    if not spec.generates:
        raise TaskError(f"--classifier-from-token reads a causal LM's head; this {spec.architecture} has none "
                        f"({'its own classification head scores: leave the flag out' if spec.head == 'classify' else 'a bare decoder'})")
    tokenizer = load_tokenizer(model_dir) if model_dir is not None else None
    if tokenizer is None:
        raise TaskError("--classifier-from-token: this model has no tokenizer to find the tokens in")
    vocab = tokenizer.get_vocab()
    missing = next((t for t in classifier.tokens if t not in vocab), None)
    if missing is not None:
        raise TaskError(f"--classifier-from-token: {missing!r} is not a token of this model's vocabulary; give each "
                        "token as the vocabulary spells it (Qwen3-Reranker: no,yes)")
    method = classifier.resolved_method
    labels = classifier.tokens[1:] if method == "from_2_way_softmax" else classifier.tokens
    return TokenLogitsHead(tuple(vocab[t] for t in classifier.tokens), method, labels)


def embedding_pooling(task: str, options: TaskOptions, spec: "ModelSpec", model_dir: Path | None) -> PoolingParams:
    """An embedding's settings (embed, a bi-encoder's score): pooled as the model's sentence-transformers config
    says unless --pooling / --normalize say otherwise; --dimensions: Matryoshka."""
    check_pooling_flag(options)
    own = model_pooling(model_dir) if model_dir is not None else None  # a weightless shape has no folder
    if options.pooling is None and own is None:
        raise TaskError(f"--task {task}: this {spec.architecture} has no pooling config (sentence-transformers "
                        "modules.json with a Pooling module); give --pooling last, mean or cls")
    dimensions = options.dimensions
    if dimensions is not None and not 1 <= dimensions <= spec.hidden_size:
        raise TaskError(f"--dimensions: between 1 and the model's hidden size {spec.hidden_size}, not {dimensions}")
    normalize = options.normalize if options.normalize is not None else (own.normalize if own is not None else False)
    return PoolingParams(task, options.pooling or own.pooling, normalize=normalize, dimensions=dimensions)


def check_task_flags(task: Task, options: TaskOptions, tensor_parallel_size: int) -> None:
    """The job's task against the flags only some tasks read (a TaskError naming the flag, never a flag ignored):
    --classifier-from-token (an LM-head head's tasks), --score-template (the pair tasks, which keep it as
    `template`); and an LM-head reranker under tensor parallelism, whose vocabulary logits rank 0 reads alone
    (a rank holds only its share of the LM head)."""
    lm_head = isinstance(task, PooledTask) and isinstance(task.pooling.head, TokenLogitsHead)
    if options.classifier is not None and not lm_head:
        raise TaskError(f"--classifier-from-token is for --task score, rerank, classify or reward; leave it out for "
                        f"--task {task.name}")
    if options.score_template is not None and getattr(task, "template", None) is None:
        raise TaskError(f"--score-template is for --task score or rerank; leave it out for --task {task.name}")
    if tensor_parallel_size > 1 and lm_head:
        raise TaskError("--classifier-from-token (an LM-head reranker) runs on one rank; use --tensor-parallel-size 1")


# ---- inputs -----------------------------------------------------------------------------------------------------
def input_ids(engine: "Engine", row: PoolingRow, text: str | None, template: str | None = None) -> list[int]:
    """A prefill-only request's token ids: its own, its text's or (`text` None with a pair: a cross-encoder) its
    pair's, tokenized as HF and sentence-transformers do (the tokenizer's special tokens added); with a score
    `template` the pair rendered through it (`encode_score_pair`)."""
    tokenizer = engine.tokenizer
    if row.token_ids is not None:
        ids = row.token_ids
    elif tokenizer is None:
        raise RowError("this model has no tokenizer; give `prompt_token_ids` instead of text")
    elif row.messages is not None:
        try:
            ids = encode_messages(tokenizer, row.messages, generation_prompt=False)
        except Exception as exc:  # no chat template, a template raising on odd roles
            raise RowError(f"could not render `messages` ({type(exc).__name__}: {exc})") from None
    elif text is not None or row.pair is None:
        ids = list(tokenizer.encode(text if text is not None else row.text))
    elif template is not None:
        try:
            ids = encode_score_pair(tokenizer, template, *row.pair)
        except Exception as exc:  # a template raising on this pair
            raise RowError(f"--score-template could not render this pair ({type(exc).__name__}: {exc})") from None
    else:
        ids = list(tokenizer.encode(*row.pair))
    if (error := engine.vocabulary_error("the input", ids)) is not None:
        raise RowError(error)
    return ids


__all__ = ["PooledTask", "embedding_pooling", "head_pooling", "input_ids", "check_task_flags", "job_classifier_tokens", "token_head"]
