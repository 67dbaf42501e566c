"""`cbatch run --ray`: one job over a pool of engine replicas (Ray actors), driven from here.

The driver owns everything a local run owns: it streams the input with cbatch's own reader (the
same row errors), owns the crash-safe `JobState` (lock, part files, manifest, atomic OUTPUT),
and writes the report. Replicas only turn blocks of rows into records.

    the driver loop (cbatch/run/driver.py) with a `RayExecutor`:
        rows -> blocks of `block_rows` -> queue (retried blocks first)
        each live replica holds `blocks_in_flight` blocks (so its engine never drains between blocks)
        a block's results come back whole -> rows new to the job are appended to the part file
        a replica that dies (or fails a block): replaced; its unfinished blocks go back to the queue

Exactly once: a row enters the part file only when its whole block came back, and only if the job
has no record for it yet, so a retried block never duplicates a row, and a re-run skips written rows.
"""
from __future__ import annotations

import os

import sys
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from cbatch.engine.stats import SchedulerStats
from cbatch.io.reader import RawRow
from cbatch.io.state import JobState
from cbatch.observe.display import make_display
from cbatch.observe.metrics import EngineSnapshot, JobMetrics
from cbatch.observe.report import build_report
from cbatch.run.exit_codes import EXIT_OK
from cbatch.run.executor import expire_unsent
from cbatch.run.job import conclude_empty_job, conclude_job, job_spec, run_rows, with_task
from cbatch.run.job_spec import JobSpec
from cbatch.run.preflight import JobError, JobOptions, preflight
from cbatch.tasks.results import RowResult
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
    crash: tuple[int, int] | None = None  # fault injection (tests): (replica, step): that replica's process dies there


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
    done_samples: dict[int, frozenset[int]] = field(default_factory=dict)  # resumed rows: samples already stored


@dataclass(slots=True)
class ReplicaHandle:
    number: int
    actor: Any
    in_flight: dict[Any, Block] = field(default_factory=dict)  # object ref -> block
    stats: ReplicaStats | None = None  # latest snapshot
    status: str = "running"  # running | failed | stopped
    error: str | None = None


def connect(ray, address: str | None, token_source: str | None = None) -> bool:
    """Joins ADDRESS, or starts a local instance; True if this call started Ray (so it stops it too).
    `token_source`: what `ray_auth_token` found (named in the error when the cluster refuses the join)."""
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
            raise JobError(f"--ray {address}: cannot join that Ray cluster ({exc}); {token_hint(token_source)}") from None
    return True


RAY_TOKEN_FILE = Path("~/.ray/auth_token")  # Ray's default token path (docs.ray.io: ray-security/token-auth)
LOOPBACK = ("127.", "localhost", "::1", "[::1]")


def ray_auth_token(address: str | None) -> str | None:
    """Where the token a join sends comes from (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, the default file: Ray's
    order), or None when none is sent. Call before Ray is imported: it reads RAY_AUTH_MODE once.

    Ray (>= 2.59) turns token authentication on for clusters started where a token exists, and a process
    joining one sends the token only with RAY_AUTH_MODE=token. Ray sets that mode itself for a local cluster it
    finds on its own (`ray.init()`), never for an address named explicitly (a token must not go to any host one
    types). cbatch does the same for an address on this machine (loopback): with the mode unset and a token at
    hand, it sets RAY_AUTH_MODE=token for this process. A remote cluster's token is sent when the user sets
    RAY_AUTH_MODE=token (docs/ray.md)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        source = "RAY_AUTH_TOKEN"
    elif path := os.environ.get("RAY_AUTH_TOKEN_PATH"):
        source = f"RAY_AUTH_TOKEN_PATH ({path})"
    elif RAY_TOKEN_FILE.expanduser().is_file():
        source = str(RAY_TOKEN_FILE)
    else:
        return None
    if address is not None and "RAY_AUTH_MODE" not in os.environ and address.removeprefix("ray://").startswith(LOOPBACK):
        os.environ["RAY_AUTH_MODE"] = "token"
    return source if os.environ.get("RAY_AUTH_MODE") == "token" else None


def token_hint(token_source: str | None) -> str:
    """What to check when a cluster that answers on its port refuses to be joined: the token, then the address."""
    address = "else check the address (`ray status` on the head node shows it)"
    if token_source is not None:
        return (f"the token from {token_source} was sent: if it is not the cluster's (`ray get-auth-token` on the "
                f"head node prints that one), replace it; {address}")
    return ("if the cluster uses Ray's token authentication (on where `ray start` finds a token, Ray >= 2.59), "
            f"set RAY_AUTH_MODE=token with its token in {RAY_TOKEN_FILE}, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN "
            f"(`ray get-auth-token` on the head node prints it); {address}")


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
    """(replicas, GPUs each, CPUs each), checked against the cluster so no actor waits forever. A replica is a
    tensor-parallel group: --tensor-parallel-size N ranks, each on its own GPU (or CPU threads), all on one
    node (the replica's actor holds its N GPUs and starts its N - 1 worker processes there)."""
    resources = ray.cluster_resources()
    cluster_gpus, cluster_cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
    ranks = options.engine.tensor_parallel_size
    gpus = ray_options.gpus_per_replica
    if gpus is None:
        gpus = 1 if cluster_gpus and options.engine.device != "cpu" else 0
    if gpus and options.engine.device == "cpu":
        raise JobError("--gpus-per-replica 1 with --device cpu: use --gpus-per-replica 0 for CPU replicas")
    if not gpus and options.engine.device == "cuda":
        raise JobError("--device cuda needs GPU replicas: pass --gpus-per-replica 1 (or leave it out)")
    gpus *= ranks  # one GPU per rank
    replicas = ray_options.replicas or (cluster_gpus // gpus if gpus else 1)
    cpus = ranks * (1 if gpus else (options.engine.num_threads or 1))
    if gpus and replicas * gpus > cluster_gpus:
        raise JobError(f"--replicas {replicas} needs {replicas * gpus} GPUs ({gpus} per replica with "
                       f"--tensor-parallel-size {ranks}); the Ray cluster has {cluster_gpus}")
    if replicas * cpus > cluster_cpus:
        raise JobError(f"--replicas {replicas} needs {replicas * cpus} CPUs (one per replica and rank, or --threads "
                       f"each); the Ray cluster has {cluster_cpus}")
    if replicas == 0:
        raise JobError(f"the Ray cluster has {cluster_gpus} GPUs, fewer than one replica's {gpus}; pass "
                       "--gpus-per-replica 0 for CPU replicas or a smaller --tensor-parallel-size")
    return replicas, gpus, cpus


class RayExecutor:
    """The driver's executor over a pool of replicas (Ray actors): rows are cut into blocks, each live
    replica holds `blocks_in_flight` of them (its engine never drains between blocks), and a block's
    results come back whole. A replica that dies (or fails a block) is replaced and its blocks go back to
    the queue; the job's store keeps each row once, whatever was retried."""

    def __init__(self, spec: JobSpec, options: JobOptions, ray_options: RayOptions, ray, metrics: JobMetrics,
                 on_block: Callable[["RayExecutor"], None] | None = None, state: JobState | None = None) -> None:
        """`spec`: the job, shipped whole to every replica. `on_block(executor)` (tests, monitoring) runs once the
        rows of each block that came back are stored (at the start of the next poll); it may read the job's
        `state`."""
        self.spec = spec
        self.options = options
        self.state = state
        self._closing = False  # a deadline came: no block starts any more
        self.ray_options = ray_options
        self.ray = ray
        self.metrics = metrics
        self.on_block = on_block
        self.replicas: list[ReplicaHandle] = []
        self.queue: deque[Block] = deque()  # blocks to (re)send, retried ones first
        self.retried_blocks = 0
        self.replacements = 0
        self.startup_seconds = 0.0
        self._pending: list[RawRow] = []  # rows of the block being filled
        self._pending_done: dict[int, frozenset[int]] = {}  # their samples stored by an earlier run
        self._blocks_made = 0
        self._blocks_back = 0  # blocks returned since `on_block` last ran

    # ---- replicas --------------------------------------------------------------------------------
    def start_replicas(self) -> dict[str, Any]:
        """Starts the pool and waits for every engine; returns the first replica's identity."""
        replicas, gpus, cpus = pool_shape(self.ray, self.options, self.ray_options)
        self.shape = {"replicas": replicas, "gpus_per_replica": gpus, "cpus_per_replica": cpus}
        config = self.spec.engine
        if not gpus:  # a CPU replica never touches a GPU it was not given; each rank gets its share of the CPUs
            config = replace(config, device="cpu", num_threads=config.num_threads or cpus // config.tensor_parallel_size)
        self._spec = replace(self.spec, engine=config, deadline=None)  # (the driver keeps the deadline)
        self._actor_class = self.ray.remote(Replica).options(
            num_gpus=gpus, num_cpus=cpus, max_concurrency=self.ray_options.blocks_in_flight,
            max_restarts=0, max_task_retries=0,
        )
        for _ in range(replicas):
            self._spawn()
        started = time.perf_counter()
        identities = self._get([r.actor.start.remote() for r in self.replicas])
        self.startup_seconds = time.perf_counter() - started  # reported apart, like a local run's model load
        return identities[0]

    def _spawn(self) -> ReplicaHandle:
        handle = ReplicaHandle(number=len(self.replicas), actor=None)
        crash = self.ray_options.crash
        crash_at_step = crash[1] if crash is not None and crash[0] == handle.number else None
        handle.actor = self._actor_class.remote(self._spec, handle.number, crash_at_step=crash_at_step)
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

    def _live(self) -> list[ReplicaHandle]:
        return [r for r in self.replicas if r.status == "running"]

    # ---- the executor protocol -------------------------------------------------------------------
    def wants_rows(self) -> bool:
        """Room for another block on some live replica, and none queued for it already."""
        free = sum(self.ray_options.blocks_in_flight - len(r.in_flight) for r in self._live())
        return not self._closing and free > len(self.queue)

    def submit(self, index: int, raw: dict[str, Any] | str, done_samples: frozenset[int] = frozenset()) -> None:
        self._pending.append((index, raw))
        if done_samples:
            self._pending_done[index] = done_samples
        if len(self._pending) >= self.ray_options.block_rows:
            self._cut_block()

    def end_of_input(self) -> None:
        if self._pending:
            self._cut_block()

    def _cut_block(self) -> None:
        self._blocks_made += 1
        self.queue.append(Block(self._blocks_made, self._pending, done_samples=self._pending_done))
        self._pending, self._pending_done = [], {}
        self._dispatch()

    def busy(self) -> bool:
        waiting = not self._closing and bool(self.queue or self._pending)  # (after a deadline, only what runs)
        return waiting or any(r.in_flight for r in self._live())

    # ---- a deadline (run/deadline.py) ------------------------------------------------------------
    def stop_starting(self) -> None:
        """No block is sent any more; the blocks running have the grace to come back."""
        self._closing = True

    def expire(self, message: str) -> list[RowResult]:
        """Every row sent or queued and not back: `expired` (blocks come back whole, so a running block's rows
        all expire; the replicas are stopped after this)."""
        blocks = [*self.queue, *(b for r in self._live() for b in r.in_flight.values())]
        rows = [(index, raw, block.done_samples.get(index, frozenset())) for block in blocks for index, raw in block.rows]
        rows += [(index, raw, self._pending_done.get(index, frozenset())) for index, raw in self._pending]
        self.queue.clear()
        self._pending, self._pending_done = [], {}
        for handle in self._live():
            handle.in_flight.clear()
        return [result for index, raw, done in sorted(rows, key=lambda r: r[0])
                for result in expire_unsent(self.spec, index, raw, done, message)]

    def expire_unsubmitted(self, index: int, raw: dict[str, Any] | str, done_samples: frozenset[int],
                           message: str) -> list[RowResult]:
        return expire_unsent(self.spec, index, raw, done_samples, message)

    def poll(self) -> list[RowResult]:
        """Waits (at most a second) for a block to come back; its results, or none."""
        for _ in range(self._blocks_back):
            self.on_block(self)
        self._blocks_back = 0
        self._dispatch()
        refs = [ref for r in self._live() for ref in r.in_flight]
        if not refs:
            if self.queue and not self._closing:  # cannot happen while a replica runs; never end with rows missing
                raise ReplicaFailure("no replica is left to run the remaining rows")
            return []
        ready, _ = self.ray.wait(refs, num_returns=1, timeout=1.0)
        results = [result for ref in ready for result in self._collect(ref)]
        self.metrics.engine = self._snapshot()
        return results

    def _dispatch(self) -> None:
        """Tops every live replica up to `blocks_in_flight` blocks from the queue (retried blocks first)."""
        if self._closing:
            return
        for handle in self._live():
            while self.queue and len(handle.in_flight) < self.ray_options.blocks_in_flight:
                block = self.queue.popleft()
                block.attempts += 1
                handle.in_flight[handle.actor.run_block.remote(block.rows, block.done_samples)] = block

    def _collect(self, ref: Any) -> list[RowResult]:
        handle = next((r for r in self.replicas if ref in r.in_flight), None)
        if handle is None:  # its replica failed meanwhile; the block is queued again already
            return []
        block = handle.in_flight.pop(ref)
        try:
            result: BlockResult = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            self._replica_failed(handle, block, exc)
            return []
        if handle.stats is None or result.stats.blocks > handle.stats.blocks:
            handle.stats = result.stats  # the newest snapshot: a replica's blocks may come back out of order
        if self.on_block is not None:
            self._blocks_back += 1
        return result.results

    def _snapshot(self) -> EngineSnapshot:
        """The replicas' live counters, summed (each as of its last block)."""
        snaps = [r.stats.engine for r in self.replicas if r.stats is not None and r.status == "running"]
        return EngineSnapshot(*(sum(getattr(s, f) for s in snaps) for f in
                                ("running", "waiting", "preemptions", "kv_used", "kv_total", "drafted_tokens", "accepted_tokens")))

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
        if self.replacements < limit:
            self.replacements += 1
            self._spawn()
        elif not self._live():
            raise ReplicaFailure(f"every replica failed (last: {handle.error})")
        print(f"cbatch: replica {handle.number} failed ({handle.error}); its rows are retried", file=sys.stderr)

    # ---- report ----------------------------------------------------------------------------------
    def report(self, wall_seconds: float) -> dict[str, Any]:
        """The local report over all replicas, plus a `replicas` list and a `ray` section."""
        snapshots = [r.stats for r in self.replicas if r.stats is not None]
        total = merge_scheduler_stats([s.scheduler for s in snapshots])
        self.metrics.forward_seconds = sum(s.forward_seconds for s in snapshots)
        self.metrics.image_usage = dict(sum((Counter(s.image_usage) for s in snapshots), Counter()))
        options = self.options
        report = build_report(
            self.metrics, total, wall_seconds=wall_seconds,
            max_num_seqs=max((s.max_num_seqs for s in snapshots), default=0),  # what the replicas ran with
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


def merge_scheduler_stats(parts: list[SchedulerStats]) -> SchedulerStats:
    """Several engines' counters as one: sums, the largest peak, and the wait lists joined."""
    total = SchedulerStats()
    for part in parts:
        for name, value in asdict(part).items():
            if name == "peak_kv_blocks":
                total.peak_kv_blocks = max(total.peak_kv_blocks, value)
            elif isinstance(value, dict):  # e.g. queue waits per priority class: {class: [waits]}
                merged = getattr(total, name)
                for key, items in value.items():
                    merged.setdefault(key, []).extend(items)
            else:
                setattr(total, name, getattr(total, name) + value)
    return total


def run_ray_job(options: JobOptions, ray_options: RayOptions, make_progress=None,
                on_block: Callable[[RayExecutor], None] | None = None) -> int:
    """`cbatch run --ray`: same OUTPUT, report and exit codes as `run_job`. Raises JobError for a bad job.

    Like a local run, every check that can refuse the job (paths, input, model config, lock, resume
    state) runs before any replica starts.
    """
    check_ray_options(ray_options)
    prepared = preflight(options)  # the same checks and fingerprint as a local run: resume either way
    if prepared is None:
        return EXIT_OK
    if prepared.total_rows == 0:  # no replica starts for an empty INPUT
        return conclude_empty_job(options, prepared, make_progress)
    options = replace(options, engine=prepared.config)
    spec = job_spec(options, prepared)  # (a bad --result-cache is refused here, before any replica starts)
    token_source = ray_auth_token(ray_options.address)  # NOTE: before Ray's import, which reads RAY_AUTH_MODE
    ray = require_ray()
    started_ray = connect(ray, ray_options.address, token_source)
    metrics = JobMetrics(total_rows=prepared.total_rows)
    executor = RayExecutor(spec, options, ray_options, ray, metrics, on_block, prepared.state)
    try:
        executor.start_replicas()
        code = run_rows(options, prepared, executor, metrics, make_progress or make_display)
        report = executor.report(metrics.now())
    finally:
        executor.stop_replicas()
        if started_ray:
            ray.shutdown()
    return conclude_job(options, prepared, with_task(report, prepared.task), code,
                        f" | {executor.shape['replicas']} Ray replica(s)")
