"""Tensor parallelism's processes: rank 0 is the engine's own process (scheduler, sampler, driver: everything
runs once), ranks 1..N-1 are worker processes spawned on the same machine, each holding its share of the
weights and of the KV pool (cbatch.model.shard). Rank 0's build starts them (`start_group`); each loads its
share as rank 0 does (`load_rank_model`) and builds the same `ModelRunner`.

Rank 0 drives; a worker only mirrors its runner. Every message goes rank 0 -> workers over a gloo group
(pickled, small: the step's host arrays, `StepInputs`, never tensors of activations):
    ("runner", kwargs)   build a ModelRunner like rank 0's (the GPU's dummy profiling runners included)
    ("capture", n, len)  capture the decode CUDA graphs (their collectives are captured on every rank)
    ("loras", config)    make the LoRA adapter slots again for the config's adapters (the library adding one)
    ("step", inputs)     run the step: copies, swaps, forward, lm_head on the sampling rows (all-gathered
                         to rank 0, which samples)
    ("stop",)            exit
The model's collectives keep the ranks in lockstep. Every collective has a timeout, and a worker that dies
(killed, out of memory) surfaces on rank 0 as `WorkerFailure`: one line naming the rank, the job stops with
its finished rows kept (exit 74), and a rerun resumes.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from cbatch.config import EngineConfig
from cbatch.engine.resolve import ResolvedModel, load_rank_model
from cbatch.engine.runner import ModelRunner
from cbatch.lora.runtime import LoraSlots
from cbatch.model.decoder import LlamaForCausalLM
from cbatch.model.spec import ModelSpec
from cbatch.parallel import WorkerFailure
from cbatch.parallel.comm import ProcessGroupComm, init_process_group

COLLECTIVE_TIMEOUT_S = float(os.environ.get("CBATCH_TP_TIMEOUT", "600"))  # loading a shard counts, hence long
# How worker ranks start: "spawn", a fresh interpreter (no fork of torch's threads). A test hook: the test suite
# uses a "forkserver" that imported torch once (tests/conftest.py), the same fresh state per worker without
# importing torch again for each of its many ranks.
START_METHOD = "spawn"


@dataclass(frozen=True, slots=True)
class WorkerArgs:
    """What a worker needs to build its rank: the resolved model (config.json read, no weights) and settings."""

    rank: int
    world: int
    port: int
    config: EngineConfig
    resolved: ResolvedModel
    timeout_s: float


class Peers:
    """Rank 0's handle on the worker ranks: sends them each step, tells a dead worker from a bug."""

    def __init__(self, processes: list[mp.process.BaseProcess], control: Any, threads_before: int | None = None) -> None:
        self.processes = processes  # rank r is processes[r - 1]
        self.control = control  # the gloo group messages travel on
        self.threads_before = threads_before  # this process's torch threads before its rank's share (`close`)

    def send(self, message: tuple) -> None:
        try:
            dist.broadcast_object_list([message], src=0, group=self.control)
        except Exception as exc:  # the gloo error of a dead peer, or its timeout
            raise self.failure(exc) from None

    def send_runner(self, **kwargs: Any) -> None:
        self.send(("runner", kwargs))

    def send_step(self, inputs: Any) -> None:
        self.send(("step", inputs))

    def send_loras(self, config: EngineConfig) -> None:
        self.send(("loras", config))

    def send_capture(self, max_num_seqs: int, max_model_len: int) -> None:
        self.send(("capture", max_num_seqs, max_model_len))

    def failure(self, exc: BaseException) -> BaseException:
        """`WorkerFailure` naming the first dead worker, when one died; else `exc` itself (a bug)."""
        for rank, process in enumerate(self.processes, start=1):
            process.join(timeout=0.5 if process.exitcode is None else 0)
            if process.exitcode is not None:
                return WorkerFailure(f"tensor-parallel rank {rank} (pid {process.pid}) died with exit code "
                                     f"{process.exitcode} (killed, or out of memory?)")
        if isinstance(exc, dist.DistError) or "timed out" in str(exc).lower():
            return WorkerFailure(f"a tensor-parallel collective failed or timed out ({type(exc).__name__}: "
                                 f"{str(exc).splitlines()[0] if str(exc) else ''})")
        return exc

    def close(self) -> None:
        """Stops the workers (they exit after "stop"; a stuck one is terminated) and leaves the group."""
        if any(p.exitcode is None for p in self.processes):
            try:
                self.send(("stop",))
            except WorkerFailure:
                pass
        for process in self.processes:
            process.join(timeout=10)
            if process.exitcode is None:
                process.terminate()
                process.join(timeout=5)
        if dist.is_initialized():
            dist.destroy_process_group()
        self.processes = []
        if self.threads_before is not None:  # (the library's process goes on after its engine)
            torch.set_num_threads(self.threads_before)
            self.threads_before = None


def start_group(config: EngineConfig, resolved: ResolvedModel) -> tuple[ProcessGroupComm, Peers]:
    """Spawns ranks 1..N-1 and joins the group as rank 0; returns rank 0's communicator and its peers."""
    world = config.tensor_parallel_size
    port = _free_port()
    context = mp.get_context(START_METHOD)
    threads = rank_threads(config, resolved.device)
    worker_config = config if threads is None else replace(config, num_threads=threads)  # each rank alike
    processes = []
    for rank in range(1, world):
        args = WorkerArgs(rank, world, port, worker_config, resolved, COLLECTIVE_TIMEOUT_S)
        process = context.Process(target=worker_main, args=(args,), name=f"cbatch-tp{rank}", daemon=True)
        process.start()
        processes.append(process)
    comm = init_process_group(0, world, port, resolved.device, COLLECTIVE_TIMEOUT_S)
    threads_before = None
    if threads is not None:
        threads_before = torch.get_num_threads()
        torch.set_num_threads(threads)
    return comm, Peers(processes, dist.new_group(backend="gloo"), threads_before)


def rank_threads(config: EngineConfig, device: torch.device) -> int | None:
    """A CPU rank's torch threads without --threads: torch's threads for the process (its cores) split between the
    ranks (each rank's OpenMP pool would take them all, and N ranks' threads spin on the same cores); None: leave
    them."""
    if config.num_threads or device.type != "cpu" or config.tensor_parallel_size == 1:
        return None
    return max(1, torch.get_num_threads() // config.tensor_parallel_size)


def worker_main(args: WorkerArgs) -> None:
    """A worker rank: loads its share of the model, then mirrors rank 0's runner until "stop"."""
    device = args.resolved.device
    if device.type == "cuda":
        device = torch.device("cuda", args.rank)
    if args.config.num_threads:  # --threads, or rank 0's share of its threads (`rank_threads`)
        torch.set_num_threads(args.config.num_threads)
    comm = init_process_group(args.rank, args.world, args.port, device, args.timeout_s)
    control = dist.new_group(backend="gloo")
    model = load_rank_model(args.config, args.resolved, comm, device)
    rank = _WorkerRank(model, device, args.resolved.spec, _lora_slots(args.config, model, args.resolved.spec))
    try:
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0, group=control)
            message = box[0]
            if message[0] == "stop":
                break
            _serve(message, rank)
    finally:
        dist.destroy_process_group()


@dataclass(slots=True)
class _WorkerRank:
    """A worker's state: its share of the model, its runner (once rank 0 built its own), its LoRA slots."""

    model: LlamaForCausalLM
    device: torch.device
    spec: ModelSpec  # the full model's
    lora: LoraSlots | None
    runner: ModelRunner | None = None


def _lora_slots(config: EngineConfig, model: LlamaForCausalLM, spec: ModelSpec) -> LoraSlots | None:
    """This rank's share of the job's adapters in their slots (rank 0's build makes its own the same way)."""
    if not config.loras:
        return None
    slots = LoraSlots.for_job(config.loras, model, spec, config.max_loras, config.max_lora_rank)
    if slots.device.type == "cuda":
        slots.warm_up()  # the shrink / expand kernels compile now, not mid-run
    return slots


def _serve(message: tuple, worker: _WorkerRank) -> None:
    """Carries out one message from rank 0."""
    kind = message[0]
    if kind == "runner":
        worker.runner = ModelRunner(worker.model, device=worker.device, **message[1])
        worker.runner.lora = worker.lora
        return
    if kind == "loras":
        worker.lora = _lora_slots(message[1], worker.model, worker.spec)
        if worker.runner is not None:
            worker.runner.lora = worker.lora
        return
    runner = worker.runner
    if kind == "capture":
        runner.capture_decode_graphs(message[1], message[2])
    elif kind == "step":
        runner.begin_step()
        runner.run_step(message[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
