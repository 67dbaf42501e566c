"""tool_choice "required" and a named function, enforced with the structured-output engine: on a tiny random
model (which would never write a call of its own accord) greedy completions parse, in each family's format, to
well-formed calls of the tools given, their arguments valid under the tool's schema."""
from __future__ import annotations

import json
import shutil

import jsonschema
import pytest

from cbatch.config import SamplingParams
from cbatch.engine.engine import run_to_completion
from cbatch.tokenizer import encode_messages
from cbatch.tools import FORMATS, tool_choice_constraint, tool_spec
from helpers import make_engine
from tool_models import make_hermes_model

# every string bounded: random weights finish a call well within max_tokens
WEATHER = {"type": "function", "function": {"name": "get_current_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}
COUNT = {"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}}}
TOOLS = [WEATHER, COUNT]
QUESTION = [{"role": "user", "content": "What is the weather like in Boston?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory, chat_tokenizer_dir):
    path = make_hermes_model(tmp_path_factory.mktemp("tools") / "model", chat_tokenizer_dir)
    yield make_engine(path)
    shutil.rmtree(path, ignore_errors=True)


def run(engine, choice, family: str, parallel: bool = True, max_tokens: int = 120):
    spec = tool_spec({"tools": TOOLS, "tool_choice": choice, "parallel_tool_calls": parallel})
    constraint = tool_choice_constraint(spec, FORMATS[family])
    prompt = encode_messages(engine.tokenizer, QUESTION, tools=spec.tools)
    out = run_to_completion(engine, [prompt], [SamplingParams(max_tokens=max_tokens, constraint=constraint)])[0]
    return out, FORMATS[family].parse(out.text, "row-0/0")


def check_calls(parsed, names: set[str]) -> list[str]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert parsed.tool_calls, "no call parsed"
    for call in parsed.tool_calls:
        assert call["type"] == "function" and call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    return [c["function"]["name"] for c in parsed.tool_calls]


@pytest.mark.parametrize("family", list(FORMATS))
def test_required_gives_a_call_of_a_tool(engine, family):
    out, parsed = run(engine, "required", family, parallel=False)
    assert out.finish_reason == "stop", out.text  # the grammar completed: EOS right after the call
    assert len(check_calls(parsed, {"get_current_weather", "count"})) == 1
    assert parsed.finish_reason(out.finish_reason) == "tool_calls"
    unconstrained = run_to_completion(engine, [encode_messages(engine.tokenizer, QUESTION, tools=TOOLS)],
                                      [SamplingParams(max_tokens=40)])[0]
    assert FORMATS[family].parse(unconstrained.text, "row-0/0").tool_calls == []  # the model alone calls nothing


def test_parallel_calls(engine):
    """parallel_tool_calls (the default): the grammar lets the calls go on ("; " between them in Llama 3's
    format); this random model makes several, each well-formed."""
    out, parsed = run(engine, "required", "llama3_json", max_tokens=200)
    assert out.finish_reason == "stop", out.text
    names = check_calls(parsed, {"get_current_weather", "count"})
    assert len(names) >= 2 and set(names) == {"get_current_weather", "count"}
    assert len({c["id"] for c in parsed.tool_calls}) == len(names)


@pytest.mark.parametrize("family", list(FORMATS))
@pytest.mark.parametrize("name", ["get_current_weather", "count"])
def test_named_function_gives_one_call_of_it(engine, family, name):
    out, parsed = run(engine, {"type": "function", "function": {"name": name}}, family)
    assert out.finish_reason == "stop", out.text
    assert check_calls(parsed, {name}) == [name]


def test_auto_and_none_are_unconstrained():
    for choice in ("auto", "none"):
        assert tool_choice_constraint(tool_spec({"tools": TOOLS, "tool_choice": choice}), FORMATS["hermes"]) is None
