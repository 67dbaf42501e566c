"""Host memory of a job's state per finished record: appending N records, then reloading them (a resume).

    PYTHONPATH=. python benchmarks/state_memory.py [--rows 1000000]

Prints the peak RSS growth (ru_maxrss) of each phase and per record. The state keeps each record's place in the
part files (cbatch/io/record_index.py) and a bit per done row; the records themselves stay on disk.
"""
from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

from cbatch.io.state import JobState


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    rows = p.parse_args().rows
    record = {"completion": "ok", "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2, "error": None,
              "completion_token_ids": []}
    with tempfile.TemporaryDirectory() as tmp:
        out, fingerprint = Path(tmp) / "out.jsonl", {"input": "i", "settings": "s"}
        state = JobState(out, fingerprint, "jsonl")
        state.open(True)
        base, t0 = peak_mb(), time.perf_counter()
        for i in range(rows):
            state.append({"index": i, "id": str(i), **record})
        appended, t1 = peak_mb(), time.perf_counter()
        state.close()
        state = JobState(out, fingerprint, "jsonl")
        done = state.open(False)
        reloaded, t2 = peak_mb(), time.perf_counter()
        state.close()
    assert len(done.rows) == rows
    print(f"{rows:,} records: append +{appended - base:,.0f} MB ({(appended - base) * 2**20 / rows:,.0f} B/record, "
          f"{t1 - t0:.1f} s); reload (resume) peak +{reloaded - base:,.0f} MB ({t2 - t1:.1f} s)")


if __name__ == "__main__":
    main()
