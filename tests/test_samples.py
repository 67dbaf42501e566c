"""n samples per row: the prompt computed once and its KV shared (fork with a copy of the partial last
block), each sample seeded from (seed, sample index); one output row per sample; resume of a row with
some samples done; the report's computed prompt tokens."""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import replace

import pytest

from cbatch.config import SamplingParams
from cbatch.engine.engine import run_to_completion
from cbatch.engine.sampler import sample_seed
from helpers import make_engine, random_prompts
from ops_jobs import read_jsonl, run_inprocess, write_jsonl

SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True, n=4,
                         presence_penalty=0.3, logprobs=2)


def test_each_sample_equals_its_own_independent_run(tiny_checkpoints):
    """A forked sample (shared prompt blocks, copied partial block) gives the tokens an unshared run with the
    sample's seed gives: the fork is exact. Prompt lengths on and off a block boundary."""
    path = tiny_checkpoints["qwen2"]
    prompts = [random_prompts(1, vocab=384, seed=n, min_len=n, max_len=n)[0] for n in (21, 32)]  # block_size 16
    engine = make_engine(path)
    outs = run_to_completion(engine, prompts, [SAMPLED] * 2)
    assert [(o.row_index, o.sample_index) for o in outs] == [(r, i) for r in range(2) for i in range(4)]
    assert engine.scheduler.stats.computed_prompt_tokens == 21 + 32  # each prompt computed once
    assert engine.scheduler.stats.forked_samples == 6
    for r, prompt in enumerate(prompts):
        samples = [o.token_ids for o in outs[4 * r : 4 * r + 4]]
        assert len(set(map(tuple, samples))) == 4  # four different samples
        for i, tokens in enumerate(samples):
            alone = replace(SAMPLED, n=1, seed=sample_seed(SAMPLED.seed, 0, 0, i))
            assert run_to_completion(make_engine(path, enable_prefix_cache=False), [prompt], [alone])[0].token_ids == tokens


def test_samples_reproducible_across_batch_shapes_and_preemption(tiny_checkpoints):
    """The same samples with room for all (one prefill per row), with fewer slots than samples (surplus
    children wait and recompute), and with a KV pool so small that sequences are preempted."""
    path = tiny_checkpoints["llama"]
    prompts = random_prompts(5, vocab=384, seed=51, min_len=10, max_len=40)
    params = [replace(SAMPLED, seed=None, max_tokens=10 + r) for r in range(5)]  # seeds from the job seed
    roomy = make_engine(path, max_num_seqs=32)
    want = [o.token_ids for o in run_to_completion(roomy, prompts, params)]
    assert roomy.scheduler.stats.computed_prompt_tokens == sum(map(len, prompts))
    for settings in (dict(max_num_seqs=2, max_num_batched_tokens=16), dict(max_num_seqs=8, num_kv_blocks=10)):
        engine = make_engine(path, **settings)
        assert [o.token_ids for o in run_to_completion(engine, prompts, params)] == want, settings
    assert engine.scheduler.stats.preemptions > 0


def test_greedy_samples_and_an_early_stop(tiny_checkpoints):
    """Greedy samples are identical (as in vLLM); samples that stop at their first token leave at once."""
    path = tiny_checkpoints["llama"]
    prompt = random_prompts(1, vocab=384, seed=52, min_len=9, max_len=9)[0]
    engine = make_engine(path)
    outs = run_to_completion(engine, [prompt], [SamplingParams(max_tokens=6, n=3)])
    assert len({tuple(o.token_ids) for o in outs}) == 1 and len(outs) == 3
    first = outs[0].token_ids[0]
    stopped = run_to_completion(engine, [prompt], [SamplingParams(max_tokens=6, n=3, stop_token_ids=[first])])
    assert [o.token_ids for o in stopped] == [[first]] * 3 and {o.finish_reason for o in stopped} == {"stop"}
    assert not engine.has_unfinished() and engine.pool.num_used == 0


def _rows(n_rows: int) -> list[dict]:
    rows = []
    for i, prompt in enumerate(random_prompts(n_rows, vocab=384, seed=53, min_len=5, max_len=30)):
        row = {"id": f"r{i}", "prompt_token_ids": prompt, "max_tokens": 14}
        if i % 2:
            row.update(n=4, temperature=1.0, seed=100 + i, stop_token_ids=list(range(40, 70)))  # samples end apart
        rows.append(row)
    return rows


def test_job_writes_a_row_per_sample_reproducibly(tiny_checkpoints, tmp_path):
    rows = _rows(6)
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    flags = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--seed", "3"]
    outputs = []
    for seqs in (16, 3):
        out, report = tmp_path / f"out{seqs}.jsonl", tmp_path / f"r{seqs}.json"
        code, stdout, err = run_inprocess("run", str(source), "--out", str(out), "--report", str(report),
                                          "--max-num-seqs", str(seqs), "--token-ids", *flags)
        assert code == 0, err
        outputs.append(out.read_bytes())
    got = read_jsonl(out)
    assert [(r["id"], r["sample_index"]) for r in got] == [
        (f"r{i}", s) for i in range(6) for s in (range(4) if i % 2 else [0])]
    assert outputs[0] == outputs[1]  # reproducible across --max-num-seqs
    assert len({tuple(r["completion_token_ids"]) for r in got if r["id"] == "r1"}) == 4
    data = json.loads((tmp_path / "r16.json").read_text())
    assert data["requests"] == {"total": 6, "ok": 15, "error": 0, "resumed": 0, "cached": 0, "output_rows": 15}
    prompt_lens = [len(r["prompt_token_ids"]) for r in rows]
    assert data["utilization"]["computed_prompt_tokens"] == sum(prompt_lens)  # each prompt once
    assert data["tokens"]["prompt"] == sum(n * (4 if i % 2 else 1) for i, n in enumerate(prompt_lens))
    assert "15/15 samples of 6 rows ok" in stdout
    # a job without n > 1 keeps the old columns
    plain = write_jsonl(tmp_path / "plain.jsonl", [rows[0], rows[2]])
    code, _, err = run_inprocess("run", str(plain), "--out", str(tmp_path / "plain_out.jsonl"), *flags)
    assert code == 0, err
    assert list(read_jsonl(tmp_path / "plain_out.jsonl")[0]) == ["id", "completion", "finish_reason", "prompt_tokens",
                                                                 "completion_tokens", "error"]


def test_resume_runs_only_the_missing_samples(tiny_checkpoints, tmp_path, monkeypatch):
    rows = _rows(10)
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    flags = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--max-num-seqs", "8"]
    reference = tmp_path / "reference.jsonl"
    assert run_inprocess("run", str(source), "--out", str(reference), *flags)[0] == 0

    from cbatch.io.state import JobState

    real_append = JobState.append

    def append_then_stop(state, record, *args, **kwargs):  # a Ctrl-C once a row has some of its samples stored
        real_append(state, record, *args, **kwargs)
        if state.finished().partial:
            raise KeyboardInterrupt

    out = tmp_path / "out.jsonl"
    monkeypatch.setattr(JobState, "append", append_then_stop)
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *flags)
    assert code == 130, err
    monkeypatch.undo()
    saved = [json.loads(line) for part in (tmp_path / ".out.jsonl.cbatch").glob("part-*.jsonl")
             for line in part.read_text().splitlines()]
    per_row = Counter(r["index"] for r in saved)
    partial = {i: c for i, c in per_row.items() if c < rows[i].get("n", 1)}
    assert partial, per_row  # some row has some of its samples on disk
    report = tmp_path / "resume.json"
    code, _, err = run_inprocess("run", str(source), "--out", str(out), "--report", str(report), *flags)
    assert code == 0, err
    assert "more have some of their samples" in err
    assert out.read_bytes() == reference.read_bytes()
    missing = {i: row.get("n", 1) - per_row.get(i, 0) for i, row in enumerate(rows)}
    forks = sum(m - 1 for m in missing.values() if m > 0)
    assert json.loads(report.read_text())["utilization"]["forked_samples"] == forks  # only the missing ran


def test_bad_n_is_an_error_row(tiny_checkpoints, tmp_path):
    rows = [{"id": "a", "prompt_token_ids": [5, 6], "n": 0}, {"id": "b", "prompt_token_ids": [5, 6], "n": 2}]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    code, _, err = run_inprocess("run", str(source), "--out", str(out), "--model", str(tiny_checkpoints["llama"]),
                                 "--device", "cpu", "--max-tokens", "3")
    assert code == 1, err
    got = read_jsonl(out)
    assert got[0]["error"] == "n must be an integer from 1 to 4096, got 0" and got[0]["sample_index"] == 0
    assert [(r["id"], r["sample_index"], r["error"]) for r in got[1:]] == [("b", 0, None), ("b", 1, None)]


@pytest.mark.parametrize("flag,value,message", [
    ("--n", "0", "--n: n must be an integer from 1 to 4096, got 0"),
    ("--logit-bias", "{bad", "--logit-bias: not valid JSON"),
    ("--logit-bias", '{"x": 1}', "--logit-bias: logit_bias must map token ids"),
    ("--chat-template-kwargs", "[1]", "--chat-template-kwargs: chat_template_kwargs must be an object"),
    ("--min-p", "2", "--min-p: min_p must be in [0, 1]"),
    ("--logprobs", "21", "--logprobs: logprobs must be an integer from 0 to 20"),
])
def test_bad_flags_name_the_flag(tiny_checkpoints, tmp_path, flag, value, message):
    source = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": [5]}])
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "o.jsonl"), "--model",
                                 str(tiny_checkpoints["llama"]), flag, value)
    assert code == 2 and message in err and err.count("\n") == 1, err
