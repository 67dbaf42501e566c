"""vLLM's run-batch test cases (benchmarks/vllm_batch_cases.py: completions, invalid input, embeddings, score,
rerank, tool calling; audio aside) through `cbatch run --output-format vllm` on tiny local models: each case's
assertions as vLLM's test makes them (exit code, no error lines, a get_current_weather call), every output line
held to BatchRequestOutput's structure, and validated by vLLM's own pydantic model where vllm is importable
(benchmarks/vllm_batch_check.py runs the same cases with a side venv's vLLM)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ops_jobs import run_inprocess

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from vllm_batch_cases import cases, check_structure, make_models, read_lines, run_args, vllm_validator, write_case  # noqa: E402

# (the LM-head reranker's cases run in benchmarks/vllm_batch_check.py; tests/test_lm_reranker.py holds its scores to HF)
CASES = {case.name: case for case in cases() if case.model != "lm_reranker"}


@pytest.fixture(scope="module")
def models(tmp_path_factory, chat_tokenizer_dir) -> dict[str, Path]:
    return make_models(tmp_path_factory.mktemp("vllm-cases"), chat_tokenizer_dir)


@pytest.mark.parametrize("name", list(CASES))
def test_vllm_run_batch_case(models, tmp_path, name):
    case = CASES[name]
    source, out = write_case(case, tmp_path), tmp_path / "out.jsonl"
    code, _, stderr = run_inprocess(*run_args(case, source, out, models[case.model]))
    assert code in (0, 1), stderr  # a job that ran (1: some rows are error lines)
    lines = read_lines(out)
    assert len(lines) == len(case.lines)  # one output line per input line, in order
    for i, line in enumerate(lines):
        assert check_structure(line) == [], (i, line)
    assert case.check(code, lines) == [], stderr
    validate = vllm_validator()
    if validate is not None:  # vLLM's own model, where vllm is importable
        for line in out.read_text().splitlines():
            validate(line)


def test_the_structure_check_can_fail():
    """Lines vLLM's BatchRequestOutput refuses are refused here too (what the cases rely on without vLLM)."""
    ok = {"id": "a", "custom_id": "b", "response": {"status_code": 400, "request_id": "r", "body": None}, "error": "x"}
    assert check_structure(ok) == []
    assert check_structure({**ok, "custom_id": None})  # custom_id must be a string
    assert check_structure({**ok, "error": None})  # neither a body nor an error
    rerank = {"id": "r", "model": "m", "usage": {"total_tokens": 3}, "results": [{"index": 0, "relevance_score": 0.5}]}
    assert len(check_structure({**ok, "response": {**ok["response"], "body": rerank}, "error": None})) == 2
