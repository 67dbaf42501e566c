"""The OpenAI Batch drop-in (input lines, --output-format openai), job-wide constraints, --keep-columns and
duplicate ids, through the real CLI entry point on a tiny model with SmolLM2's tokenizer."""
from __future__ import annotations

import datetime
import decimal
import json
from pathlib import Path

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cbatch.io.openai import BODY_FIELDS, HONOURED, NOT_YET, RequestError, request_fields
from ops_jobs import read_jsonl, run_inprocess, write_jsonl
from test_structured_output import CHOICES, SMALL

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def chat_line(custom_id: str, **body) -> dict:
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": f"Hello {custom_id}"}], **body}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def check_output_line(line: dict, request: dict) -> None:
    """One line against OpenAI's documented batch output format (a success, or an error-file line)."""
    assert set(line) == {"id", "custom_id", "response", "error"}
    assert line["id"].startswith("batch_req_") and line["custom_id"] == request["custom_id"]
    response = line["response"]
    assert set(response) == {"status_code", "request_id", "body"} and isinstance(response["request_id"], str)
    assert line["error"] is None  # only non-HTTP failures (expired, cancelled) use the top-level error
    body = response["body"]
    if response["status_code"] != 200:
        assert response["status_code"] == 400 and set(body) == {"error"}
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["type"] == "invalid_request_error" and isinstance(body["error"]["message"], str)
        return
    chat = request.get("url", CHAT) == CHAT
    assert body["object"] == ("chat.completion" if chat else "text_completion")
    assert body["id"].startswith("chatcmpl-" if chat else "cmpl-")
    assert isinstance(body["created"], int) and body["model"] == request["body"].get("model", body["model"])
    n = request["body"].get("n") or 1
    assert [c["index"] for c in body["choices"]] == list(range(n))
    asks_logprobs = bool(request["body"].get("logprobs"))
    for choice in body["choices"]:
        assert choice["finish_reason"] in ("stop", "length") and (choice["logprobs"] is not None) == asks_logprobs
        if chat:
            assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
        else:
            assert isinstance(choice["text"], str)
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def content_of(line: dict) -> str:
    choice = line["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def error_of(line: dict) -> str:
    return line["response"]["body"]["error"]["message"]


# ---- the body-field table ---------------------------------------------------------------------------
def test_every_body_field_is_honoured_or_refused_by_name():
    base = {"custom_id": "x", "url": CHAT, "body": {"messages": [{"role": "user", "content": "hi"}]}}
    for name, spec in BODY_FIELDS.items():
        if name in ("messages", "prompt"):
            continue
        if spec.status == HONOURED:
            continue
        row = {**base, "body": {**base["body"], name: 7}}
        with pytest.raises(RequestError, match=rf"^body\.{name}: "):
            request_fields(row)
        if spec.has_off:
            request_fields({**base, "body": {**base["body"], name: spec.off}})  # the value meaning "off" is fine
    assert {"n", "logprobs", "top_logprobs", "presence_penalty", "logit_bias"} <= {
        n for n, s in BODY_FIELDS.items() if s.status == HONOURED}
    assert not [n for n, s in BODY_FIELDS.items() if s.status == NOT_YET]  # the sampling work landed


def test_off_values_pass_and_unknown_fields_are_refused():
    fields, obj = request_fields(chat_line("a", n=1, logprobs=False, stream=False, presence_penalty=0, max_completion_tokens=9))
    assert obj == "chat.completion" and fields["max_tokens"] == 9
    with pytest.raises(RequestError, match=r"^body\.frobnicate: "):
        request_fields(chat_line("a", frobnicate=True))
    with pytest.raises(RequestError, match=r"^url: "):
        request_fields({**chat_line("a"), "url": "/v1/embeddings"})
    with pytest.raises(RequestError, match=r"^method: "):
        request_fields({**chat_line("a"), "method": "GET"})
    with pytest.raises(RequestError, match=r"^body\.prompt: "):
        request_fields({"custom_id": "b", "url": COMPLETIONS, "body": {"prompt": ["one", "two"]}})
    fields, obj = request_fields({"custom_id": "c", "url": COMPLETIONS, "body": {"prompt": [[5, 6, 7]]}})
    assert obj == "text_completion" and fields["prompt_token_ids"] == [5, 6, 7]


# ---- the round trip --------------------------------------------------------------------------------
def test_openai_batch_round_trip(tiny_chat_model, tmp_path):
    schema_format = {"type": "json_schema", "json_schema": {"name": "small", "schema": SMALL, "strict": True}}
    requests = [
        chat_line("schema", response_format=schema_format, max_tokens=80),
        {"custom_id": "text", "method": "POST", "url": COMPLETIONS, "body": {"model": "m2", "prompt": "Once upon", "max_tokens": 5}},
        chat_line("offs", n=1, stream=False, logprobs=False, max_completion_tokens=4, seed=3, temperature=0.7),
        chat_line("logprobs", logprobs=True, top_logprobs=2, max_tokens=4),
        chat_line("tools", tools=[{"type": "function", "function": {"name": "f"}}], max_tokens=4),
        chat_line("two", n=2, max_tokens=80, temperature=1.0, seed=5, response_format=schema_format),
        {"custom_id": "unknown", "method": "POST", "url": COMPLETIONS, "body": {"prompt": "x", "frobnicate": 1}},
        {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}},
        chat_line("choice", choice=CHOICES, max_tokens=20),
        {"custom_id": "ids", "method": "POST", "url": COMPLETIONS, "body": {"prompt": [1, 500, 600], "max_tokens": 3}},
    ]
    src, out = write_jsonl(tmp_path / "batch.jsonl", requests), tmp_path / "out.jsonl"
    code, _, err = run_inprocess("run", str(src), "--out", str(out), "--model", str(tiny_chat_model),
                                 "--output-format", "openai", "--allow-errors", "--quiet")
    assert code == 0, err
    lines = read_jsonl(out)
    assert [line["custom_id"] for line in lines] == [r["custom_id"] for r in requests]
    for line, request in zip(lines, requests):
        check_output_line(line, request)
    by_id = {line["custom_id"]: line for line in lines}
    assert {k for k, line in by_id.items() if line["response"]["status_code"] == 200} == {
        "schema", "text", "offs", "choice", "ids", "logprobs", "two"}
    jsonschema.validate(json.loads(content_of(by_id["schema"])), SMALL)
    assert content_of(by_id["choice"]) in CHOICES
    assert by_id["text"]["response"]["body"]["model"] == "m2"
    assert by_id["ids"]["response"]["body"]["model"] == tiny_chat_model.name  # no model given: the job's
    content = by_id["logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert len(content) == by_id["logprobs"]["response"]["body"]["usage"]["completion_tokens"]
    assert all(e["logprob"] <= 0 and len(e["top_logprobs"]) == 2 for e in content)
    assert all(e["top_logprobs"][0]["logprob"] >= e["logprob"] for e in content)  # best first
    two = by_id["two"]["response"]["body"]
    for choice in two["choices"]:  # each sample valid under the schema, drawn with its own seed
        jsonschema.validate(json.loads(choice["message"]["content"]), SMALL)
    assert two["usage"]["completion_tokens"] > 0
    assert error_of(by_id["tools"]).startswith("--tool-call-parser: ")  # (SmolLM2's template names no tool format)
    assert error_of(by_id["unknown"]).startswith("body.frobnicate: ")
    assert error_of(by_id["embed"]).startswith("url: ")


def test_openai_output_needs_jsonl(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [chat_line("a")])
    code, _, err = run_inprocess("run", str(src), "--out", str(tmp_path / "o.parquet"), "--output-format", "openai")
    assert code == 2 and "--output-format openai writes JSONL" in err


# ---- job-wide constraints --------------------------------------------------------------------------
def test_job_schema_flag_constrains_rows_without_their_own(tiny_chat_model, tmp_path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SMALL))
    rows = [{"id": "a", "prompt": "Hi"}, {"id": "b", "messages": [{"role": "user", "content": "Yo"}]},
            {"id": "c", "prompt": "Pick", "choice": CHOICES, "max_tokens": 20},
            {"id": "d", "prompt": "Bad", "regex": "(a|b"}]
    src, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    code, _, err = run_inprocess("run", str(src), "--out", str(out), "--model", str(tiny_chat_model),
                                 "--json-schema", str(schema_file), "--max-tokens", "80", "--quiet")
    assert code == 1, err  # row d's regex is malformed: an error row, the others ran
    got = {r["id"]: r for r in read_jsonl(out)}
    for key in "ab":
        assert got[key]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(got[key]["completion"]), SMALL)
    assert got["c"]["completion"] in CHOICES
    assert got["d"]["finish_reason"] == "error" and got["d"]["error"].startswith("regex: ")


@pytest.mark.parametrize("flags,message", [
    (["--regex", "(a|b"], "--regex: Regex parsing error"),
    (["--choice", "a", "--regex", "b"], "give one of --json-schema, --regex, --choice"),
])
def test_bad_job_constraint_fails_before_loading(tmp_path, flags, message):
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "x"}])
    code, _, err = run_inprocess("run", str(src), "--out", str(tmp_path / "o.jsonl"), "--model", str(tmp_path / "none"), *flags)
    assert code == 2 and message in err


# ---- duplicate ids ---------------------------------------------------------------------------------
def test_duplicate_ids_refuse_the_job_before_the_model_loads(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"id": "a", "prompt": "x"}\n{"custom_id": "b", "body": {"prompt": "y"}}\n\n{"id": "a", "prompt": "z"}\n')
    code, _, err = run_inprocess("run", str(src), "--out", str(tmp_path / "o.jsonl"), "--model", str(tmp_path / "no-model"))
    assert code == 2 and "lines 1 and 4 have the same id 'a'" in err and "--allow-duplicate-ids" in err
    assert not (tmp_path / "o.jsonl").exists()
    table = pa.table({"id": ["x", "y", "z", "y"], "prompt": ["p"] * 4})
    pq.write_table(table, tmp_path / "in.parquet")
    code, _, err = run_inprocess("run", str(tmp_path / "in.parquet"), "--out", str(tmp_path / "o.jsonl"),
                                 "--model", str(tmp_path / "no-model"))
    assert code == 2 and "rows 2 and 4 have the same id 'y'" in err


def test_allow_duplicate_ids_runs_every_row(tiny_chat_model, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    out = tmp_path / "o.jsonl"
    code, _, err = run_inprocess("run", str(src), "--out", str(out), "--model", str(tiny_chat_model),
                                 "--max-tokens", "2", "--allow-duplicate-ids", "--quiet")
    assert code == 0, err
    assert [r["id"] for r in read_jsonl(out)] == ["a", "a"]


# ---- --keep-columns --------------------------------------------------------------------------------
def test_keep_columns_from_parquet_keep_their_types(tiny_chat_model, tmp_path):
    when = datetime.datetime(2024, 5, 6, 7, 8, 9, 123456)
    table = pa.table({
        "id": ["r0", "r1", "r2"], "prompt": ["a", "b", None],
        "score": pa.array([3, None, -9], pa.int32()), "tags": [["x"], [], ["y", "z"]],
        "when": pa.array([when, None, when], pa.timestamp("us")), "amount": pa.array([decimal.Decimal("1.25")] * 3, pa.decimal128(6, 2)),
        "meta": [{"k": 1}, {"k": 2}, None], "blob": [b"\x00\xff", None, b"ok"],
    })
    src, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(table, src)
    code, _, err = run_inprocess("run", str(src), "--out", str(out), "--model", str(tiny_chat_model), "--max-tokens", "2",
                                 "--keep-columns", "all", "--allow-errors", "--quiet")
    assert code == 0, err
    got = pq.read_table(out)
    for name in ("prompt", "score", "tags", "when", "amount", "meta", "blob"):
        assert got.schema.field(name).type == table.schema.field(name).type, name
        assert got.column(name).to_pylist() == table.column(name).to_pylist(), name
    assert got.column("error").to_pylist()[2] is not None  # the row without a prompt still carries its columns


def test_keep_columns_from_jsonl(tiny_chat_model, tmp_path):
    rows = [{"id": "a", "prompt": "x", "num": 1, "label": "cat", "extra": [1, 2]},
            {"id": "b", "prompt": "y", "num": 2, "label": "dog", "extra": {"k": "v"}}]
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    for out in (tmp_path / "o.jsonl", tmp_path / "o.parquet"):
        code, _, err = run_inprocess("run", str(src), "--out", str(out), "--model", str(tiny_chat_model),
                                     "--max-tokens", "2", "--keep-columns", "num,label,extra", "--quiet")
        assert code == 0, err
        got = read_jsonl(out) if out.suffix == ".jsonl" else pq.read_table(out).to_pylist()
        assert [(r["num"], r["label"]) for r in got] == [(1, "cat"), (2, "dog")]
        extras = [r["extra"] for r in got]
        assert extras == ([[1, 2], {"k": "v"}] if out.suffix == ".jsonl" else ['[1, 2]', '{"k": "v"}'])
    code, _, err = run_inprocess("run", str(src), "--out", str(tmp_path / "x.jsonl"), "--keep-columns", "completion")
    assert code == 2 and "--keep-columns: completion is an output column" in err
    pq.write_table(pa.table({"prompt": ["p"]}), tmp_path / "in.parquet")
    code, _, err = run_inprocess("run", str(tmp_path / "in.parquet"), "--out", str(tmp_path / "x.jsonl"),
                                 "--keep-columns", "nope")
    assert code == 2 and "no column nope" in err


def test_docs_list_every_body_field_as_the_table_does():
    """docs/structured-output.md copies BODY_FIELDS: shrinking the table (a field becomes honoured) must update it."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "structured-output.md").read_text()
    listed = {}
    for line in doc.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and cells[0].startswith("`") and cells[1] in (HONOURED, NOT_YET, "unsupported"):
            listed[cells[0].strip("`")] = cells[1]
    assert listed == {name: spec.status for name, spec in BODY_FIELDS.items()}
