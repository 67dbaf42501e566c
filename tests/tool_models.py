"""A tiny random Qwen3 with SmolLM2's tokenizer and a Hermes (Qwen-style) tool template: the model the tool-call
tests run (tests/test_tool_choice.py through the engine, tests/test_tool_rows.py through `cbatch run`)."""
from __future__ import annotations

import json
from pathlib import Path

from test_tool_calls import HERMES_TEMPLATE
from tiny_models import make_checkpoint


def make_hermes_model(path: Path, tokenizer_dir: Path) -> Path:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    make_checkpoint("qwen3", path, vocab_size=len(tokenizer))
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return path
