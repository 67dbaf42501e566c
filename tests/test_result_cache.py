"""The result cache across jobs (`--result-cache`): copied rows are what generation gives, only new rows
are generated, an entry is used only under the same key (a test per key part), LRU eviction, torn
entries, and two concurrent jobs on one cache."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

from cbatch.model.backend import cpu_kernels
from cbatch.config import (BOOL, INT, NUMBER, OBJECT, SAMPLING_FIELDS, STRINGS, TOKEN_BIASES, TOKEN_IDS, Constraint,
                           EngineConfig, SamplingParams)
from cbatch.run.result_cache import (
    SCHEDULING_ONLY, CacheLimit, ResultCache, ResultCacheError, RowCache, device_kind, generation_identity,
)
from ops_jobs import ROOT, read_jsonl, run_inprocess, token_rows, write_jsonl

N_ROWS = 40


@pytest.fixture(scope="module")
def job(tiny_checkpoints, tmp_path_factory):
    """40 token-id rows (greedy, seeded and unseeded sampled), their output without a cache, and a cache
    filled by a first run over them."""
    root = tmp_path_factory.mktemp("result-cache")
    rows = token_rows(N_ROWS, vocab=384, seed=3)
    source = write_jsonl(root / "in.jsonl", rows)
    flags = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--token-ids", "--seed", "5",
             "--max-num-seqs", "16"]
    job = {"root": root, "rows": rows, "input": source, "flags": flags, "cache": root / "cache"}
    job["reference"] = (run_job(job, source, root / "reference.jsonl")[1]).read_bytes()
    report, out = run_job(job, source, root / "first.jsonl", cache=job["cache"])
    job["first_report"], job["first"] = report, out.read_bytes()
    return job


def run_job(job, source: Path, out: Path, *extra: str, cache: Path | None = None) -> tuple[dict, Path]:
    report = out.with_name(out.stem + "-report.json")
    args = ["run", str(source), "--out", str(out), *job["flags"], *extra, "--report", str(report)]
    if cache is not None:
        args += ["--result-cache", str(cache)]
    code, _, err = run_inprocess(*args)
    assert code == 0, err
    return json.loads(report.read_text()), out


def entries(cache: Path) -> list[Path]:
    return sorted((cache / "v1" / "entries").glob("*/*.json"))


def test_first_run_stores_every_row_and_changes_nothing(job):
    assert job["first"] == job["reference"]  # the cache never changes what a run writes
    assert job["first_report"]["requests"]["cached"] == 0
    assert len(entries(job["cache"])) == N_ROWS
    assert not list((job["cache"] / "v1" / "entries").glob("*/.tmp-*"))


def test_second_run_generates_nothing_and_writes_the_same_bytes(job, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(job["cache"], cache)
    report, out = run_job(job, job["input"], tmp_path / "again.jsonl", cache=cache)
    assert report["requests"]["cached"] == N_ROWS and report["requests"]["ok"] == N_ROWS
    assert report["utilization"]["steps"] == 0 and report["tokens"]["output"] == 0  # nothing reached the engine
    assert out.read_bytes() == job["first"]


def test_only_the_new_rows_are_generated(job, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(job["cache"], cache)
    new = [dict(r, id=f"new{i}") for i, r in enumerate(token_rows(4, vocab=384, seed=99))]  # 10% new rows
    source = write_jsonl(tmp_path / "in.jsonl", job["rows"] + new)
    report, out = run_job(job, source, tmp_path / "out.jsonl", cache=cache)
    _, reference = run_job(job, source, tmp_path / "reference.jsonl")
    assert out.read_bytes() == reference.read_bytes()
    rows = read_jsonl(out)
    assert report["requests"]["cached"] == N_ROWS and report["requests"]["ok"] == N_ROWS + 4
    assert report["tokens"]["output"] == sum(r["completion_tokens"] for r in rows[N_ROWS:])  # exactly the new ones
    assert len(entries(cache)) == N_ROWS + 4


def _greedy(row) -> bool:
    return not row.get("temperature")


def _seeded(row) -> bool:
    return "seed" in row


# (flags of the second job, which of the first job's entries it may use)
KEY_PARTS = {
    "model": (None, lambda row: False),  # another checkpoint: filled in by the test
    "dtype": (["--dtype", "bfloat16"], lambda row: False),
    "max_model_len": (["--max-model-len", "64"], lambda row: False),
    "top_p": (["--top-p", "0.5"], lambda row: False),
    "top_k": (["--top-k", "7"], lambda row: False),
    "ignore_eos": (["--ignore-eos"], lambda row: False),
    "temperature": (["--temperature", "0.5"], lambda row: not _greedy(row)),  # rows with their own keep it
    "job seed": (["--seed", "6"], lambda row: _greedy(row) or _seeded(row)),  # unseeded sampled rows draw from it
    "priority": (["--priority", "3"], lambda row: True),  # scheduling only: never in the key
}


@pytest.mark.parametrize("part", list(KEY_PARTS))
def test_an_entry_is_used_only_under_the_same_key(job, tmp_path, part):
    """Each key part: a job that differs in it uses none of the first job's entries (but those its change
    does not concern), and its OUTPUT is what it generates without a cache."""
    extra, usable = KEY_PARTS[part]
    if part == "model":
        from tiny_models import make_checkpoint

        extra = ["--model", str(make_checkpoint("llama", tmp_path / "other-model", seed=1))]
    cache = tmp_path / "cache"
    shutil.copytree(job["cache"], cache)
    report, out = run_job(job, job["input"], tmp_path / "out.jsonl", *extra, cache=cache)
    _, reference = run_job(job, job["input"], tmp_path / "reference.jsonl", *extra)
    assert report["requests"]["cached"] == sum(1 for row in job["rows"] if usable(row))
    assert out.read_bytes() == reference.read_bytes()


def _row_cache(job_seed: int = 5, **identity_changes) -> RowCache:
    identity = generation_identity("fingerprint", EngineConfig(device="cpu"), torch.float32, torch.device("cpu"), 512)
    return RowCache(None, {**identity, **identity_changes}, job_seed)


def test_key_covers_the_identity_and_every_sampling_field():
    """Every identity part and every SamplingParams field but the scheduling-only ones change the key
    (a field added to SamplingParams is covered without touching the cache)."""
    ids, params = [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=5, seed=11, stop=["x"])
    base = _row_cache().row_key(0, ids, params)
    identity = generation_identity("fingerprint", EngineConfig(device="cpu"), torch.float32, torch.device("cpu"), 512)
    for name, value in identity.items():
        assert _row_cache(**{name: f"other {value}"}).row_key(0, ids, params) != base, name
    assert _row_cache().row_key(0, [5, 6, 8], params) != base
    other_values = {"max_tokens": 9, "temperature": 0.8, "top_p": 0.8, "top_k": 6, "seed": 12, "stop": ["y"],
                    "ignore_eos": True, "priority": 1, "n": 2, "repetition_penalty": 1.1, "presence_penalty": 0.5,
                    "frequency_penalty": 0.5, "min_p": 0.1, "min_tokens": 2, "stop_token_ids": [7],
                    "logit_bias": {3: 1.0}, "logprobs": 2, "prompt_logprobs": 1,
                    "chat_template_kwargs": {"enable_thinking": False}, "constraint": Constraint("regex", "[ab]+"),
                    "lora": "adapter-a"}
    # a field not listed above (added since) gets a value by its kind (cbatch/config.py's SAMPLING_FIELDS)
    of_kind = {INT: 3, NUMBER: 0.25, BOOL: True, STRINGS: ["y"], TOKEN_IDS: [7], TOKEN_BIASES: {3: 1.0}, OBJECT: {"k": 1}}
    for f in fields(SamplingParams):
        other = other_values[f.name] if f.name in other_values else of_kind[SAMPLING_FIELDS[f.name].kind]
        assert other != getattr(params, f.name), f.name
        changed = _row_cache().row_key(0, ids, replace(params, **{f.name: other}))
        assert (changed == base) == (f.name in SCHEDULING_ONLY), f.name


def test_seed_part_of_the_key():
    cache, ids = _row_cache(), [5, 6, 7]
    greedy, unseeded, seeded = SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=0.7, seed=3)
    assert cache.row_key(0, ids, greedy) == cache.row_key(9, ids, replace(greedy, seed=4))  # greedy: no seed
    assert cache.row_key(0, ids, unseeded) != cache.row_key(9, ids, unseeded)  # drawn from (job seed, row)
    assert cache.row_key(0, ids, seeded) == cache.row_key(9, ids, seeded)  # its own seed, wherever the row is
    # an unseeded row and a seeded one with the seed it would draw: the same tokens, the same key
    assert cache.row_key(9, ids, unseeded) == cache.row_key(0, ids, replace(unseeded, seed=(5 << 32) ^ 9))
    other_job = _row_cache(job_seed=6)
    assert other_job.row_key(9, ids, unseeded) != cache.row_key(9, ids, unseeded)
    assert other_job.row_key(9, ids, greedy) == cache.row_key(9, ids, greedy)


def test_device_kind_names_what_the_numerics_depend_on():
    assert device_kind(torch.device("cpu")) == f"cpu:{torch.backends.cpu.get_cpu_capability()}"
    identity = generation_identity("m", EngineConfig(device="cpu"), torch.bfloat16, torch.device("cpu"), 64)
    assert identity["device"] == device_kind(torch.device("cpu")) and identity["dtype"] == "torch.bfloat16"
    # the CPU path numerics: the compiled decode kernel where it builds, else plain torch
    assert identity["attention_backend"] == ("cpu" if cpu_kernels.available() is None else "torch")
    assert identity["torch"] == torch.__version__


RECORD = {"index": 3, "id": "r3", "completion": None, "finish_reason": "length", "prompt_tokens": 2,
          "completion_tokens": 2, "error": None, "completion_token_ids": [7, 8]}


def _set_age(cache: ResultCache, key: str, seconds_ago: float) -> None:
    path = cache.entries / key[:2] / f"{key}.json"
    t = int((1.7e9 - seconds_ago) * 1e9)
    os.utime(path, ns=(t, t))


def test_least_recently_used_entries_are_evicted(tmp_path):
    cache = ResultCache(tmp_path, CacheLimit(entries=5))
    keys = [f"{i:02d}" + "ab" * 31 for i in range(6)]
    for age, key in zip((50, 40, 30, 20, 10), keys):
        cache.put(key, RECORD)
        _set_age(cache, key, age)  # oldest first
    assert cache.get(keys[0]) == {k: v for k, v in RECORD.items() if k not in ("index", "id")}  # now the newest
    cache.put(keys[5], RECORD)  # 6 > 5 entries: evicts down to 90% of the bound (4)
    left = {k for k in keys if (cache.entries / k[:2] / f"{k}.json").exists()}
    assert left == {keys[0], keys[3], keys[4], keys[5]}


def test_byte_bound_and_stale_temp_files(tmp_path):
    cache = ResultCache(tmp_path, CacheLimit(bytes=1000))
    size = len(json.dumps({"key": "k" * 64, "record": RECORD}))
    stale = cache.entries / "zz" / ".tmp-999-dead"
    stale.parent.mkdir(parents=True)
    stale.write_text("{")
    os.utime(stale, (0, 0))
    for i in range(2 * 1000 // size + 2):
        cache.put(f"{i:04d}" + "c" * 60, RECORD)
    total = sum(p.stat().st_size for p in cache.entries.glob("*/*.json"))
    assert 0 < total <= 1000
    assert not stale.exists()  # a killed writer's temp file goes with the first scan


def test_a_torn_or_foreign_entry_is_a_miss_and_removed(tmp_path):
    cache = ResultCache(tmp_path, CacheLimit(entries=100))
    key = "ab" * 32
    cache.put(key, RECORD)
    path = cache.entries / key[:2] / f"{key}.json"
    path.write_bytes(path.read_bytes()[:20])  # torn
    assert cache.get(key) is None and not path.exists()
    cache.put(key, RECORD)
    path.write_text(json.dumps({"key": "cd" * 32, "record": RECORD}))  # another key's content
    assert cache.get(key) is None and not path.exists()


def test_sizes_and_bad_folders(tmp_path):
    assert CacheLimit.parse("10GB") == CacheLimit(bytes=10**10)
    assert CacheLimit.parse("512MiB") == CacheLimit(bytes=512 * 2**20)
    assert CacheLimit.parse("1000") == CacheLimit(bytes=1000)
    assert CacheLimit.parse("50000 entries") == CacheLimit(entries=50000)
    for bad in ("", "ten", "5 parsecs", "0", "-3GB"):
        with pytest.raises(ResultCacheError, match="--result-cache-size"):
            CacheLimit.parse(bad)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ResultCacheError, match="--result-cache"):
        ResultCache(blocker / "cache", CacheLimit(entries=1))


def test_bad_cache_flags_are_one_line(job, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    for extra, expected in ((["--result-cache", str(blocker / "c")], "--result-cache"),
                            (["--result-cache", str(tmp_path / "c"), "--result-cache-size", "lots"], "--result-cache-size")):
        code, _, err = run_inprocess("run", str(job["input"]), "--out", str(tmp_path / "o.jsonl"), *job["flags"], *extra)
        assert code == 2 and expected in err and err.count("\n") == 1, err
        assert not (tmp_path / "o.jsonl").exists()


def test_two_concurrent_jobs_share_one_cache(job, tmp_path):
    """Real processes, met halfway (each waits, after its first stored row, for the other's): both store
    and evict (a bound below the job's rows) in one cache at once; both OUTPUTs are what generation gives."""
    cache, barrier = tmp_path / "cache", tmp_path / "barrier"
    barrier.mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    procs = []
    for name, other in (("a", "b"), ("b", "a")):
        args = ["run", str(job["input"]), "--out", str(tmp_path / f"{name}.jsonl"), *job["flags"],
                "--result-cache", str(cache), "--result-cache-size", "25entries"]
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "cache_worker.py"), str(barrier), name, other,
                                       *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err
    assert (barrier / "a").exists() and (barrier / "b").exists()
    assert (tmp_path / "a.jsonl").read_bytes() == job["reference"]
    assert (tmp_path / "b.jsonl").read_bytes() == job["reference"]
    assert 0 < len(entries(cache)) <= N_ROWS and not list((cache / "v1" / "entries").glob("*/.tmp-*"))
    for path in entries(cache):  # every entry whole
        assert json.loads(path.read_text())["key"] == path.stem
