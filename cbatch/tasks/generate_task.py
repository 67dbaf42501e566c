"""`--task generate` (the default): a row is a prompt (text, chat or token ids) with its sampling settings; it runs
as one request with `n` samples, and each finished sample is one result: its completion, finish reason and the
optional columns it asked for (reasoning, log-probabilities)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from cbatch.config import SamplingParams
from cbatch.io.openai import request_digest
from cbatch.io.reader import PROMPT_FIELDS
from cbatch.io.row_fields import RowError
from cbatch.io.rows import RowRequest, parse_row, with_lora
from cbatch.tasks.base import ParsedRow, Part, PendingRow, Request, RowWork, Task, TaskError, TaskOptions, register
from cbatch.tasks.results import RowResult
from cbatch.tokenizer import encode_messages, encode_text, split_reasoning, template_thinks

if TYPE_CHECKING:
    from cbatch.engine.engine import Engine, RequestOutput
    from cbatch.model.spec import ModelSpec


@register
class GenerateTask(Task):
    name: ClassVar[str] = "generate"
    input_fields: ClassVar[tuple[str, ...]] = PROMPT_FIELDS

    def __init__(self, defaults: SamplingParams = SamplingParams(), reasoning_split: bool = True) -> None:
        self.defaults = defaults  # the job's sampling settings, under each row's own
        self.reasoning_split = reasoning_split  # a thinking model's <think>...</think> goes to a `reasoning` column

    @classmethod
    def for_job(cls, options: TaskOptions, spec: "ModelSpec", model_dir: Path | None) -> "GenerateTask":
        if any(getattr(options, flag) is not None for flag in ("pooling", "normalize", "dimensions")):
            raise TaskError("--pooling, --normalize and --dimensions are for --task embed or score; add --task embed")
        if not spec.generates:
            fix = "use --task classify, reward or score" if spec.head == "classify" else "use --task embed or score"
            raise TaskError(f"--task generate: this {spec.architecture} has no language-model head; {fix}")
        return cls(options.defaults, options.reasoning_split)

    def identity(self) -> dict[str, Any]:
        return {} if self.reasoning_split else {"reasoning_split": False}  # (the default adds nothing)

    # ---- a row's life ---------------------------------------------------------------------------------------
    def parse(self, index: int, raw: dict[str, Any] | str) -> ParsedRow:
        request = parse_row(index, raw, self.defaults)
        return ParsedRow(index, request.row_id, request, request.params.n, request.echo)

    def requests(self, engine: "Engine", parsed: ParsedRow) -> RowWork:
        request: RowRequest = parsed.request
        if request.params.lora is None and parsed.echo.get("model") in engine.lora_names:
            request.params = with_lora(request.params, parsed.echo["model"])  # OpenAI lines: `model` names the adapter
        prompt_ids = prompt_token_ids(engine, request)
        return RowWork(parsed, [Request(prompt_ids, request.params)], cache_key=(prompt_ids, request.params))

    def collect(self, engine: "Engine", row: PendingRow, part: Part, out: "RequestOutput") -> list[RowResult]:
        completion, columns = out.text, {}
        if self.reasoning_split and completion is not None and template_thinks(engine.tokenizer):
            columns["reasoning"], completion = split_reasoning(completion)
        if out.logprobs is not None:
            columns.update(token_logprobs=out.logprobs.token, top_logprobs=out.logprobs.top())
        if out.prompt_logprobs is not None:
            lp = out.prompt_logprobs
            columns.update(prompt_token_ids=out.prompt_token_ids, prompt_token_logprobs=[None, *lp.token],
                           prompt_top_logprobs=[None, *lp.top()])
        return [row.result(out.finish_reason, completion=completion, prompt_tokens=len(out.prompt_token_ids),
                           completion_tokens=len(out.token_ids), completion_token_ids=out.token_ids,
                           sample_index=out.sample_index, columns=columns)]

    # ---- OpenAI output ----------------------------------------------------------------------------------------
    def openai_body(self, samples: list[dict[str, Any]], model: str, created: int) -> dict[str, Any]:
        """A `chat.completion` or `text_completion` object, its samples as choices."""
        first = samples[0]
        echo = first.get("echo") or {}
        obj = echo.get("object", "text_completion")
        prefix = "chatcmpl" if obj == "chat.completion" else "cmpl"
        prompt_tokens = first["prompt_tokens"]
        completion_tokens = sum(r["completion_tokens"] for r in samples)
        return {
            "id": f"{prefix}-{request_digest(first)}", "object": obj, "created": created,
            "model": echo.get("model") or model, "choices": [_choice(r, obj) for r in samples],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
            "system_fingerprint": None,
        }


def _choice(record: dict[str, Any], obj: str) -> dict[str, Any]:
    """One sample's choice. Log-probabilities name tokens by id (`token_id`): cbatch keeps ids, not token text."""
    text = record.get("completion") or ""
    logprobs = None
    if record.get("token_logprobs") is not None:
        tops = record.get("top_logprobs") or [[] for _ in record["token_logprobs"]]
        logprobs = {"content": [{"token_id": t, "logprob": lp, "top_logprobs": top}
                                for t, lp, top in zip(record["completion_token_ids"], record["token_logprobs"], tops)]}
    index = record.get("sample_index", 0)
    if obj == "chat.completion":
        return {"index": index, "message": {"role": "assistant", "content": text, "refusal": None},
                "logprobs": logprobs, "finish_reason": record["finish_reason"]}
    return {"text": text, "index": index, "logprobs": logprobs, "finish_reason": record["finish_reason"]}


def prompt_token_ids(engine: "Engine", request: RowRequest) -> list[int]:
    """The prompt's token ids (`Engine.add_request` keeps the last `truncate_prompt_tokens` of them); raises
    RowError naming what is wrong."""
    tokenizer = engine.tokenizer
    if request.prompt_token_ids is not None:
        ids = request.prompt_token_ids
    elif tokenizer is None:
        raise RowError("this model has no tokenizer; give `prompt_token_ids` instead of text")
    else:
        try:
            if request.messages is not None:
                ids = encode_messages(tokenizer, request.messages, request.params.chat_template_kwargs)
            else:
                ids = encode_text(tokenizer, request.prompt)
        except Exception as exc:  # a chat template raising on odd roles, a tokenizer edge case
            raise RowError(f"could not tokenize the prompt ({type(exc).__name__}: {exc})") from None
    if (error := engine.vocabulary_error("the prompt", ids)) is not None:
        raise RowError(error)
    return ids


__all__ = ["GenerateTask", "prompt_token_ids"]
