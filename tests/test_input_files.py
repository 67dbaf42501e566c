"""INPUT beyond one file: a folder of JSONL/Parquet files, a glob pattern (`day=*/part-*.parquet`), gzip-compressed
JSONL. Rows are numbered across the files in path order, so a job over the parts writes the very OUTPUT the same
rows in one file give; messages name the file; the fingerprint covers every file."""
from __future__ import annotations

import gzip
import importlib.util

import pyarrow as pa
import pyarrow.parquet as pq

from ops_jobs import read_jsonl, run_inprocess, token_rows, write_jsonl


def flags(model) -> list[str]:
    return ["--model", str(model), "--device", "cpu", "--max-tokens", "4", "--token-ids", "--seed", "3", "--quiet"]


def test_a_folder_with_gzip_parts_gives_the_one_file_output(tiny_checkpoints, tmp_path):
    rows = token_rows(30, vocab=384, seed=2, bad_every=11)
    rows[12] = '{"id": "broken'  # an invalid line, in the gzip part (its line 3)
    whole = write_jsonl(tmp_path / "whole.jsonl", rows)
    folder = tmp_path / "parts"
    folder.mkdir()
    write_jsonl(folder / "part-1.jsonl", rows[:10])
    with gzip.open(folder / "part-2.jsonl.gz", "wb") as f:  # compressed: read as it is
        f.write(write_jsonl(tmp_path / "tmp.jsonl", rows[10:22]).read_bytes())
    write_jsonl(folder / "part-3.jsonl", rows[22:])
    (folder / "_SUCCESS").write_text("")  # a marker file Spark writes: not an input
    model = tiny_checkpoints["llama"]
    code, _, err = run_inprocess("run", str(whole), "--out", str(tmp_path / "a.jsonl"), *flags(model))
    assert code == 1, err  # the bad rows
    code, _, err = run_inprocess("run", str(folder), "--out", str(tmp_path / "b.jsonl"), *flags(model))
    assert code == 1, err
    one, parts = read_jsonl(tmp_path / "a.jsonl"), read_jsonl(tmp_path / "b.jsonl")
    assert one[12]["error"].startswith("line 13: invalid JSON")
    assert parts[12]["error"] == "part-2.jsonl.gz: " + one[12]["error"].replace("line 13", "line 3")  # names its file
    assert parts[:12] + parts[13:] == one[:12] + one[13:]  # every other row as the one-file job wrote it
    assert sum(r["finish_reason"] == "error" for r in one) >= 3 and sum(r["finish_reason"] == "length" for r in one) > 20
    # another file in the folder: another input (the rows' numbering would change under a resume)
    write_jsonl(folder / "part-4.jsonl", [{"id": "extra", "prompt_token_ids": [5, 6]}])
    code, _, err = run_inprocess("run", str(folder), "--out", str(tmp_path / "b.jsonl"), *flags(model))
    assert code == 2 and "from a different input file" in err


def test_a_glob_of_parquet_partitions(tiny_checkpoints, tmp_path):
    ids = [[5 + i, 6, 7] for i in range(9)]
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(9)], "prompt_token_ids": ids}), tmp_path / "whole.parquet")
    for day, part in ((1, range(0, 4)), (2, range(4, 9))):
        (tmp_path / f"day={day}").mkdir()
        pq.write_table(pa.table({"id": [f"r{i}" for i in part], "prompt_token_ids": [ids[i] for i in part]}),
                       tmp_path / f"day={day}" / "part-0.parquet")
    model = tiny_checkpoints["llama"]
    assert run_inprocess("run", str(tmp_path / "whole.parquet"), "--out", str(tmp_path / "a.jsonl"), *flags(model))[0] == 0
    code, _, err = run_inprocess("run", str(tmp_path / "day=*" / "part-*.parquet"), "--out", str(tmp_path / "b.jsonl"),
                                 *flags(model))
    assert code == 0, err
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "a.jsonl").read_bytes()
    code, _, err = run_inprocess("plan", str(tmp_path / "day=*" / "part-*.parquet"), "--model", str(model),
                                 "--device", "cpu", "--no-search")
    assert code == 0 and "9 rows: 9 would run" in err + _


def test_a_folder_of_parquet_parts_and_a_gzip_jsonl_is_one_job(tiny_checkpoints, tmp_path):
    """Three Parquet files and a .jsonl.gz in one folder: one input, rows numbered across the files in path order,
    the OUTPUT the same rows in one file give."""
    rows = [r for r in token_rows(28, vocab=384, seed=4) if isinstance(r, dict)]
    whole = write_jsonl(tmp_path / "whole.jsonl", rows)
    folder = tmp_path / "mixed"
    folder.mkdir()
    for k, (start, stop) in enumerate(((0, 7), (7, 12), (12, 20))):
        part = rows[start:stop]
        names = dict.fromkeys(key for r in part for key in r)
        pq.write_table(pa.table({n: [r.get(n) for r in part] for n in names}), folder / f"part-{k}.parquet")
    with gzip.open(folder / "part-3.jsonl.gz", "wb") as f:
        f.write(write_jsonl(tmp_path / "tail.jsonl", rows[20:]).read_bytes())
    model = tiny_checkpoints["llama"]
    assert run_inprocess("run", str(whole), "--out", str(tmp_path / "a.jsonl"), *flags(model))[0] == 0
    code, _, err = run_inprocess("run", str(folder), "--out", str(tmp_path / "b.jsonl"), *flags(model))
    assert code == 0, err
    assert (tmp_path / "b.jsonl").read_bytes() == (tmp_path / "a.jsonl").read_bytes()
    assert len(read_jsonl(tmp_path / "b.jsonl")) == len(rows) > 20


def test_bad_inputs_are_one_line(tiny_checkpoints, tmp_path):
    model = tiny_checkpoints["llama"]
    write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "prompt_token_ids": [5]}, {"id": "y", "prompt_token_ids": [6]}])
    write_jsonl(tmp_path / "b.jsonl", [{"id": "z", "prompt_token_ids": [7]}, {"id": "x", "prompt_token_ids": [8]}])
    out = ["--out", str(tmp_path / "o.jsonl"), *flags(model)]
    code, _, err = run_inprocess("run", str(tmp_path / "*.jsonl"), *out)
    assert code == 2 and err.strip().endswith(
        "a.jsonl line 1 and b.jsonl line 2 have the same id 'x'; give every row its own `id`/`custom_id`, or pass "
        "--allow-duplicate-ids")
    code, _, err = run_inprocess("run", str(tmp_path / "nothing-*.jsonl"), *out)
    assert code == 2 and "nothing-*.jsonl: the pattern matches no file" in err
    (tmp_path / "d.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    code, _, err = run_inprocess("run", str(tmp_path / "d.jsonl.zst"), *out)
    if importlib.util.find_spec("zstandard") is None:
        assert code == 2 and "needs the zstandard package: pip install zstandard" in err
    else:
        assert code == 2 and "d.jsonl.zst: cannot read the input" in err
    (tmp_path / "e.jsonl.gz").write_bytes(b"not gzip at all")
    code, _, err = run_inprocess("run", str(tmp_path / "e.jsonl.gz"), *out)
    assert code == 2 and "e.jsonl.gz: cannot read the input" in err and "Traceback" not in err


def test_duplicate_ids_are_found_through_hashes_and_confirmed(tmp_path, monkeypatch):
    """The duplicate-id check keeps a hash a row; ids whose hashes agree are compared for real (forced here: every
    hash the same), so a collision is never reported as a duplicate and a duplicate is found with its places."""
    from cbatch.io import reader

    monkeypatch.setattr(reader, "hash", lambda value: 42, raising=False)
    unique = reader.open_input(write_jsonl(tmp_path / "u.jsonl", [{"id": f"r{i}", "prompt": "x"} for i in range(50)]))
    assert reader.find_duplicate_id(unique) is None
    rows = [{"id": f"r{i}", "prompt": "x"} for i in range(50)] + [{"custom_id": "r17", "body": {}}]
    twice = reader.open_input(write_jsonl(tmp_path / "d.jsonl", rows))
    assert reader.find_duplicate_id(twice) == ("r17", ("", "line", 18), ("", "line", 51))
