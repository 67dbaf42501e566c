"""OpenAI Responses lines (`url: "/v1/responses"`): the body read as the chat it means (input, instructions,
max_output_tokens, text.format), its fields checked against the one body-field table, and the Responses object
written back under --output-format openai."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from cbatch.io.openai import RESPONSES_URL, RequestError, request_fields
from ops_jobs import read_jsonl, run_inprocess, write_jsonl
from test_structured_output import SMALL

CHAT = "/v1/chat/completions"


def line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def run(src: Path, out: Path, model: Path, *flags: str) -> None:
    code, _, err = run_inprocess("run", str(src), "--out", str(out), "--model", str(model), "--temperature", "0",
                                 "--allow-errors", "--quiet", *flags)
    assert code == 0, err


EQUIVALENT = [  # (a Responses line, the chat line it means)
    (line("r-text", RESPONSES_URL, input="Tell me a story", max_output_tokens=6),
     line("c-text", CHAT, messages=[{"role": "user", "content": "Tell me a story"}], max_tokens=6)),
    (line("r-items", RESPONSES_URL, instructions="You are terse.", max_output_tokens=6,
          input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi "},
                                                                  {"type": "input_text", "text": "there"}]},
                 {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to three"}]),
     line("c-items", CHAT, max_tokens=6, messages=[{"role": "system", "content": "You are terse."},
                                                   {"role": "user", "content": "Hi there"},
                                                   {"role": "assistant", "content": "Hello."},
                                                   {"role": "user", "content": "Count to three"}])),
]


def test_responses_lines_give_the_chat_lines_tokens(tiny_chat_model, tmp_path):
    rows = [r for pair in EQUIVALENT for r in pair]
    out = tmp_path / "out.jsonl"
    run(write_jsonl(tmp_path / "in.jsonl", rows), out, tiny_chat_model, "--token-ids")
    got = {r["id"]: r for r in read_jsonl(out)}
    for responses, chat in EQUIVALENT:
        mine, theirs = got[responses["custom_id"]], got[chat["custom_id"]]
        assert mine["error"] is None and theirs["error"] is None
        assert mine["completion_token_ids"] == theirs["completion_token_ids"] and len(mine["completion_token_ids"]) > 0
        assert mine["prompt_tokens"] == theirs["prompt_tokens"]
    assert got["r-items"]["prompt_tokens"] > got["r-text"]["prompt_tokens"]  # the instructions and items are in


def test_responses_output_shape_structured_output_and_errors(tiny_chat_model, tmp_path):
    schema_format = {"type": "json_schema", "name": "small", "schema": SMALL, "strict": True}
    rows = [line("schema", RESPONSES_URL, model="gpt-4.1-mini", input="JSON please", max_output_tokens=80,
                 text={"format": schema_format}, metadata={"k": "v"}, user="u", top_p=1.0),
            line("object", RESPONSES_URL, input="JSON please", max_output_tokens=80, text={"format": {"type": "json_object"}}),
            line("cut", RESPONSES_URL, input="Tell me a long story", max_output_tokens=2, text={"format": {"type": "text"}}),
            line("bad", RESPONSES_URL, input="x", tools=[]),
            line("chatfield", RESPONSES_URL, input="x", max_tokens=3),
            line("noinput", RESPONSES_URL, instructions="x"),
            line("badpart", RESPONSES_URL, input=[{"role": "user", "content": [{"type": "input_file", "file_id": "u"}]}]),
            line("badformat", RESPONSES_URL, input="x", text={"format": {"type": "yaml"}})]
    out = tmp_path / "out.jsonl"
    run(write_jsonl(tmp_path / "in.jsonl", rows), out, tiny_chat_model, "--output-format", "openai")
    got = {r["custom_id"]: r["response"] for r in read_jsonl(out)}
    again = tmp_path / "again.jsonl"
    run(tmp_path / "in.jsonl", again, tiny_chat_model, "--output-format", "openai")
    body = got["schema"]["body"]
    assert got["schema"]["status_code"] == 200 and body["object"] == "response" and body["model"] == "gpt-4.1-mini"
    assert body["id"].startswith("resp_") and body["id"] == read_jsonl(again)[0]["response"]["body"]["id"]  # from the row
    assert body["status"] == "completed" and body["incomplete_details"] is None and isinstance(body["created_at"], int)
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant" and message["id"].startswith("msg_")
    [text] = message["content"]
    assert text["type"] == "output_text" and text["annotations"] == []
    jsonschema.validate(json.loads(text["text"]), SMALL)
    usage = body["usage"]
    assert usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert got["object"]["body"]["output"][0]["content"][0]["text"].startswith("{")  # (cut at 80 tokens, maybe)
    cut = got["cut"]["body"]
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["usage"]["output_tokens"] == 2
    errors = {k: v["body"]["error"]["message"] for k, v in got.items() if v["status_code"] != 200}
    assert set(errors) == {"bad", "chatfield", "noinput", "badpart", "badformat"}
    assert errors["bad"].startswith("body.tools: ") and errors["chatfield"].startswith("body.max_tokens: ")
    assert errors["noinput"].startswith("body.input: ") and errors["badpart"].startswith("body.input[0].content[0]: ")
    assert errors["badformat"].startswith("body.text.format.type: ")


def test_a_message_items_bad_content_is_named_by_its_input_index():
    """The item's own place in `body.input` (not the chat message it becomes, which `instructions` shifts by one)."""
    from cbatch.io.openai import responses_fields

    body = {"instructions": "Be brief.", "input": [{"role": "user", "content": "hi"}, {"role": "user", "content": 7}]}
    with pytest.raises(RequestError, match=r"^body\.input\[1\]\.content: must be a string or a list .* got int$"):
        responses_fields(body)


def test_responses_fields_are_refused_on_chat_lines():
    with pytest.raises(RequestError, match=r"^body\.input: not a field cbatch knows for /v1/chat/completions"):
        request_fields(line("a", CHAT, messages=[{"role": "user", "content": "hi"}], input="x"))
    with pytest.raises(RequestError, match=r"^body\.text\.verbosity: "):
        request_fields(line("a", RESPONSES_URL, input="x", text={"verbosity": "low"}))
    with pytest.raises(RequestError, match=r"^body\.input\[0\]\.type: "):
        request_fields(line("a", RESPONSES_URL, input=[{"type": "function_call_output", "role": "tool", "content": "x"}]))
