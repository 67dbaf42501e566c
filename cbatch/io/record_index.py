"""Where each finished record is, and which rows are done, compact enough for tens of millions of rows.

A job's state remembers, for every (row index, sample index), where the record sits in the part files. A dict of
tuples costs ~170 bytes a record (1.7 GB at 10M rows, and more to rebuild on resume); here a row's first sample
costs 8 bytes (an int64 array indexed by row; -1: none) and a done row one bit. Rows with n > 1 samples keep their
other samples in a dict (few jobs have many of them).
"""
from __future__ import annotations

from array import array
from typing import Iterator

RecordKey = tuple[int, int]  # (row index, sample index)
_NONE = -1


class RowSet:
    """A set of row indices as a bitmap: `in`, `add`, `len`."""

    def __init__(self) -> None:
        self._bits = bytearray()
        self._len = 0

    def add(self, index: int) -> None:
        byte, mask = index >> 3, 1 << (index & 7)
        if byte >= len(self._bits):
            self._bits.extend(bytes(max(byte + 1 - len(self._bits), len(self._bits))))  # doubling: amortised
        if not self._bits[byte] & mask:
            self._bits[byte] |= mask
            self._len += 1

    def __contains__(self, index: object) -> bool:
        if not isinstance(index, int) or index < 0:
            return False
        byte = index >> 3
        return byte < len(self._bits) and bool(self._bits[byte] & (1 << (index & 7)))

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def count_range(self, start: int, stop: int) -> int:
        """How many of the rows start..stop-1 are in the set (whole bytes counted at once)."""
        head = min(stop, -(-start // 8) * 8)  # the rows before the first whole byte
        tail = max(head, stop // 8 * 8)  # the rows after the last one
        count = sum(1 for i in range(start, head) if i in self) + sum(1 for i in range(tail, stop) if i in self)
        return count + int.from_bytes(self._bits[head // 8: tail // 8], "little").bit_count()


class RecordPlaces:
    """(row index, sample index) -> place (an int), with `in`, `[]`, `len` and `keys()` in input order."""

    def __init__(self) -> None:
        self._first = array("q")  # row index -> its sample 0's place, or _NONE
        self._more: dict[RecordKey, int] = {}  # samples 1.. of rows with n > 1
        self._count = 0

    def __setitem__(self, key: RecordKey, place: int) -> None:
        index, sample = key
        if sample:
            self._count += key not in self._more
            self._more[key] = place
            return
        first = self._first
        if index >= len(first):
            first.extend(array("q", [_NONE]) * max(index + 1 - len(first), len(first)))  # doubling: amortised
        self._count += first[index] == _NONE
        first[index] = place

    def get(self, key: RecordKey) -> int | None:
        index, sample = key
        if sample:
            return self._more.get(key)
        place = self._first[index] if 0 <= index < len(self._first) else _NONE
        return None if place == _NONE else place

    def __getitem__(self, key: RecordKey) -> int:
        place = self.get(key)
        if place is None:
            raise KeyError(key)
        return place

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and self.get(key) is not None

    def __len__(self) -> int:
        return self._count

    def samples_by_row(self) -> dict[int, list[int]]:
        """Rows with samples beyond the first -> those sample indices, sorted."""
        rows: dict[int, list[int]] = {}
        for index, sample in sorted(self._more):
            rows.setdefault(index, []).append(sample)
        return rows

    def keys(self, start: int = 0, stop: int | None = None) -> Iterator[RecordKey]:
        """Every key (of the rows start..stop-1), in input order then sample order."""
        more = self.samples_by_row()
        last = max(len(self._first) - 1, max(more, default=-1))
        first = self._first
        for index in range(start, last + 1 if stop is None else min(stop, last + 1)):
            if index < len(first) and first[index] != _NONE:
                yield index, 0
            for sample in more.get(index, ()):
                yield index, sample

    def done_rows(self, num_samples: dict[int, int]) -> tuple[RowSet, dict[int, frozenset[int]]]:
        """(rows with all their samples recorded, {row: its samples recorded} of the others); `num_samples`:
        the n of each row with n > 1 (the others have 1)."""
        done, partial = RowSet(), {}
        more = self.samples_by_row()
        first = self._first
        for index in range(len(first)):
            if first[index] != _NONE and index not in num_samples:
                done.add(index)
        for index, n in num_samples.items():
            recorded = set(more.get(index, ()))
            if index < len(first) and first[index] != _NONE:
                recorded.add(0)
            if len(recorded) >= n:
                done.add(index)
            elif recorded:
                partial[index] = frozenset(recorded)
        for index, samples in more.items():  # rows whose n is not known here (no record said it): partial
            if index not in num_samples and index not in done:
                partial[index] = frozenset(samples)
        return done, partial
