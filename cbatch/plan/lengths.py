"""How many tokens each row is planned to generate.

Without --lengths-from: its max_tokens, an upper bound (EOS and stop strings end rows earlier in a real
run). With --lengths-from REPORT (an earlier run of the same job, `cbatch run --report`): a draw from
that run's output lengths (the report's `lengths.output_tokens` quantiles), capped at the row's
max_tokens. Draws are a pure function of the row's index and the job seed, so every simulation of a
plan (the search included) gives a row the same length. Rows with `ignore_eos` always generate
max_tokens, as they do in a run.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

from cbatch.config import SamplingParams
from cbatch.plan.devices import PlanError


class OutputLengths:
    def __init__(self, quantiles: list[int] | None = None, source: str = "max_tokens", seed: int = 0) -> None:
        self.quantiles = quantiles  # output lengths at 0, 1/(n-1), ..., 100% of an earlier run's rows
        self.source = source
        self.seed = seed

    @classmethod
    def from_report(cls, path: Path, seed: int) -> "OutputLengths":
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise PlanError(f"--lengths-from {path}: not a readable JSON report ({exc})") from None
        quantiles = report.get("lengths", {}).get("output_tokens") if isinstance(report, dict) else None
        if not isinstance(quantiles, list) or len(quantiles) < 2 or not all(isinstance(q, int) for q in quantiles):
            raise PlanError(f"--lengths-from {path}: has no output lengths; give the --report of a `cbatch run` "
                            "of this job that finished some rows")
        return cls(quantiles, f"drawn from {path}", seed)

    def of(self, index: int, params: SamplingParams, stops_at_eos: bool) -> int:
        """Row `index`'s planned output length (at least 1, at most its max_tokens)."""
        if self.quantiles is None or params.ignore_eos or not stops_at_eos:
            return params.max_tokens
        position = random.Random(self.seed * 1_000_003 + index).random() * (len(self.quantiles) - 1)
        low = int(position)
        high = min(low + 1, len(self.quantiles) - 1)
        drawn = self.quantiles[low] + (self.quantiles[high] - self.quantiles[low]) * (position - low)
        return max(1, min(params.max_tokens, round(drawn)))
