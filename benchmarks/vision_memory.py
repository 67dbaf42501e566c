"""A job of many rows whose images are files keeps host memory flat: `cbatch run` on N rows (default 10,000), each
naming its own small PNG file, on a tiny random Qwen2-VL (tests/vision_models.py), counted by tests/vision_models's
`ImageWatch` (no timing): each image is opened once, when its row is about to enter the engine (when the k-th is
opened at least k - cap rows are done; cap = the executor's PREFETCH_ROWS + --max-num-seqs), and the decoded images
alive at once never pass the cap. Also prints the process's resident memory when 10%, 50% and 100% of the images
had been opened (a figure, not a check: it moves with the allocator).

    PYTHONPATH=$PWD python benchmarks/vision_memory.py                 # 10,000 rows
    PYTHONPATH=$PWD python benchmarks/vision_memory.py --rows 500      # a quick check of the script

tests/test_vision_jobs.py asserts the same on 200 rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from ops_jobs import read_jsonl, run_inprocess, write_jsonl  # noqa: E402
from vision_models import ImageWatch, make_vl_checkpoint, png_bytes  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000)
    p.add_argument("--max-num-seqs", type=int, default=16)
    args = p.parse_args()
    from cbatch.run.executor import PREFETCH_ROWS

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_vl_checkpoint("qwen2_vl", tmp / "model")
        (tmp / "pages").mkdir()
        rows = []
        for i in range(args.rows):  # each row its own file (28..56 pixel sides: 1..4 image tokens)
            path = tmp / "pages" / f"{i:05d}.png"
            path.write_bytes(png_bytes(28 + 28 * (i % 2), 28 + 28 * (i // 2 % 2), seed=i))
            rows.append({"id": str(i), "messages": [{"role": "user", "content": f"w{i % 300}"}], "images": [str(path)]})
        write_jsonl(tmp / "in.jsonl", rows)
        marks = {max(1, args.rows // 10): "10%", max(1, args.rows // 2): "50%", args.rows: "100%"}
        rss: dict[str, float] = {}
        with ImageWatch() as watch:
            watch.on_open = lambda k: rss.setdefault(marks[k], rss_mb()) if k in marks else None
            start = time.perf_counter()
            code, _, err = run_inprocess("run", str(tmp / "in.jsonl"), "-o", str(tmp / "out.jsonl"), "--model",
                                         str(model), "--device", "cpu", "--display", "none", "--quiet", "--max-tokens",
                                         "1", "--max-num-seqs", str(args.max_num_seqs))
            seconds = time.perf_counter() - start
        assert code == 0, err
        cap = PREFETCH_ROWS + args.max_num_seqs
        out = read_jsonl(tmp / "out.jsonl")
        checks = {
            "every row done": len(out) == args.rows == watch.done and all(r["error"] is None for r in out),
            "each image opened once": watch.opened == args.rows,
            "k-th image opened after k - cap rows were done": all(
                done >= k - cap for k, done in enumerate(watch.done_at_open, start=1)),
            "decoded images alive <= cap": watch.peak_alive <= cap,
        }
        print(json.dumps({"rows": args.rows, "cap": cap, "peak_alive": watch.peak_alive,
                          "done_when_last_opened": watch.done_at_open[-1], "rss_mb_at_images_opened": rss,
                          "seconds": round(seconds, 1), "checks": checks}, indent=2))
        if not all(checks.values()):
            sys.exit(1)


if __name__ == "__main__":
    main()
