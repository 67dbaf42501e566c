"""Every runner the engine can step satisfies the whole `Runner` protocol, `launch` included (asynchronous
scheduling calls it): the model's runner, the simulator's and the planner's. `cbatch plan --async-scheduling`
and `cbatch bench --simulate --async-scheduling` once stopped with an AttributeError on `launch`; now they run and
count the steps the synchronous order counts."""
from __future__ import annotations

import json
import random

from cbatch.bench.simulator import CostModel, SimulatedRunner, simulate
from cbatch.bench.workload import BenchRequest
from cbatch.config import EngineConfig
from cbatch.engine.engine import PendingResult, Runner
from cbatch.plan.simulate import PlannedRunner
from helpers import make_engine
from ops_jobs import run_inprocess, write_jsonl


def protocol_members(protocol: type) -> set[str]:
    """A Protocol's attributes and methods (its own, not `object`'s or typing's)."""
    names = set(getattr(protocol, "__annotations__", {}))
    names |= {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    return names


def test_every_runner_satisfies_the_protocol(tiny_checkpoints):
    members = protocol_members(Runner)
    assert {"launch", "execute", "idle", "close", "reset", "forward_seconds"} <= members
    runners = [make_engine(tiny_checkpoints["llama"]).runner, SimulatedRunner(CostModel()),
               PlannedRunner(CostModel(), (2,), 100)]
    for runner in runners:
        missing = {m for m in members if not hasattr(runner, m)}
        assert not missing, f"{type(runner).__name__} lacks {sorted(missing)}"
    assert protocol_members(PendingResult) == {"result"}


def test_simulated_bench_schedules_ahead_with_the_synchronous_step_count():
    rng = random.Random(3)
    requests = [BenchRequest(rng.randint(4, 60), rng.randint(1, 40), 0) for _ in range(40)]
    runs = {flag: simulate(requests, EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, async_scheduling=flag),
                           CostModel(), max_model_len=4096) for flag in (False, True)}
    assert runs[True].stats.steps == runs[False].stats.steps > 40
    assert runs[True].wall == runs[False].wall
    assert runs[True].metrics.output_tokens == runs[False].metrics.output_tokens == sum(r.output_len for r in requests)


def test_plan_schedules_ahead_with_the_synchronous_step_count(tiny_checkpoints, tmp_path):
    rng = random.Random(4)
    rows = [{"prompt_token_ids": [rng.randrange(3, 300) for _ in range(rng.randint(2, 30))],
             "max_tokens": rng.randint(1, 20)} for _ in range(12)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    predicted = {}
    for flag in ("--no-async-scheduling", "--async-scheduling"):
        report = tmp_path / f"plan{flag}.json"
        code, _, err = run_inprocess("plan", str(source), "--model", str(tiny_checkpoints["llama"]), "--device", "cpu",
                                     "--max-num-seqs", "4", flag, "--no-search", "--report", str(report))
        assert code == 0, err
        predicted[flag] = json.loads(report.read_text())["predicted"]
    sync, ahead = predicted["--no-async-scheduling"], predicted["--async-scheduling"]
    assert ahead["steps"] == sync["steps"] > 12
    assert ahead["output_tokens"] == sync["output_tokens"] and ahead["wall_seconds"] == sync["wall_seconds"]
