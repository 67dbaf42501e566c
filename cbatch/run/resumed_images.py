"""A resume's check of the images its finished rows read: the job's fingerprint digests INPUT's bytes, but a row may
name an image file (a path, a URL) whose bytes are not in INPUT. Each finished row's record keeps the digests of its
images (`RowResult.image_digests`); before a resume runs anything, the images of the rows it keeps are read again
(their bytes, not decoded) and a changed one refuses the resume, as a changed INPUT does.

Streamed: the finished records (in input order) are walked beside INPUT's rows, so nothing grows with the job.
"""
from __future__ import annotations

from typing import Iterator

from cbatch.io.images import ImageError, describe, read_source, source_digest
from cbatch.io.reader import RawRow
from cbatch.io.row_fields import RowError
from cbatch.io.state import JobState, StateError
from cbatch.tasks.base import Task


def check_resumed_images(state: JobState, rows: Iterator[RawRow], task: Task) -> None:
    """Raises StateError naming the first finished row whose image now has other bytes (or cannot be read)."""
    checked = -1  # the last row index checked (a row with n samples has n records)
    for record in state.records():
        digests, index = record.get("image_digests"), record["index"]
        if not digests or index == checked:
            continue
        checked = index
        raw = next(raw for i, raw in rows if i == index)  # (INPUT is the one the fingerprint matched)
        try:
            sources = task.image_sources(task.parse(index, raw))
        except RowError:
            sources = []
        for (name, source), digest in zip(sources, digests):
            try:
                now = source_digest(source, read_source(source))
            except ImageError as exc:
                now, problem = None, f"{exc} now"
            else:
                problem = "has other bytes now"
            if now != digest:
                raise StateError(
                    f"a partial run for {state.output} finished row {index} ({record.get('id')!r}) with "
                    f"`{name}` ({describe(source)}), which {problem}; restore the image and run the same command "
                    "to resume, or pass --overwrite to start over")
