"""Shared fixtures: tiny random checkpoints (HF writes them) and the real SmolLM2-135M-Instruct."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tiny_models import ARCHS, make_checkpoint, make_family_checkpoint  # pytest (prepend import mode) puts this folder on sys.path


def pytest_configure(config) -> None:
    """Before any test module is imported: without a GPU, Triton kernels run under its CPU interpreter
    (TRITON_INTERPRET must be set before the first import of triton anywhere in the process). Test
    modules themselves change nothing in the process when imported."""
    torch.set_num_threads(min(2, torch.get_num_threads()))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Ray Data's live progress bars swallow pytest's closing "N passed" line (tests/test_ray.py's map_batches)
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    _fast_tensor_parallel_ranks()


def _fast_tensor_parallel_ranks() -> None:
    """Tensor-parallel worker ranks fork from one server process that imported torch once, instead of each
    spawning a fresh interpreter that imports it again (seconds per rank, dozens of ranks in the suite). Each
    worker still starts from that clean state, as under "spawn"; the server starts on first use, after the
    environment above is set. Only torch is preloaded: importing cbatch runs an OpenMP region, and a child forked
    after one hangs in its first parallel op. tests/test_tensor_parallel.py keeps one run on "spawn", production's
    method."""
    import multiprocessing

    from cbatch.engine import tensor_parallel

    multiprocessing.set_forkserver_preload(["torch"])
    tensor_parallel.START_METHOD = "forkserver"


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
    """The default model, converted once per test session into a private cache (skips where its package
    is not installed: the GPU machines, which have no package registry and no room to carry it)."""
    from cbatch.model import default_model
    from cbatch.model.loader import ModelLoadError

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CBATCH_CACHE", str(tmp_path_factory.mktemp("cbatch-cache")))
        try:
            return default_model.default_model_dir()
        except ModelLoadError as exc:
            pytest.skip(f"the default model is not installed here: {exc}")


@pytest.fixture(scope="session")
def chat_tokenizer_dir(request) -> Path:
    """SmolLM2's tokenizer and chat template: from $CBATCH_TEST_TOKENIZER_DIR when set (the GPU kit carries
    them: benchmarks/gpu_session.sh), else from the default model."""
    carried = os.environ.get("CBATCH_TEST_TOKENIZER_DIR")
    if carried and (Path(carried) / "tokenizer.json").is_file():
        return Path(carried)
    return request.getfixturevalue("smollm2_dir")


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, chat_tokenizer_dir) -> Path:
    """A tiny random Llama with SmolLM2's real tokenizer and chat template: fast CLI tests on text rows."""
    path = make_checkpoint("llama", tmp_path_factory.mktemp("tinychat") / "model", vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (chat_tokenizer_dir / name).exists():
            shutil.copy(chat_tokenizer_dir / name, path / name)
    gen = {"eos_token_id": 2, "bos_token_id": 1}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path
