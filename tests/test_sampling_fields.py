"""SAMPLING_FIELDS (cbatch/config.py) is the one table of per-row sampling settings: the row parser, the
flags, the OpenAI body fields and SamplingParams' checks all follow it, so a field added there works
everywhere."""
from __future__ import annotations

from dataclasses import fields

import pytest

from cbatch.cli.flags import SAMPLING_FLAGS
from cbatch.config import (BOOL, INT, NUMBER, OBJECT, SAMPLING_FIELDS, STRINGS, TOKEN_BIASES, TOKEN_IDS,
                           SamplingParams)
from cbatch.io.openai import BODY_FIELDS, HONOURED
from cbatch.io.rows import RowError, parse_row

# a usable value of each kind, as a JSON row carries it, and what SamplingParams holds for it
GOOD = {INT: (3.0, 3), NUMBER: (1, 1.0), BOOL: (True, True), STRINGS: ("end", ["end"]), TOKEN_IDS: (7, [7]),
        TOKEN_BIASES: ({"7": 1.5}, {7: 1.5}), OBJECT: ({"k": 1}, {"k": 1})}
BAD = {INT: "x", NUMBER: "x", BOOL: "yes", STRINGS: 5, TOKEN_IDS: ["x"], TOKEN_BIASES: "x", OBJECT: ["x"]}


def test_every_sampling_params_field_is_in_the_table():
    assert {f.name for f in fields(SamplingParams)} - {"constraint", "lora"} == set(SAMPLING_FIELDS)
    assert all(spec.kind in GOOD for spec in SAMPLING_FIELDS.values())


@pytest.mark.parametrize("name", list(SAMPLING_FIELDS))
def test_a_field_of_the_table_is_a_row_field_a_flag_and_a_body_field(name):
    spec = SAMPLING_FIELDS[name]
    given, held = GOOD[spec.kind]
    assert getattr(parse_row(0, {"prompt": "hi", name: given}, SamplingParams()).params, name) == held
    body_row = {"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "hi", name: given}}
    assert getattr(parse_row(0, body_row, SamplingParams()).params, name) == held
    assert BODY_FIELDS[name].status == HONOURED
    flag = next(f for f in SAMPLING_FLAGS if f.name == (spec.flag or name))
    assert flag.help == spec.help and flag.field == (name if name != "seed" else None)  # --seed: the job seed
    with pytest.raises(RowError) as info:
        parse_row(0, {"prompt": "hi", name: BAD[spec.kind]}, SamplingParams())
    assert str(info.value).startswith(f"{name} "), str(info.value)


def test_a_row_object_field_adds_to_the_defaults_key_by_key():
    defaults = SamplingParams(chat_template_kwargs={"a": 1, "b": 2})
    params = parse_row(0, {"prompt": "hi", "chat_template_kwargs": {"b": 3}}, defaults).params
    assert params.chat_template_kwargs == {"a": 1, "b": 3} and defaults.chat_template_kwargs == {"a": 1, "b": 2}


def test_two_field_checks_follow_the_field_checks():
    assert SamplingParams(min_tokens=9, max_tokens=8).validate() == "min_tokens must not exceed max_tokens (8), got 9"
    assert SamplingParams(chat_template_kwargs={"tokenize": True, "padding": 1}).validate().startswith(
        "chat_template_kwargs may not set tokenize, padding (cbatch sets it)")


def test_defaults_pass_every_rule_and_look_alikes_do_not():
    """validate() skips a field at its default (a row sets a few of twenty): that holds only because every default
    passes its field's rules, and a look-alike of another type (True for 1, False for 0.0) is not the default."""
    from cbatch.config import SAMPLING_FIELDS, SamplingParams

    defaults = SamplingParams()
    for name, spec in SAMPLING_FIELDS.items():
        value = getattr(defaults, name)
        assert not any(rule.bad(value) for rule in spec.rules if value is not None), name
    assert SamplingParams(n=True).validate() is not None and SamplingParams(temperature=False).validate() is not None
