"""Property: whatever bytes or JSON values the input lines hold, `cbatch run` never crashes, writes one
output row per input row, and answers every good row exactly as on its own.

The job runs in-process (`run_job` with one pre-built engine reused across examples) to stay fast."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.engine import run_to_completion
from cbatch.run.exit_codes import EXIT_OK, EXIT_ROW_ERRORS
from cbatch.run.job import run_job
from cbatch.run.preflight import JobOptions
from helpers import make_engine
from ops_jobs import read_jsonl

GOOD_PROMPTS = [[5, 17, 99], [200, 3, 3, 41, 7, 300], [11]]
MAX_TOKENS = 3
FIELDS = ["prompt", "messages", "prompt_token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed",
          "stop", "ignore_eos", "id", "custom_id", "body"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True) | st.text(max_size=8)
    | st.sampled_from(["\ud800", "a\udfffb", "\u2028", "\x00"]),  # lone surrogates survive JSON escapes
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
# rows that look like requests: the known fields with any values (token ids kept small so most are valid)
request_like = st.dictionaries(
    st.sampled_from(FIELDS),
    json_values | st.lists(st.integers(-3, 500), max_size=6) | st.integers(-5, 40) | st.floats(-2, 3),
    min_size=1, max_size=5,
)
# valid prompts with odd sampling settings: values at and past the edges of every numeric type
edge_numbers = st.sampled_from([0, -1, 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30, 0.5, 1e308, -0.0, 101.0])
sampling_row = st.fixed_dictionaries(
    {"prompt_token_ids": st.lists(st.integers(0, 383), min_size=1, max_size=6), "temperature": st.floats(0.1, 2) | edge_numbers},
    optional={k: edge_numbers | json_values for k in ("max_tokens", "top_p", "top_k", "seed", "stop", "ignore_eos")},
)
bad_line = (
    st.binary(max_size=40)
    | json_values.map(lambda v: json.dumps(v).encode())
    | request_like.map(lambda v: json.dumps(v).encode())
    | sampling_row.map(lambda v: json.dumps(v).encode())
)


@pytest.fixture(scope="module")
def engine_and_expected(tiny_checkpoints):
    model = tiny_checkpoints["llama"]
    config = EngineConfig(model=str(model), device="cpu", max_model_len=48, max_num_seqs=8)
    engine = make_engine(model, max_model_len=48, max_num_seqs=8)
    expected = run_to_completion(engine, GOOD_PROMPTS, [SamplingParams(max_tokens=MAX_TOKENS)] * len(GOOD_PROMPTS))
    return config, engine, [o.token_ids for o in expected]


def _rows_of(data: bytes) -> list[bytes]:
    """The non-blank lines: the rows the reader sees."""
    return [line for line in data.split(b"\n") if line.strip()]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(bad=st.lists(bad_line, max_size=12), where=st.lists(st.integers(0, 12), min_size=3, max_size=3))
def test_random_lines_never_crash_and_good_rows_are_answered(engine_and_expected, bad, where):
    config, engine, expected = engine_and_expected
    lines = list(bad)
    good_lines = []
    for k, (prompt, pos) in enumerate(zip(GOOD_PROMPTS, where)):
        line = json.dumps({"id": f"good-{k}", "prompt_token_ids": prompt}).encode()
        good_lines.append(line)
        lines.insert(min(pos, len(lines)) if k else 0, line)  # the first good row leads: the file is a prompts file
    data = b"\n".join(lines) + b"\n"
    rows = _rows_of(data)
    with tempfile.TemporaryDirectory() as tmp:
        source, out = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        source.write_bytes(data)
        options = JobOptions(input=source, output=out, engine=config, defaults=SamplingParams(max_tokens=MAX_TOKENS),
                             token_ids=True, display="none", lookahead=4,
                             allow_duplicate_ids=True)  # random lines may share an id: that refusal is tested elsewhere
        code = run_job(options, make_engine=lambda _: engine)
        assert code in (EXIT_OK, EXIT_ROW_ERRORS)
        got = read_jsonl(out)
        assert len(got) == len(rows)
        for k, line in enumerate(good_lines):
            row = got[rows.index(line)]
            assert row["id"] == f"good-{k}" and row["error"] is None
            assert row["completion_token_ids"] == expected[k]
        for row in got:
            assert row["finish_reason"] in ("stop", "length", "error")
            assert (row["finish_reason"] == "error") == bool(row["error"])
        assert (code == EXIT_ROW_ERRORS) == any(r["error"] for r in got)
        assert not engine.has_unfinished()
