"""`--out FOLDER`: OUTPUT as parts of --part-rows input rows, each written whole the moment its rows are done, with a
manifest; a job stopped mid-run has valid parts for the finished ones and resumes; at the end `_SUCCESS`. The
parts, read in order, hold exactly the rows a single-file OUTPUT holds."""
from __future__ import annotations

import json
import os
import signal

import pyarrow.dataset as ds
import pyarrow.parquet as pq

from cbatch.run.exit_codes import EXIT_EXPIRED
from ops_jobs import cbatch_process, read_jsonl, run_inprocess, wait_until_stopped, write_jsonl

N_ROWS = 23


def job_flags(model) -> list[str]:
    # fcfs and equal lengths: rows finish in input order, four at a time, so parts complete while the job runs
    return ["--model", str(model), "--device", "cpu", "--max-tokens", "3", "--token-ids", "--max-num-seqs", "4",
            "--policy", "fcfs", "--display", "none", "--quiet"]


def rows() -> list[dict]:
    return [{"id": f"r{i}", "prompt_token_ids": [5 + i, 6, 7, 8], "note": i} for i in range(N_ROWS)]


def part_rows_of(folder) -> list[dict]:
    return ds.dataset(folder, format="parquet").to_table().to_pylist()  # the parts, in file (input) order


def test_parts_hold_the_single_file_rows(tiny_checkpoints, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", rows())
    flags = job_flags(tiny_checkpoints["llama"])
    assert run_inprocess("run", str(source), "--out", str(tmp_path / "one.parquet"), *flags)[0] == 0
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "res"), *flags, "--part-rows", "5")
    assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "res").iterdir())
    assert names == ["_SUCCESS", "_manifest.json"] + [f"part-{k:05d}.parquet" for k in range(5)]
    manifest = json.loads((tmp_path / "res" / "_manifest.json").read_text())
    assert manifest["complete"] and [p["rows"] for p in manifest["parts"].values()] == [5, 5, 5, 5, 3]
    assert part_rows_of(tmp_path / "res") == pq.read_table(tmp_path / "one.parquet").to_pylist()
    # the same command again: complete, nothing to do; JSONL parts are the JSONL file's lines
    loud = [f for f in flags if f != "--quiet"]
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "res"), *loud, "--part-rows", "5")
    assert code == 0 and "is already complete for this input and settings; nothing to do" in err
    assert run_inprocess("run", str(source), "--out", str(tmp_path / "one.jsonl"), *flags)[0] == 0
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "lines"), *flags, "--part-rows", "10",
                                 "--part-format", "jsonl")
    assert code == 0, err
    lines = [r for k in range(3) for r in read_jsonl(tmp_path / "lines" / f"part-{k:05d}.jsonl")]
    assert lines == read_jsonl(tmp_path / "one.jsonl")


def test_a_stopped_job_has_its_finished_parts_and_resumes(tiny_checkpoints, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", rows())
    flags = job_flags(tiny_checkpoints["llama"])
    assert run_inprocess("run", str(source), "--out", str(tmp_path / "one.parquet"), *flags)[0] == 0
    out = tmp_path / "res"
    proc = cbatch_process("run", str(source), "--out", str(out), *flags, "--part-rows", "5", stop_after_rows=14)
    wait_until_stopped(proc)
    try:  # the job holds rows 0..13: parts 0 and 1 are there, whole; part 2 is not; the job is not complete
        manifest = json.loads((out / "_manifest.json").read_text())
        assert sorted(manifest["parts"]) == ["0", "1"] and not manifest["complete"]
        assert not (out / "_SUCCESS").exists() and not (out / "part-00002.parquet").exists()
        assert [r["id"] for r in part_rows_of(out)] == [f"r{i}" for i in range(10)]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.send_signal(signal.SIGCONT)
        proc.wait()
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *flags, "--part-rows", "5")
    assert code == 0, err
    assert (out / "_SUCCESS").exists() and part_rows_of(out) == pq.read_table(tmp_path / "one.parquet").to_pylist()
    assert not [p for p in os.listdir(out) if p.startswith(".")]  # no temp file left


def test_a_deadline_writes_every_part_and_a_rerun_completes_them(tiny_checkpoints, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", rows())
    flags = job_flags(tiny_checkpoints["llama"])
    out = tmp_path / "res"
    code, _, err = run_inprocess("run", str(source), "--out", str(out), *flags, "--part-rows", "5",
                                 "--max-wall-time", "0.001")
    assert code == EXIT_EXPIRED, err
    manifest = json.loads((out / "_manifest.json").read_text())
    assert len(manifest["parts"]) == 5 and not manifest["complete"] and not (out / "_SUCCESS").exists()
    assert {r["finish_reason"] for r in part_rows_of(out)} == {"expired"}
    assert run_inprocess("run", str(source), "--out", str(out), *flags, "--part-rows", "5")[0] == 0
    assert (out / "_SUCCESS").exists() and {r["finish_reason"] for r in part_rows_of(out)} == {"length"}
    assert all(p["expired"] == 0 for p in json.loads((out / "_manifest.json").read_text())["parts"].values())


def test_folder_mistakes_are_one_line(tiny_checkpoints, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", rows())
    flags = job_flags(tiny_checkpoints["llama"])
    (tmp_path / "plain").write_text("a file")
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "plain"), *flags)
    assert code == 2 and "plain: is a file; give a folder" in err
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "res"), *flags, "--retry-errors")
    assert code == 2 and "--retry-errors: not available for a folder --out yet" in err
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "res"), *flags, "--part-format", "csv")
    assert code == 2 and "--part-format: parquet or jsonl, not 'csv'" in err
