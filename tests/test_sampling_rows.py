"""The new sampling fields as rows carry them (JSON, Parquet, OpenAI bodies) and the output columns they add."""
from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from cbatch.config import SamplingParams
from cbatch.engine.engine import run_to_completion
from cbatch.io.rows import RowError, parse_row
from helpers import make_engine
from ops_jobs import read_jsonl, run_inprocess, write_jsonl

DEFAULTS = SamplingParams(chat_template_kwargs={"enable_thinking": False, "x": 1})


def test_row_fields_are_coerced_like_vllm_requests():
    row = {"prompt": "hi", "logit_bias": {"12": -100, "7": 2.5}, "stop_token_ids": 5.0, "n": 3.0, "min_p": 0,
           "logprobs": 2, "prompt_logprobs": 0, "chat_template_kwargs": {"x": 2}, "presence_penalty": 1}
    params = parse_row(0, row, DEFAULTS).params
    assert params.logit_bias == {12: -100, 7: 2.5} and params.stop_token_ids == [5] and params.n == 3
    assert params.min_p == 0.0 and isinstance(params.presence_penalty, float)
    assert params.chat_template_kwargs == {"enable_thinking": False, "x": 2}  # merged key by key, the row's wins
    parquet_map = parse_row(0, {"prompt": "hi", "logit_bias": [(12, -1.0)]}, DEFAULTS).params
    assert parquet_map.logit_bias == {12: -1.0}
    body = {"custom_id": "c", "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 4}}
    assert parse_row(0, body, DEFAULTS).params.logprobs == 4
    off = {"custom_id": "c", "body": {"messages": [{"role": "user", "content": "hi"}], "logprobs": False}}
    assert parse_row(0, off, DEFAULTS).params.logprobs is None


@pytest.mark.parametrize("field,value,message", [
    ("logit_bias", {"a": 1}, "logit_bias must map token ids to numbers in [-100, 100]"),
    ("logit_bias", {"3": 101}, "logit_bias must map token ids"),
    ("logit_bias", "3", "logit_bias must be an object of token id -> bias"),
    ("stop_token_ids", [-1], "stop_token_ids must be a list of token ids"),
    ("repetition_penalty", 0, "repetition_penalty must be a positive number (1 = off)"),
    ("presence_penalty", 3, "presence_penalty must be in [-2, 2] (0 = off)"),
    ("frequency_penalty", "x", "frequency_penalty must be in [-2, 2] (0 = off)"),
    ("min_tokens", 300, "min_tokens must not exceed max_tokens (256)"),
    ("prompt_logprobs", -1, "prompt_logprobs must be an integer from 0 to 20"),
    ("n", True, "n must be an integer from 1 to 4096"),
    ("chat_template_kwargs", {"add_generation_prompt": False}, "chat_template_kwargs may not set add_generation_prompt"),
])
def test_bad_fields_name_themselves(field, value, message):
    with pytest.raises(RowError) as info:
        parse_row(0, {"prompt": "hi", field: value}, SamplingParams())
    assert str(info.value).startswith(message), str(info.value)


def test_logprob_columns_only_when_asked(tiny_checkpoints, tmp_path):
    rows = [{"id": "a", "prompt_token_ids": [5, 6, 7], "logprobs": 2, "prompt_logprobs": 1},
            {"id": "b", "prompt_token_ids": [8, 9]},
            {"id": "c", "prompt_token_ids": [8, 9], "stop_token_ids": [999]}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    flags = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--max-tokens", "4"]
    out = tmp_path / "out.parquet"
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *flags)
    assert code == 1, err
    table = pq.read_table(out)
    assert table.column_names == ["id", "completion", "finish_reason", "prompt_tokens", "completion_tokens", "error",
                                  "token_logprobs", "top_logprobs", "prompt_token_ids", "prompt_token_logprobs",
                                  "prompt_top_logprobs"]
    a, b, c = table.to_pylist()
    assert len(a["token_logprobs"]) == 4 and all(v < 0 for v in a["token_logprobs"])
    assert all(len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"] for top in a["top_logprobs"])
    assert a["prompt_token_ids"] == [5, 6, 7] and a["prompt_token_logprobs"][0] is None
    assert len(a["prompt_top_logprobs"]) == 3 and len(a["prompt_top_logprobs"][1]) == 1
    assert b["token_logprobs"] is None and b["prompt_top_logprobs"] is None
    assert c["error"] == "stop_token_ids has token id 999, outside the model's vocabulary (ids 0..383)"
    # the same job with --logprobs for every row, as JSONL
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "out.jsonl"), *flags, "--logprobs", "1")
    got = read_jsonl(tmp_path / "out.jsonl")
    assert len(got[1]["top_logprobs"]) == 4 and len(got[0]["top_logprobs"][0]) == 2  # the row's own k wins


def test_new_settings_enter_the_job_fingerprint(tiny_checkpoints, tmp_path):
    """A resume with another --n, --logprobs, ... (or without the reasoning split) is refused as other settings;
    jobs that set none of the new fields keep the fingerprint they had (only fields set away from their
    defaults are added), so their partial runs still resume after an upgrade."""
    from dataclasses import replace

    from cbatch.config import EngineConfig
    from cbatch.run.preflight import JobOptions, job_fingerprint, resolve_or_fail

    config = EngineConfig(model=str(tiny_checkpoints["llama"]), device="cpu")
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": [5]}])
    options = JobOptions(input=source, output=tmp_path / "o.jsonl", engine=config, defaults=SamplingParams(max_tokens=9))
    model = resolve_or_fail(config)
    base = job_fingerprint(options, model)
    changed = [replace(options, defaults=replace(options.defaults, **change)) for change in
               ({"n": 2}, {"logprobs": 0}, {"logit_bias": {3: 1.0}}, {"chat_template_kwargs": {"enable_thinking": False}})]
    changed.append(replace(options, reasoning_split=False))
    prints = [job_fingerprint(o, model)["settings"] for o in changed]
    assert base["settings"] not in prints and len(set(prints)) == len(prints)
    assert job_fingerprint(replace(options, defaults=SamplingParams(max_tokens=9)), model) == base


def test_truncate_prompt_tokens_runs_a_long_prompt_on_its_last_tokens(tiny_checkpoints, tmp_path):
    long = list(range(5, 45))  # 40 tokens: more than --max-model-len 16 holds
    rows = [{"id": "cut", "prompt_token_ids": long, "truncate_prompt_tokens": 6},
            {"id": "tail", "prompt_token_ids": long[-6:]},
            {"id": "short", "prompt_token_ids": [7, 8], "truncate_prompt_tokens": 6},
            {"id": "long", "prompt_token_ids": long}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    flags = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--max-tokens", "4", "--max-model-len", "16",
             "--token-ids"]
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "out.jsonl"), *flags)
    assert code == 1, err  # the long row without truncation cannot run
    got = read_jsonl(tmp_path / "out.jsonl")
    assert [r["id"] for r in got] == ["cut", "tail", "short", "long"]  # each output row is its input row's
    cut, tail, short, too_long = got
    assert cut["error"] is None and cut["prompt_tokens"] == 6
    assert cut["completion_token_ids"] == tail["completion_token_ids"] and len(cut["completion_token_ids"]) == 4
    assert short["prompt_tokens"] == 2 and "the prompt has 40 tokens" in too_long["error"]
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "all.jsonl"), *flags,
                                 "--truncate-prompt-tokens", "6")  # the flag: every row's default
    assert code == 0, err
    assert [r["completion_token_ids"] for r in read_jsonl(tmp_path / "all.jsonl")][3] == tail["completion_token_ids"]
    with pytest.raises(RowError, match="^truncate_prompt_tokens must be a positive integer"):
        parse_row(0, {"prompt": "hi", "truncate_prompt_tokens": 0}, SamplingParams())
    # the library API takes it too (Engine.add_request applies it, whatever the entry)
    engine = make_engine(tiny_checkpoints["llama"], max_model_len=16)
    outs = run_to_completion(engine, [long], [SamplingParams(max_tokens=4, truncate_prompt_tokens=6)])
    assert outs[0].error is None and outs[0].token_ids == tail["completion_token_ids"]
