"""INPUT as an fsspec URL: `memory://` and `file://` folders and globs, and `s3://` served by moto's S3 server on
the loopback. A URL job writes the very OUTPUT the same rows in a local file give (rows numbered across the files
in path order), its fingerprint covers the remote bytes, and a missing backend package is one line naming it."""
from __future__ import annotations

import gzip
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ops_jobs import read_jsonl, run_inprocess, token_rows, write_jsonl

fsspec = pytest.importorskip("fsspec")


def flags(model) -> list[str]:
    return ["--model", str(model), "--device", "cpu", "--max-tokens", "4", "--token-ids", "--seed", "3", "--quiet"]


def jsonl_bytes(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def parquet_bytes(rows) -> bytes:
    buf = io.BytesIO()
    names = dict.fromkeys(k for r in rows for k in r)
    pq.write_table(pa.table({k: [r.get(k) for r in rows] for k in names}), buf)  # a missing field: null, read as absent
    return buf.getvalue()


@pytest.fixture
def rows():
    return [r for r in token_rows(24, vocab=384, seed=5) if isinstance(r, dict)]


def test_memory_and_file_urls_give_the_local_output(tiny_checkpoints, tmp_path, rows):
    model = tiny_checkpoints["llama"]
    whole = write_jsonl(tmp_path / "whole.jsonl", rows)
    assert run_inprocess("run", str(whole), "--out", str(tmp_path / "local.jsonl"), *flags(model))[0] == 0
    local = read_jsonl(tmp_path / "local.jsonl")
    assert sum(r["finish_reason"] == "length" for r in local) == len(rows)

    mem = fsspec.filesystem("memory")
    mem.pipe("/cbatch-test/in/part-1.jsonl", jsonl_bytes(rows[:10]))
    mem.pipe("/cbatch-test/in/part-2.jsonl.gz", gzip.compress(jsonl_bytes(rows[10:])))
    mem.pipe("/cbatch-test/in/_SUCCESS", b"")  # a marker, not an input
    try:
        code, _, err = run_inprocess("run", "memory://cbatch-test/in", "--out", str(tmp_path / "mem.jsonl"), *flags(model))
        assert code == 0, err
        assert (tmp_path / "mem.jsonl").read_bytes() == (tmp_path / "local.jsonl").read_bytes()
        # a changed remote file is a different input: the resume refuses
        mem.pipe("/cbatch-test/in/part-1.jsonl", jsonl_bytes(rows[:9]))
        code, _, err = run_inprocess("run", "memory://cbatch-test/in", "--out", str(tmp_path / "mem.jsonl"), *flags(model))
        assert code == 2 and "from a different input file" in err
    finally:
        mem.rm("/cbatch-test", recursive=True)

    for day, part in ((1, rows[:7]), (2, rows[7:])):
        (tmp_path / f"day={day}").mkdir()
        (tmp_path / f"day={day}" / "part-0.parquet").write_bytes(parquet_bytes(part))
    url = f"file://{tmp_path}/day=*/part-*.parquet"
    code, _, err = run_inprocess("run", url, "--out", str(tmp_path / "file.jsonl"), *flags(model))
    assert code == 0, err
    assert (tmp_path / "file.jsonl").read_bytes() == (tmp_path / "local.jsonl").read_bytes()
    code, out, err = run_inprocess("plan", url, "--model", str(model), "--device", "cpu", "--no-search")
    assert code == 0, err


def test_url_mistakes_are_one_line(tiny_checkpoints, tmp_path):
    model = tiny_checkpoints["llama"]
    cases = {
        "memory://cbatch-none/x.jsonl": "no such input file",
        "memory://cbatch-none/day=*/x.jsonl": "the pattern matches no file",
        "nosuchproto://bucket/x.jsonl": "nosuchproto",
    }
    for url, words in cases.items():
        code, _, err = run_inprocess("run", url, "--out", str(tmp_path / "o.jsonl"), *flags(model))
        assert code == 2 and words in err and "Traceback" not in err, (url, err)
        assert len(err.strip().splitlines()) == 1, err


def test_s3_url_through_an_s3_server_on_the_loopback(tiny_checkpoints, tmp_path, rows, monkeypatch):
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}.items():
            monkeypatch.setenv(name, value)  # how a user points s3fs at MinIO, moto or another S3-compatible store
        s3 = boto3.client("s3", endpoint_url=endpoint)
        s3.create_bucket(Bucket="nightly")
        s3.put_object(Bucket="nightly", Key="day=1/part-0.parquet", Body=parquet_bytes(rows[:12]))
        s3.put_object(Bucket="nightly", Key="day=2/part-0.parquet", Body=parquet_bytes(rows[12:]))
        model = tiny_checkpoints["llama"]
        whole = write_jsonl(tmp_path / "whole.jsonl", rows)
        assert run_inprocess("run", str(whole), "--out", str(tmp_path / "local.jsonl"), *flags(model))[0] == 0
        code, _, err = run_inprocess("run", "s3://nightly/day=*/part-0.parquet", "--out", str(tmp_path / "s3.jsonl"),
                                     *flags(model))
        assert code == 0, err
        assert (tmp_path / "s3.jsonl").read_bytes() == (tmp_path / "local.jsonl").read_bytes()
        code, _, err = run_inprocess("run", "s3://nightly/nothing.jsonl", "--out", str(tmp_path / "x.jsonl"), *flags(model))
        assert code == 2 and "s3://nightly/nothing.jsonl: no such input file" in err, err
    finally:
        server.stop()
