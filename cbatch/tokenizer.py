"""Tokenizers and chat templates (transformers), and turning an input row's prompt into token ids."""
from __future__ import annotations

from pathlib import Path
from typing import Any


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


def encode_messages(tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """A chat rendered with the model's chat template, the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; give `prompt` text instead of `messages`")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]
