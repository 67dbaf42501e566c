"""Host work per step with the model call taken out: scheduling, flat-batch building, attention prep.

    python benchmarks/host_overhead.py                   # 256 and 1024 running sequences
    python benchmarks/host_overhead.py --running 4096 --steps 50

A real Engine (SmolLM2-135M's shapes, one layer, random weights, CPU) runs steady-state decode
steps, but the model call is replaced by its host part only: release preempted rows, `_build`
(tokens, positions, slots, block-table rows), the tensors (`to_device`), the sampling settings;
the "sampled" token is a constant. Both step orders run: `sync` (schedule, build, update: the CPU's
default) and `async` (the GPU's default: the check that the next step may go ahead, schedule, build,
then the previous step's resolve and this one's account). `--params per-row` gives every request its own
SamplingParams object, as a CLI job's rows have. The figures are what a GPU step would have to hide:
targets are <= 1 ms at 256 sequences and <= 3 ms at 1024 for the whole host step on the slowest
CPU kind (a Zen 3). Timings are medians over the measured steps (process CPU time when --cpu-time,
else wall time); the TorchBackend's per-step `prepare` (CPU path only) is shown apart, not counted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.resolve import resolve_model
from cbatch.engine.step import StepOutput
from cbatch.model.backend import TorchBackend
from cbatch.model.spec import parse_spec

# SmolLM2-135M-Instruct's shapes with a single layer: the model is never called, and one layer keeps
# the KV pool small at thousands of sequences.
_SPEC = dict(
    architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576, intermediate_size=1536,
    num_hidden_layers=1, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
)


def measure(running: int, steps: int, prompt_len: int, clock, async_order: bool, per_row_params: bool) -> dict[str, float]:
    """Median milliseconds per decode step for each host phase, with `running` sequences decoding."""
    spec = parse_spec(dict(_SPEC))
    blocks = running * (-(-(prompt_len + steps + 8) // 16)) + 1
    # the torch backend: the model never runs here, and the compiled CPU kernels would be built first on a fresh machine
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=running, async_scheduling=async_order,
                          max_num_batched_tokens=max(running, 8192), num_kv_blocks=blocks, attention_backend="torch")
    engine = build_engine(config, resolve_model(config, spec))
    runner, torch_backend = engine.runner, TorchBackend()
    times: dict[str, list[float]] = {"schedule": [], "build": [], "torch_prepare": [], "whole": []}
    timing = {"on": False}

    def host_only_launch(plan):  # ModelRunner.forward's host part (keep in step with it), then a constant token
        runner.release(plan)
        runner.begin_step()
        t0 = clock()
        inputs, sampling_seqs, _, _, offsets = runner._build(plan)
        batch = inputs.to_device(runner.device, runner.block_size, runner._last_sampled, runner.staging)  # host copies on a GPU
        runner.sampling.build(sampling_seqs, offsets, plan.drafts)  # the sampling settings (and seeds) of each step
        runner._last_sampled = torch.full((len(sampling_seqs),), 7, dtype=torch.int64)
        runner._last_row = dict(zip([seq.seq_id for seq in sampling_seqs], range(len(sampling_seqs))))  # as `launch`
        t1 = clock()
        torch_backend.prepare(batch.meta)  # the CPU path's per-step prep (decode groups, masks)
        t2 = clock()
        if timing["on"]:
            times["build"].append(t1 - t0)
            times["torch_prepare"].append(t2 - t1)
        return _Sampled(StepOutput({seq.seq_id: 7 for seq in sampling_seqs}))

    schedule = engine.scheduler.schedule

    def timed_schedule():
        t0 = clock()
        plan = schedule()
        if timing["on"]:
            times["schedule"].append(clock() - t0)
        return plan

    runner.launch = host_only_launch
    runner.execute = lambda plan: host_only_launch(plan).result()
    engine.scheduler.schedule = timed_schedule
    # enough tokens to decode through the measured steps (not 10**6: admission refuses a request whose prompt +
    # max_tokens cannot fit the pool even alone, and the pool holds prompt + steps per sequence)
    max_tokens = steps + 8
    shared = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i in range(running):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True) if per_row_params else shared
        engine.add_request([(i * 31 + j) % 40000 + 100 for j in range(prompt_len)], params)
    while any(s.num_computed < s.prompt_len for s in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step()  # prefill everyone (through the same fake step)
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == running, "every sequence should be decoding"
    timing["on"] = True
    for _ in range(steps):
        t0 = clock()
        engine.step()
        times["whole"].append(clock() - t0 - times["torch_prepare"][-1])
    assert engine.steps_ahead >= steps if async_order else engine.steps_ahead == 0, "the step order asked for"
    result = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    result["update"] = statistics.median(
        w - s - b for w, s, b in zip(times["whole"], times["schedule"], times["build"])) * 1e3
    return result


class _Sampled:
    """A launched fake step: its constant tokens."""

    def __init__(self, output: StepOutput) -> None:
        self.output = output

    def result(self) -> StepOutput:
        return self.output


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--running", type=int, nargs="+", default=[256, 1024], help="sequences decoding in every step")
    p.add_argument("--steps", type=int, default=100, help="measured steps (after warm-up)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1, help="torch threads (host work is mostly single-threaded)")
    p.add_argument("--cpu-time", action="store_true", help="process CPU time instead of wall time (for loaded machines)")
    p.add_argument("--order", choices=["sync", "async", "both"], default="both",
                   help="step order: sync (the CPU's default), async (the GPU's default), or both")
    p.add_argument("--params", choices=["shared", "per-row"], default="shared",
                   help="one SamplingParams for all requests, or one per request (a CLI job's rows)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.cpu_time else time.perf_counter
    results = {}
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; "
          f"{'CPU' if args.cpu_time else 'wall'} time, medians over {args.steps} decode steps, "
          f"SamplingParams {args.params}")
    print("| order | running | schedule ms | build ms | update ms | whole host step ms | torch prepare ms (CPU path, apart) |")
    print("|---|---|---|---|---|---|---|")
    orders = ["sync", "async"] if args.order == "both" else [args.order]
    for order in orders:
        for n in args.running:
            r = measure(n, args.steps, args.prompt_len, clock, order == "async", args.params == "per-row")
            results[f"{order}/{n}"] = r
            print(f"| {order} | {n} | {r['schedule']:.3f} | {r['build']:.3f} | {r['update']:.3f} | "
                  f"{r['whole']:.3f} | {r['torch_prepare']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
