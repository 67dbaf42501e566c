"""The job state's compact index (cbatch/io/record_index.py) answers as the dict and sets it replaced, on random
keys: rows with one sample and with several, some samples missing, keys set twice, rows far apart."""
from __future__ import annotations

import random

from cbatch.io.record_index import RecordPlaces, RowSet


def test_record_places_and_done_rows_match_a_dict():
    rng = random.Random(7)
    places, reference = RecordPlaces(), {}
    num_samples: dict[int, int] = {}
    for index in rng.sample(range(5000), 800) + [123_456]:  # far apart: the array grows by doubling
        n = rng.choice([1, 1, 1, 3])
        if n > 1:
            num_samples[index] = n
        for sample in range(n):
            if rng.random() < 0.8:
                place = rng.randrange(1 << 40)
                places[(index, sample)] = place
                reference[(index, sample)] = place
                if rng.random() < 0.1:  # set again (a record written twice keeps the last place)
                    places[(index, sample)] = reference[(index, sample)] = place + 1
    assert len(places) == len(reference)
    assert list(places.keys()) == sorted(reference)
    assert all(places[k] == v for k, v in reference.items())
    assert all((key in places) == (key in reference) for key in ((5, 0), (7, 1), (123_456, 0)))
    assert (10**7, 0) not in places and (3, 9) not in places
    done, partial = places.done_rows(num_samples)
    by_row: dict[int, set[int]] = {}
    for index, sample in reference:
        by_row.setdefault(index, set()).add(sample)
    want_done = {i for i, s in by_row.items() if len(s) >= num_samples.get(i, 1)}
    assert len(done) == len(want_done) and all(i in done for i in want_done)
    assert not any(i in done for i in set(range(5000)) - want_done)
    assert partial == {i: frozenset(s) for i, s in by_row.items() if i not in want_done}


def test_row_set():
    rows = RowSet()
    assert not rows and 3 not in rows and -1 not in rows and "3" not in rows
    for i in (3, 3, 0, 1_000_003):
        rows.add(i)
    assert len(rows) == 3 and rows and all(i in rows for i in (0, 3, 1_000_003)) and 4 not in rows
