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


def test_engine_args_are_typed_as_json(peers):
    """--engine-arg values reach the engines as JSON types (the GPU run of issue 40 found every value cast to int)."""
    extra = peers.parse_extra(["hf-cb:max_batch_tokens=4096", "hf-cb:use_cuda_graph=false", "hf-cb:max_memory_percent=0.5",
                               "hf-cb:attn_implementation=sdpa", "cbatch:kv_cache_dtype=fp8", "cbatch:max_model_len=2048",
                               "cbatch:async_scheduling=true", "cbatch:cuda_graph_max_batch=null"])
    assert extra == {"hf-cb": {"max_batch_tokens": 4096, "use_cuda_graph": False, "max_memory_percent": 0.5,
                               "attn_implementation": "sdpa"},
                     "cbatch": {"kv_cache_dtype": "fp8", "max_model_len": 2048, "async_scheduling": True,
                                "cuda_graph_max_batch": None}}
    assert type(extra["hf-cb"]["max_batch_tokens"]) is int and type(extra["hf-cb"]["use_cuda_graph"]) is bool
    with pytest.raises(SystemExit, match="ENGINE:KEY=VALUE"):
        peers.parse_extra(["max_batch_tokens=4096"])
    with pytest.raises(SystemExit, match="engine must be one of"):
        peers.parse_extra(["hf:max_batch_tokens=4096"])


def test_hf_cb_settings_are_its_gpu_defaults_overridden_by_the_engine_args(engines, peers):
    pytest.importorskip("transformers")
    attn, settings = engines.hf_cb_settings({}, on_gpu=True)
    assert attn == "sdpa" and settings == engines.HF_CB_GPU_DEFAULTS
    assert settings is not engines.HF_CB_GPU_DEFAULTS  # a copy: a run's overrides never change the defaults
    extra = peers.parse_extra(["hf-cb:max_batch_tokens=512", "hf-cb:use_cuda_graph=false",
                               "hf-cb:attn_implementation=eager"])["hf-cb"]
    attn, settings = engines.hf_cb_settings(extra, on_gpu=True)
    assert attn == "eager" and "attn_implementation" not in settings
    assert settings == {**engines.HF_CB_GPU_DEFAULTS, "max_batch_tokens": 512, "use_cuda_graph": False}
    assert engines.hf_cb_settings({"max_batch_tokens": 512}, on_gpu=False) == (None, {"max_batch_tokens": 512})
    with pytest.raises(SystemExit, match="no_such_field"):
        engines.hf_cb_settings({"no_such_field": 1}, on_gpu=True)


def _fake_model(tmp_path: Path) -> Path:
    config = {"vocab_size": 500, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(__import__("json").dumps(config))
    return tmp_path


def _fake_run(num_requests: int, tok_s: float) -> dict:
    return {"wall_s": 1.0, "output_tok_s": tok_s, "total_tok_s": 2 * tok_s, "process_s": 2.0, "peak_rss_mb": 1.0,
            "peak_gpu_mb": None, "weights": None, "dense": True, "about": "fake", "outputs": [[1]] * num_requests}


def test_a_peer_that_does_not_finish_is_compared_again_on_fewer_requests(peers, tmp_path, monkeypatch, capsys):
    """The kit's peer step: cbatch first, the peer at 256 guarded by what the deadline leaves before the fallback's
    reserve (here: under --min-peer-guard, so not started), then both on the fallback's requests, and a ratio."""
    calls = []

    def spawn(what, python, args, workload_path, dtype, log=None, timeout=None):
        n = len(__import__("json").loads(Path(workload_path).read_text())["prompts"])
        calls.append((what[1], n, timeout))
        if what[0] == "--probe":
            return {"error": "no probe here"}
        return _fake_run(n, 1000.0 if what[1] == "cbatch" else 50.0)

    monkeypatch.setattr(peers, "spawn", spawn)
    json_path = tmp_path / "out.json"
    argv = ["--model", str(_fake_model(tmp_path)), "--engines", "cbatch,hf-cb", "--repeats", "1", "--cooldown", "0",
            "--num-requests", "8", "--prompt-len", "4,8", "--output-len", "2,4", "--deadline", "100",
            "--fallback-requests", "3", "--fallback-reserve", "60", "--min-peer-guard", "200", "--json", str(json_path)]
    peers.main(argv)
    engine_calls = [(name, n) for name, n, _ in calls if name != "gemm"]
    # hf-cb at 8: 40 s left < 200: skipped; at 3 (the fallback, its last chance) the minimum does not apply
    assert engine_calls == [("cbatch", 8), ("cbatch", 3), ("hf-cb", 3)]
    assert all(t is not None and t <= 100 for _, _, t in calls)
    out = capsys.readouterr().out
    assert "run 1/1 hf-cb [8 requests]: SKIPPED" in out and "FAILED" not in out
    assert out.rstrip().splitlines()[-1] == "ratio cbatch / hf-cb: 20.00x output tok/s on 3 requests"
    doc = __import__("json").loads(json_path.read_text())
    assert doc["runs"]["hf-cb"][0]["skipped"] and doc["fallback"]["runs"]["hf-cb"][0]["output_tok_s"] == 50.0

    # with time for it, the peer runs at 256 (here 8), guarded by the deadline less the reserve; no fallback
    calls.clear()
    peers.main([a if a != "200" else "10" for a in argv])
    assert [(name, n) for name, n, _ in calls if name != "gemm"] == [("cbatch", 8), ("hf-cb", 8)]
    assert 0 < calls[1][2] <= 40
    assert capsys.readouterr().out.rstrip().splitlines()[-1] == "ratio cbatch / hf-cb: 20.00x output tok/s on 8 requests"
