"""One replica: an engine that runs blocks of rows and returns their records. No Ray in here.

Ray wraps `Replica` as an actor (`ray_job.py`) and `CbatchPredictor` wraps it for
`Dataset.map_batches` (`predictor.py`). The replica accepts several blocks at once (a threaded
actor): every block's rows go into the same engine, and whichever call holds the lock steps it,
so the engine's batch stays full across block boundaries instead of draining at the end of
each block. A call returns when all of its own rows are finished.
"""
from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

from cbatch.config import EngineConfig
from cbatch.engine.build import build_engine
from cbatch.engine.engine import Engine
from cbatch.engine.stats import SchedulerStats
from cbatch.io.reader import RawRow
from cbatch.observe.metrics import EngineSnapshot, JobMetrics
from cbatch.run.driver import count
from cbatch.run.executor import LocalExecutor
from cbatch.run.job_spec import JobSpec
from cbatch.tasks.results import RowResult


@dataclass(slots=True)
class ReplicaStats:
    """A replica's counters since it started; a fresh snapshot comes back with every block."""

    replica: int
    host: str
    device: str
    rows: int = 0
    ok_rows: int = 0
    error_rows: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    blocks: int = 0
    busy_seconds: float = 0.0  # time spent in engine steps
    alive_seconds: float = 0.0  # since the engine was ready
    forward_seconds: float = 0.0
    num_kv_blocks: int = 0
    max_num_seqs: int = 0
    memory: dict[str, int] = field(default_factory=dict)  # per rank: ModelRunner.memory()
    scheduler: SchedulerStats = field(default_factory=SchedulerStats)
    engine: EngineSnapshot = field(default_factory=EngineSnapshot)  # live counters at the last block
    image_usage: dict[str, int] = field(default_factory=dict)  # rows with images: JobMetrics.image_usage

    def as_report(self) -> dict[str, Any]:
        steps = max(self.scheduler.steps, 1)
        return {
            "replica": self.replica, "host": self.host, "device": self.device, "blocks": self.blocks,
            "rows": self.rows, "ok": self.ok_rows, "error": self.error_rows,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "busy_seconds": self.busy_seconds,
            "busy_fraction": self.busy_seconds / self.alive_seconds if self.alive_seconds > 0 else 0.0,
            "output_tokens_per_busy_s": self.output_tokens / self.busy_seconds if self.busy_seconds > 0 else 0.0,
            "steps": self.scheduler.steps,
            "mean_batch_occupancy": self.scheduler.occupancy_sum / steps,
            "peak_kv_usage": self.scheduler.peak_kv_blocks / max(self.num_kv_blocks, 1),
            "preemptions": self.scheduler.preemptions, "memory": self.memory,
        }


@dataclass(slots=True)
class BlockResult:
    results: list[RowResult]  # one per row of the block, in the block's order
    stats: ReplicaStats


class Replica:
    def __init__(self, spec: JobSpec, replica: int = 0, make_engine: Callable[[EngineConfig], Engine] = build_engine,
                 crash_at_step: int | None = None) -> None:
        """`spec`: the job, whole (its task, kept columns, result cache), as a local run's executor has it.
        `crash_at_step` (fault injection, for tests): the process dies once its engine has taken that many steps,
        in the middle of a block, as an OOM-killed worker would."""
        self.spec = spec
        self.config = spec.engine
        self.crash_at_step = crash_at_step
        self.replica = replica
        self._make_engine = make_engine
        self._engine: Engine | None = None
        self._lock = threading.Lock()  # guards the engine, the executor and the results below
        self._done: dict[int, list[RowResult]] = {}  # finished rows (their samples) not yet returned, by row index

    # ---- start -----------------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Loads the model (once); returns what the driver reports of this replica's engine."""
        with self._lock:
            if self._engine is None:
                engine = self._make_engine(self.config)
                self.executor = LocalExecutor(engine, replace(self.spec, engine=engine.config), JobMetrics())
                self.stats = ReplicaStats(
                    replica=self.replica, host=socket.gethostname(), device=str(engine.device),
                    num_kv_blocks=engine.pool.num_blocks, max_num_seqs=engine.config.max_num_seqs,
                    memory=engine.runner.memory() if hasattr(engine.runner, "memory") else {},
                )
                self._ready = time.perf_counter()
                self._engine = engine
            engine = self._engine
        return {
            "model_dir": str(engine.model_dir) if engine.model_dir else None,
            "architecture": engine.spec.architecture, "dtype": str(engine.dtype),
            "max_model_len": engine.max_model_len, "device": str(engine.device), "host": self.stats.host,
        }

    # ---- work ------------------------------------------------------------------------------------
    def run_block(self, rows: list[RawRow], done_samples: dict[int, frozenset[int]] | None = None) -> BlockResult:
        """Runs the rows (index, raw row) to completion, but the samples `done_samples` names (a resumed row's
        stored ones); other blocks may share the engine meanwhile. The results come in the block's order,
        a row's samples in the order they finished."""
        self.start()
        indices = [index for index, _ in rows]
        done_samples = done_samples or {}
        with self._lock:
            for index, raw in rows:
                if index in self._done or self.executor.is_pending(index):  # one sequence per row id, always
                    raise ValueError(f"row {index} is already running in replica {self.replica}")
                self.executor.submit(index, raw, done_samples.get(index, frozenset()))
        while True:
            with self._lock:
                if all(i in self._done and not self.executor.is_pending(i) for i in indices):
                    return self._result(indices)
                started = time.perf_counter()
                for result in self.executor.poll():
                    self._finish(result)
                self.stats.busy_seconds += time.perf_counter() - started
                if self.crash_at_step is not None and self._engine.scheduler.stats.steps >= self.crash_at_step:
                    os._exit(1)

    def _finish(self, result: RowResult) -> None:
        self._done.setdefault(result.index, []).append(result)
        count(self.executor.metrics, result)

    def _result(self, indices: list[int]) -> BlockResult:
        results = [result for i in indices for result in self._done.pop(i)]
        engine, stats, metrics = self._engine, self.stats, self.executor.metrics
        stats.blocks += 1
        stats.ok_rows, stats.error_rows = metrics.ok_rows, metrics.error_rows
        stats.rows = metrics.done_rows
        stats.prompt_tokens, stats.output_tokens = metrics.prompt_tokens, metrics.output_tokens
        stats.forward_seconds = engine.runner.forward_seconds
        stats.alive_seconds = time.perf_counter() - self._ready
        stats.scheduler = SchedulerStats(**asdict(engine.scheduler.stats))
        stats.engine = self.executor.metrics.engine
        stats.image_usage = dict(metrics.image_usage)
        # a detached copy: the live stats keep changing while the result travels
        return BlockResult(results=results, stats=replace(stats, scheduler=stats.scheduler))
