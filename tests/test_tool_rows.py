"""Tool calls and reasoning effort in batch files (issue 49), end to end through `cbatch run`: vLLM's run-batch tool
calling case (`tool_choice: "required"` with get_current_weather) gives OpenAI's `message.tool_calls`, finish_reason
`tool_calls` and null content; a cbatch row gets a `tool_calls` column; mistakes are error rows naming the field."""
from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from ops_jobs import read_jsonl, run_inprocess, write_jsonl
from test_tool_choice import COUNT, QUESTION, TOOLS, WEATHER
from tool_models import make_hermes_model


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory, chat_tokenizer_dir):
    path = make_hermes_model(tmp_path_factory.mktemp("toolrows") / "model", chat_tokenizer_dir)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def run(*args) -> tuple[int, str]:
    code, _, stderr = run_inprocess("run", *map(str, args), "--device", "cpu", "--display", "none", "--quiet",
                                    "--max-tokens", "120")
    return code, stderr


def check_call(call: dict, name: str) -> None:
    assert call["type"] == "function" and call["function"]["name"] == name and call["id"].startswith("call_")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)


def test_vllms_tool_calling_case_gives_openais_tool_calls(tool_model, tmp_path):
    body = {"model": "qwen", "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required"}
    lines = [{"custom_id": "weather", "method": "POST", "url": "/v1/chat/completions", "body": body},
             {"custom_id": "named", "method": "POST", "url": "/v1/chat/completions",
              "body": {**body, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "count"}}}},
             {"custom_id": "bad-choice", "url": "/v1/chat/completions",
              "body": {**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}}},
             {"custom_id": "bad-effort", "url": "/v1/chat/completions",
              "body": {"messages": QUESTION, "reasoning_effort": "extreme"}}]
    source, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    code, stderr = run(source, "--out", out, "--model", tool_model, "--output-format", "openai")
    assert code == 1, stderr
    got = read_jsonl(out)
    for line, name in ((got[0], "get_current_weather"), (got[1], "count")):
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert len(choice["message"]["tool_calls"]) >= 1
        for call in choice["message"]["tool_calls"]:
            check_call(call, name)
    assert "tool_choice.function.name: 'nope' is not a function of `tools`" in \
        got[2]["response"]["body"]["error"]["message"]
    assert "reasoning_effort: must be one of" in got[3]["response"]["body"]["error"]["message"]


def test_cbatch_rows_get_a_tool_calls_column(tool_model, tmp_path):
    rows = [{"id": "call", "messages": QUESTION, "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
            {"id": "plain", "messages": QUESTION, "max_tokens": 4},
            {"id": "none", "messages": QUESTION, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4},
            {"id": "text-with-tools", "prompt": "hi", "tools": TOOLS}]
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    for suffix in (".jsonl", ".parquet"):
        out = tmp_path / f"out{suffix}"
        code, stderr = run(source, "--out", out, "--model", tool_model)
        assert code == 1, stderr
    got = read_jsonl(tmp_path / "out.jsonl")
    assert got[0]["finish_reason"] == "tool_calls" and len(got[0]["tool_calls"]) == 1  # parallel_tool_calls false
    check_call(got[0]["tool_calls"][0], got[0]["tool_calls"][0]["function"]["name"])
    assert got[1]["tool_calls"] is None and got[2]["tool_calls"] is None and got[2]["finish_reason"] == "length"
    assert got[3]["error"] == "`tools` are for a chat: give `messages` (the chat template renders the tools)"
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "out.parquet").to_pylist()
    assert table[0]["tool_calls"] == got[0]["tool_calls"]


def test_a_tool_choice_beside_a_rows_own_constraint_is_refused(tool_model, tmp_path):
    rows = [{"id": "both", "messages": QUESTION, "tools": [COUNT], "tool_choice": "required", "regex": "[ab]+"}]
    source, out = write_jsonl(tmp_path / "rows.jsonl", rows), tmp_path / "out.jsonl"
    code, stderr = run(source, "--out", out, "--model", tool_model)
    assert code == 1, stderr
    assert read_jsonl(out)[0]["error"] == "tool_choice 'required' and a structured-output field (regex): give one of them"
    code, _, stderr = run_inprocess("run", str(source), "--out", str(tmp_path / "x.jsonl"), "--model", str(tool_model),
                                    "--tool-call-parser", "xml")
    assert code == 2 and "--tool-call-parser: one of hermes" in stderr
