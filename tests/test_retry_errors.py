"""`cbatch run --retry-errors`: only the error rows of a complete OUTPUT run again (under the new settings),
the other rows stay byte-identical; an interrupted retry resumes; what a retry refuses."""
from __future__ import annotations

import json
import os
import random
import signal

import pyarrow.parquet as pq
import pytest

from ops_jobs import listing, read_jsonl, run_inprocess, token_rows, write_jsonl

CONTEXT = 32  # the first run's --max-model-len: the long rows do not fit it


@pytest.fixture(scope="module")
def job(tiny_checkpoints, tmp_path_factory):
    """30 token-id rows, every fifth with a prompt longer than CONTEXT, and one line that is not JSON; the
    output of a run with a context that fits every row (what retried rows must equal)."""
    root = tmp_path_factory.mktemp("retry")
    rng = random.Random(4)
    rows: list = token_rows(30, vocab=384, seed=21)
    for i in range(0, 30, 5):
        rows[i]["prompt_token_ids"] = [rng.randrange(3, 384) for _ in range(rng.randint(CONTEXT + 1, 60))]
    rows.insert(17, '{"id": "broken')
    source = write_jsonl(root / "in.jsonl", rows)
    flags = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--token-ids", "--seed", "3",
             "--max-num-seqs", "8"]
    fixed = root / "fixed.jsonl"
    code, _, err = run_inprocess("run", str(source), "--out", str(fixed), *flags, "--max-model-len", "128")
    assert code == 1, err  # the broken line stays an error row
    return {"rows": rows, "input": source, "flags": flags, "fixed": read_jsonl(fixed)}


def first_run(job, out, *extra: str) -> bytes:
    code, _, err = run_inprocess("run", str(job["input"]), "--out", str(out), *job["flags"],
                                 "--max-model-len", str(CONTEXT), *extra)
    assert code == 1, err
    return out.read_bytes()


def retry(job, out, *extra: str) -> tuple[int, str]:
    code, _, err = run_inprocess("run", str(job["input"]), "--out", str(out), *job["flags"], "--max-model-len", "128",
                                 "--retry-errors", *extra)
    return code, err


def assert_ok_rows_kept(before: bytes, after: bytes) -> None:
    """Every row that was not an error row in `before` is the same line, byte for byte, in `after`."""
    old, new = before.split(b"\n"), after.split(b"\n")
    assert len(old) == len(new)
    kept = [i for i, line in enumerate(old) if line and json.loads(line)["error"] is None]
    assert kept and all(new[i] == old[i] for i in kept)


def test_retry_after_fixing_max_model_len(job, tmp_path):
    out, report = tmp_path / "out.jsonl", tmp_path / "report.json"
    before = first_run(job, out).split(b"\n")
    first = [json.loads(line) for line in before if line]
    too_long = [i for i, r in enumerate(first) if r["error"] and "context is 32" in r["error"]]
    assert len(too_long) == 6
    code, err = retry(job, out, "--report", str(report))
    assert code == 1, err  # the broken line is still an error row
    assert "--retry-errors: running 7 rows again; the other 24 rows of OUTPUT are kept" in err
    after = out.read_bytes().split(b"\n")
    rows = [json.loads(line) for line in after if line]
    for i, row in enumerate(first):
        if row["error"] is None:
            assert after[i] == before[i]  # kept, byte for byte
        else:
            assert rows[i] == job["fixed"][i]  # run again under the new settings
    assert all(rows[i]["error"] is None and rows[i]["completion_token_ids"] for i in too_long)
    assert rows[17]["error"] == first[17]["error"] and "invalid JSON" in rows[17]["error"]
    data = json.loads(report.read_text())
    assert data["requests"]["resumed"] == 24 and data["requests"]["ok"] == 30 and data["requests"]["error"] == 1
    record = json.loads((tmp_path / ".out.jsonl.cbatch.json").read_text())
    assert record["errors"] == 1 and record["retry_of"]["input"] == record["fingerprint"]["input"]
    assert record["retry_of"]["settings"] != record["fingerprint"]["settings"]
    assert {p.name for p in tmp_path.iterdir()} == {"out.jsonl", ".out.jsonl.cbatch.json", "report.json"}

    # again: only the row that still fails runs; everything else stays as it is
    again = out.read_bytes()
    code, err = retry(job, out)
    assert code == 1 and "running 1 rows again" in err, err
    assert out.read_bytes() == again


def test_retry_keeps_parquet_rows(job, tmp_path):
    out = tmp_path / "out.parquet"
    first_run(job, out)
    before = pq.read_table(out).to_pylist()
    code, err = retry(job, out, "--allow-errors")
    assert code == 0, err
    after = pq.read_table(out).to_pylist()
    for i, row in enumerate(before):
        assert after[i] == (row if row["error"] is None else {k: job["fixed"][i][k] for k in row})


def test_no_error_rows_to_retry_touches_nothing(job, tmp_path, monkeypatch):
    source = write_jsonl(tmp_path / "in.jsonl", [r for r in job["rows"][:10] if isinstance(r, dict) and
                                                 len(r["prompt_token_ids"]) <= CONTEXT - 8])
    out = tmp_path / "out.jsonl"
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"])
    assert code == 0, err
    files = listing(tmp_path)
    content = out.read_bytes()
    import cbatch.run.job as job_module

    monkeypatch.setattr(job_module, "build_engine", lambda *a, **k: pytest.fail("the model was loaded"))
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"], "--retry-errors", "--top-k", "3")
    assert code == 0 and "has no error rows to retry; nothing to do" in err, err
    assert listing(tmp_path) == files and out.read_bytes() == content


def test_what_a_retry_refuses(job, tmp_path):
    out = tmp_path / "out.jsonl"
    code, err = retry(job, out)
    assert code == 2 and "--retry-errors" in err and "run without --retry-errors first" in err, err
    content = first_run(job, out)
    files = listing(tmp_path)
    other = write_jsonl(tmp_path / "other.jsonl", job["rows"][:-1])
    cases = [
        (["--overwrite"], "give one of the two"),
        ([], "the columns id, completion, finish_reason, prompt_tokens, completion_tokens, error, completion_token_ids"),
    ]
    for extra, expected in cases:
        flags = job["flags"] if extra else [f for f in job["flags"] if f != "--token-ids"]
        code, _, err = run_inprocess("run", str(job["input"]), "--out", str(out), *flags, "--retry-errors", *extra)
        assert code == 2 and expected in err and err.count("\n") == 1, err
    code, _, err = run_inprocess("run", str(other), "--out", str(out), *job["flags"], "--retry-errors")
    assert code == 2 and "written from a different input file" in err, err
    assert listing(tmp_path) == files | {"other.jsonl"} and out.read_bytes() == content
    out.write_bytes(content + b"\n")
    code, err = retry(job, out)
    assert code == 2 and "has been changed since cbatch wrote it" in err, err


def test_interrupted_retry_resumes_and_keeps_rows(job, tmp_path, monkeypatch):
    import cbatch.run.job as job_module

    out = tmp_path / "out.jsonl"
    before = first_run(job, out).split(b"\n")

    class SigtermAtFirstStep:
        def update(self) -> None:
            os.kill(os.getpid(), signal.SIGTERM)

        def close(self) -> None:
            pass

    monkeypatch.setattr(job_module, "make_display", lambda metrics, options: SigtermAtFirstStep())
    code, err = retry(job, out)
    assert code == 143, err
    monkeypatch.undo()
    assert out.read_bytes().split(b"\n") == before  # OUTPUT is replaced only when the retry is done
    manifest = json.loads((tmp_path / ".out.jsonl.cbatch" / "manifest.json").read_text())
    assert "retry_of" in manifest
    code, err = retry(job, out)
    assert code == 1 and "--retry-errors: running" in err, err
    assert_ok_rows_kept(b"\n".join(before), out.read_bytes())
    assert read_jsonl(out)[0] == job["fixed"][0]  # a retried row


def test_a_crash_while_keeping_rows_leaves_no_half_state(job, tmp_path, monkeypatch):
    """The kept rows are written aside and renamed into place whole: a crash halfway leaves no state that a
    rerun would complete by generating kept rows again."""
    import cbatch.io.state as state_module

    out = tmp_path / "out.jsonl"
    before = first_run(job, out)
    real = state_module.read_output

    def crash_halfway(path, fmt):
        for i, row in enumerate(real(path, fmt)):
            if i == 10:
                raise RuntimeError("injected crash while keeping rows")
            yield row

    monkeypatch.setattr(state_module, "read_output", crash_halfway)
    code, err = retry(job, out)
    assert code == 70 and "injected crash" in err, err
    monkeypatch.undo()
    assert not (tmp_path / ".out.jsonl.cbatch").exists() and out.read_bytes() == before
    code, err = retry(job, out)
    assert code == 1 and "the other 24 rows of OUTPUT are kept" in err, err
    assert not (tmp_path / ".out.jsonl.cbatch.seeding").exists()
    assert_ok_rows_kept(before, out.read_bytes())


def test_retry_with_samples_keeps_whole_rows(job, tmp_path):
    """Rows with n = 3 samples are three OUTPUT lines each: a retry keeps every line of an ok row, byte for
    byte, and runs the error rows (one line each before) again into three lines."""
    rows = [dict(r, n=3, temperature=0.8) for r in job["rows"][:10] if isinstance(r, dict)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"], "--max-model-len", str(CONTEXT))
    assert code == 1, err
    before = read_jsonl(out)
    errors = [r["id"] for r in before if r["error"]]
    assert len(errors) == 2 and len(before) == 3 * 8 + 2
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *job["flags"], "--max-model-len", "128",
                                 "--retry-errors")
    assert code == 0 and "running 2 rows again; the other 8 rows" in err, err
    after = read_jsonl(out)
    assert len(after) == 30 and [r["id"] for r in after] == [r["id"] for r in rows for _ in range(3)]
    assert [r["sample_index"] for r in after] == [0, 1, 2] * 10
    kept = [r for r in before if not r["error"]]
    assert [r for r in after if r["id"] not in errors] == kept
    assert all(r["error"] is None and r["completion_token_ids"] for r in after)


def test_a_retry_keeps_the_kept_columns(tiny_checkpoints, tmp_path):
    """--keep-columns survives a retry: the kept rows keep their values, the retried rows get theirs; a retry with
    other kept columns is refused in one line (before, any OUTPUT with kept columns was refused)."""
    rows = [{"id": f"r{i}", "note": f"n{i}", "prompt_token_ids": list(range(5, 5 + (40 if i % 3 == 0 else 4)))}
            for i in range(9)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    flags = [str(source), "--out", str(out), "--model", str(tiny_checkpoints["llama"]), "--device", "cpu",
             "--max-tokens", "3", "--keep-columns", "note"]
    code, _, err = run_inprocess("run", *flags, "--max-model-len", "32")
    assert code == 1, err  # the 40-token rows do not fit
    assert sum(r["finish_reason"] == "error" for r in read_jsonl(out)) == 3
    code, _, err = run_inprocess("run", *flags[:-2], "--max-model-len", "64", "--retry-errors")
    assert code == 2 and "has the kept columns note; give the same --keep-columns" in err
    code, _, err = run_inprocess("run", *flags, "--max-model-len", "64", "--retry-errors")
    assert code == 0, err
    got = read_jsonl(out)
    assert [r["note"] for r in got] == [f"n{i}" for i in range(9)] and all(r["error"] is None for r in got)
