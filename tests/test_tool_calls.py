"""Tool calls without a model: each family's parser (round trips, malformed calls -> content), the tool fields'
checks, the deterministic ids, which format a model writes, and tool-calling chats rendered through a chat
template token for token as HF's `apply_chat_template(tools=...)` renders them."""
from __future__ import annotations

import json

import pytest

from cbatch.config import UserError
from cbatch.io.rows import RowError, parse_messages
from cbatch.tokenizer import encode_messages, template_texts
from cbatch.tools import FORMATS, ToolFieldError, detect_format, tool_call_id, tool_format, tool_spec

WEATHER = {"type": "function", "function": {
    "name": "get_current_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]


def calls_of(parsed) -> list[tuple[str, dict]]:
    """(name, decoded arguments) of each parsed call, checking OpenAI's shape on the way."""
    out = []
    for call in parsed.tool_calls:
        assert set(call) == {"id", "type", "function"} and call["type"] == "function"
        assert isinstance(call["function"]["arguments"], str)
        out.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
    return out


# ---- parsers -------------------------------------------------------------------------------------------
PARIS = ("get_current_weather", {"city": "Paris", "unit": "celsius"})
TWO = [PARIS, ("get_time", {})]


@pytest.mark.parametrize("family,text,content,calls", [
    ("hermes", '<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>',
     None, [PARIS]),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_current_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
     '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me look.", TWO),
    ("hermes", '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>', None, [("get_time", {})]),  # string args
    ("hermes", '<tool_call>\n{"name": "get_time"}', None, [("get_time", {})]),  # unclosed at the end, no arguments
    ("llama3_json", '{"name": "get_current_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_current_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
     '{"name": "get_time", "parameters": {}}', None, TWO),
    ("llama3_json", 'Calling.<|python_tag|>{"name": "get_time", "arguments": {}}', "Calling.", [("get_time", {})]),
    ("mistral", '[TOOL_CALLS][{"name": "get_current_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
     '{"name": "get_time", "arguments": {}}]', None, TWO),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "get_time", "arguments": {}}]', "Sure.", [("get_time", {})]),
    ("mistral", '[{"name": "get_current_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', None, [PARIS]),
])
def test_parsers_read_calls(family, text, content, calls):
    parsed = FORMATS[family].parse(text, "row-1/0")
    assert parsed.content == content
    assert calls_of(parsed) == calls
    assert parsed.finish_reason("stop") == "tool_calls" and parsed.finish_reason("length") == "length"


@pytest.mark.parametrize("family,text", [
    ("hermes", "The weather is fine."),
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {}\n</tool_call>'),  # unbalanced JSON
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>'),  # arguments not an object
    ("hermes", '<tool_call>\n{"name": "a"}\n</tool_call><tool_call>not json</tool_call>'),  # one bad call spoils all
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call></tool_call>'),
    ("llama3_json", '{"name": "get_time", "parameters": {}} and then some words'),
    ("llama3_json", '{"name": "get_time", "parameters": {}, "extra": 1}'),
    ("llama3_json", '{"city": "Paris"}'),
    ("llama3_json", '{"name": "get_time", "parameters": {}, "arguments": {}}'),
    ("llama3_json", "Sure, here is JSON: {}"),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}'),  # cut off
    ("mistral", "[TOOL_CALLS][]"),
    ("mistral", '[TOOL_CALLS]{"name": "get_time", "arguments": {}}'),  # not a list
    ("mistral", "[1, 2, 3]"),
    ("mistral", ""),
])
def test_malformed_calls_are_content(family, text):
    parsed = FORMATS[family].parse(text, "row")
    assert parsed.content == text and parsed.tool_calls == []
    assert parsed.finish_reason("stop") == "stop"


@pytest.mark.parametrize("family", list(FORMATS))
def test_constraint_form_round_trips(family):
    """The text a tool_choice constraint makes (each call's begin + arguments + end, the format's separator
    between) parses back to the same calls: the constraint and the parser agree on the format."""
    fmt = FORMATS[family]
    spec = tool_spec({"tools": TOOLS})
    parts = []
    for name, arguments in TWO:
        tag = fmt.call_tag(name, spec.functions[name])
        assert tag["content"]["json_schema"] == spec.functions[name]
        parts.append(tag["begin"] + json.dumps(arguments) + tag["end"])
    text = fmt.separator.join(parts)
    if family == "mistral":
        text = f"[{text}]"
    assert calls_of(fmt.parse(text, "k")) == TWO


def test_call_ids_are_deterministic():
    text = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    first = FORMATS["hermes"].parse(text, "row-7/0").tool_calls
    assert [c["id"] for c in first] == [c["id"] for c in FORMATS["hermes"].parse(text, "row-7/0").tool_calls]
    assert first[0]["id"] == tool_call_id("row-7/0", 0) != first[1]["id"] == tool_call_id("row-7/0", 1)
    assert first[0]["id"] != tool_call_id("row-7/1", 0)  # another sample of the row
    assert first[0]["id"].startswith("call_") and len(first[0]["id"]) == 29 and first[0]["id"][5:].isalnum()
    mistral_id = FORMATS["mistral"].parse('[{"name": "get_time", "arguments": {}}]', "row-7/0").tool_calls[0]["id"]
    assert len(mistral_id) == 9 and mistral_id.isalnum()  # Mistral's templates take nine letters and digits


# ---- the tool fields ---------------------------------------------------------------------------------
def test_tool_spec_reads_the_fields():
    assert tool_spec({"prompt": "x"}) is None
    spec = tool_spec({"tools": TOOLS})
    assert (spec.choice, spec.function, spec.parallel, list(spec.functions)) == ("auto", None, True, ["get_current_weather", "get_time"])
    assert spec.functions["get_time"] == {"type": "object", "properties": {}}
    named = tool_spec({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_time"}},
                       "parallel_tool_calls": False})
    assert (named.choice, named.function, named.parallel) == ("function", "get_time", False)
    bare = tool_spec({"tools": [{"type": "function", "function": {"name": "ping"}}], "tool_choice": "required"})
    assert bare.functions == {"ping": {"type": "object"}} and bare.parses_calls
    assert not tool_spec({"tools": TOOLS, "tool_choice": "none"}).parses_calls


@pytest.mark.parametrize("row,message", [
    ({"tools": {"a": 1}}, "tools: must be a list of tools"),
    ({"tools": [{"type": "function"}]}, 'tools[0]: must be {"type": "function", "function": {"name": ..., "parameters": {...}}}'),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name: must be a non-empty string"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters: must be a JSON schema object (or left out)"),
    ({"tools": [TIME, TIME]}, "tools[1].function.name: 'get_time' is given twice; give each function once"),
    ({"tools": TOOLS, "tool_choice": "always"},
     'tool_choice: must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}, not \'always\''),
    ({"tool_choice": "required"}, 'tool_choice: "required" needs `tools`; give the functions the model may call'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name: 'nope' is not a function of `tools` (those are: get_current_weather, get_time)"),
    ({"tools": TOOLS, "tool_choice": {"name": "get_time"}},
     'tool_choice: a named function is {"type": "function", "function": {"name": ...}}'),
    ({"tools": TOOLS, "tool_choice": 3}, "tool_choice: must be a string or an object, got int"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls: must be true or false, got 'yes'"),
])
def test_tool_spec_names_the_field(row, message):
    with pytest.raises(ToolFieldError) as caught:
        tool_spec(row)
    assert str(caught.value) == message and isinstance(caught.value, UserError)


# ---- which format -----------------------------------------------------------------------------------
def test_format_from_template_architecture_or_flag():
    assert detect_format("... <tool_call> ...", None).name == "hermes"
    assert detect_format("[AVAILABLE_TOOLS] ...", "llama").name == "mistral"
    assert detect_format("<|start_header_id|>{% if tools %}", None).name == "llama3_json"
    assert detect_format("{{ messages }}", "qwen3").name == "hermes"
    assert detect_format("{{ messages }}", "llama") is None
    assert tool_format("mistral", "<tool_call>", None).name == "mistral"  # the flag wins
    with pytest.raises(ToolFieldError, match=r"^--tool-call-parser: 'json' is not a tool-call parser; give one of "
                                             r"hermes, llama3_json, mistral$"):
        tool_format("json", "", None)
    with pytest.raises(ToolFieldError, match="^--tool-call-parser: this model's chat template names no tool-call format"):
        tool_format(None, "{{ messages }}", "llama")


# ---- chats with tools through the template ------------------------------------------------------------
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}\n{{ messages[0].content }}{% endif %}\n"
    "Functions you may call, one JSON signature a line:\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    "Answer a call as <tool_call>\n{\"name\": ..., \"arguments\": {...}}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{% if m.content %}{{ m.content }}{% endif %}"
    "{%- for call in m.tool_calls or [] %}\n<tool_call>\n"
    "{\"name\": \"{{ call.function.name }}\", \"arguments\": {{ call.function.arguments | tojson }}}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{%- for call in m.tool_calls %}{\"name\": \"{{ call.function.name }}\", \"parameters\": "
    "{{ call.function.arguments | tojson }}}{% endfor %}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
    "{%- if loop.last and tools and m.role == 'user' %}Call a function by answering {\"name\": ..., \"parameters\": "
    "{...}}. The functions:\n{%- for tool in tools %}\n{{ tool | tojson(indent=2) }}{% endfor %}\n\n{% endif %}"
    "{{ m.content }}<|eot_id|>{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_current_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
CHAT = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_current_weather", "content": '{"temperature": 21}'},
        {"role": "user", "content": "And the time?"}]


@pytest.fixture(scope="module", params=[("hermes", HERMES_TEMPLATE), ("llama3_json", LLAMA3_TEMPLATE)], ids=["hermes", "llama3"])
def tool_tokenizer(request, chat_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    tokenizer.chat_template = request.param[1]
    return request.param[0], tokenizer


def hf_ids(tokenizer, messages, tools) -> list[int]:
    """HF's own rendering, given what HF templates expect: each call's arguments as an object."""
    hf_messages = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                                        for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    ids = tokenizer.apply_chat_template(hf_messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("chat", [CHAT[1:2], CHAT], ids=["first-turn", "multi-turn"])
def test_tools_render_as_hf_renders_them(tool_tokenizer, chat):
    family, tokenizer = tool_tokenizer
    assert detect_format("".join(template_texts(tokenizer)), "llama").name == family
    messages = parse_messages(chat)  # a row's messages, checked: the tool fields kept
    ids = encode_messages(tokenizer, messages, tools=TOOLS)
    assert ids == hf_ids(tokenizer, chat, TOOLS)
    text = tokenizer.decode(ids)
    assert '"name": "get_current_weather"' in text and '"description": "The weather in a city."' in text
    if len(chat) > 1:  # the call as an object (not a JSON string inside a string) and the tool's result
        assert '"arguments": {"city": "Paris", "unit": "celsius"}' in text or '"parameters": {"city": "Paris"' in text
        assert '{"temperature": 21}' in text
    assert encode_messages(tokenizer, messages) != ids  # without tools the template renders none
    assert CHAT[2]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris", "unit": "celsius"}'  # not changed


@pytest.mark.parametrize("message,error", [
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "messages[0].tool_calls: only an assistant message has tool calls"),
    ({"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]},
     "messages[0].tool_calls[0].function.arguments: must be a JSON object, or a string holding one"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]},
     "messages[0].tool_calls[0].function.name: must be a non-empty string"),
    ({"role": "assistant", "content": None, "tool_calls": {"a": 1}}, "messages[0].tool_calls: must be a list of calls"),
    ({"role": "tool", "content": "21", "tool_call_id": 5}, "messages[0].tool_call_id: must be a string"),
    ({"role": "assistant", "content": None}, "`messages[0].content` must be a string"),
])
def test_tool_messages_are_checked(message, error):
    with pytest.raises(RowError) as caught:
        parse_messages([message])
    assert str(caught.value) == error
