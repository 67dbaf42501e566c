"""`--out DIR`: OUTPUT as a folder of parts written while the job runs.

Part k holds the input rows [k * part_rows, (k + 1) * part_rows), in input order, and is written the moment its
last row is finished: whole (a temp file renamed into place), then listed in `_manifest.json` (rewritten whole).
A reader sees finished parts before the job ends; a killed job leaves valid parts (its rows are in the job's
state too, and the same command resumes). At the end the rest of the parts are written, the manifest says
`"complete": true`, and `_SUCCESS` appears. A part written at a deadline (run/deadline.py) holds its expired rows;
it is written again when they have run.

Parts carry the optional columns their own rows have (a reader that unifies schemas fills the others with nulls).
"""
from __future__ import annotations

import json
import os
import tempfile
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from cbatch.io.durable import fsync_dir
from cbatch.io.record_index import RowSet

MANIFEST, SUCCESS = "_manifest.json", "_SUCCESS"
SUFFIX = {"parquet": ".parquet", "jsonl": ".jsonl"}

# writes part k's rows to a path: (k, path) -> None
PartWriter = Callable[[int, Path], None]


@dataclass(frozen=True, slots=True)
class PartPlan:
    """How a folder OUTPUT is cut: its part files' format and rows per part."""

    format: str  # parquet | jsonl
    part_rows: int


class PartitionedOutput:
    def __init__(self, folder: Path, plan: PartPlan, total_rows: int) -> None:
        self.folder = folder
        self.plan = plan
        self.total_rows = total_rows
        self.num_parts = max(1, -(-total_rows // plan.part_rows))
        self._done = array("l", [0]) * self.num_parts  # finished rows per part
        self.manifest = self._read_manifest()

    # ---- layout ------------------------------------------------------------------------------
    def name(self, k: int) -> str:
        return f"part-{k:05d}{SUFFIX[self.plan.format]}"

    def rows_of(self, k: int) -> range:
        return range(k * self.plan.part_rows, min((k + 1) * self.plan.part_rows, self.total_rows))

    def total_bytes(self) -> int:
        return sum(p["bytes"] for p in self.manifest["parts"].values())

    def is_complete(self) -> bool:
        return self.manifest["complete"] and (self.folder / SUCCESS).is_file()

    # ---- while the job runs --------------------------------------------------------------------
    def start(self, done: RowSet) -> list[int]:
        """Counts the rows an earlier run finished; returns the parts that are whole now but not written whole
        (never written, or written with expired rows that have run since)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        ready = []
        for k in range(self.num_parts):
            rows = self.rows_of(k)
            self._done[k] = done.count_range(rows.start, rows.stop)
            written = self.manifest["parts"].get(str(k))
            if self._done[k] == len(rows) and (written is None or written.get("expired")):
                ready.append(k)
        return ready

    def row_done(self, index: int) -> int | None:
        """A row finished (its last sample); the part it completed, if it did."""
        k = index // self.plan.part_rows
        self._done[k] += 1
        return k if self._done[k] == len(self.rows_of(k)) else None

    def write(self, k: int, write_part: PartWriter, expired: int = 0) -> None:
        """Part k, whole (temp file, fsync, rename), then the manifest that lists it (`expired`: its rows a deadline
        left unfinished, which a resume runs and writes it again for)."""
        path = self.folder / self.name(k)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=self.folder)
        os.close(fd)
        try:
            write_part(k, Path(tmp))
            os.chmod(tmp, 0o666 & ~_umask())  # as a plain open() would (mkstemp makes it 0600)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
        rows = self.rows_of(k)
        self.manifest["parts"][str(k)] = {"file": path.name, "first_row": rows.start, "rows": len(rows),
                                          "bytes": path.stat().st_size, "expired": expired}
        self._write_manifest()

    def unwritten(self) -> list[int]:
        """The parts not written whole yet (never, or with expired rows)."""
        return [k for k in range(self.num_parts) if (p := self.manifest["parts"].get(str(k))) is None or p.get("expired")]

    def finish(self) -> None:
        """Every part is written: the manifest says so, then `_SUCCESS`."""
        self.manifest["complete"] = True
        self._write_manifest()
        (self.folder / SUCCESS).write_bytes(b"")
        fsync_dir(self.folder)

    # ---- the manifest --------------------------------------------------------------------------
    def _read_manifest(self) -> dict[str, Any]:
        fresh = {"format": self.plan.format, "part_rows": self.plan.part_rows, "total_rows": self.total_rows,
                 "parts": {}, "complete": False}
        try:
            manifest = json.loads((self.folder / MANIFEST).read_text())
        except (OSError, ValueError):
            return fresh
        same = all(manifest.get(k) == fresh[k] for k in ("format", "part_rows", "total_rows"))
        return manifest if same and isinstance(manifest.get("parts"), dict) else fresh

    def _write_manifest(self) -> None:
        tmp = self.folder / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(self.manifest, indent=1))
        os.replace(tmp, self.folder / MANIFEST)
        fsync_dir(self.folder)

    def reset(self) -> None:
        """--overwrite: the folder's parts, manifest and marker go (other files in it stay)."""
        for path in self.folder.glob("part-*"):
            path.unlink(missing_ok=True)
        for name in (MANIFEST, SUCCESS):
            (self.folder / name).unlink(missing_ok=True)
        self.manifest = self._read_manifest()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


__all__ = ["MANIFEST", "PartPlan", "PartitionedOutput", "SUCCESS"]
