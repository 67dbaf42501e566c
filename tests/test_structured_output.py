"""Structured output: JSON schema, JSON object, regex and choice rows are valid by construction (xgrammar masks),
on SmolLM2 and on every architecture's tiny checkpoint; unconstrained rows are untouched by constrained ones."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jsonschema
import pytest

from cbatch.config import Constraint, SamplingParams
from cbatch.engine.engine import run_to_completion
from cbatch.engine.structured import Grammars
from cbatch.io.constraints import ConstraintFieldError, constraint_from_row, flags_constraint, schema_text
from helpers import make_engine
from tiny_models import ARCHS, make_checkpoint

# nested: objects in objects, an array of objects, enums, bounded integers, required fields
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                    "required": ["city", "zip"]},
        "pets": {"type": "array", "minItems": 1, "maxItems": 2,
                 "items": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                            "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
                           "required": ["kind", "legs"]}},
    },
    "required": ["name", "age", "role", "address", "pets"],
}
# small enough that random weights complete it well within max_tokens (every string and number is bounded)
SMALL = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
                   "tag": {"enum": ["a", "b"]}, "name": {"type": "string", "maxLength": 3},
                   "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
                   "inner": {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}},
    "required": ["ok", "n", "tag", "name", "xs", "inner"],
}
REGEX = r"[a-c]{2,4}-[0-9]{2}"
CHOICES = ["yes", "no", "not sure"]


def schema_rule(schema: dict) -> Constraint:
    return Constraint("json_schema", schema_text("json_schema", schema), "json_schema")


def check_valid(text: str, constraint: Constraint) -> None:
    """The completion satisfies its constraint (the acceptance checks)."""
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(constraint.text))
    elif constraint.kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif constraint.kind == "regex":
        assert re.fullmatch(constraint.text, text), text
    else:
        assert text in json.loads(constraint.text), text


def mixed_job(constrained: list[SamplingParams], free: list[SamplingParams], engine, prompts):
    """Runs constrained and unconstrained rows interleaved, then the unconstrained ones alone on the same
    prompts: (constrained outputs, unconstrained outputs in the mixed job, unconstrained outputs alone).
    Sampled unconstrained rows carry their own seed (an unseeded row's seed depends on its place)."""
    slots = [("c", i) for i in range(len(constrained))] + [("f", i) for i in range(len(free))]
    slots.sort(key=lambda slot: (slot[1], slot[0]))  # c0, f0, c1, f1, ...
    params = [constrained[i] if kind == "c" else free[i] for kind, i in slots]
    outs = run_to_completion(engine, prompts[: len(slots)], params)
    mixed_free = [outs[k] for k, (kind, _) in enumerate(slots) if kind == "f"]
    engine.reset()
    alone = run_to_completion(engine, [prompts[k] for k, (kind, _) in enumerate(slots) if kind == "f"], free)
    return [outs[k] for k, (kind, _) in enumerate(slots) if kind == "c"], mixed_free, alone


# ---- row fields -> Constraint ------------------------------------------------------------------------
def test_row_fields_become_constraints():
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    by_object = constraint_from_row({"json_schema": schema}, None)
    by_string = constraint_from_row({"json_schema": json.dumps(schema, indent=2)}, None)
    assert by_object == by_string and by_object.kind == "json_schema"
    assert list(json.loads(by_object.text)["properties"]) == ["b", "a"]  # property order is the output's order
    assert constraint_from_row({"regex": "[0-9]+"}, None) == Constraint("regex", "[0-9]+")
    assert json.loads(constraint_from_row({"choice": ["x", "y z"]}, None).text) == ["x", "y z"]
    assert constraint_from_row({"json_object": True}, None).kind == "json_object"
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": True}}
    assert constraint_from_row({"response_format": rf}, None) == by_object
    assert constraint_from_row({"response_format": {"type": "json_object"}}, None).kind == "json_object"
    job = Constraint("regex", "[a-z]+", "--regex")
    assert constraint_from_row({"prompt": "x"}, job) is job  # the job's constraint for rows without their own
    assert constraint_from_row({"response_format": {"type": "text"}}, job) is None  # the row's own choice wins


@pytest.mark.parametrize("row,field", [
    ({"json_schema": "{not json"}, "json_schema"),
    ({"json_schema": [1, 2]}, "json_schema"),
    ({"regex": ""}, "regex"),
    ({"choice": ["a", 3]}, "choice"),
    ({"choice": []}, "choice"),
    ({"json_object": "yes"}, "json_object"),
    ({"regex": "a", "choice": ["a"]}, "choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema"),
])
def test_malformed_fields_name_the_field(row, field):
    with pytest.raises(ConstraintFieldError) as info:
        constraint_from_row(row, None)
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")


def test_job_flags_become_one_constraint(tmp_path):
    schema_file = tmp_path / "s.json"
    schema_file.write_text(json.dumps(SMALL))
    assert flags_constraint(schema_file, None, None) == schema_rule(SMALL)
    assert flags_constraint(None, None, ["a", "b"]).kind == "choice"
    with pytest.raises(ConstraintFieldError, match="--regex"):
        flags_constraint(schema_file, "[0-9]", None)
    with pytest.raises(ConstraintFieldError, match="--json-schema"):
        flags_constraint(tmp_path / "missing.json", None, None)


# ---- SmolLM2: a real model following a nested schema ---------------------------------------------
@pytest.mark.slow
def test_smollm2_chat_rows_follow_their_constraints(smollm2_dir):
    from cbatch.tokenizer import encode_messages

    engine = make_engine(smollm2_dir, dtype="float32", max_num_seqs=8)
    asks = ["Describe a person with one pet as JSON.", "Name a color.", "Write a product code.", "Say hello.",
            "Is water wet?"]
    prompts = [encode_messages(engine.tokenizer, [{"role": "user", "content": a}]) for a in asks]
    rules = [schema_rule(PERSON), Constraint("regex", REGEX, "regex"), Constraint("choice", json.dumps(CHOICES), "choice")]
    constrained = [SamplingParams(max_tokens=150, constraint=rules[0]), SamplingParams(max_tokens=20, constraint=rules[1]),
                   SamplingParams(max_tokens=10, constraint=rules[2])]
    free = [SamplingParams(max_tokens=8), SamplingParams(max_tokens=8, temperature=0.8, seed=11)]
    got, mixed_free, alone = mixed_job(constrained, free, engine, prompts)
    for out, rule in zip(got, rules):
        assert out.finish_reason == "stop", (rule.kind, out.text)  # the grammar completed
        check_valid(out.text, rule)
    assert [o.token_ids for o in mixed_free] == [o.token_ids for o in alone]


def test_json_object_grammar_takes_any_object_and_nothing_else(tiny_text_models):
    """json_object is unbounded (no max_tokens guarantees completion), so its grammar is checked directly."""
    engine = make_engine(tiny_text_models["llama"])
    tokenizer, eos = engine.tokenizer, engine.spec.eos_token_ids[0]
    grammars = Grammars(tokenizer, engine.spec.vocab_size, [eos])
    rule = Constraint("json_object", "", "json_object")
    for text, ok in [('{"a": [1, {"b": null}], "c": "d"}', True), ("{}", True), ("[1, 2]", False), ('"x"', False)]:
        state = grammars.start(rule)
        accepted = state.matcher.accept_string(text) and state.accept(eos)
        assert accepted == ok, text


# ---- every architecture, random weights: still valid by construction --------------------------------
@pytest.fixture(scope="module")
def tiny_text_models(tmp_path_factory, smollm2_dir) -> dict[str, Path]:
    """Each architecture's tiny checkpoint with SmolLM2's tokenizer (vocabulary 49152)."""
    root = tmp_path_factory.mktemp("tiny-structured")
    paths = {}
    for arch in ARCHS:
        path = make_checkpoint(arch, root / arch, vocab_size=49152)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (smollm2_dir / name).exists():
                shutil.copy(smollm2_dir / name, path / name)
        paths[arch] = path
    return paths


@pytest.mark.parametrize("arch", list(ARCHS))
def test_random_weights_follow_constraints_on_every_architecture(tiny_text_models, arch):
    engine = make_engine(tiny_text_models[arch], max_num_seqs=8)
    prompts = [[1, 300 + 17 * i, 700, 9000 + i] for i in range(8)]
    rules = [schema_rule(SMALL), Constraint("regex", REGEX, "regex"), Constraint("choice", json.dumps(CHOICES), "choice")]
    constrained = [SamplingParams(max_tokens=80, constraint=rules[0]),
                   SamplingParams(max_tokens=80, temperature=1.0, seed=5, constraint=rules[0]),
                   SamplingParams(max_tokens=20, constraint=rules[1]),
                   SamplingParams(max_tokens=20, temperature=1.0, seed=6, constraint=rules[2])]
    free = [SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=6, temperature=1.0, seed=7)]
    got, mixed_free, alone = mixed_job(constrained, free, engine, prompts)
    for out, params in zip(got, constrained):
        assert out.finish_reason == "stop", out.text
        check_valid(out.text, params.constraint)
    assert [o.token_ids for o in mixed_free] == [o.token_ids for o in alone]


def test_constraint_errors_are_row_errors_and_others_run(tiny_text_models):
    engine = make_engine(tiny_text_models["llama"], max_num_seqs=4)
    bad_schema = Constraint("json_schema", '{"type": "strin"}', "json_schema")
    bad_regex = Constraint("regex", "(a|b", "regex")
    params = [SamplingParams(max_tokens=4, constraint=bad_schema), SamplingParams(max_tokens=4, constraint=bad_regex),
              SamplingParams(max_tokens=20, constraint=Constraint("choice", json.dumps(CHOICES), "choice")),
              SamplingParams(max_tokens=4, constraint=bad_schema)]
    outs = run_to_completion(engine, [[1, 5, 6]] * 4, params)
    assert outs[0].finish_reason == "error" and outs[0].error.startswith("json_schema: ") and "strin" in outs[0].error
    assert outs[1].finish_reason == "error" and outs[1].error.startswith("regex: ")
    assert outs[2].finish_reason == "stop" and outs[2].text in CHOICES
    assert outs[3].error == outs[0].error
    assert engine.grammars.num_compiled == 3  # the bad schema's error is cached like a grammar


def test_max_tokens_cuts_a_constrained_row_with_length(tiny_text_models):
    engine = make_engine(tiny_text_models["llama"])
    out = run_to_completion(engine, [[1, 5, 6]], [SamplingParams(max_tokens=3, constraint=schema_rule(SMALL))])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    assert out.text.startswith("{")
