"""Crash-safe job state next to the output: lock, manifest, append-only part files, atomic final write.

Layout for OUTPUT = dir/results.parquet:
    dir/.results.parquet.cbatch.lock    while a job runs: flock()ed by it, holds its pid and host
    dir/.results.parquet.cbatch/        while the job is unfinished
        manifest.json                  fingerprint of input + generation settings
        part-0001.jsonl, part-0002...  finished rows, one JSON object a line, one file per run
    dir/.results.parquet.cbatch.json    after success: the fingerprint (and size) of the complete OUTPUT

`--retry-errors` starts a partial state from a complete OUTPUT: its ok rows become the first part file
(built aside, renamed into place whole), so only its error rows run again, under this job's settings.

Invariants: OUTPUT only ever appears whole (temp file + fsync + rename); a part line is either
complete JSON or the torn tail of a killed run, which is ignored (that row is generated again).
The lock is an flock() on the lock file, so the kernel drops it when its owner dies in any way
(SIGKILL, OOM-kill): a lock file left behind by a dead job is simply taken over.
Finished rows are not kept in memory: the state keeps each record's place in the part files, and the
final OUTPUT is streamed from there in input order. Records are keyed by (row index, sample index): a
row with n > 1 samples has n records, each saying n (`num_samples`), so a resume knows which of a
row's samples are still missing.
"""
from __future__ import annotations

import fcntl
import glob
import hashlib
import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator


from cbatch.config import UserError
from cbatch.io.durable import fsync_dir
from cbatch.io.outcomes import EXPIRED, FAILED
from cbatch.io.partitions import MANIFEST, PartitionedOutput
from cbatch.io.record_index import RecordKey, RecordPlaces, RowSet
from cbatch.io.writer import OUTPUT_COLUMNS, read_output


class StateError(UserError):
    """The job cannot start with this output (locked, or from other input/settings)."""


class StorageError(Exception):
    """The environment failed one of the job's own files (no space, quota, read-only, permission): not a
    bug in cbatch and not the user's input. The finished rows already on disk are kept."""

    def __init__(self, path: Path, cause: OSError, what: str = "the job's files") -> None:
        reason = cause.strerror or str(cause)
        super().__init__(f"cannot write {what} at {path}: {reason}")
        self.path = path
        self.cause = cause


def settings_digest(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


_PART_SHIFT = 40  # a record's place in the part files: part number << 40 | byte offset



def record_key(record: dict[str, Any]) -> RecordKey:
    return record["index"], record.get("sample_index", 0)


@dataclass(slots=True)
class Finished:
    """What earlier runs of a job finished: the rows with every sample done, and the samples done of the
    rows some of whose samples are missing (a run stopped while they ran)."""

    rows: RowSet = field(default_factory=RowSet)  # a bitmap: one bit a row
    partial: dict[int, frozenset[int]] = field(default_factory=dict)  # row index -> its samples done


def _output_rows(lines: Iterator[dict[str, Any]]) -> Iterator[tuple[int, list[dict[str, Any]]]]:
    """OUTPUT's lines grouped by input row: (row index, its lines). A row with n > 1 samples has n lines,
    sample_index 0..n-1; every other row one line (no sample_index, or 0)."""
    index, samples = -1, []
    for line in lines:
        if line.get("sample_index") in (None, 0):
            if samples:
                yield index, samples
            index, samples = index + 1, []
        samples.append(line)
    if samples:
        yield index, samples


class JobState:
    def __init__(self, output: Path, fingerprint: dict[str, str], output_format: str,
                 parts: PartitionedOutput | None = None, own_columns: tuple[str, ...] = OUTPUT_COLUMNS) -> None:
        self.output = output
        self.own_columns = frozenset(own_columns)  # OUTPUT's columns of its own (the task's too); the others are kept
        self.output_format = output_format  # OUTPUT's file format: jsonl | parquet (--retry-errors reads it back)
        self.parts = parts  # --out DIR: OUTPUT is a folder of parts written as the job goes (io/partitions.py)
        self.fingerprint = fingerprint
        self.dir = output.parent / f".{output.name}.cbatch"
        self.done_record = output.parent / f".{output.name}.cbatch.json"
        self.lock_path = output.parent / f".{output.name}.cbatch.lock"
        self._lock_fd: int | None = None
        self._part = None
        self._part_no = 0
        self._unsynced = 0
        self._last_sync = time.monotonic()
        self._places = RecordPlaces()  # (row, sample) -> where its record is (see _PART_SHIFT)
        self._num_samples: dict[int, int] = {}  # row index -> n, for rows with n > 1
        self.error_rows: set[RecordKey] = set()  # records of failed rows: errors and expired ones
        self.expired_rows: set[RecordKey] = set()  # of those, the ones a deadline left unfinished
        self.columns: set[str] = set()  # keys of the records: which optional output columns OUTPUT has
        self._retry_of: Any = None  # --retry-errors: the fingerprint of the job whose ok rows were kept

    # ---- read-only checks (before the model loads) ------------------------------------------------
    def is_complete(self) -> bool:
        """OUTPUT exists and was written whole by a finished job with the same input and settings."""
        whole = self.parts.is_complete() if self.parts is not None else self.output.is_file()
        if not whole or self.dir.exists():
            return False
        record = _read_json(self.done_record) or {}
        return record.get("fingerprint") == self.fingerprint and record.get("bytes") == self._output_size()

    def _output_exists(self) -> bool:
        return (self.output / MANIFEST).exists() if self.parts is not None else self.output.exists()

    def _output_size(self) -> int:
        return self.parts.total_bytes() if self.parts is not None else self.output.stat().st_size

    def lock_owner(self) -> dict[str, Any] | None:
        """The live job holding the lock ({} if it has not written its pid yet), or None when free."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return _read_json(self.lock_path) or {}
            return None  # nobody holds it: a stale file from a dead job
        finally:
            os.close(fd)  # also drops our shared lock

    def check(self, overwrite: bool, retry_errors: bool = False) -> None:
        """Why this job may not start on OUTPUT (raises StateError); reads, never writes."""
        owner = self.lock_owner()
        if owner is not None:
            raise self._locked_error(owner)
        self._check_output(overwrite, retry_errors)

    def _locked_error(self, owner: dict[str, Any]) -> StateError:
        return StateError(
            f"{self.output} is already being written by another cbatch job "
            f"(pid {owner.get('pid', '?')} on {owner.get('host', '?')}); wait for it to finish, "
            "or stop it and run again to resume"
        )

    def _check_output(self, overwrite: bool, retry_errors: bool = False) -> None:
        if overwrite:
            return
        if self._output_exists() and not self.dir.exists():
            record = _read_json(self.done_record)
            if record is None:
                raise StateError(
                    f"--out {self.output} already exists and was not written by cbatch; "
                    "pass --overwrite to replace it, or choose another --out"
                )
            if retry_errors:  # other settings are the point of a retry: only the error rows run under them
                return self._check_retry(record)
            what = self._difference(record) or "the same input and settings, but the file has been changed since"
            raise StateError(f"--out {self.output} was written by an earlier cbatch job from {what}; pass --overwrite to replace it")
        manifest = _read_json(self.dir / "manifest.json") if self.dir.exists() else None
        if retry_errors and (manifest is None or "retry_of" not in manifest):
            raise StateError(f"--retry-errors: {self.output} is not complete yet; " + (
                "run the same command without --retry-errors to finish it first" if manifest is not None
                else "run without --retry-errors first"))
        if manifest is not None and manifest.get("fingerprint") != self.fingerprint:
            raise StateError(
                f"a partial run for {self.output} used {self._difference(manifest)}; run the same command as before "
                "to resume it, or pass --overwrite to start over"
            )

    def _check_retry(self, record: dict[str, Any]) -> None:
        """A complete OUTPUT may have its error rows run again: it must be from this input, and unchanged."""
        previous = record.get("fingerprint")
        if not isinstance(previous, dict) or previous.get("input") != self.fingerprint["input"]:
            raise StateError(f"--retry-errors: {self.output} was written from a different input file; "
                             "give the input it was made from")
        if record.get("bytes") != self._output_size():
            raise StateError(f"--retry-errors: {self.output} has been changed since cbatch wrote it; "
                             "pass --overwrite to generate every row again")

    def recorded_errors(self) -> int | None:
        """The error rows the completion record of OUTPUT counts (None: no record)."""
        errors = (_read_json(self.done_record) or {}).get("errors")
        return errors if isinstance(errors, int) else None

    def _difference(self, record: dict[str, Any]) -> str | None:
        """What differs between this job and the one that wrote `record` (a manifest or a completion record)."""
        previous = record.get("fingerprint")
        if not isinstance(previous, dict) or previous.get("input") != self.fingerprint["input"]:
            return "a different input file"
        if previous.get("settings") != self.fingerprint["settings"]:
            return "different generation settings (model, dtype, device, seed, sampling flags)"
        adapters = sorted({k for k in {*previous, *self.fingerprint} if k.startswith("lora:")})
        changed = [k[5:] for k in adapters if previous.get(k) != self.fingerprint.get(k)]
        if changed:  # LoRA adapters (cbatch/lora): added, removed, or their files changed
            return f"the LoRA adapter {changed[0]!r} with other files (or without it)"
        return None

    # ---- start -----------------------------------------------------------------------------------
    def open(self, overwrite: bool, retry_errors: bool = False) -> Finished:
        """Takes the lock and loads the records of earlier runs; returns which rows (and samples) they finished.
        `retry_errors`: a complete OUTPUT's ok rows become the finished rows (see `_keep_ok_rows`)."""
        try:
            self._take_lock()
        except OSError as exc:
            raise StorageError(self.lock_path, exc, "the job's lock file") from None
        try:
            self._check_output(overwrite, retry_errors)  # again, now under the lock
            if overwrite:
                shutil.rmtree(self.dir, ignore_errors=True)
                self.done_record.unlink(missing_ok=True)
                if self.parts is not None:
                    self.parts.reset()
            self._remove_temp_files()
            if retry_errors and not self.dir.exists():
                self._keep_ok_rows()
            self.dir.mkdir(parents=True, exist_ok=True)
            manifest = self.dir / "manifest.json"
            if not manifest.exists():
                _write_atomic(manifest, json.dumps({"fingerprint": self.fingerprint}))
                fsync_dir(self.output.parent)
            self._retry_of = (_read_json(manifest) or {}).get("retry_of")
            done = self._load_parts()
            self._part_no = 1 + max((int(p.stem.split("-")[1]) for p in self.dir.glob("part-*.jsonl")), default=0)
            self._part = open(self.dir / f"part-{self._part_no:04d}.jsonl", "ab")
            fsync_dir(self.dir)  # the new part file's name survives a power loss too
        except OSError as exc:
            self._drop_lock()
            raise StorageError(self.dir, exc, "the job's state") from None
        except BaseException:
            self._drop_lock()
            raise
        return done

    def _keep_ok_rows(self) -> None:
        """--retry-errors: a partial state whose finished rows are OUTPUT's ok rows, as they are. Built in
        a side folder and renamed into place whole, so a crash never leaves some of them out (they would
        be generated again, under the new settings)."""
        seeding = self._seeding_dir()
        seeding.mkdir()
        with open(seeding / "part-0001.jsonl", "wb") as f:
            for index, samples in _output_rows(read_output(self.output, self.output_format)):
                if all(row.get("finish_reason") not in FAILED for row in samples):  # else the whole row runs again
                    for row in samples:
                        own = {k: v for k, v in row.items() if k in self.own_columns}
                        kept = {k: v for k, v in row.items() if k not in self.own_columns}  # --keep-columns values
                        extra = {"num_samples": len(samples)} if len(samples) > 1 else {}
                        record = {"index": index, **own, **extra, **({"kept": kept} if kept else {})}
                        f.write((json.dumps(record) + "\n").encode("ascii"))
            f.flush()
            os.fsync(f.fileno())
        previous = (_read_json(self.done_record) or {}).get("fingerprint")
        _write_atomic(seeding / "manifest.json", json.dumps({"fingerprint": self.fingerprint, "retry_of": previous}))
        fsync_dir(seeding)
        os.replace(seeding, self.dir)
        fsync_dir(self.output.parent)

    def _seeding_dir(self) -> Path:
        return self.dir.with_name(self.dir.name + ".seeding")

    def _take_lock(self, tries: int = 20) -> None:
        """flock()s the lock file; a file left by a dead job is free (the kernel dropped its lock)."""
        for _ in range(tries):
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)  # held, or only peeked at by a job starting this very moment: look again
                time.sleep(0.05)
                continue
            try:  # a finishing job unlinks the file it locked: make sure the path is still ours
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}).encode())
            self._lock_fd = fd
            return
        raise self._locked_error(_read_json(self.lock_path) or {})

    def _drop_lock(self) -> None:
        if self._lock_fd is None:
            return
        self.lock_path.unlink(missing_ok=True)  # while still locked: a waiting opener sees a new inode
        os.close(self._lock_fd)
        self._lock_fd = None

    def _remove_temp_files(self) -> None:
        """Temp files of a job killed while writing OUTPUT or its record (we hold the lock: none is live)."""
        for tmp in self.output.parent.glob(glob.escape(f".{self.output.name}") + ".tmp-*"):
            tmp.unlink(missing_ok=True)
        if self.parts is not None and self.output.is_dir():  # a part being written when the job was killed
            for tmp in self.output.glob(".part-*.tmp-*"):
                tmp.unlink(missing_ok=True)
        self.done_record.with_name(self.done_record.name + ".tmp").unlink(missing_ok=True)
        shutil.rmtree(self._seeding_dir(), ignore_errors=True)  # a --retry-errors start cut short

    def _load_parts(self) -> Finished:
        for part in sorted(self.dir.glob("part-*.jsonl")):
            part_no = int(part.stem.split("-")[1])
            offset = 0
            with open(part, "rb") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except ValueError:
                        record = None  # the torn tail of a killed run: that row runs again
                    # an expired record (a deadline's) is no finished row: the row runs again
                    if (isinstance(record, dict) and isinstance(record.get("index"), int)
                            and record.get("finish_reason") != EXPIRED):
                        self._remember(record, part_no, offset)
                    offset += len(line)
        return self.finished()

    def finished(self) -> Finished:
        """Rows with all their samples recorded, and the samples recorded of the others."""
        return Finished(*self._places.done_rows(self._num_samples))

    def _remember(self, record: dict[str, Any], part_no: int, offset: int) -> None:
        key = record_key(record)
        self._places[key] = part_no << _PART_SHIFT | offset
        self.columns.update(record)
        if record.get("num_samples", 1) > 1:
            self._num_samples[key[0]] = record["num_samples"]
        for rows, belongs in ((self.error_rows, record.get("finish_reason") in FAILED),
                              (self.expired_rows, record.get("finish_reason") == EXPIRED)):
            if belongs:
                rows.add(key)
            else:
                rows.discard(key)

    # ---- while running ---------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Records: output rows (a row with n samples has n)."""
        return len(self._places)

    def __contains__(self, key: RecordKey) -> bool:
        """The job has a record for (row index, sample index) (this run's or an earlier one's)."""
        return key in self._places

    def _part_path(self) -> Path:
        return self.dir / f"part-{self._part_no:04d}.jsonl"

    def append(self, record: dict[str, Any], sync_every: int = 64, sync_seconds: float = 2.0) -> None:
        """Persists one finished row (or sample); fsync in batches (a crash loses at most the unsynced tail)."""
        try:
            offset = self._part.tell()
            self._part.write((json.dumps(record) + "\n").encode("ascii"))  # escaped: any str round-trips
        except OSError as exc:
            raise StorageError(self._part_path(), exc) from None
        self._remember(record, self._part_no, offset)
        self._unsynced += 1
        if self._unsynced >= sync_every or time.monotonic() - self._last_sync > sync_seconds:
            self.sync()

    def sync(self) -> None:
        if self._part is None or self._unsynced == 0:
            return
        try:
            self._part.flush()
            os.fsync(self._part.fileno())
        except OSError as exc:
            raise StorageError(self._part_path(), exc) from None
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def close(self) -> None:
        """Leaves the partial state for a later resume (after an interrupt or error). Best effort when
        the disk itself failed: rows that did not reach it run again on resume."""
        if self._part is not None:
            part, self._part = self._part, None
            try:
                part.flush()
                os.fsync(part.fileno())
            except OSError:
                pass
            try:
                part.close()
            except OSError:
                pass
        self._drop_lock()

    def records(self, start: int = 0, stop: int | None = None) -> Iterator[dict[str, Any]]:
        """Every finished row's record (of the rows start..stop-1), in input order then sample order, read back
        from the part files."""
        self._part.flush()
        files: dict[int, Any] = {}
        try:
            for key in self._places.keys(start, stop):
                place = self._places[key]
                part_no = place >> _PART_SHIFT
                f = files.get(part_no)
                if f is None:
                    f = files[part_no] = open(self.dir / f"part-{part_no:04d}.jsonl", "rb")
                f.seek(place & ((1 << _PART_SHIFT) - 1))
                yield json.loads(f.readline())
        finally:
            for f in files.values():
                f.close()

    # ---- the end ---------------------------------------------------------------------------------
    def _write_output(self, write_output: Callable[[Path], None]) -> None:
        """OUTPUT, whole: `write_output(tmp_path)`, fsync, rename over OUTPUT. A folder OUTPUT: `write_output(folder)`
        writes its parts, each whole (io/partitions.py)."""
        self.sync()
        if self.parts is not None:
            try:
                write_output(self.output)
            except OSError as exc:
                self.close()
                raise StorageError(self.output, exc, "OUTPUT's parts") from None
            return
        tmp = self.output.parent / f".{self.output.name}.tmp-{os.getpid()}"
        try:
            write_output(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.output)
        except OSError as exc:  # disk full, folder removed: the finished rows stay in the part files
            self.close()
            raise StorageError(self.output, exc, "OUTPUT") from None
        finally:
            tmp.unlink(missing_ok=True)

    def publish_expired(self, write_output: Callable[[Path], None]) -> None:
        """A deadline's end: OUTPUT written whole (its expired rows among the others) while the state stays, so the
        same command run again resumes: the expired records are not loaded as finished (`_load_parts`), and only
        those rows run. OUTPUT is not recorded complete until then."""
        self._write_output(write_output)
        self.done_record.unlink(missing_ok=True)  # (a --retry-errors start had one: it no longer describes OUTPUT)
        fsync_dir(self.output.parent)
        self.close()

    def finish(self, write_output: Callable[[Path], None], summary: dict[str, Any]) -> None:
        """Writes OUTPUT atomically with `write_output(tmp_path)`, records it complete, removes the state."""
        self._write_output(write_output)
        try:
            retry = {} if self._retry_of is None else {"retry_of": self._retry_of}
            _write_atomic(self.done_record, json.dumps(
                {"fingerprint": self.fingerprint, "bytes": self._output_size(), **summary, **retry}
            ))
        except OSError as exc:  # OUTPUT is whole; without its record a rerun refuses to touch it, so say so
            self.close()
            raise StorageError(self.done_record, exc, "the completion record (OUTPUT itself is complete)") from None
        fsync_dir(self.output.parent)
        if self._part is not None:
            self._part.close()
            self._part = None
        shutil.rmtree(self.dir, ignore_errors=True)
        self._drop_lock()
