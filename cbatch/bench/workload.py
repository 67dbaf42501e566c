"""Synthetic workloads: length distributions (`--input-len`, `--output-len`) and JSONL traces.

A distribution is written as
  N                       every request N tokens
  A:B                     uniform on A..B, both included
  lognormal:MEDIAN:SIGMA  exp(normal(ln MEDIAN, SIGMA)), rounded, at least 1
  chat                    70% 10..100, 20% 100..500, 10% 500..2000 (a chat service's skew)
Workloads are seeded: the same flags give the same requests.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from cbatch.config import UserError

# (share, low, high) buckets of the `chat` preset; used for prompts and for outputs alike
CHAT_BUCKETS: tuple[tuple[float, int, int], ...] = ((0.7, 10, 100), (0.2, 100, 500), (0.1, 500, 2000))


class WorkloadError(UserError):
    """A bad distribution or trace: the message names the flag or the row and the fix."""


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_len: int  # text tokens (an image's placeholder run comes on top)
    output_len: int
    arrival: int = 0  # the engine step at which the request appears (0 = known up front)
    image_sizes: tuple[tuple[int, int], ...] = ()  # (width, height) in pixels of each of its images


@dataclass(frozen=True, slots=True)
class Distribution:
    text: str
    draw: Callable[[random.Random], int]

    def sample(self, rng: random.Random, n: int) -> list[int]:
        return [self.draw(rng) for _ in range(n)]


def _chat(rng: random.Random) -> int:
    u = rng.random()
    for share, low, high in CHAT_BUCKETS:
        if u < share:
            return rng.randint(low, high)
        u -= share
    return rng.randint(CHAT_BUCKETS[-1][1], CHAT_BUCKETS[-1][2])


def parse_distribution(text: str, flag: str) -> Distribution:
    """`N`, `A:B`, `lognormal:MEDIAN:SIGMA` or `chat`; raises WorkloadError naming `flag`."""
    usage = f"{flag}: expected N, A:B, lognormal:MEDIAN:SIGMA or chat, not {text!r}"
    parts = text.strip().split(":")
    try:
        if parts == ["chat"]:
            return Distribution(text, _chat)
        if parts[0] == "lognormal" and len(parts) == 3:
            median, sigma = float(parts[1]), float(parts[2])
            if median < 1 or sigma < 0:
                raise WorkloadError(f"{flag}: lognormal needs MEDIAN >= 1 and SIGMA >= 0, not {text!r}")
            mu = math.log(median)
            return Distribution(text, lambda rng: max(1, round(rng.lognormvariate(mu, sigma))))
        if len(parts) == 1:
            n = int(parts[0])
            if n < 1:
                raise WorkloadError(f"{flag}: lengths must be at least 1, not {text!r}")
            return Distribution(text, lambda rng: n)
        if len(parts) == 2:
            low, high = int(parts[0]), int(parts[1])
            if not 1 <= low <= high:
                raise WorkloadError(f"{flag}: A:B needs 1 <= A <= B, not {text!r}")
            return Distribution(text, lambda rng: rng.randint(low, high))
    except ValueError as exc:
        if isinstance(exc, WorkloadError):
            raise
        raise WorkloadError(usage) from None
    raise WorkloadError(usage)


def synthetic_workload(num_prompts: int, input_len: Distribution, output_len: Distribution, seed: int) -> list[BenchRequest]:
    """`num_prompts` requests, all known up front; prompts and outputs from independent seeded streams."""
    prompts = input_len.sample(random.Random(f"{seed}/input"), num_prompts)
    outputs = output_len.sample(random.Random(f"{seed}/output"), num_prompts)
    return [BenchRequest(p, o) for p, o in zip(prompts, outputs)]


def parse_image_sizes(text: str, flag: str) -> list[tuple[int, int]]:
    """`WxH` or several, comma-separated: [(width, height)]; raises WorkloadError naming `flag`."""
    sizes = []
    for part in text.split(","):
        width, _, height = part.strip().lower().partition("x")
        if not (width.isdigit() and height.isdigit() and int(width) > 0 and int(height) > 0):
            raise WorkloadError(f"{flag}: expected WIDTHxHEIGHT in pixels (e.g. 896x1152), or several separated by "
                                f"commas, not {text!r}")
        sizes.append((int(width), int(height)))
    return sizes


def with_images(requests: list[BenchRequest], count: int, sizes: list[tuple[int, int]], seed: int
                ) -> list[BenchRequest]:
    """`requests` with `count` images each, every image's size drawn from `sizes` (a seeded stream of its own)."""
    rng = random.Random(f"{seed}/images")
    return [replace(r, image_sizes=tuple(rng.choice(sizes) for _ in range(count))) for r in requests]


def read_trace(path: Path) -> list[BenchRequest]:
    """JSONL rows `{"prompt_len": int, "output_len": int, "arrival": int (optional, in steps)}`."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise WorkloadError(f"--trace {path}: cannot read it ({exc.strerror})") from None
    requests: list[BenchRequest] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise WorkloadError(f"--trace {path} line {number}: not valid JSON") from None
        if not isinstance(row, dict):
            raise WorkloadError(f"--trace {path} line {number}: expected an object with prompt_len and output_len")
        values = {}
        for name, low in (("prompt_len", 1), ("output_len", 1), ("arrival", 0)):
            value = row.get(name, 0 if name == "arrival" else None)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise WorkloadError(
                    f"--trace {path} line {number}: `{name}` must be an integer >= {low}, got {value!r}"
                )
            values[name] = value
        requests.append(BenchRequest(values["prompt_len"], values["output_len"], values["arrival"]))
    if not requests:
        raise WorkloadError(f"--trace {path}: no rows")
    return requests


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    """Random token ids avoiding the lowest ids (often special tokens)."""
    low = min(3, vocab_size - 1)
    return [rng.randrange(low, vocab_size) for _ in range(length)]
