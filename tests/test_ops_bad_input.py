"""Bad rows become error rows naming the problem while every other row completes; bad jobs are refused
with one line naming the file or flag, exit 2, and nothing written."""
from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ops_jobs import cbatch, listing, read_jsonl, run_inprocess, write_jsonl

GOOD = [
    {"id": "good-prompt", "prompt": "The capital of France is"},
    {"id": "good-chat", "messages": [{"role": "user", "content": "Say hi."}]},
    {"id": "good-openai", "custom_id": "x", "body": {"messages": [{"role": "user", "content": "Count to three."}], "max_tokens": 4}},
    {"id": "good-sampled", "prompt": "Once upon a time", "temperature": 0.7, "seed": 3},
    {"id": "good-ids", "prompt_token_ids": [1, 504, 3458, 282]},
]

# (input line, the text the row's error must contain)
BAD = [
    (b'{"id": "x", "prompt": "unterminated', "invalid JSON"),
    (b'\xff\xfe{"prompt": "latin-1 \xe9"}', "undecodable bytes (not UTF-8)"),
    (b'["a", "list"]', "expected a JSON object, got list"),
    (b'{"id": "b-missing"}', "missing prompt"),
    (b'{"id": "b-empty", "prompt": "   "}', "`prompt` is empty"),
    (b'{"id": "b-type", "prompt": 42}', "`prompt` must be a string, got int"),
    (b'{"id": "b-both", "prompt": "a", "messages": [{"role": "user", "content": "b"}]}', "give only one of"),
    (b'{"id": "b-msgs", "messages": "hello"}', "`messages` must be a non-empty list"),
    (b'{"id": "b-msg-role", "messages": [{"content": "hi"}]}', "`messages[0]` must be an object with a string `role`"),
    (b'{"id": "b-msg-content", "messages": [{"role": "user", "content": 7}]}', "`messages[0].content` must be a string"),
    (b'{"id": "b-negmax", "prompt": "hi", "max_tokens": -5}', "max_tokens must be a positive integer, got -5"),
    (b'{"id": "b-maxtype", "prompt": "hi", "max_tokens": "ten"}', "max_tokens must be a positive integer, got 'ten'"),
    (b'{"id": "b-temp", "prompt": "hi", "temperature": 250}', "temperature must be in [0, 100], got 250.0"),
    (b'{"id": "b-negtemp", "prompt": "hi", "temperature": -0.1}', "temperature must be in [0, 100], got -0.1"),
    (b'{"id": "b-topp", "prompt": "hi", "top_p": 0}', "top_p must be in (0, 1]"),
    (b'{"id": "b-seed", "prompt": "hi", "seed": "abc"}', "seed must be a 64-bit integer, got 'abc'"),
    (b'{"id": "b-bigseed", "prompt": "hi", "temperature": 1, "seed": 18446744073709551616}', "seed must be a 64-bit integer"),
    (b'{"id": "b-topk", "prompt": "hi", "temperature": 1, "top_k": 100000000000000000000000}', "top_k must be a non-negative integer"),
    (b'{"id": "b-stop", "prompt": "hi", "stop": 5}', "stop must be a string or a list"),
    (b'{"id": "b-vocab", "prompt_token_ids": [1, 49152, 5]}', "token id 49152, outside the model's vocabulary (ids 0..49151)"),
    (b'{"id": "b-surrogate", "prompt": "a\\udfffb"}', "`prompt` is not valid Unicode text (an unpaired surrogate at character 1)"),
    (b'{"id": "b-ids", "prompt_token_ids": [1, -2]}', "`prompt_token_ids` must be a non-empty list of non-negative integers"),
]


def _long_prompt_row() -> bytes:
    return json.dumps({"id": "b-long", "prompt": "word " * 300}).encode()


def test_bad_rows_are_error_rows_and_good_rows_complete(tiny_chat_model, tmp_path):
    lines = [b"\xef\xbb\xbf" + json.dumps(GOOD[0]).encode()]  # files saved on Windows often start with a BOM
    for i, (line, _) in enumerate(BAD):
        lines += [line, json.dumps(GOOD[1 + i % (len(GOOD) - 1)]).encode()]
    lines.append(_long_prompt_row())
    source, out, report = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", tmp_path / "r.json"
    args = ["run", str(source), "--out", str(out), "--model", str(tiny_chat_model), "--device", "cpu", "--max-tokens", "5",
            "--max-model-len", "128", "--report", str(report), "--token-ids",
            "--allow-duplicate-ids"]  # the good rows repeat (ids included)
    code, stdout, err = run_inprocess(*args)
    assert code == 1, err  # finished, with error rows
    assert "Traceback" not in err
    rows = read_jsonl(out)
    assert len(rows) == len(lines)
    expected_errors = [text for _, text in BAD] + ["the model's context is 128"]
    bad = [r for r in rows if r["finish_reason"] == "error"]
    assert len(bad) == len(expected_errors)
    for row, text in zip(bad, expected_errors):
        assert text in row["error"], (row, text)
        assert row["completion"] is None and row["completion_tokens"] == 0
    long_row = bad[-1]
    assert long_row["id"] == "b-long" and long_row["error"].startswith("the prompt has ") and long_row["prompt_tokens"] > 128
    good = [r for r in rows if r["finish_reason"] != "error"]
    assert len(good) == len(lines) - len(expected_errors)
    for row in good:
        assert row["error"] is None and isinstance(row["completion"], str)
        assert 1 <= row["completion_tokens"] == len(row["completion_token_ids"]) <= 5
    assert rows[0]["id"] == "good-prompt" and rows[7]["id"] == "b-missing"  # ids kept, input order
    assert rows[1]["id"] == "1" and rows[3]["id"] == "3"  # a line that is not an object has no id: its row index
    data = json.loads(report.read_text())
    assert data["requests"]["error"] == len(expected_errors)
    assert data["requests"]["ok"] == len(good)
    assert f"{len(good)}/{len(rows)} rows ok, {len(expected_errors)} errors" in stdout

    # --allow-errors: the same finished job exits 0
    out2 = tmp_path / "out2.jsonl"
    code, _, err = run_inprocess(*args[:3], str(out2), *args[4:], "--allow-errors")
    assert code == 0, err
    assert read_jsonl(out2) == rows


def test_request_too_big_for_the_kv_pool_is_an_error_row(tiny_checkpoints, tmp_path):
    """With 4 blocks of 16 tokens a row needing more can never run: an error row, not a crash or a hang."""
    rows = [{"id": f"ok{i}", "prompt_token_ids": [5 + i] * 10, "max_tokens": 6} for i in range(6)]
    rows.insert(3, {"id": "huge", "prompt_token_ids": [7] * 20, "max_tokens": 200})
    source, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    code, _, err = run_inprocess("run", str(source), "--out", str(out), "--model", str(tiny_checkpoints["llama"]),
                                 "--num-kv-blocks", "4", "--block-size", "16", "--ignore-eos")
    assert code == 1, err
    got = {r["id"]: r for r in read_jsonl(out)}
    assert got["huge"]["finish_reason"] == "error"
    assert got["huge"]["error"] == ("prompt (20 tokens) + max_tokens (200) needs 14 KV blocks but the pool has 4; "
                                    "lower max_tokens or raise --num-kv-blocks")
    assert all(got[f"ok{i}"]["finish_reason"] == "length" and got[f"ok{i}"]["completion_tokens"] == 6 for i in range(6))


def test_exceptions_while_preparing_a_row_become_error_rows(tiny_checkpoints, tiny_chat_model, tmp_path, monkeypatch):
    """A tokenizer or chat template raising, or an engine check refusing a row, fails that row only."""
    import cbatch.tasks.generate_task

    real = cbatch.tasks.generate_task.encode_messages

    def fussy_template(tokenizer, messages, *template_kwargs, **options):
        if messages[0]["role"] == "narrator":
            raise TypeError("unknown role 'narrator'")
        return real(tokenizer, messages, *template_kwargs, **options)

    monkeypatch.setattr(cbatch.tasks.generate_task, "encode_messages", fussy_template)
    rows = [{"id": "a", "messages": [{"role": "narrator", "content": "x"}]}, GOOD[1],
            {"id": "t", "prompt": "text on a model without a tokenizer"}]
    source, out = write_jsonl(tmp_path / "in.jsonl", rows[:2]), tmp_path / "out.jsonl"
    code, _, err = run_inprocess("run", str(source), "--out", str(out), "--model", str(tiny_chat_model), "--max-tokens", "3")
    assert code == 1, err
    got = read_jsonl(out)
    assert got[0]["error"] == "could not tokenize the prompt (TypeError: unknown role 'narrator')"
    assert got[1]["error"] is None and got[1]["completion_tokens"] >= 1

    # a model without a tokenizer: text rows and stop strings are row errors, token rows run
    rows = [{"id": "s", "prompt_token_ids": [5, 6], "stop": ["x"]}, rows[2], {"id": "k", "prompt_token_ids": [5, 6]}]
    source, out = write_jsonl(tmp_path / "in2.jsonl", rows), tmp_path / "out2.jsonl"
    code, _, err = run_inprocess("run", str(source), "--out", str(out), "--model", str(tiny_checkpoints["llama"]), "--max-tokens", "3")
    assert code == 1, err
    got = read_jsonl(out)
    assert got[0]["error"] == "stop strings need a tokenizer; this model has none"
    assert got[1]["error"] == "this model has no tokenizer; give `prompt_token_ids` instead of text"
    assert got[2]["error"] is None and got[2]["completion_tokens"] >= 1


# ---- bad jobs -----------------------------------------------------------------------------------------

def _bad_job_cases(tmp_path, model):
    """(name, args, expected stderr text): each must exit 2 with one line and write nothing."""
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD[0]])
    out = str(tmp_path / "out.jsonl")
    (tmp_path / "folder.jsonl").mkdir()
    write_jsonl(tmp_path / "noprompt.jsonl", [{"text": "no prompt field"}, {"question": "?"}])
    (tmp_path / "empty.jsonl").write_bytes(b"\n\n")
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "noprompt.parquet")
    (tmp_path / "damaged.parquet").write_bytes(os.urandom(300))
    (tmp_path / "in.txt").write_text('{"prompt": "x"}\n')
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    no_config = tmp_path / "no_config"
    no_config.mkdir()
    m = ["--model", str(model)]
    unwritable = "/sys/out.jsonl" if os.geteuid() == 0 else None
    if unwritable is None:
        locked = tmp_path / "ro"
        locked.mkdir(mode=0o500)
        unwritable = str(locked / "out.jsonl")
    return [
        ("missing input", ["run", str(tmp_path / "nope.jsonl"), "--out", out, *m], "nope.jsonl: no such input file"),
        ("input is a folder without inputs", ["run", str(tmp_path / "folder.jsonl"), "--out", out, *m],
         "folder.jsonl: the folder has no .jsonl or .parquet file"),
        ("unknown extension", ["run", str(tmp_path / "in.txt"), "--out", out, *m], "unknown input extension '.txt'; use .jsonl"),
        ("no prompt field", ["run", str(tmp_path / "noprompt.jsonl"), "--out", out, *m], "no row has a `prompt`, `messages`"),
        ("no prompt column", ["run", str(tmp_path / "noprompt.parquet"), "--out", out, *m], "no `prompt` or `messages` column (columns: text)"),
        ("damaged parquet", ["run", str(tmp_path / "damaged.parquet"), "--out", out, *m], "not a readable Parquet file"),
        ("unsupported model", ["run", str(good), "--out", out, "--model", str(gpt2)], "GPT2LMHeadModel"),
        ("not a checkpoint", ["run", str(good), "--out", out, "--model", str(no_config)], "has no config.json"),
        ("missing model", ["run", str(good), "--out", out, "--model", str(tmp_path / "nomodel")], "no such folder"),
        ("output folder missing", ["run", str(good), "--out", str(tmp_path / "sub" / "o.jsonl"), *m], "does not exist; create it first"),
        ("output unwritable", ["run", str(good), "--out", unwritable, *m], "cannot write in the folder"),
        ("output extension", ["run", str(good), "--out", str(tmp_path / "o.csv"), *m], "unknown output extension '.csv'"),
        ("output is input", ["run", str(good), "--out", str(good), *m], "is the input file; choose another --out"),
        ("report folder missing", ["run", str(good), "--out", out, *m, "--report", str(tmp_path / "x" / "r.json")], "--report"),
        ("max-num-seqs", ["run", str(good), "--out", out, *m, "--max-num-seqs", "0"], "--max-num-seqs: must be at least 1"),
        ("block-size", ["run", str(good), "--out", out, *m, "--block-size", "12"], "--block-size: must be a power of two"),
        ("temperature", ["run", str(good), "--out", out, *m, "--temperature", "-1"], "--temperature: temperature must be in [0, 100]"),
        ("top-p", ["run", str(good), "--out", out, *m, "--top-p", "1.5"], "--top-p: top_p must be in (0, 1]"),
        ("max-tokens", ["run", str(good), "--out", out, *m, "--max-tokens", "0"], "--max-tokens: max_tokens must be a positive integer"),
        ("seed", ["run", str(good), "--out", out, *m, "--seed", str(2**40)], "--seed: must be a 32-bit integer"),
        ("lookahead", ["run", str(good), "--out", out, *m, "--lookahead", "0"], "--lookahead: must be at least 1"),
        ("progress-interval", ["run", str(good), "--out", out, *m, "--progress-interval", "0"], "--progress-interval: must be a positive"),
        ("policy", ["run", str(good), "--out", out, *m, "--policy", "random"], "--policy: must be one of longest-first, fcfs, static"),
        ("not a number", ["run", str(good), "--out", out, *m, "--max-num-seqs", "abc"], "Invalid value for '--max-num-seqs'"),
        ("unknown flag", ["run", str(good), "--out", out, *m, "--temprature", "1"], "No such option: --temprature"),
        ("missing --out", ["run", str(good), *m], "Missing option '--out'"),
    ]


def test_bad_jobs_exit_2_with_one_line_and_write_nothing(tiny_checkpoints, tmp_path):
    cases = _bad_job_cases(tmp_path, tiny_checkpoints["llama"])
    before = listing(tmp_path)
    for name, args, text in cases:
        code, stdout, err = run_inprocess(*args)
        assert code == 2, (name, err)
        assert err.startswith("cbatch: error: ") and err.count("\n") == 1, (name, err)  # one line, no traceback
        assert text in err, (name, err)
        assert stdout == "", name
        assert listing(tmp_path) == before, name  # no state folder, lock, report or output


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file: an unreadable input cannot be made")
def test_unreadable_input(tiny_checkpoints, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", [GOOD[0]])
    source.chmod(0)
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "o.jsonl"), "--model", str(tiny_checkpoints["llama"]))
    assert code == 2 and "cannot read the input" in err, err


def test_usage_errors_through_the_real_entry_point(tmp_path):
    """What a shell sees from the installed entry point for a typo'd number: one line, exit 2."""
    proc = cbatch("run", "x.jsonl", "--out", "o.jsonl", "--max-num-seqs", "abc", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("cbatch: error: Invalid value for '--max-num-seqs'")
    assert proc.stderr.endswith("(see `python -m cbatch.cli run --help`)\n") and proc.stderr.count("\n") == 1
    assert listing(tmp_path) == set()
