"""Shared fixtures: tiny random checkpoints (HF writes them) and the real SmolLM2-135M-Instruct."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import ARCHS, make_checkpoint, make_family_checkpoint  # noqa: E402

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_configure(config) -> None:
    """Before any test module is imported: without a GPU, Triton kernels run under its CPU interpreter
    (TRITON_INTERPRET must be set before the first import of triton anywhere in the process)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_checkpoint(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def family_checkpoint(tmp_path_factory):
    """name -> the tiny checkpoint of tiny_models.FAMILIES[name], written on first use."""
    root = tmp_path_factory.mktemp("families")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_family_checkpoint(name, root / name)
        return made[name]

    return get


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """The default model, converted once per test session into a private cache."""
    from cbatch.model import default_model

    cache = tmp_path_factory.mktemp("cbatch-cache")
    old = os.environ.get("CBATCH_CACHE")
    os.environ["CBATCH_CACHE"] = str(cache)
    try:
        return default_model.default_model_dir()
    finally:
        if old is None:
            os.environ.pop("CBATCH_CACHE")
        else:
            os.environ["CBATCH_CACHE"] = old


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template: fast CLI tests on text rows."""
    import json

    path = make_checkpoint("llama", tmp_path_factory.mktemp("tinychat") / "model", vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, path / name)
    gen = {"eos_token_id": 2, "bos_token_id": 1}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path
