"""`LLM`: the library API in vLLM's shapes (docs/library.md). An engine built once; each call runs its prompts to
completion, tokenized as `cbatch run` tokenizes rows (tasks/generate_task.py's `prompt_token_ids`, tokenizer.py's chat
encoding) and seeded as rows of the same index, so greedy (and seeded) tokens equal the command's."""
from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Sequence

from cbatch.api.engine_args import check_quantization, library_settings
from cbatch.api.inputs import PromptType, as_list, row_request
from cbatch.api.outputs import (ClassificationOutput, ClassificationRequestOutput, EmbeddingOutput,
                                EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput, RequestOutput,
                                ScoringOutput, ScoringRequestOutput, completion, prompt_logprobs)
from cbatch.api.sampling import LoRARequest, SamplingParams
from cbatch.config import RESERVED_TEMPLATE_KWARGS, SamplingParams as RowSamplingParams, UserError
from cbatch.engine.build import add_loras, build_engine
from cbatch.engine.engine import RequestOutput as EngineOutput, run_to_completion
from cbatch.engine.images import PromptImage
from cbatch.io.images import expand_placeholders, in_prompt_order, template_parts
from cbatch.engine.pooling import PoolingParams
from cbatch.engine.resolve import resolve_model
from cbatch.io.pooling_rows import score_pairs
from cbatch.io.row_fields import RowError
from cbatch.io.rows import RowRequest, parse_messages, row_images, with_lora
from cbatch.tasks import make_task
from cbatch.tasks.classify_task import class_columns
# (renamed: `generate`'s keyword prompt_token_ids shadows it)
from cbatch.tasks.generate_task import GenerateTask, prompt_token_ids as row_token_ids
from cbatch.tasks.pooled import PooledTask, check_task_flags
from cbatch.tasks.base import ParsedRow
from cbatch.tasks.score_task import PairPlan
from cbatch.tokenizer import encode_messages

Params = RowSamplingParams | Sequence[RowSamplingParams] | None
Lora = LoRARequest | Sequence[LoRARequest | None] | None
Conversation = list[dict[str, Any]]
POOLING_TASKS = ("embed", "classify", "reward")  # what `encode` runs (score takes pairs: `LLM.score`)


class LLM:
    """`LLM(model, **engine settings)`: vLLM's engine keywords or cbatch's `EngineConfig` names (engine_args.py).
    Loading and runs show tqdm bars (in a notebook too) unless `use_tqdm=False`."""

    def __init__(self, model: str | None = None, *, use_tqdm: bool = True, **settings: Any) -> None:
        lib = library_settings(model, settings)
        resolved = resolve_model(lib.config)
        check_quantization(lib.quantization, resolved.spec)
        self.engine = build_engine(lib.config, resolved, show_progress=use_tqdm)
        self.enable_lora = lib.enable_lora or bool(lib.config.loras)
        self.task = lib.task
        self.classifier = lib.classifier  # hf_overrides' classifier_from_token (an LM-head reranker)
        self._request_ids = itertools.count()
        self._images = GenerateTask()  # reads prompts' images with the model's processor, as `cbatch run` does

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    # ---- generation ------------------------------------------------------------------------------------
    def generate(self, prompts: PromptType | Sequence[PromptType] | None = None, sampling_params: Params = None,
                 use_tqdm: bool = True, lora_request: Lora = None, *,
                 prompt_token_ids: Sequence[Sequence[int]] | None = None) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in input order; `sampling_params` one for all or one per prompt."""
        if (prompts is None) == (prompt_token_ids is None):
            raise UserError("give prompts or prompt_token_ids (one of them)")
        items = as_list(prompts) if prompts is not None else [{"prompt_token_ids": list(p)} for p in prompt_token_ids]
        params = self._params(sampling_params, len(items), lora_request)
        token_lists, images = [], []
        for i, (item, p) in enumerate(zip(items, params)):
            request = row_request(i, item)
            request.params = p
            ids, read = self._with_images(f"prompt {i}", request, lambda: row_token_ids(self.engine, request))
            token_lists.append(ids)
            images.append(read)
        shown = [p if isinstance(p, str) else p.get("prompt") for p in items]
        return self._generate(token_lists, params, shown, use_tqdm, images)

    def chat(self, messages: Conversation | Sequence[Conversation], sampling_params: Params = None,
             use_tqdm: bool = True, lora_request: Lora = None, chat_template: str | None = None, *,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, rendered with the model's chat
        template (or `chat_template`), the assistant's turn opened unless `add_generation_prompt=False`. Content
        reaches the template as a string (text parts joined); a message with image parts (`image_url`, `image`,
        `image_pil`: a vision-language model's) or video parts (`video_url`, `video`: Qwen2-VL's, Qwen2.5-VL's) as
        its parts, each image a bare {"type": "image"}, each video {"type": "video"}."""
        if self.engine.tokenizer is None:
            raise UserError("this model has no tokenizer; chat needs one")
        if chat_template_content_format not in ("auto", "string"):
            raise UserError(f"chat_template_content_format={chat_template_content_format!r}: cbatch gives the "
                            "template each message's content as a string (\"auto\" or \"string\")")
        if add_generation_prompt and continue_final_message:
            raise UserError("give add_generation_prompt=False with continue_final_message=True")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = self._params(sampling_params, len(conversations), lora_request)
        options = {"chat_template": chat_template, "tools": tools, "continue_final_message": continue_final_message}
        extra = {**(chat_template_kwargs or {}), **{k: v for k, v in options.items() if v}}
        reserved = [k for k in RESERVED_TEMPLATE_KWARGS if k in extra]
        if reserved:
            raise UserError(f"chat_template_kwargs may not set {', '.join(reserved)} (cbatch sets it)")
        token_lists, images, shown = [], [], []
        for i, (conversation, p) in enumerate(zip(conversations, params)):
            where = f"conversation {i}"
            try:
                messages = parse_messages(conversation, images=True)
                request = RowRequest(index=i, row_id=str(i), messages=messages, params=p)
                request.images = row_images({}, request)
            except UserError as exc:
                raise UserError(f"{where}: {exc}") from None
            template = {**p.chat_template_kwargs, **extra}
            ids, read = self._with_images(where, request, lambda: encode_messages(
                self.engine.tokenizer, template_parts(request.messages), template, add_generation_prompt))
            token_lists.append(ids)
            images.append(read)
            shown.append(self.engine.tokenizer.decode(ids))
        return self._generate(token_lists, params, shown, use_tqdm, images)

    def _with_images(self, where: str, request: RowRequest, tokenize: Callable[[], list[int]]
                     ) -> tuple[list[int], list[PromptImage] | None]:
        """(a generation prompt's token ids, one placeholder per image as the template or text wrote it; its images
        read by the model's processor as `cbatch run` reads a row's); a UserError naming the prompt."""
        try:
            images = self._images.read_images(self.engine, request) or None  # (first: a text model refuses them)
            return tokenize(), images
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None

    def _tokenize(self, index: int, prompt: PromptType, params: RowSamplingParams | None = None) -> list[int]:
        """A prefill-only prompt's token ids as `cbatch run` tokenizes the same row; a UserError naming the prompt."""
        request = row_request(index, prompt)
        request.params = params
        try:
            if request.images:
                raise UserError("multi_modal_data: images and videos are for generate and chat (the pooling calls "
                                "read text)")
            return row_token_ids(self.engine, request)
        except UserError as exc:
            raise UserError(f"prompt {index}: {exc}") from None

    def _params(self, sampling_params: Params, count: int, lora_request: Lora) -> list[RowSamplingParams]:
        """Each prompt's settings (one object for all, or one per prompt) with its LoRA adapter."""
        if sampling_params is None:
            sampling_params = SamplingParams()
        per = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * count
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * count
        for name, given in (("sampling_params", per), ("lora_request", loras)):
            if len(given) != count:
                raise UserError(f"{name}: {len(given)} given for {count} prompts; give one, or one per prompt")
        self._add_adapters([r for r in loras if r is not None])
        return [p if r is None else with_lora(p, r.lora_name) for p, r in zip(per, loras)]

    def _add_adapters(self, requests: list[LoRARequest]) -> None:
        """The adapters the requests name that the engine does not have yet, added (an adapter's name must keep
        its folder)."""
        if requests and not self.enable_lora:
            raise UserError("lora_request: start the LLM with enable_lora=True")
        known = {name: _folder(path) for name, path in self.engine.config.loras}
        new: dict[str, str] = {}
        for request in requests:
            if not isinstance(request, LoRARequest):
                raise UserError(f"lora_request: must be a LoRARequest, got {type(request).__name__}")
            folder = _folder(request.lora_path)
            if known.setdefault(request.lora_name, folder) != folder:
                raise UserError(f"LoRARequest {request.lora_name!r}: this name is already the adapter at "
                                f"{known[request.lora_name]}; give another adapter another name")
            if request.lora_name not in dict(self.engine.config.loras):
                new[request.lora_name] = request.lora_path
        if new:
            add_loras(self.engine, tuple(new.items()))

    def _generate(self, token_lists: list[list[int]], params: list[RowSamplingParams], shown: list[str | None],
                  use_tqdm: bool, images: list[list[PromptImage] | None]) -> list[RequestOutput]:
        """Runs the prompts (each with the seq_id of its index, as the CLI's rows) and groups each one's samples;
        a prompt's images (`images`) each take its placeholder, expanded to the image's tokens here."""
        token_lists, images = list(token_lists), list(images)
        for i, (ids, p, read) in enumerate(zip(token_lists, params, images)):
            try:
                if read:  # (a text prompt's images, then its videos: each takes its placeholder in prompt order)
                    images[i] = read = in_prompt_order(ids, read, self.engine.spec.vision)
                    token_lists[i] = ids = expand_placeholders(ids, read, self.engine.spec.vision,
                                                                self.engine.tokenizer)
                error = self.engine.check_prompt(ids, p, read)[2]
            except UserError as exc:
                error = str(exc)
            if error is not None:
                raise UserError(f"prompt {i}: {error}")
        outs = run_to_completion(self.engine, token_lists, params, bool(use_tqdm), seq_ids=range(len(token_lists)),
                                 images=images)
        self._raise_failed(outs)
        results, start = [], 0
        for text, p in zip(shown, params):
            samples = outs[start : start + p.n]
            start += p.n
            first = samples[0]
            results.append(RequestOutput(
                request_id=self._request_id(), prompt=text, prompt_token_ids=list(first.prompt_token_ids),
                prompt_logprobs=prompt_logprobs(first, self._decode_one),
                outputs=[completion(o.sample_index, o, self._stop_reason(o, p), self._decode_one) for o in samples]))
        return results

    def _stop_reason(self, out: EngineOutput, params: RowSamplingParams) -> int | str | None:
        """The stop token id or stop string that ended a sample ("stop" by EOS or a grammar's end: None)."""
        if out.finish_reason != "stop" or not out.token_ids:
            return None
        if out.token_ids[-1] in params.stop_token_ids:
            return out.token_ids[-1]
        if params.stop and out.text is not None:
            full = self.engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)  # the text before the cut
            return next((s for s in params.stop if full.startswith(s, len(out.text))), None)
        return None

    def _decode_one(self, token: int) -> str | None:
        tokenizer = self.engine.tokenizer
        return None if tokenizer is None else tokenizer.decode([token])

    # ---- prefill-only tasks (docs/tasks.md): one prefill per input, no decoding ----------------------------
    def embed(self, prompts: PromptType | Sequence[PromptType], /, *, use_tqdm: bool = True, pooling: str | None = None,
              normalize: bool | None = None, dimensions: int | None = None) -> list[EmbeddingRequestOutput]:
        """Each input's embedding (float32 values), pooled as the model's sentence-transformers config says unless
        cbatch's `pooling` (last | mean | cls) / `normalize` say otherwise; `dimensions`: Matryoshka."""
        ids, vectors = self._pool_prompts(prompts, self._task("embed", pooling, normalize, dimensions).pooling, use_tqdm)
        return [EmbeddingRequestOutput(self._request_id(), EmbeddingOutput(v), i) for i, v in zip(ids, vectors)]

    def classify(self, prompts: PromptType | Sequence[PromptType], /, *,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Each input's class probabilities (softmax over the sequence classification head's labels)."""
        params = self._task("classify").pooling
        ids, vectors = self._pool_prompts(prompts, params, use_tqdm)
        columns = [class_columns(v, params.head.labels) for v in vectors]
        return [ClassificationRequestOutput(self._request_id(), ClassificationOutput(**c), i)
                for i, c in zip(ids, columns)]

    def reward(self, prompts: PromptType | Sequence[PromptType], /, *,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Each input's reward: `.outputs.data`, the reward head's output (one value) as a tensor."""
        return self.encode(prompts, use_tqdm=use_tqdm, pooling_task="reward")

    def encode(self, prompts: PromptType | Sequence[PromptType], /, *, use_tqdm: bool = True,
               pooling_task: str | None = None) -> list[PoolingRequestOutput]:
        """`.outputs.data` of each input as a float32 tensor: the embedding (embed), the class probabilities
        (classify) or the head's output (reward); `pooling_task` defaults to the LLM's `task`."""
        import torch

        task = pooling_task or self.task
        if task not in POOLING_TASKS:
            raise UserError(f"encode: pooling_task must be one of {', '.join(POOLING_TASKS)}, not {task!r} "
                            "(score pairs with LLM.score)")
        ids, vectors = self._pool_prompts(prompts, self._task(task).pooling, use_tqdm)
        if task == "classify":
            vectors = [class_columns(v, ())["probs"] for v in vectors]
        return [PoolingRequestOutput(self._request_id(), PoolingOutput(torch.tensor(v, dtype=torch.float32)), i)
                for i, v in zip(ids, vectors)]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], /, *,
              use_tqdm: bool = True, chat_template: str | None = None) -> list[ScoringRequestOutput]:
        """Each pair's score, as `--task score` scores a row of lists (`PairPlan`): a cross-encoder's sigmoid(logit)
        of the pair (an LM-head reranker's sigmoid(logit(true) - logit(false)) of text_1 + text_2), or an embedding
        model's cosine. One text against many pairs it with each (1:N); two lists pair item by item (N:N).
        `chat_template`: vLLM's score template (roles `query` and `document`), as --score-template."""
        try:
            pairs = score_pairs("data_1", data_1, "data_2", data_2)  # (a row's rules: vLLM's)
        except RowError as exc:
            raise UserError(f"score: {exc}") from None
        task = self._task("score", score_template=chat_template)
        params = task.pooling
        plan = PairPlan.of(pairs, params.head, task.template)
        prompts = plan.prompts(self.engine, ParsedRow(0, "score", None))
        scores = plan.scores(self._pool(prompts, params, use_tqdm))
        token_ids = [[t for j in slot for t in prompts[j]] for slot in plan.slots]  # a pair's input(s), in order
        return [ScoringRequestOutput(self._request_id(), ScoringOutput(s), ids) for s, ids in zip(scores, token_ids)]

    def _task(self, task: str, pooling: str | None = None, normalize: bool | None = None,
              dimensions: int | None = None, score_template: str | None = None) -> PooledTask:
        """The prefill-only task with these settings, resolved against the model as a job's --task is."""
        options = SimpleNamespace(task=task, defaults=RowSamplingParams(), pooling=pooling, normalize=normalize,
                                  dimensions=dimensions, classifier=self.classifier, score_template=score_template,
                                  reasoning_split=True)
        task = make_task(options, self.engine.spec, self.engine.model_dir)
        check_task_flags(task, options, self.engine.config.tensor_parallel_size)  # (hf_overrides' tokens: a head's)
        return task

    def _pool_prompts(self, prompts: PromptType | Sequence[PromptType], params: PoolingParams,
                      use_tqdm: bool) -> tuple[list[list[int]], list[list[float]]]:
        """(each input's token ids, its pooled result): text tokenized as `cbatch run`'s prefill-only rows."""
        token_lists = [self._tokenize(i, p) for i, p in enumerate(as_list(prompts))]
        return token_lists, self._pool(token_lists, params, use_tqdm)

    def _pool(self, token_lists: list[list[int]], params: PoolingParams, use_tqdm: bool) -> list[list[float]]:
        outs = run_to_completion(self.engine, token_lists, [RowSamplingParams()] * len(token_lists), bool(use_tqdm),
                                 seq_ids=range(len(token_lists)), pooling=params)
        self._raise_failed(outs)
        return [o.pooled for o in outs]

    @staticmethod
    def _raise_failed(outs: list[EngineOutput]) -> None:
        failed = next((o for o in outs if o.finish_reason == "error"), None)
        if failed is not None:
            raise UserError(f"input {failed.row_index}: {failed.error}")

    def _request_id(self) -> str:
        return str(next(self._request_ids))


def _folder(path: str) -> str:
    return str(Path(path).expanduser().resolve())


__all__ = ["LLM"]
