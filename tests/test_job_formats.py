"""A job's formats (INPUT's and OUTPUT's file formats, --output-format, --keep-columns and the kept columns'
types) are derived once, in preflight, and carried in the PreparedJob to every reader and writer."""
from __future__ import annotations

import collections
import sys

import pyarrow as pa
import pyarrow.parquet as pq

from cbatch.config import EngineConfig, SamplingParams
from cbatch.io import reader, writer
from cbatch.io.columns import KeepColumns
from cbatch.run.preflight import JobOptions, preflight
from ops_jobs import run_inprocess


def count_derivations(monkeypatch) -> collections.Counter:
    """Counts calls of input_format, output_format and KeepColumns.parse, wherever cbatch calls them from."""
    calls: collections.Counter = collections.Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for fn in (reader.input_format, writer.output_format):
        wrapped = counted(fn.__name__, fn)
        for module in list(sys.modules.values()):
            if getattr(module, "__name__", "").startswith("cbatch") and getattr(module, fn.__name__, None) is fn:
                monkeypatch.setattr(module, fn.__name__, wrapped)
    monkeypatch.setattr(KeepColumns, "parse", classmethod(counted("keep_columns", KeepColumns.parse.__func__)))
    return calls


def test_preflight_derives_the_formats(tiny_checkpoints, tmp_path):
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt_token_ids": [[5, 6]], "doc": pa.array([7], pa.int16())}), src)
    options = JobOptions(input=src, output=tmp_path / "out.jsonl", defaults=SamplingParams(max_tokens=2),
                         engine=EngineConfig(model=str(tiny_checkpoints["llama"]), device="cpu"),
                         output_format="openai", keep_columns="doc")
    formats = preflight(options).formats
    assert (formats.input.path, formats.input.format, formats.output, formats.openai_lines) == (src, "parquet", "jsonl", True)
    assert formats.keep.names == ("doc",) and "custom_id" in formats.keep.reserved  # OpenAI lines' own keys
    assert formats.kept_types == {"doc": pa.int16()}  # from INPUT's schema, for a Parquet OUTPUT


def test_a_run_and_a_retry_derive_the_formats_once(tiny_checkpoints, tmp_path, monkeypatch):
    calls = count_derivations(monkeypatch)
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"prompt_token_ids": [[5, 6], [999], [7]], "doc": pa.array([1, 2, 3], pa.int16())}), src)
    flags = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--max-tokens", "2", "--quiet"]
    code, _, err = run_inprocess("run", str(src), "--out", str(tmp_path / "kept.parquet"), *flags, "--keep-columns", "doc")
    assert code == 1, err  # token 999 is outside the tiny vocabulary: one error row
    assert calls == {"input_format": 1, "output_format": 1, "keep_columns": 1}
    got = pq.read_table(tmp_path / "kept.parquet")
    assert got.schema.field("doc").type == pa.int16() and got.column("doc").to_pylist() == [1, 2, 3]
    out = tmp_path / "out.parquet"
    assert run_inprocess("run", str(src), "--out", str(out), *flags)[0] == 1
    calls.clear()
    code, _, err = run_inprocess("run", str(src), "--out", str(out), *flags, "--retry-errors")
    assert code == 1, err  # OUTPUT read back as Parquet (its ok rows kept) and written again; the row still fails
    assert calls == {"input_format": 1, "output_format": 1, "keep_columns": 1}
    assert [e is None for e in pq.read_table(out).column("error").to_pylist()] == [True, False, True]
