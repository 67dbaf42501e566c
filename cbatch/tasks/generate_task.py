"""`--task generate` (the default): a row is a prompt (text, chat or token ids) with its sampling settings; it runs
as one request with `n` samples, and each finished sample is one result: its completion, finish reason and the
optional columns it asked for (reasoning, log-probabilities)."""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from cbatch.config import SamplingParams, UserError
from cbatch.io.images import ImageReader, expand_placeholders, image_pool, in_prompt_order, template_parts
from cbatch.io.openai import request_digest
from cbatch.io.reader import PROMPT_FIELDS
from cbatch.io.row_fields import RowError, VideoSource
from cbatch.io.videos import VideoReader
from cbatch.io.rows import RowRequest, parse_row, with_lora
from cbatch.model.vision_spec import takes_videos
from cbatch.reasoning import DEFAULT_EFFORT_BUDGETS, effort_in_template
from cbatch.tasks.base import ParsedRow, Part, PendingRow, Request, RowWork, Task, TaskError, TaskOptions, register
from cbatch.tasks.results import RowResult
from cbatch.reasoning_split import reasoning_format
from cbatch.tokenizer import encode_messages, encode_text, template_reads, template_texts
from cbatch.tools import FORMATS, tool_choice_constraint, tool_format

if TYPE_CHECKING:
    from cbatch.engine.engine import Engine, RequestOutput
    from cbatch.model.spec import ModelSpec


@register
class GenerateTask(Task):
    name: ClassVar[str] = "generate"
    input_fields: ClassVar[tuple[str, ...]] = PROMPT_FIELDS

    columns: ClassVar[tuple[str, ...]] = ("tool_calls",)  # (only rows with tools that called one have it)

    def __init__(self, defaults: SamplingParams = SamplingParams(), reasoning_split: bool = True,
                 tool_call_parser: str | None = None, effort_budgets: Mapping[str, int] = DEFAULT_EFFORT_BUDGETS
                 ) -> None:
        self.defaults = defaults  # the job's sampling settings, under each row's own
        self.reasoning_split = reasoning_split  # a thinking model's <think>...</think> goes to a `reasoning` column
        self.tool_call_parser = tool_call_parser  # --tool-call-parser (None: the model's own format)
        self.effort_budgets = dict(effort_budgets)  # --reasoning-effort-budgets: thinking tokens per reasoning_effort
        # made at the first row with images: the model's processor with the engine's pixel bounds and pan-and-scan
        # (EngineConfig.image_min_pixels / image_max_pixels / image_pan_and_scan: --image-min-pixels / ...)
        self._image_reader: ImageReader | None = None
        # made at the first row with a video (io/videos.py), with the engine's video pixel bounds
        self._video_reader: VideoReader | None = None

    @classmethod
    def for_job(cls, options: TaskOptions, spec: "ModelSpec", model_dir: Path | None) -> "GenerateTask":
        if any(getattr(options, flag) is not None for flag in ("pooling", "normalize", "dimensions")):
            raise TaskError("--pooling, --normalize and --dimensions are for --task embed or score; add --task embed")
        if not spec.generates:
            fix = "use --task classify, reward or score" if spec.head == "classify" else "use --task embed or score"
            raise TaskError(f"--task generate: this {spec.architecture} has no language-model head; {fix}")
        parser = getattr(options, "tool_call_parser", None)
        if parser is not None and parser not in FORMATS:
            raise TaskError(f"--tool-call-parser: one of {', '.join(FORMATS)}, not {parser!r}")
        return cls(options.defaults, options.reasoning_split, parser,
                   getattr(options, "effort_budgets", None) or DEFAULT_EFFORT_BUDGETS)

    def identity(self) -> dict[str, Any]:
        """What changes a row's output beyond its own fields (each absent at its default: older identities hold)."""
        return {**({} if self.reasoning_split else {"reasoning_split": False}),
                **({"tool_call_parser": self.tool_call_parser} if self.tool_call_parser else {}),
                **({"effort_budgets": self.effort_budgets} if self.effort_budgets != DEFAULT_EFFORT_BUDGETS else {})}

    def column_types(self) -> dict[str, Any]:
        import pyarrow as pa

        function = pa.struct([("name", pa.string()), ("arguments", pa.string())])
        call = pa.struct([("id", pa.string()), ("type", pa.string()), ("function", function)])
        return {"tool_calls": pa.list_(call)}

    # ---- a row's life ---------------------------------------------------------------------------------------
    def parse(self, index: int, raw: dict[str, Any] | str) -> ParsedRow:
        request = parse_row(index, raw, self.defaults, self.effort_budgets)
        return ParsedRow(index, request.row_id, request, request.params.n, request.echo)

    def requests(self, engine: "Engine", parsed: ParsedRow) -> RowWork:
        request: RowRequest = parsed.request
        if request.params.lora is None and parsed.echo.get("model") in engine.lora_names:
            request.params = with_lora(request.params, parsed.echo["model"])  # OpenAI lines: `model` names the adapter
        if request.tools is not None and request.tools.parses_calls:
            self._add_tool_choice(engine, request)
        if (request.reasoning_effort is not None and request.messages is not None
                and template_reads(engine.tokenizer, "reasoning_effort")):  # gpt-oss: "Reasoning: high", no budget
            request.params = effort_in_template(request.params, request.reasoning_effort, request.effort_budget)
        images = self.read_images(engine, request)
        prompt_ids = prompt_token_ids(engine, request)
        if images:
            images = in_prompt_order(prompt_ids, images, engine.spec.vision)
            prompt_ids = expand_placeholders(prompt_ids, images, engine.spec.vision, engine.tokenizer)
        identity = [*prompt_ids, *(f"image:{image.digest}" for image in images)]  # images by their bytes, not names
        if request.raw_text:  # (its record is not split: not the same as a split row's of the same tokens)
            identity.append("raw_text")
        return RowWork(parsed, [Request(prompt_ids, request.params, images=images or None)],
                       cache_key=(identity, request.params))

    def image_sources(self, parsed: ParsedRow) -> list[tuple[str, Any]]:
        return list(parsed.request.images or [])

    def prefetch(self, engine: "Engine", parsed: ParsedRow) -> list[Future] | None:
        request: RowRequest = parsed.request
        if not request.images:
            return None
        self._check_limits(engine, request)
        pool = image_pool()
        request.image_futures = [pool.submit(self._reader(engine, name, source).read, source, name)
                                 for name, source in request.images]
        return request.image_futures

    def read_images(self, engine: "Engine", request: RowRequest) -> list:
        """The row's images read and preprocessed by the model's processor (io/images.py), in prompt order: what
        `prefetch` started, or read here (cbatch plan's engine: counted from their headers, not decoded)."""
        if not request.images:
            return []
        if request.image_futures is not None:  # (`prefetch` checked the limits)
            return [future.result() for future in request.image_futures]  # (an ImageError: the row's error)
        self._check_limits(engine, request)
        return [self._reader(engine, name, source).read(source, name, engine.decodes_images)
                for name, source in request.images]

    @staticmethod
    def _check_limits(engine: "Engine", request: RowRequest) -> None:
        """A RowError where the row has more images or videos than --limit-mm-per-prompt allows: before any is
        read."""
        error = engine.mm_limit_error([isinstance(source, VideoSource) for _, source in request.images])
        if error is not None:
            raise RowError(error)

    def _reader(self, engine: "Engine", name: str, source: Any) -> ImageReader | VideoReader:
        """The reader of the row's image or video `source` (called `name`); a RowError where the model takes none."""
        video = isinstance(source, VideoSource)
        vision = engine.spec.vision if engine.spec is not None else None
        if vision is None or (video and not takes_videos(vision)):
            model = engine.spec.architecture if engine.spec is not None else "model"
            if video:
                raise RowError(f"`{name}` is a video; this {model} reads no videos (Qwen2-VL, Qwen2.5-VL and "
                               "Qwen3-VL do)")
            raise RowError(f"`{name}` is an image; this {model} reads no images (use a vision-language model, "
                           "e.g. Qwen2.5-VL or Gemma 3)")
        if video:
            if self._video_reader is None or self._video_reader.vision is not vision:
                self._video_reader = VideoReader.for_config(engine.model_dir, vision, engine.config)
            return self._video_reader
        if self._image_reader is None or self._image_reader.vision is not vision:
            self._image_reader = ImageReader.for_config(engine.model_dir, vision, engine.config)
        return self._image_reader

    def __getstate__(self) -> dict[str, Any]:  # (Ray ships the task: the processor is made again where it runs)
        return {**self.__dict__, "_image_reader": None, "_video_reader": None}

    def _add_tool_choice(self, engine: "Engine", request: RowRequest) -> None:
        """The row's tool-call format (--tool-call-parser, else the chat template's), and for tool_choice "required"
        or a named function the constraint that makes its completion such calls."""
        try:
            request.tool_format = tool_format(self.tool_call_parser, "".join(template_texts(engine.tokenizer)), None)
        except UserError as exc:
            raise RowError(str(exc)) from None
        constraint = tool_choice_constraint(request.tools, request.tool_format)
        if constraint is None:
            return
        if request.params.constraint is not None and request.params.constraint is not self.defaults.constraint:
            raise RowError(f"tool_choice {request.tools.choice!r} and a structured-output field "
                           f"({request.params.constraint.source}): give one of them")
        request.params = replace(request.params, constraint=constraint)  # (it takes the job's default constraint's place)

    def collect(self, engine: "Engine", row: PendingRow, part: Part, out: "RequestOutput") -> list[RowResult]:
        completion, columns, finish_reason = out.text, {}, out.finish_reason
        request: RowRequest = row.parsed.request
        splits = self.reasoning_split and not request.raw_text and completion is not None
        split = reasoning_format(engine.tokenizer) if splits else None
        if split is not None:  # the chat format's reasoning (<think> tags, harmony's analysis channel) to its column
            columns["reasoning"], completion = split.split(completion, out.token_ids, out.prompt_token_ids)
            # its token count, for OpenAI usage (a record key; OUTPUT has no such column)
            columns["reasoning_tokens"] = (split.reasoning_tokens(out.prompt_token_ids, out.token_ids)
                                           if columns["reasoning"] is not None else 0)
        if request.tool_format is not None and completion is not None:  # the answer's calls, parsed
            parsed = request.tool_format.parse(completion, f"{row.parsed.row_id}/{out.sample_index}")
            if parsed.tool_calls:
                completion, columns["tool_calls"] = parsed.content, parsed.tool_calls
                finish_reason = parsed.finish_reason(out.finish_reason)
        if out.logprobs is not None:
            columns.update(token_logprobs=out.logprobs.token, top_logprobs=out.logprobs.top())
        if out.prompt_logprobs is not None:
            lp = out.prompt_logprobs
            columns.update(prompt_token_ids=out.prompt_token_ids, prompt_token_logprobs=[None, *lp.token],
                           prompt_top_logprobs=[None, *lp.top()])
        return [row.result(finish_reason, completion=completion, prompt_tokens=len(out.prompt_token_ids),
                           completion_tokens=len(out.token_ids), completion_token_ids=out.token_ids,
                           sample_index=out.sample_index, columns=columns)]

    # ---- OpenAI output ----------------------------------------------------------------------------------------
    def openai_body(self, samples: list[dict[str, Any]], model: str, created: int) -> dict[str, Any]:
        """A `chat.completion` or `text_completion` object, its samples as choices; a /v1/responses line's
        `response` object."""
        first = samples[0]
        echo = first.get("echo") or {}
        obj = echo.get("object", "text_completion")
        if obj == "response":
            return response_body(first, echo.get("model") or model, created)
        prefix = "chatcmpl" if obj == "chat.completion" else "cmpl"
        prompt_tokens = first["prompt_tokens"]
        completion_tokens = sum(r["completion_tokens"] for r in samples)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        if obj == "chat.completion":
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(map(_reasoning_tokens, samples))}
        return {
            "id": f"{prefix}-{request_digest(first)}", "object": obj, "created": created,
            "model": echo.get("model") or model, "choices": [_choice(r, obj) for r in samples],
            "usage": usage, "system_fingerprint": None,
        }


def response_body(record: dict[str, Any], model: str, created: int) -> dict[str, Any]:
    """OpenAI's Responses object for a /v1/responses row (one sample: the body takes no `n`); ids from the row, as
    a chat body's are. Cut at max_output_tokens: status "incomplete". A thinking model's reasoning (the `reasoning`
    column: <think> tags, harmony's analysis channel) is a `reasoning` item before the message, as OpenAI's API
    gives a reasoning model's; cut while thinking, that item is the incomplete one and the last (no empty message
    after it, as OpenAI writes a response cut in its reasoning)."""
    digest = request_digest(record)
    cut = record["finish_reason"] == "length"
    completion = record.get("completion") or ""
    output = []
    thinking_cut = cut and bool(record.get("reasoning")) and not completion
    if record.get("reasoning"):
        output.append({"type": "reasoning", "id": f"rs_{digest}", "summary": [],
                       "content": [{"type": "reasoning_text", "text": record["reasoning"]}],
                       "status": "incomplete" if thinking_cut else "completed"})
    if not thinking_cut:
        text = {"type": "output_text", "text": completion, "annotations": []}
        output.append({"type": "message", "id": f"msg_{digest}", "status": "incomplete" if cut else "completed",
                       "role": "assistant", "content": [text]})
    input_tokens, output_tokens = record["prompt_tokens"], record["completion_tokens"]
    return {"id": f"resp_{digest}", "object": "response", "created_at": created,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "model": model, "output": output,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens,
                      "output_tokens_details": {"reasoning_tokens": _reasoning_tokens(record)},
                      "total_tokens": input_tokens + output_tokens}}


def _reasoning_tokens(record: dict[str, Any]) -> int:
    """A sample's output tokens inside its reasoning (0: none, or the job keeps the raw text: --no-reasoning-split)."""
    return record.get("reasoning_tokens") or 0


def _choice(record: dict[str, Any], obj: str) -> dict[str, Any]:
    """One sample's choice. Log-probabilities name tokens by id (`token_id`): cbatch keeps ids, not token text. A
    sample that called tools has them in `message.tool_calls`, its content null when it wrote nothing else. A job
    that splits a thinking model's reasoning gives it in `message.reasoning` (vLLM's field; null: none)."""
    calls = record.get("tool_calls")
    text = record.get("completion") if calls else (record.get("completion") or "")
    logprobs = None
    if record.get("token_logprobs") is not None:
        tops = record.get("top_logprobs") or [[] for _ in record["token_logprobs"]]
        logprobs = {"content": [{"token_id": t, "logprob": lp, "top_logprobs": top}
                                for t, lp, top in zip(record["completion_token_ids"], record["token_logprobs"], tops)]}
    index = record.get("sample_index", 0)
    if obj == "chat.completion":
        message = {"role": "assistant", "content": text, "refusal": None, **({"tool_calls": calls} if calls else {}),
                   **({"reasoning": record["reasoning"]} if "reasoning" in record else {})}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": record["finish_reason"]}
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
                tools = request.tools.tools if request.tools is not None and request.tools.tools else None
                ids = encode_messages(tokenizer, template_parts(request.messages), request.params.chat_template_kwargs,
                                      tools=tools)
            else:
                ids = encode_text(tokenizer, request.prompt)
        except Exception as exc:  # a chat template raising on odd roles, a tokenizer edge case
            raise RowError(f"could not tokenize the prompt ({type(exc).__name__}: {exc})") from None
    if (error := engine.vocabulary_error("the prompt", ids)) is not None:
        raise RowError(error)
    return ids


__all__ = ["GenerateTask", "prompt_token_ids"]
