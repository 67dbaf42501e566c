"""The result cache across jobs (`--result-cache DIR`): a finished row's record, stored under a key of
everything that decides its tokens, and copied into any later job that asks for the same row.

Where it sits: after tokenization (the key needs the prompt's token ids), before the engine (a hit
never reaches the scheduler): `LocalExecutor.submit` asks `RowCache.lookup`, and `LocalExecutor`
hands every finished ok row to `RowCache.store`.

The key: sha256 over
    the generation identity   model fingerprint (checkpoint contents), dtype, device kind (CPU ISA or
                              GPU name), attention backend, context length, torch and cbatch versions
    every sampling setting    `dataclasses.asdict(SamplingParams)` minus scheduling-only fields
    the effective seed        none for greedy rows (they do not depend on it); for sampled rows their
                              own seed, else the one drawn from (job seed, row index)
    the prompt token ids
A hit is what generation would give because generation is batch-invariant (a row's tokens do not
depend on what else is in the batch: tests/test_batching_invariance.py) and deterministic for a fixed
key. What is not in the key is assumed not to change tokens: that holds on the CPU path; on GPUs,
kernels may pick other reduction orders for other batch shapes (docs/nightly.md).

Layout: DIR/v1/entries/ab/abcd....json, one JSON file per row ({"key", "record"}), written to a temp
file and renamed into place (atomic: a reader sees a whole entry or none; no fsync, so an entry torn
by a power loss is caught by its embedded key and JSON check, and dropped). Least recently used
eviction by file mtime (a hit touches its entry) under an flock, so concurrent jobs never evict at
once; a reader whose entry vanished under it sees a miss.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from cbatch.config import EngineConfig, SamplingParams, UserError
from cbatch.engine.resolve import ResolvedModel
from cbatch.engine.sampler import sample_seed
from cbatch.run.identity import output_identity
from cbatch.tasks.base import Task
from cbatch.tasks.generate_task import GenerateTask
from cbatch.tasks.results import Record, RowResult

SCHEDULING_ONLY = frozenset({"priority"})  # SamplingParams fields that never change a row's tokens
ROW_FIELDS = ("index", "id")  # record fields that belong to the row, not to its completion
_STALE_TEMP_SECONDS = 3600.0  # a temp file this old belongs to a killed writer
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt](?:ib|b)?|b|entries|entry|rows)?\s*$", re.IGNORECASE)


class ResultCacheError(UserError):
    """A bad --result-cache / --result-cache-size: the message names the flag and the fix."""


@dataclass(frozen=True, slots=True)
class CacheLimit:
    """The cache's bound: bytes on disk, or a number of entries."""

    bytes: int | None = None
    entries: int | None = None

    @classmethod
    def parse(cls, text: str) -> "CacheLimit":
        """`10GB`, `512MiB`, `1000000` (bytes) or `50000 entries`."""
        match = _SIZE.match(text)
        if match is None or float(match.group(1)) <= 0:
            raise ResultCacheError(f"--result-cache-size: expected a size such as 10GB, 512MiB or 50000entries, not {text!r}")
        number, unit = float(match.group(1)), (match.group(2) or "").lower()
        if unit in ("entries", "entry", "rows"):
            return cls(entries=int(number))
        power = "bkmgt".index(unit[0]) if unit else 0  # K, M, G, T: 1000s; KiB, MiB, ...: 1024s
        return cls(bytes=int(number * (1024 if unit.endswith("ib") else 1000) ** power))

    def exceeded(self, num_bytes: int, entries: int) -> bool:
        return (self.bytes is not None and num_bytes > self.bytes) or (self.entries is not None and entries > self.entries)

    def low_water(self) -> "CacheLimit":
        """90% of the bound: eviction goes below it, so it does not run again at the next row."""
        return CacheLimit(None if self.bytes is None else self.bytes * 9 // 10,
                          None if self.entries is None else self.entries * 9 // 10)


DEFAULT_CACHE_LIMIT = CacheLimit(bytes=10 * 10**9)


def device_kind(device: torch.device) -> str:
    """What the numerics depend on besides the model: the GPU's name, or the CPU's vector ISA."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{torch.backends.cpu.get_cpu_capability()}"


def generation_identity(model_fingerprint: str, config: EngineConfig, dtype: torch.dtype, device: torch.device,
                        max_model_len: int, task: Task | None = None) -> dict[str, Any]:
    """Everything besides the row that decides its output (the key's first part): the output identity
    (run/identity.py, which the resume fingerprint is made from too), the checkpoint's contents, and what a copy
    into another machine's job must match as well: the device's kind (its CPU ISA or GPU name, not only cpu/cuda)
    and the torch and cbatch versions."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        cbatch_version = version("cbatch")
    except PackageNotFoundError:
        cbatch_version = "unknown"
    return {
        **output_identity(config, task if task is not None else GenerateTask(), device, dtype, max_model_len,
                          job_seed=False),  # (each row's key holds the seed it samples with: RowCache.row_key)
        "model": model_fingerprint, "device": device_kind(device), "torch": torch.__version__, "cbatch": cbatch_version,
    }


class ResultCache:
    """One cache folder. `get`/`put` take a key from `row_key`; safe for concurrent jobs and processes."""

    def __init__(self, folder: Path, limit: CacheLimit, writable: bool = True) -> None:
        self.root = folder / "v1"
        self.entries = self.root / "entries"
        self.limit = limit
        self.writable = writable
        self._bytes = self._count = 0  # what the folder holds, as of the last scan plus our own puts
        self._scanned = False
        if not writable:
            return  # lookups only: a folder that does not exist yet is an empty cache
        try:
            self.entries.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ResultCacheError(f"--result-cache {folder}: cannot create the folder ({exc.strerror})") from None
        if not os.access(self.entries, os.W_OK):
            raise ResultCacheError(f"--result-cache {folder}: the folder is not writable; choose another")

    def _path(self, key: str) -> Path:
        return self.entries / key[:2] / f"{key}.json"

    def get(self, key: str) -> Record | None:
        """The stored completion (the record without the row's index and id), or None. A hit becomes the
        most recently used entry."""
        path = self._path(key)
        try:
            entry = json.loads(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):  # torn by a power loss, or unreadable: a miss, and gone
            self._discard(path)
            return None
        if not isinstance(entry, dict) or entry.get("key") != key or not isinstance(entry.get("record"), dict):
            self._discard(path)
            return None
        if self.writable:
            try:
                touch(path)
            except OSError:
                pass  # evicted meanwhile: the copy we read is still whole
        return entry["record"]

    def put(self, key: str, record: Record) -> None:
        """Stores a completion atomically (temp file + rename), then evicts if over the bound."""
        if not self.writable:
            return
        if not self._scanned:
            self._rescan()
        path = self._path(key)
        data = json.dumps({"key": key, "record": {k: v for k, v in record.items() if k not in ROW_FIELDS}}).encode()
        path.parent.mkdir(exist_ok=True)
        tmp = path.parent / f".tmp-{os.getpid()}-{key[:16]}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        try:
            touch(path)
        except FileNotFoundError:
            pass  # another job's eviction took it already
        self._bytes += len(data)
        self._count += 1
        if self.limit.exceeded(self._bytes, self._count):
            self.evict()

    def _discard(self, path: Path) -> None:
        if self.writable:
            try:
                path.unlink()
            except OSError:
                pass

    def _scan(self) -> Iterator[tuple[int, int, Path]]:
        """(mtime in ns, size, path) of every entry; removes stale temp files of killed writers."""
        now = time.time_ns()
        for shard in os.scandir(self.entries):
            if not shard.is_dir():
                continue
            for item in os.scandir(shard.path):
                try:
                    st = item.stat()
                except FileNotFoundError:
                    continue  # evicted or renamed meanwhile
                if item.name.startswith(".tmp-"):
                    if now - st.st_mtime_ns > _STALE_TEMP_SECONDS * 1e9:
                        self._discard(Path(item.path))
                    continue
                yield st.st_mtime_ns, st.st_size, Path(item.path)

    def _rescan(self) -> list[tuple[int, int, Path]]:
        found = list(self._scan())
        self._bytes, self._count, self._scanned = sum(size for _, size, _ in found), len(found), True
        return found

    def evict(self) -> None:
        """Deletes least recently used entries until the cache is below 90% of its bound. One job evicts
        at a time (an flock); the others skip and count on it."""
        with open(self.root / "evict.lock", "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            found = sorted(self._rescan(), key=lambda e: e[0])  # oldest first
            target = self.limit.low_water()
            for _, size, path in found:
                if not target.exceeded(self._bytes, self._count):
                    break
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
                self._bytes -= size
                self._count -= 1


def touch(path: Path) -> None:
    """Marks an entry used now: mtime is the LRU clock, set from the precise time (the kernel's own
    timestamps are coarse, so entries written in one tick would tie)."""
    now = time.time_ns()
    os.utime(path, ns=(now, now))


class RowCache:
    """The executor's side of the cache: the key of a row, a hit as that row's result, and the row's
    result stored when it finishes (the key is remembered between the two)."""

    def __init__(self, cache: ResultCache, identity: dict[str, Any], job_seed: int) -> None:
        self.cache = cache
        self.job_seed = job_seed
        self._identity = json.dumps(identity, sort_keys=True)
        self._pending: dict[int, str] = {}  # row index -> key, for rows in the engine
        self._write_failed = False

    def row_key(self, index: int, prompt_ids: list[int | str], params: SamplingParams) -> str:
        settings = {k: v for k, v in asdict(params).items() if k not in SCHEDULING_ONLY and k != "seed"}
        seed = None if params.temperature == 0 else sample_seed(params.seed, self.job_seed, index, 0)
        payload = json.dumps([self._identity, settings, seed, prompt_ids], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(payload.encode()).hexdigest()

    def lookup(self, index: int, row_id: str, prompt_ids: list[int | str], params: SamplingParams) -> RowResult | None:
        """Row `index`'s result from the cache (`prompt_ids`: the prompt's identity: its token ids, then an image's
        "image:<digest of its bytes>"), or None (then its result is stored once it finishes). Rows
        with n > 1 samples are neither looked up nor stored (one record per sample: not one entry)."""
        if params.n > 1:
            return None
        key = self.row_key(index, prompt_ids, params)
        record = self.cache.get(key)
        if record is None:
            self._pending[index] = key
            return None
        return RowResult.from_record(record, index, row_id, cached=True)

    def store(self, result: RowResult) -> None:
        key = self._pending.pop(result.index, None)
        if key is None or not result.ok or self._write_failed:
            return
        try:
            self.cache.put(key, result.record())
        except OSError as exc:  # a full disk costs the cache, never the job
            self._write_failed = True
            print(f"cbatch: warning: --result-cache: cannot write to {self.cache.root} ({exc.strerror}); "
                  "this job stops adding to the cache", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """--result-cache as a job holds it: the folder, its bound and the job's identity there (computed once, where
    the model's files are: `cache_spec`); each executor opens its own view (`open`), a Ray replica too."""

    folder: Path
    limit: CacheLimit
    identity: dict[str, Any]
    job_seed: int
    writable: bool = True  # False: lookups only (`cbatch plan`)

    def open(self) -> RowCache:
        return RowCache(ResultCache(self.folder, self.limit, self.writable), self.identity, self.job_seed)


def cache_spec(folder: Path | None, limit: CacheLimit, model: ResolvedModel, config: EngineConfig, task: Task,
               writable: bool = True) -> CacheSpec | None:
    """The job's --result-cache (None without one): the folder checked (a bad one is refused before the model loads
    and before anything is written), the identity of its rows there (`generation_identity` of the checkpoint's
    contents, with the adapters' digests)."""
    if folder is None:
        return None
    cache = ResultCache(folder, limit, writable)
    try:
        fingerprint = model_fingerprint(model.checkpoint.path, cache.root / "models")
    except OSError as exc:
        raise ResultCacheError(f"--result-cache {folder}: cannot fingerprint the model ({exc})") from None
    identity = generation_identity(fingerprint, config, model.dtype, model.device, model.max_model_len, task)
    if config.loras:  # a row's adapter is in its settings (`lora`); what the adapter holds is here
        from cbatch.lora.registry import adapter_digests

        identity["loras"] = adapter_digests(config.loras, model.spec, config.max_lora_rank)
    return CacheSpec(folder, limit, identity, config.seed, writable)


def model_fingerprint(folder: Path, memo_dir: Path) -> str:
    """A digest of the checkpoint folder's contents (config, tokenizer, weights). Hashing is memoized in
    `memo_dir` by (path, size, mtime) per file, so an unchanged checkpoint is hashed once."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        digest.update(f"{path.name}\0{file_content_digest(path, memo_dir)}\0".encode())
    return digest.hexdigest()


def file_content_digest(path: Path, memo_dir: Path) -> str:
    st = path.stat()
    memo = memo_dir / hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}".encode()).hexdigest()
    try:
        return memo.read_text().strip()
    except OSError:
        pass
    with open(path, "rb") as f:
        value = hashlib.file_digest(f, "sha256").hexdigest()
    try:  # best effort: a read-only cache hashes again next time
        memo_dir.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".tmp-{os.getpid()}-{memo.name[:16]}")
        tmp.write_text(value)
        os.replace(tmp, memo)
    except OSError:
        pass
    return value
