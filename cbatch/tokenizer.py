"""Tokenizers and chat templates (transformers), turning an input row's prompt into token ids, and splitting
a thinking model's `<think>...</think>` off its answer."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from cbatch.tools.messages import template_messages


def load_tokenizer(model_dir: Path):
    """The checkpoint's tokenizer, or None for a folder without one (token-id prompts only)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    has_tokenizer = any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json"))
    if not has_tokenizer:
        return None
    return AutoTokenizer.from_pretrained(model_dir)


def encode_text(tokenizer, text: str) -> list[int]:
    """A plain prompt, tokenized as HF and vLLM do (the tokenizer's special tokens, e.g. BOS, added)."""
    return list(tokenizer.encode(text))


def encode_messages(tokenizer, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None,
                    generation_prompt: bool = True, tools: list[dict[str, Any]] | None = None) -> list[int]:
    """A chat rendered with the model's chat template, the assistant's turn opened (`generation_prompt`; a reward
    model or classifier reads the chat as it is); `template_kwargs` are extra template variables (e.g.
    {"enable_thinking": False} for Qwen3; the library's `chat_template`). `tools` (OpenAI's function tools) go to
    the template as HF's `tools`; assistant `tool_calls` and `tool` results in `messages` render through it too."""
    if not getattr(tokenizer, "chat_template", None) and not (template_kwargs or {}).get("chat_template"):
        raise ValueError("this model's tokenizer has no chat template; give `prompt` text instead of `messages`")
    kwargs = dict(template_kwargs or {})
    if tools is not None:
        kwargs["tools"] = tools
    ids = tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=generation_prompt,
                                        tokenize=True, **kwargs)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def encode_score_pair(tokenizer, template: str, query: str, document: str) -> list[int]:
    """A scored pair rendered with a score template, as vLLM renders it (`--chat-template` for /score and /rerank):
    the messages [{"role": "query"}, {"role": "document"}] through the template as text, then that text tokenized
    as a plain prompt (the tokenizer's special tokens added)."""
    messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=False)
    return encode_text(tokenizer, text)


THINK_START, THINK_END = "<think>", "</think>"


def template_texts(tokenizer) -> list[str]:
    """The model's chat template(s) as text: one, or each of a named set; [] without a tokenizer or template."""
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return list(template.values()) if isinstance(template, dict) else [template] if isinstance(template, str) else []


def template_reads(tokenizer, variable: str) -> bool:
    """The model's chat template mentions `variable` (e.g. gpt-oss's reads `reasoning_effort`)."""
    return any(variable in t for t in template_texts(tokenizer))


def template_thinks(tokenizer) -> bool:
    """The model's chat template knows `<think>...</think>` (Qwen3, DeepSeek-R1 and the like)."""
    return any(THINK_START in t and THINK_END in t for t in template_texts(tokenizer))


def think_token_ids(tokenizer) -> tuple[int, int] | None:
    """(think-start, think-end) token ids when each marker is one token of the vocabulary (what a thinking
    budget forces), else None."""
    if tokenizer is None:
        return None
    start, end = (_single_token(tokenizer, marker) for marker in (THINK_START, THINK_END))
    return None if start is None or end is None else (start, end)


def _single_token(tokenizer, text: str) -> int | None:
    """The id of `text` when it is one token of the vocabulary (as encoded, or as a token's own name)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) == 1:
        return int(ids[0])
    token = tokenizer.convert_tokens_to_ids(text)
    return token if isinstance(token, int) and token != tokenizer.unk_token_id else None


def thinking_opened(prompt_ids: list[int], think_ids: tuple[int, int]) -> bool:
    """The prompt leaves the thinking open: its last think marker is the start (a template that opens it)."""
    start, end = think_ids
    for token in reversed(prompt_ids):
        if token == start:
            return True
        if token == end:
            return False
    return False


def count_thinking(token_ids: list[int], think_ids: tuple[int, int], inside: bool) -> tuple[bool, int]:
    """Walks `token_ids` from `inside` (within <think>...</think> or not): (inside after them, the thinking tokens
    among them). The markers themselves are not thinking; several thinking blocks all count."""
    start, end = think_ids
    used = 0
    for token in token_ids:
        if token == start:
            inside = True
        elif token == end:
            inside = False
        elif inside:
            used += 1
    return inside, used


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(reasoning, answer) of a thinking model's completion, both stripped of surrounding whitespace; `opened`: the
    prompt left the thinking open (DeepSeek-R1's template ends its prompt with <think>).

    `<think>R</think>A` -> (R, A); `R</think>A` (the template opened the thinking in the prompt) -> (R, A);
    `<think>R`, or `R` with `opened` (cut off while thinking, e.g. by max_tokens) -> (R, ""); no tags -> (None, text).
    """
    before, end, after = text.partition(THINK_END)
    if end:
        return before.strip().removeprefix(THINK_START).strip(), after.strip()
    if text.lstrip().startswith(THINK_START) or opened:
        return text.lstrip().removeprefix(THINK_START).strip(), ""
    return None, text
