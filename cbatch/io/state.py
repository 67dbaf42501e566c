"""Crash-safe job state next to the output: lock, manifest, append-only part files, atomic final write.

Layout for OUTPUT = dir/results.parquet:
    dir/.results.parquet.cbatch/        while the job is unfinished
        lock                           pid and host of the running job
        manifest.json                  fingerprint of input + generation settings
        part-0001.jsonl, part-0002...  finished rows, one JSON object a line, one file per run
    dir/.results.parquet.cbatch.json    after success: the fingerprint of the complete OUTPUT

Invariants: OUTPUT only ever appears whole (temp file + fsync + rename); a part line is either
complete JSON or the torn tail of a killed run, which is ignored (that row is generated again).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Iterable


class StateError(ValueError):
    """The job cannot start with this output (locked, or from other input/settings)."""


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def settings_digest(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class JobState:
    def __init__(self, output: Path, fingerprint: dict[str, str]) -> None:
        self.output = output
        self.fingerprint = fingerprint
        self.dir = output.parent / f".{output.name}.cbatch"
        self.done_record = output.parent / f".{output.name}.cbatch.json"
        self._lock_path = self.dir / "lock"
        self._part = None
        self._unsynced = 0
        self._last_sync = time.monotonic()

    # ---- start -----------------------------------------------------------------------------------
    def is_complete(self) -> bool:
        """OUTPUT exists and was written by a finished job with the same input and settings."""
        if not self.output.exists() or self.dir.exists() or not self.done_record.exists():
            return False
        try:
            return json.loads(self.done_record.read_text()).get("fingerprint") == self.fingerprint
        except (OSError, json.JSONDecodeError):
            return False

    def open(self, overwrite: bool) -> dict[int, dict[str, Any]]:
        """Takes the lock and returns the rows finished by earlier runs ({} on a fresh start)."""
        if overwrite:
            self._clear_previous()
        elif self.output.exists() and not self.dir.exists():
            raise StateError(
                f"{self.output} already exists from another input or other settings; "
                "pass --overwrite to replace it"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        self._take_lock()
        manifest = self.dir / "manifest.json"
        if manifest.exists():
            try:
                previous = json.loads(manifest.read_text()).get("fingerprint")
            except (OSError, json.JSONDecodeError):
                previous = None
            if previous != self.fingerprint:
                what = "input file" if previous and previous.get("input") != self.fingerprint["input"] else "generation settings"
                self._drop_lock()
                raise StateError(
                    f"a partial run for {self.output} used a different {what}; "
                    "run the same command as before to resume, or pass --overwrite to start over"
                )
        else:
            self._write_atomic(manifest, json.dumps({"fingerprint": self.fingerprint}))
        done = self._load_parts()
        run_no = 1 + max((int(p.stem.split("-")[1]) for p in self.dir.glob("part-*.jsonl")), default=0)
        self._part = open(self.dir / f"part-{run_no:04d}.jsonl", "a", encoding="utf-8")
        return done

    def _clear_previous(self) -> None:
        if self.dir.exists():
            lock = self._read_lock()
            if lock and lock.get("host") == socket.gethostname() and _pid_alive(int(lock.get("pid", -1))) and int(lock["pid"]) != os.getpid():
                raise StateError(f"{self.output} is being written by a running job (pid {lock['pid']}); --overwrite cannot take it over")
            shutil.rmtree(self.dir)
        self.done_record.unlink(missing_ok=True)

    def _read_lock(self) -> dict[str, Any] | None:
        try:
            return json.loads(self._lock_path.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    def _take_lock(self) -> None:
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()})
        for _ in range(2):
            try:
                fd = os.open(self._lock_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._read_lock() or {}
                pid = int(owner.get("pid", -1))
                if owner.get("host", socket.gethostname()) != socket.gethostname() or (pid > 0 and _pid_alive(pid)):
                    raise StateError(
                        f"{self.output} is already being written by another cbatch job "
                        f"(pid {pid} on {owner.get('host', '?')}); wait for it, or remove {self._lock_path} if that job is gone"
                    ) from None
                self._lock_path.unlink(missing_ok=True)  # stale: its owner died
                continue
            with os.fdopen(fd, "w") as f:
                f.write(me)
            return
        raise StateError(f"could not take the lock {self._lock_path}; another job is starting on the same output")

    def _drop_lock(self) -> None:
        self._lock_path.unlink(missing_ok=True)

    def _load_parts(self) -> dict[int, dict[str, Any]]:
        done: dict[int, dict[str, Any]] = {}
        for part in sorted(self.dir.glob("part-*.jsonl")):
            with open(part, "rb") as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        continue  # the torn tail of a killed run: that row runs again
                    if isinstance(record, dict) and isinstance(record.get("index"), int):
                        done[record["index"]] = record
        return done

    # ---- while running ---------------------------------------------------------------------------
    def append(self, record: dict[str, Any], sync_every: int = 64, sync_seconds: float = 2.0) -> None:
        """Persists one finished row; fsync in batches (a crash loses at most the unsynced tail)."""
        self._part.write(json.dumps(record, ensure_ascii=False) + "\n")
        self._unsynced += 1
        if self._unsynced >= sync_every or time.monotonic() - self._last_sync > sync_seconds:
            self.sync()

    def sync(self) -> None:
        if self._part is None or self._unsynced == 0:
            return
        self._part.flush()
        os.fsync(self._part.fileno())
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def close(self) -> None:
        """Leaves the partial state for a later resume (after an interrupt or error)."""
        if self._part is not None:
            self.sync()
            self._part.close()
            self._part = None
        self._drop_lock()

    # ---- success ---------------------------------------------------------------------------------
    def finish(self, write_output, summary: dict[str, Any]) -> None:
        """Writes OUTPUT atomically with `write_output(tmp_path)`, records it complete, removes the state."""
        self.sync()
        tmp = self.output.parent / f".{self.output.name}.tmp-{os.getpid()}"
        try:
            write_output(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, self.output)
        finally:
            tmp.unlink(missing_ok=True)
        self._write_atomic(self.done_record, json.dumps({"fingerprint": self.fingerprint, **summary}))
        _fsync_dir(self.output.parent)
        if self._part is not None:
            self._part.close()
            self._part = None
        shutil.rmtree(self.dir, ignore_errors=True)

    @staticmethod
    def _write_atomic(path: Path, text: str) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def records_in_order(done: dict[int, dict[str, Any]]) -> Iterable[dict[str, Any]]:
    for index in sorted(done):
        yield done[index]
