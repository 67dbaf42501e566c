"""`CbatchPredictor`: a callable class for `ray.data.Dataset.map_batches`, for people already in Ray.

    ds = ray.data.read_parquet("s3://bucket/prompts/")
    out = ds.map_batches(
        CbatchPredictor, fn_constructor_kwargs={"model": "/models/llama", "sampling": {"max_tokens": 128}},
        concurrency=4, num_gpus=1, batch_size=512, batch_format="pyarrow",
    )

Each actor owns one engine (a `Replica`); a batch's rows go through it like rows of a `cbatch run`
(same validation, chat template, error rows) and come back with the output columns added:
`completion`, `finish_reason`, `prompt_tokens`, `completion_tokens`, `error` (and
`completion_token_ids` with token_ids=True). The input columns are kept, `id` included.
Sampled rows are reproducible only with their own `seed` (here a row has no stable job index). A row
gives one output row, so `n` > 1 is refused (an error row); use `cbatch run` for several samples.
"""
from __future__ import annotations

import itertools
import math
from typing import Any

from cbatch.config import EngineConfig, SamplingParams
from cbatch.io.writer import output_columns, output_schema
from cbatch.run.job_spec import JobSpec
from cbatch.scaleout.replica import Replica
from cbatch.tasks.generate_task import GenerateTask


def plain(value: Any) -> Any:
    """Numpy arrays and scalars (Ray's numpy batches) -> Python lists and numbers, recursively."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        value = value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def batch_rows(batch: Any) -> list[dict[str, Any]]:
    """A Ray batch (pyarrow Table, pandas DataFrame or dict of columns) -> row dicts, missing fields left out."""
    import pyarrow as pa

    if not isinstance(batch, (pa.Table, dict)):  # pandas
        batch = pa.Table.from_pandas(batch, preserve_index=False)
    if isinstance(batch, pa.Table):
        rows = batch.to_pylist()
    else:
        columns = {name: plain(values) for name, values in batch.items()}
        n = len(next(iter(columns.values()), []))
        rows = [{name: values[i] for name, values in columns.items()} for i in range(n)]
    return [{k: v for k, v in row.items() if v is not None and not (isinstance(v, float) and math.isnan(v))} for row in rows]


SINGLE_SAMPLE = "n must be 1 in CbatchPredictor (one output row per input row); use `cbatch run` for n samples"


def _one_sample(row: dict[str, Any]) -> bool:
    body = row.get("body") if isinstance(row.get("body"), dict) else {}
    return all(r.get("n") in (None, 1) for r in (row, body))


class CbatchPredictor:
    def __init__(self, model: str | None = None, sampling: SamplingParams | dict[str, Any] | None = None,
                 token_ids: bool = False, **engine_settings: Any) -> None:
        """`sampling`: the defaults a row's own fields override; `engine_settings`: EngineConfig fields."""
        defaults = sampling if isinstance(sampling, SamplingParams) else SamplingParams(**(sampling or {}))
        error = defaults.validate() or (None if defaults.n == 1 else SINGLE_SAMPLE)
        if error is not None:
            raise ValueError(f"sampling: {error}")
        self.replica = Replica(JobSpec(EngineConfig(model=model, **engine_settings), GenerateTask(defaults)))
        self.replica.start()
        self.schema = output_schema(output_columns(token_ids))
        self._indices = itertools.count()  # seq ids, unique inside this actor's engine

    def __call__(self, batch: Any) -> Any:
        import pyarrow as pa

        rows = batch_rows(batch)
        indexed = [(next(self._indices), row if _one_sample(row) else SINGLE_SAMPLE) for row in rows]
        records = [result.record() for result in self.replica.run_block(indexed).results]
        added = [f for f in self.schema if f.name != "id"]
        columns = {f.name: pa.array([r.get(f.name) for r in records], type=f.type) for f in added}
        if isinstance(batch, pa.Table):
            table = batch.drop_columns([name for name in columns if name in batch.column_names])
            for name, values in columns.items():
                table = table.append_column(name, values)
            return table
        if isinstance(batch, dict):
            return {**batch, **{name: values.to_numpy(zero_copy_only=False) for name, values in columns.items()}}
        out = batch.copy()  # pandas
        for name, values in columns.items():
            out[name] = values.to_pandas()
        return out
