"""The batch file's edges, as vLLM's run-batch tests try them: an empty INPUT is a finished job; an OpenAI line
without a `custom_id`, or with a top-level key the format does not define, is an error row naming it (never a
made-up id with the key dropped); `--output-format vllm` writes vLLM's error lines."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from ops_jobs import read_jsonl, run_inprocess, write_jsonl

CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 3}


def run(*args) -> tuple[int, str, str]:
    return run_inprocess("run", *map(str, args), "--device", "cpu", "--display", "none")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_an_empty_input_is_a_finished_job(tiny_checkpoints, tmp_path, suffix):
    """Exit 0, OUTPUT written empty with its columns, one summary line saying 0 rows (as vLLM exits 0: a nightly
    partition without rows is no usage error)."""
    source = tmp_path / "empty.jsonl"
    source.write_text("\n")
    out, report = tmp_path / f"out{suffix}", tmp_path / "report.json"
    code, stdout, stderr = run(source, "--out", out, "--model", tiny_checkpoints["llama"], "--report", report)
    assert code == 0, stderr
    assert stdout.strip().startswith("cbatch: 0/0 rows ok, 0 errors") and len(stdout.strip().splitlines()) == 1
    if suffix == ".jsonl":
        assert out.read_bytes() == b""
    else:
        table = pq.read_table(out)
        assert table.num_rows == 0 and table.schema.names[:3] == ["id", "completion", "finish_reason"]
    assert json.loads(report.read_text())["requests"]["total"] == 0
    code, _, stderr = run(source, "--out", out, "--model", tiny_checkpoints["llama"])  # done already: nothing to do
    assert code == 0 and "already complete" in stderr


def test_openai_lines_are_checked_by_name(tiny_chat_model, tmp_path):
    lines = [{"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
             {"method": "POST", "url": "/v1/chat/completions", "body": CHAT},
             {"custom_id": "odd", "invalid_field": 1, "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
             {"custom_id": "kept", "batch_tag": "nightly", "url": "/v1/chat/completions", "body": CHAT}]
    source, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    code, _, stderr = run(source, "--out", out, "--model", tiny_chat_model, "--output-format", "openai",
                          "--keep-columns", "batch_tag")
    assert code == 1, stderr
    got = read_jsonl(out)
    assert got[0]["response"]["status_code"] == 200 and got[0]["custom_id"] == "ok"
    missing = got[1]["response"]["body"]["error"]["message"]
    assert missing.startswith("custom_id: every OpenAI batch line needs its own `custom_id`")
    assert got[2]["response"]["body"]["error"]["message"].startswith("invalid_field: not a key of an OpenAI batch line")
    assert got[3]["response"]["status_code"] == 200 and got[3]["batch_tag"] == "nightly"  # carried, not refused


def test_vllm_output_format_writes_vllms_error_lines(tiny_chat_model, tmp_path):
    lines = [{"custom_id": "ok", "method": "POST", "url": "/v1/chat/completions", "body": CHAT},
             {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": "hi"}}]
    source = write_jsonl(tmp_path / "in.jsonl", lines)
    for fmt in ("openai", "vllm"):
        code, _, stderr = run(source, "--out", tmp_path / f"{fmt}.jsonl", "--model", tiny_chat_model,
                              "--output-format", fmt)
        assert code == 1, stderr
    openai, vllm = read_jsonl(tmp_path / "openai.jsonl"), read_jsonl(tmp_path / "vllm.jsonl")
    assert vllm[0]["response"] == {**openai[0]["response"], "body": {**openai[0]["response"]["body"],
                                                                      "created": vllm[0]["response"]["body"]["created"]}}
    assert vllm[0]["error"] is None
    error = openai[1]["response"]["body"]["error"]
    assert "`messages` must be a non-empty list" in error["message"] and openai[1]["error"] is None
    assert vllm[1]["response"]["status_code"] == 400 and vllm[1]["response"]["body"] is None
    assert vllm[1]["error"] == error and vllm[1]["custom_id"] == "bad"
