"""A `cbatch run` process that meets another one halfway (tests/test_result_cache.py): once its first row
is in the result cache it creates BARRIER/NAME and waits until BARRIER/OTHER exists, so both jobs store
(and evict) in the same cache at the same time.

    python tests/cache_worker.py BARRIER NAME OTHER run INPUT --out OUT --result-cache DIR ...
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

barrier, name, other = Path(sys.argv[1]), sys.argv[2], sys.argv[3]

from cbatch.run import result_cache  # noqa: E402

put = result_cache.ResultCache.put
met = False


def put_then_meet(self, key, record) -> None:
    global met
    put(self, key, record)
    if met:
        return
    met = True
    (barrier / name).touch()
    deadline = time.monotonic() + 240
    while not (barrier / other).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: the other job never stored a row")
        time.sleep(0.01)


result_cache.ResultCache.put = put_then_meet
sys.argv = ["cbatch", *sys.argv[4:]]

from cbatch.cli import main  # noqa: E402

main()
