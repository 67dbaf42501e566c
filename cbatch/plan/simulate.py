"""The job's rows through the same code as `cbatch run`, with a cost model in place of the model.

    rows -> RowFeed -> LocalExecutor (parse_row, tokenize_request, the result cache) -> PlannedEngine
         -> the real Scheduler and BlockPool, stepped by PlannedRunner (the simulator's runner: time is
            its cost model's, each row "generates" its planned length) -> the driver's counts -> report

So a row is an error row in the plan exactly when it would be one in the run (same parsing, tokenizer,
chat template, context length and KV pool), and the schedule is the one the run would take for those
lengths. The search replays the accepted rows (their token ids) under other batch settings.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator
from typing import Sequence as Sequence_

from cbatch.bench.simulator import CostModel, SimulatedRunner
from cbatch.config import SAMPLING_FIELDS, EngineConfig, SamplingParams
from cbatch.engine import memory
from cbatch.engine.engine import Engine
from cbatch.engine.pooling import PoolingParams
from cbatch.engine.resolve import ResolvedModel
from cbatch.engine.step import StepOutput, StepPlan
from cbatch.engine.sequence import Sequence
from cbatch.io.reader import RawRow
from cbatch.observe.metrics import JobMetrics
from cbatch.observe.progress import NoProgress
from cbatch.observe.report import build_report
from cbatch.plan.devices import DeviceKind
from cbatch.plan.lengths import OutputLengths
from cbatch.run.driver import RowFeed, drive
from cbatch.run.executor import LocalExecutor
from cbatch.run.result_cache import RowCache
from cbatch.run.results import RowResult

SEARCH_MAX_NUM_SEQS = (16, 32, 64, 128, 256)
SEARCH_MAX_NUM_BATCHED_TOKENS = (512, 1024, 2048, 4096, 8192)


class PlannedRunner(SimulatedRunner):
    """The simulator's runner with planned output lengths: a row samples a filler token (never EOS) until
    it has `targets[seq_id] - 1` tokens, then EOS; the clock advances by the cost model's price."""

    def __init__(self, cost: CostModel, eos_ids: tuple[int, ...], vocab_size: int) -> None:
        super().__init__(cost)
        self.targets: dict[int, int] = {}  # seq_id -> planned output length
        self.eos = min(eos_ids) if eos_ids else None
        self.filler = next(t for t in range(vocab_size) if t not in eos_ids)

    def execute(self, plan: StepPlan) -> StepOutput:
        self.forward_seconds += self.cost.step_cost(plan.info)
        sampled = {}
        for seq, num_new in plan.scheduled:
            if seq.num_computed + num_new >= seq.num_tokens:  # this chunk reaches the end: it samples
                for sample in seq.samples if seq.pending_children else [seq]:  # and so do the samples it forks
                    last = len(sample.output_ids) + 1 >= self.targets[sample.seq_id]
                    sampled[sample.seq_id] = self.eos if last and self.eos is not None else self.filler
        return StepOutput(sampled)


@dataclass(eq=False)
class PlannedEngine(Engine):
    """The engine, checking each request as a run does (`Engine.add_request`), then planning its length.
    No text is generated, so stop strings are not checked: the planned length stands for them."""

    lengths: OutputLengths = field(default_factory=OutputLengths)
    accepted: dict[int, tuple[array, SamplingParams]] = field(default_factory=dict)  # for the search: 4 B a token

    def add_request(self, prompt_ids: list[int], params: SamplingParams, seq_id: int | None = None,
                    samples: Sequence_[int] | None = None, pooling: PoolingParams | None = None) -> Sequence:
        seq = super().add_request(prompt_ids, params, seq_id, samples, pooling)
        if not seq.is_finished:
            for sample in seq.samples:  # each sample its own planned length (as each draws its own tokens)
                sample.stop = None
                key = seq.seq_id * params.n + sample.sample_index
                self.runner.targets[sample.seq_id] = (1 if pooling is not None else  # prefill-only: the prompt alone
                                                      self.lengths.of(key, params, bool(self.spec.eos_token_ids)))
            self.accepted[seq.seq_id] = (array("i", prompt_ids), params)
        return seq


@dataclass(slots=True)
class PlanSetup:
    """What every simulation of one plan shares."""

    model: ResolvedModel
    kind: DeviceKind
    tokenizer: Any
    cost: CostModel
    lengths: OutputLengths
    defaults: SamplingParams
    lookahead: int
    pooling: PoolingParams | None = None  # a prefill-only job's settings (--task)


@dataclass(slots=True)
class Simulation:
    config: EngineConfig
    errors: list[RowResult]  # in the order they came (rows that fail on arrival first)
    cached: int
    report: dict[str, Any]  # the simulated run's report (build_report), in the cost model's time
    accepted: dict[int, tuple[array, SamplingParams]]

    @property
    def wall(self) -> float:
        return self.report["time"]["wall_seconds"]

    def predicted(self) -> dict[str, Any]:
        r, t, u = self.report, self.report["throughput"], self.report["utilization"]
        return {
            "wall_seconds": self.wall, "output_tokens_per_s": t["output_tokens_per_s"],
            "total_tokens_per_s": t["total_tokens_per_s"], "requests_per_s": t["requests_per_s"],
            "prompt_tokens": r["tokens"]["prompt"], "output_tokens": r["tokens"]["output"], "steps": u["steps"],
            "mean_batch_occupancy": u["mean_batch_occupancy"], "mean_kv_usage": u["mean_kv_usage"],
            "peak_kv_usage": u["peak_kv_usage"], "preemptions": u["preemptions"],
            "recomputed_tokens": u["recomputed_tokens"], "prefix_cache_hit_rate": u["prefix_cache_hit_rate"],
            "num_kv_blocks": u["kv_blocks_total"], "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "latency_seconds": r["latency"]["seconds"]["total"],
        }


def simulate_rows(rows: Iterator[RawRow], config: EngineConfig, setup: PlanSetup, total_rows: int,
                  cache: RowCache | None = None) -> Simulation:
    """Every row through LocalExecutor and the planned engine, driven by the job's own loop. A row found
    in `cache` (opened for lookups only) is not simulated: the run would copy it. The step limits the run
    would get on the planned device fill in what `config` leaves unset."""
    spec = setup.model.spec
    config = memory.with_step_limits(config, setup.kind.device)
    engine = PlannedEngine(
        config, PlannedRunner(setup.cost, spec.eos_token_ids, spec.vocab_size), setup.kind.kv_pool(config, setup.model),
        setup.model.max_model_len, spec=spec, tokenizer=setup.tokenizer, device=setup.model.device,
        dtype=setup.model.dtype, model_dir=setup.model.checkpoint.path, lengths=setup.lengths,
    )
    metrics = JobMetrics(total_rows=total_rows, clock=lambda: engine.runner.forward_seconds)
    executor = LocalExecutor(engine, setup.defaults, metrics, setup.lookahead, cache, pooling=setup.pooling)
    errors: list[RowResult] = []

    def store(result: RowResult) -> bool:
        if not result.ok:
            errors.append(result)
        return True

    drive(RowFeed(rows), executor, store, metrics, NoProgress())
    report = build_report(metrics, engine.scheduler.stats, wall_seconds=metrics.now(), max_num_seqs=config.max_num_seqs,
                          num_kv_blocks=engine.pool.num_blocks, settings={}, time_unit=setup.cost.unit)
    return Simulation(config, errors, metrics.cached_rows, report, engine.accepted)


def replay(accepted: dict[int, tuple[array, SamplingParams]]) -> Callable[[], Iterator[RawRow]]:
    """The accepted rows again, as token-id rows with their settings (each simulation re-reads them)."""
    def rows() -> Iterator[RawRow]:
        for index, (prompt_ids, params) in sorted(accepted.items()):
            # (getattr, not dataclasses.asdict: that deep-copies every field of every row of every simulation)
            settings = {k: v for k in SAMPLING_FIELDS if (v := getattr(params, k)) is not None}
            yield index, {"prompt_token_ids": list(prompt_ids), **settings}

    return rows


def search(first: Simulation, setup: PlanSetup) -> list[Simulation]:
    """A small coordinate search from the job's settings: --max-num-seqs at its token budget, then the
    token budget at the fastest of those. A setting under which a row that runs with the job's settings
    would fail (a smaller KV pool) is never the answer. Returns every simulation, the job's first."""
    rows = replay(first.accepted)
    tried = {(first.config.max_num_seqs, first.config.max_num_batched_tokens): first}
    best = first
    for name, values in (("max_num_seqs", SEARCH_MAX_NUM_SEQS), ("max_num_batched_tokens", SEARCH_MAX_NUM_BATCHED_TOKENS)):
        for value in values:
            config = replace(best.config, **{name: value})
            key = (config.max_num_seqs, config.max_num_batched_tokens)
            if key not in tried:
                tried[key] = simulate_rows(rows(), config, setup, len(first.accepted))
        best = fastest(list(tried.values()))
    return list(tried.values())


def fastest(simulations: list[Simulation]) -> Simulation:
    """The quickest simulation that fails no row the first one ran (ties: the earlier one)."""
    allowed = [s for s in simulations if s is simulations[0] or not s.errors]
    return min(allowed, key=lambda s: s.wall)
