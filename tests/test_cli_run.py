"""`cbatch run` end to end through the real CLI entry point, on a tiny model with a real tokenizer."""
from __future__ import annotations

import json

import pytest

from ops_jobs import SAMPLE, cbatch, read_jsonl, read_output, run_inprocess


def sample_ids() -> list[str]:
    return [row["id"] for row in read_jsonl(SAMPLE / "prompts.jsonl")]


@pytest.mark.parametrize("src,dst", [("prompts.parquet", "out.parquet"), ("prompts.jsonl", "out.jsonl")])
def test_run_writes_every_row_in_order(tiny_chat_model, tmp_path, src, dst):
    out, report = tmp_path / dst, tmp_path / "report.json"
    proc = cbatch("run", str(SAMPLE / src), "--out", str(out), "--model", str(tiny_chat_model),
                  "--max-tokens", "12", "--report", str(report), "--token-ids", "--max-num-seqs", "4")
    assert proc.returncode == 0, proc.stderr
    rows = read_output(out)
    assert [r["id"] for r in rows] == sample_ids()
    for r in rows:
        assert r["finish_reason"] in ("stop", "length") and r["error"] is None
        assert r["completion_tokens"] == len(r["completion_token_ids"]) >= 1
        assert r["prompt_tokens"] > 0 and isinstance(r["completion"], str)
    data = json.loads(report.read_text())
    assert data["requests"] == {"total": 12, "ok": 12, "error": 0, "resumed": 0, "cached": 0, "output_rows": 12}
    assert data["tokens"]["output"] == sum(r["completion_tokens"] for r in rows)
    assert 0 < data["utilization"]["mean_batch_occupancy"] <= 1
    assert "cbatch: 12/12 rows ok" in proc.stdout
    assert not list(tmp_path.glob(".*.cbatch")) and not list(tmp_path.glob(".*tmp*"))  # nothing left behind


def test_same_outputs_as_the_library(tiny_chat_model, tmp_path):
    """The CLI's greedy tokens equal the engine's on the same rows (chat template applied once). Through the
    real entry point in this process: the runs above prove the installed command, a third process adds nothing."""
    from cbatch.config import EngineConfig, SamplingParams
    from cbatch.engine.build import build_engine
    from cbatch.engine.engine import run_to_completion
    from cbatch.tokenizer import encode_messages, encode_text, load_tokenizer

    out = tmp_path / "o.jsonl"
    code, _, stderr = run_inprocess("run", str(SAMPLE / "prompts.jsonl"), "--out", str(out), "--model",
                                    str(tiny_chat_model), "--max-tokens", "6", "--token-ids", "--temperature", "0")
    assert code == 0, stderr
    tok = load_tokenizer(tiny_chat_model)
    rows = read_jsonl(SAMPLE / "prompts.jsonl")
    greedy_rows = [r for r in rows if not r.get("temperature") and not r.get("stop")]
    prompts = [encode_messages(tok, r["messages"]) if "messages" in r else encode_text(tok, r["prompt"]) for r in greedy_rows]
    engine = build_engine(EngineConfig(model=str(tiny_chat_model), device="cpu"))
    expected = run_to_completion(engine, prompts, [SamplingParams(max_tokens=6)] * len(prompts))
    # rows carry their own max_tokens (>= 6); greedy output is a prefix-stable sequence
    got = {r["id"]: r["completion_token_ids"][:6] for r in read_output(out)}
    assert [got[r["id"]] for r in greedy_rows] == [o.token_ids for o in expected]
