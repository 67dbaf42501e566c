"""`cbatch run --ray`: one job over a pool of engine replicas (Ray actors), driven from here.

The driver owns everything a local run owns: it streams the input with cbatch's own reader (the
same row errors), owns the crash-safe `JobState` (lock, part files, manifest, atomic OUTPUT),
and writes the report. Replicas only turn blocks of rows into records.

    driver: rows -> blocks of `block_rows` -> queue (retried blocks first)
        each live replica holds `blocks_in_flight` blocks (so its engine never drains between blocks)
        a block's records come back whole -> records new to the job are appended to the part file
        a replica that dies (or fails a block): replaced; its unfinished blocks go back to the queue

Exactly once: a row enters the part file only when its whole block came back, and only if the job
has no record for it yet, so a retried block never duplicates a row, and a re-run skips written rows.
"""
from __future__ import annotations

import signal
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from itertools import islice
from typing import Any, Callable, Iterator

from cbatch.engine.scheduler import SchedulerStats
from cbatch.io.reader import RawRow, iter_rows
from cbatch.io.state import JobState, StateError
from cbatch.job import (
    EXIT_OK, EXIT_SIGINT, EXIT_SIGTERM, JobError, JobOptions, _Interrupt, conclude_job, preflight,
)
from cbatch.observe.metrics import JobMetrics
from cbatch.observe.report import build_report
from cbatch.rowrun import Record, is_ok
from cbatch.scaleout import require_ray
from cbatch.scaleout.replica import BlockResult, Replica, ReplicaStats


class ReplicaFailure(RuntimeError):
    """The job cannot go on (replicas keep failing); finished rows are kept for a re-run."""


@dataclass(slots=True)
class RayOptions:
    address: str | None = None  # None: start a local Ray instance; else join this cluster ("auto", "ray://...")
    replicas: int | None = None  # None: one per GPU in the cluster (one CPU replica when it has none)
    gpus_per_replica: int | None = None  # None: 1 when the cluster has GPUs, else 0 (CPU replicas)
    block_rows: int = 512  # rows per block sent to a replica
    blocks_in_flight: int = 2  # blocks held by each replica: the next is queued in its engine already
    max_block_attempts: int = 3  # a block that fails this often stops the job (a row that kills replicas)
    max_replacements: int | None = None  # replicas started to replace failed ones; None: 2 x replicas


def check_ray_options(ray_options: RayOptions) -> None:
    """Raises JobError naming the flag."""
    if ray_options.replicas is not None and ray_options.replicas < 1:
        raise JobError("--replicas: must be at least 1")
    if ray_options.gpus_per_replica not in (None, 0, 1):
        raise JobError(
            "--gpus-per-replica: must be 1 (a GPU replica) or 0 (a CPU replica); "
            "cbatch runs one model per GPU, so scale with --replicas instead"
        )
    if ray_options.block_rows < 1:
        raise JobError("--ray-block-rows: must be at least 1")


@dataclass(slots=True)
class Block:
    number: int
    rows: list[RawRow]
    attempts: int = 0


@dataclass(slots=True)
class ReplicaHandle:
    number: int
    actor: Any
    in_flight: dict[Any, Block] = field(default_factory=dict)  # object ref -> block
    stats: ReplicaStats | None = None  # latest snapshot
    status: str = "running"  # running | failed | stopped
    error: str | None = None


def connect(ray, address: str | None) -> bool:
    """Joins ADDRESS, or starts a local instance; True if this call started Ray (so it stops it too)."""
    if ray.is_initialized():
        return False
    quiet = dict(include_dashboard=False, logging_level="warning", log_to_driver=False)
    if address is None:
        ray.init(**quiet)
    else:
        check_reachable(address)
        try:
            ray.init(address=address, logging_level="warning", log_to_driver=False)
        except (ConnectionError, ValueError) as exc:
            raise JobError(f"--ray {address}: cannot join that Ray cluster ({exc}); check the address "
                           "(`ray status` on the head node shows it)") from None
    return True


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A `host:port` (or `ray://host:port`) nobody answers on fails here in seconds, not in Ray's minutes of retries."""
    import socket

    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        return  # "auto" and friends: Ray resolves them
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise JobError(f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc}); "
                       "start one with `ray start --head`, or check the address") from None


def pool_shape(ray, options: JobOptions, ray_options: RayOptions) -> tuple[int, int, int]:
    """(replicas, GPUs each, CPUs each), checked against the cluster so no actor waits forever."""
    resources = ray.cluster_resources()
    cluster_gpus, cluster_cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    gpus = ray_options.gpus_per_replica
    if gpus is None:
        gpus = 1 if cluster_gpus and options.engine.device != "cpu" else 0
    if gpus and options.engine.device == "cpu":
        raise JobError("--gpus-per-replica 1 with --device cpu: use --gpus-per-replica 0 for CPU replicas")
    if not gpus and options.engine.device == "cuda":
        raise JobError("--device cuda needs GPU replicas: pass --gpus-per-replica 1 (or leave it out)")
    replicas = ray_options.replicas or (cluster_gpus if gpus else 1)
    cpus = 1 if gpus else (options.engine.num_threads or 1)
    if gpus and replicas * gpus > cluster_gpus:
        raise JobError(f"--replicas {replicas} needs {replicas * gpus} GPUs; the Ray cluster has {cluster_gpus}")
    if replicas * cpus > cluster_cpus:
        raise JobError(f"--replicas {replicas} needs {replicas * cpus} CPUs (one per replica, or --threads each); "
                       f"the Ray cluster has {cluster_cpus}")
    if replicas == 0:
        raise JobError("the Ray cluster has no GPUs; pass --gpus-per-replica 0 for CPU replicas")
    return replicas, gpus, cpus


class RayJob:
    """The driver loop; `on_block` (tests, monitoring) is called after each block comes back."""

    def __init__(self, options: JobOptions, ray_options: RayOptions, ray, on_block: Callable[["RayJob"], None] | None = None) -> None:
        self.options = options
        self.ray_options = ray_options
        self.ray = ray
        self.on_block = on_block
        self.metrics = JobMetrics()
        self.done: set[int] = set()  # rows with a record in the job state: each is written exactly once
        self.replicas: list[ReplicaHandle] = []
        self.queue: deque[Block] = deque()  # blocks to (re)send, retried ones first
        self.retried_blocks = 0
        self.replacements = 0
        self.startup_seconds = 0.0
        self._blocks_made = 0
        self.state: JobState | None = None
        self.progress = None
        self.interrupt: _Interrupt | None = None

    # ---- replicas --------------------------------------------------------------------------------
    def start_replicas(self) -> dict[str, Any]:
        """Starts the pool and waits for every engine; returns the first replica's identity."""
        replicas, gpus, cpus = pool_shape(self.ray, self.options, self.ray_options)
        self.shape = {"replicas": replicas, "gpus_per_replica": gpus, "cpus_per_replica": cpus}
        config = self.options.engine
        if not gpus:  # a CPU replica never touches a GPU it was not given
            config = replace(config, device="cpu", num_threads=config.num_threads or cpus)
        self._actor_class = self.ray.remote(Replica).options(
            num_gpus=gpus, num_cpus=cpus, max_concurrency=self.ray_options.blocks_in_flight,
            max_restarts=0, max_task_retries=0,
        )
        self._config = config
        for _ in range(replicas):
            self._spawn()
        identities = self._get([r.actor.start.remote() for r in self.replicas])
        # like a local run, the job's clock starts once the models are loaded; start-up is reported apart
        self.startup_seconds = self.metrics.now()
        self.metrics.started = time.perf_counter()
        return identities[0]

    def _spawn(self) -> ReplicaHandle:
        handle = ReplicaHandle(number=len(self.replicas), actor=None)
        handle.actor = self._actor_class.remote(self._config, self.options.defaults, handle.number)
        self.replicas.append(handle)
        return handle

    def _get(self, refs: list[Any]) -> list[Any]:
        """ray.get, with an engine start-up error (bad --model, ...) re-raised as itself (one line for the CLI)."""
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            raise (cause if isinstance(cause, Exception) else ReplicaFailure(str(exc).splitlines()[0])) from None
        except self.ray.exceptions.RayError as exc:  # an actor that died while starting
            raise ReplicaFailure(f"a replica could not start ({type(exc).__name__}: {str(exc).strip().splitlines()[0]})") from None

    def stop_replicas(self) -> None:
        for handle in self.replicas:
            if handle.status == "running":
                handle.status = "stopped"
            try:
                self.ray.kill(handle.actor, no_restart=True)
            except Exception:  # already gone
                pass

    # ---- the loop --------------------------------------------------------------------------------
    def run(self, state: JobState, done: set[int], total_rows: int, interrupt: _Interrupt) -> int | None:
        """Runs every row not in `done`; returns an exit code if interrupted, else None."""
        self.state = state
        self.interrupt = interrupt
        self.done = set(done)
        self.metrics.total_rows = total_rows
        self.metrics.skipped_rows = len(done)
        rows = (item for item in iter_rows(self.options.input) if item[0] not in done)
        ray = self.ray
        while True:
            if interrupt.signum is not None:
                return EXIT_SIGINT if interrupt.signum == signal.SIGINT else EXIT_SIGTERM
            self._feed(rows)
            refs = [ref for r in self.replicas if r.status == "running" for ref in r.in_flight]
            if not refs:
                if self.queue:  # cannot happen while a replica runs; never end with rows missing
                    raise ReplicaFailure("no replica is left to run the remaining rows")
                return None
            ready, _ = ray.wait(refs, num_returns=1, timeout=1.0)
            for ref in ready:
                self._collect(ref)
            self.progress.update(engine=None)

    def _feed(self, rows: Iterator[RawRow]) -> None:
        """Tops every live replica up to `blocks_in_flight` blocks: retried blocks first, then new rows."""
        for handle in self.replicas:
            while handle.status == "running" and len(handle.in_flight) < self.ray_options.blocks_in_flight:
                block = self.queue.popleft() if self.queue else self._next_block(rows)
                if block is None:
                    return
                block.attempts += 1
                handle.in_flight[handle.actor.run_block.remote(block.rows)] = block

    def _next_block(self, rows: Iterator[RawRow]) -> Block | None:
        chunk = list(islice(rows, self.ray_options.block_rows))
        if not chunk:
            return None
        self._blocks_made += 1
        return Block(self._blocks_made, chunk)

    def _collect(self, ref: Any) -> None:
        handle = next((r for r in self.replicas if ref in r.in_flight), None)
        if handle is None:  # its replica failed meanwhile; the block is queued again already
            return
        block = handle.in_flight.pop(ref)
        try:
            result: BlockResult = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            self._replica_failed(handle, block, exc)
            return
        if handle.stats is None or result.stats.blocks > handle.stats.blocks:
            handle.stats = result.stats  # the newest snapshot: a replica's blocks may come back out of order
        for timing in result.timings:
            self.metrics.add_timing(timing)
        for record in result.records:
            if record["index"] not in self.done:  # exactly once, whatever was retried
                self._store(record)
        if self.on_block is not None:
            self.on_block(self)

    def _store(self, record: Record) -> None:
        metrics = self.metrics
        if is_ok(record):
            metrics.ok_rows += 1
            metrics.prompt_tokens += record["prompt_tokens"]
            metrics.output_tokens += record["completion_tokens"]
        else:
            metrics.error_rows += 1
        self.done.add(record["index"])
        self.state.append(record)

    def _replica_failed(self, handle: ReplicaHandle, block: Block, exc: Exception) -> None:
        """Requeues the block (and, once per replica, all its other unfinished blocks) and replaces the replica."""
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if block.attempts >= self.ray_options.max_block_attempts:
            raise ReplicaFailure(
                f"rows {block.rows[0][0]}..{block.rows[-1][0]} failed on {block.attempts} replicas "
                f"(last: {type(exc).__name__}: {reason})"
            )
        self.queue.appendleft(block)
        self.retried_blocks += 1
        if handle.status != "running":
            return
        handle.status, handle.error = "failed", f"{type(exc).__name__}: {reason}"
        for other in handle.in_flight.values():  # they will fail too: send them elsewhere now
            self.queue.appendleft(other)
            self.retried_blocks += 1
        handle.in_flight.clear()
        try:
            self.ray.kill(handle.actor, no_restart=True)  # a replica that failed a block is not trusted again
        except Exception:
            pass
        limit = self.ray_options.max_replacements
        limit = 2 * self.shape["replicas"] if limit is None else limit
        if self.replacements < limit and (self.interrupt is None or self.interrupt.signum is None):
            self.replacements += 1
            self._spawn()
        elif not any(r.status == "running" for r in self.replicas):
            raise ReplicaFailure(f"every replica failed (last: {handle.error})")
        print(f"cbatch: replica {handle.number} failed ({handle.error}); its rows are retried", file=sys.stderr)

    # ---- report ----------------------------------------------------------------------------------
    def report(self, wall_seconds: float) -> dict[str, Any]:
        """The local report over all replicas, plus a `replicas` list and a `ray` section."""
        snapshots = [r.stats for r in self.replicas if r.stats is not None]
        total = SchedulerStats()
        for s in snapshots:
            for name, value in asdict(s.scheduler).items():
                if name == "peak_kv_blocks":
                    total.peak_kv_blocks = max(total.peak_kv_blocks, value)
                elif isinstance(value, dict):  # e.g. queue waits per priority class: {class: [waits]}
                    merged = getattr(total, name)
                    for key, items in value.items():
                        merged.setdefault(key, []).extend(items)
                else:
                    setattr(total, name, getattr(total, name) + value)
        self.metrics.forward_seconds = sum(s.forward_seconds for s in snapshots)
        options = self.options
        report = build_report(
            self.metrics, total, wall_seconds=wall_seconds, max_num_seqs=options.engine.max_num_seqs,
            num_kv_blocks=max((s.num_kv_blocks for s in snapshots), default=0),
            settings={"engine": asdict(options.engine), "defaults": asdict(options.defaults),
                      "device": ", ".join(sorted({s.device for s in snapshots})),
                      "input": str(options.input), "output": str(options.output)},
        )
        report["time"]["startup_seconds"] = self.startup_seconds
        report["replicas"] = [
            {**(r.stats.as_report() if r.stats else {"replica": r.number, "rows": 0}), "status": "failed" if r.status == "failed" else "ok",
             "failure": r.error}
            for r in self.replicas
        ]
        report["ray"] = {
            **self.shape, "address": self.ray_options.address or "local", "block_rows": self.ray_options.block_rows,
            "blocks_in_flight": self.ray_options.blocks_in_flight, "retried_blocks": self.retried_blocks,
            "replaced_replicas": self.replacements,
        }
        return report


def run_ray_job(options: JobOptions, ray_options: RayOptions, make_progress=None,
                on_block: Callable[[RayJob], None] | None = None) -> int:
    """`cbatch run --ray`: same OUTPUT, report and exit codes as `run_job`. Raises JobError for a bad job.

    Like a local run, every check that can refuse the job (paths, input, model config, lock, resume
    state) runs before any replica starts.
    """
    check_ray_options(ray_options)
    prepared = preflight(options)  # the same checks and fingerprint as a local run: resume either way
    if prepared is None:
        return EXIT_OK
    total_rows, config, state = prepared
    options = replace(options, engine=config)
    ray = require_ray()
    started_ray = connect(ray, ray_options.address)
    job = RayJob(options, ray_options, ray, on_block)
    try:
        return _run(job, state, total_rows, options, make_progress)
    finally:
        job.stop_replicas()
        if started_ray:
            ray.shutdown()


def _run(job: RayJob, state: JobState, total_rows: int, options: JobOptions, make_progress) -> int:
    job.start_replicas()
    try:
        done = set(state.open(options.overwrite))
    except StateError as exc:
        raise JobError(str(exc)) from None
    from cbatch.observe.progress import make_progress as default_progress

    job.progress = (make_progress or default_progress)(job.metrics, options)
    with _Interrupt() as interrupt:
        try:
            code = job.run(state, done, total_rows, interrupt)
        except BaseException:
            job.progress.close()
            state.close()
            raise
    job.progress.close()
    report = job.report(job.metrics.now())
    return conclude_job(options, state, report, code, total_rows, f" | {job.shape['replicas']} Ray replica(s)")
