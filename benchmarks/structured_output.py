"""Structured output's cost: a job constrained to a nested JSON schema against the same job unconstrained.

Usage: PYTHONPATH=. python benchmarks/structured_output.py [--rows 256] [--device cpu|cuda] [--quick]

Model: SmolLM2-135M-Instruct (the default model). Rows: chat prompts asking for a person record; the
constrained run gives every row the nested schema below (objects, an array of objects, enums, integers,
required fields). The unconstrained run then generates exactly as many tokens per row as the constrained
one did (EOS ignored, max_tokens = that row's length), so both runs do the same model work and the ratio
of their output tok/s is the constraint's overhead (the target is a ratio >= 0.9). Each run is repeated
(`--repeats`) after a warm-up; the best of each is compared. The 1-minute load average is printed: figures
from a loaded machine mean little. Every completed constrained row is checked to parse as a JSON object; rows cut by --max-tokens are counted.
"""
from __future__ import annotations

import argparse
import json
import os
import time

from cbatch.config import Constraint, EngineConfig, SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.engine import Engine, run_to_completion
from cbatch.io.constraints import schema_text
from cbatch.model.default_model import default_model_dir
from cbatch.tokenizer import encode_messages

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                     "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
                                                     "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                              "maxItems": 3}},
                    "required": ["city", "zip", "tags"]},
        "pets": {"type": "array", "minItems": 1, "maxItems": 3,
                 "items": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "bird"]},
                                                            "legs": {"type": "integer", "minimum": 0, "maximum": 4}},
                           "required": ["kind", "legs"]}},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address", "pets", "active"],
}
CITIES = ["Paris", "Lagos", "Lima", "Osaka", "Oslo", "Quito", "Pune", "Perth"]


def prompts_for(engine: Engine, rows: int) -> list[list[int]]:
    asks = [f"Invent a person #{i} living in {CITIES[i % len(CITIES)]} with {1 + i % 3} pets; answer in JSON."
            for i in range(rows)]
    return [encode_messages(engine.tokenizer, [{"role": "user", "content": a}]) for a in asks]


def timed(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, list]:
    engine.reset()
    start = time.perf_counter()
    outputs = run_to_completion(engine, prompts, params)
    return time.perf_counter() - start, outputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="8 rows, 1 repeat: checks the script runs")
    args = ap.parse_args()
    if args.quick:
        args.rows, args.repeats, args.max_num_seqs = 8, 1, 8
    config = EngineConfig(model=str(default_model_dir()), device=args.device, dtype=args.dtype,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=8192, num_threads=args.threads)
    engine = build_engine(config)
    prompts = prompts_for(engine, args.rows)
    rule = Constraint("json_schema", schema_text("json_schema", SCHEMA), "json_schema")
    constrained = [SamplingParams(max_tokens=args.max_tokens, constraint=rule)] * args.rows
    run_to_completion(engine, prompts[:4], constrained[:4])  # warm-up: the grammar compiles, first calls
    print(f"{args.rows} rows, SmolLM2-135M-Instruct on {engine.device} ({engine.dtype}), max_num_seqs {args.max_num_seqs}, "
          f"load average {os.getloadavg()[0]:.2f}")
    best: dict[str, float] = {}
    lengths: list[int] = []
    for _ in range(args.repeats):
        seconds, outputs = timed(engine, prompts, constrained)
        lengths = [len(o.token_ids) for o in outputs]
        cut = sum(o.finish_reason == "length" for o in outputs)  # reached max_tokens: JSON cut short
        if any(o.finish_reason == "stop" and not isinstance(json.loads(o.text), dict) for o in outputs):
            raise SystemExit("a completed constrained row is not a JSON object (a bug)")
        best["json schema"] = max(best.get("json schema", 0.0), sum(lengths) / seconds)
        same_work = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
        seconds, outputs = timed(engine, prompts, same_work)
        best["unconstrained"] = max(best.get("unconstrained", 0.0), sum(len(o.token_ids) for o in outputs) / seconds)
    print(f"output tokens per run: {sum(lengths)} (mean {sum(lengths) / len(lengths):.1f} per row; "
          f"{cut} rows reached --max-tokens before their JSON was complete)")
    for name, rate in best.items():
        print(f"{name:>14}: {rate:9.1f} output tok/s (best of {args.repeats})")
    ratio = best["json schema"] / best["unconstrained"]
    print(f"constrained / unconstrained = {ratio:.3f} (overhead {1 - ratio:+.1%}; target: overhead <= 10%)")


if __name__ == "__main__":
    main()
