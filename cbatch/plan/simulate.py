"""The job's rows through the same code as `cbatch run`, with a cost model in place of the model. Two passes:

    1. check: every row -> LocalExecutor.prepare (its task's parse and requests, the result cache)
              -> Engine.check_prompt (context length, KV pool, grammar, images): the error rows, the rows that run
    2. simulate: those rows (their token ids; above PLAN_SIMULATED_ROWS an even sample of them) -> RowFeed
              -> LocalExecutor -> PlannedEngine -> the real Scheduler and BlockPool, stepped by PlannedRunner
              (the simulator's runner: time is its cost model's, each row "generates" its planned length)
              -> the driver's counts -> report, its totals scaled from the sample to every row

A row's images are counted from their headers in pass 1 (no pixels) and kept with the sample: a replayed row is
token ids, and takes its images back by its index (`PlannedEngine.row_images`), so the simulated prefix cache keys
image blocks by the images' digests as the run's does, and the encoder budget and a bidirectional model's whole
image chunks (Gemma 3) schedule as in the run.

So a row is an error row in the plan exactly when it would be one in the run (same parsing, tokenizer,
chat template, context length and KV pool), and the schedule is the one the run would take for those
lengths. The search replays the same rows under other batch settings. The sample keeps a plan of 10M rows
to the cost of checking them: the schedule of a long job is its steady state, which an even sample of
25,000 rows shows as the whole does (the tail of one sample's last rows is scaled with it: a small overestimate).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Iterator
from typing import Sequence as Sequence_

from cbatch.bench.simulator import CostModel, SimulatedRunner, kept_drafts, on_cost_clock
from cbatch.config import SAMPLING_FIELDS, EngineConfig, SamplingParams
from cbatch.engine import memory
from cbatch.engine.engine import Engine
from cbatch.engine.images import PromptImage
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
from cbatch.run.job_spec import JobSpec
from cbatch.tasks.base import RowWork, Task
from cbatch.run.result_cache import CacheSpec
from cbatch.tasks.results import RowResult

SEARCH_MAX_NUM_SEQS = (16, 32, 64, 128, 256)
SEARCH_MAX_NUM_BATCHED_TOKENS = (512, 1024, 2048, 4096, 8192)
PLAN_SIMULATED_ROWS = 25_000  # above it the schedule is simulated on an even sample of the rows, its totals scaled


class PlannedRunner(SimulatedRunner):
    """The simulator's runner with planned output lengths: a row samples a filler token (never EOS) until
    it has `targets[seq_id] - 1` tokens, then EOS; the clock advances by the cost model's price. A row verifying
    drafts (--speculative) keeps as many as `kept_drafts` draws (--speculative-acceptance), never past its
    planned length: a draft that is an EOS id is kept only where the plan ends the row."""

    def __init__(self, cost: CostModel, eos_ids: tuple[int, ...], vocab_size: int, acceptance: float = 0.0) -> None:
        super().__init__(cost, acceptance)
        self.targets: dict[int, int] = {}  # seq_id -> planned output length
        self.eos_ids = frozenset(eos_ids)
        self.eos = min(eos_ids) if eos_ids else None
        # two non-EOS tokens: the filler, and the target's own token where it rejects a draft equal to the filler
        self.filler, self.other = [t for t in range(vocab_size) if t not in eos_ids][:2]

    def planned(self, seq: Sequence, index: int) -> int:
        """The token the plan puts at output index `index` of `seq`: EOS at its planned length, else the filler."""
        return self.eos if index + 1 >= self.targets[seq.seq_id] and self.eos is not None else self.filler

    def execute(self, plan: StepPlan) -> StepOutput:
        self.forward_seconds += self.cost.step_cost(plan.info)
        sampled = {}
        for seq, num_new in plan.scheduled:
            if seq.num_computed + num_new >= seq.num_tokens:  # this chunk reaches the end: it samples
                for sample in seq.samples if seq.pending_children else [seq]:  # and so do the samples it forks
                    sampled[sample.seq_id] = self.planned(sample, len(sample.output_ids))
        if not plan.drafts:
            return StepOutput(sampled)
        rows = {seq.seq_id: seq for seq, _ in plan.scheduled}
        return StepOutput(sampled, verified={seq_id: self._planned_targets(rows[seq_id], plan.step, drafted)
                                             for seq_id, drafted in plan.drafts.items()})

    def _planned_targets(self, seq: Sequence, step: int, drafted: list[int]) -> list[int]:
        """The target's tokens at a verified row's positions, up to the first that differs from its draft."""
        kept, start, targets = kept_drafts(seq.seq_id, step, len(drafted), self.acceptance), len(seq.output_ids), []
        for j, draft in enumerate(drafted):
            planned = self.planned(seq, start + j)
            if j < kept:  # kept, unless the plan ends the row here or the draft would end it early
                target = planned if planned == self.eos or draft in self.eos_ids else draft
            else:  # the draw rejects it: the target's token differs
                target = planned if planned != draft else self.other
            targets.append(target)
            if target != draft:
                return targets
        return [*targets, self.planned(seq, start + len(drafted))]


@dataclass(eq=False)
class PlannedEngine(Engine):
    """The engine, checking each request as a run does (`Engine.add_request`), then planning its length.
    No text is generated, so stop strings are not checked: the planned length stands for them. Images are counted
    from their headers (their size and digest; no pixels are decoded) and placed as the run places them; none is
    encoded here."""

    lengths: OutputLengths = field(default_factory=OutputLengths)
    # the sampled rows' images by row index: a replayed row is token ids alone (`replay`)
    row_images: dict[int, tuple[PromptImage, ...]] = field(default_factory=dict)
    decodes_images: ClassVar[bool] = False  # an image's header is enough to plan its tokens

    def add_request(self, prompt_ids: list[int], params: SamplingParams, seq_id: int | None = None,
                    samples: Sequence_[int] | None = None, pooling: PoolingParams | None = None,
                    images: Sequence_[PromptImage] | None = None) -> Sequence:
        if images is None and seq_id is not None:
            images = self.row_images.get(seq_id)
        seq = super().add_request(prompt_ids, params, seq_id, samples, pooling, images)
        if not seq.is_finished:
            for sample in seq.samples:  # each sample its own planned length (as each draws its own tokens)
                sample.stop = None
                key = seq.seq_id * params.n + sample.sample_index
                # (the sequence's own settings: a prefill-only request's max_tokens 1 plans the prompt alone)
                self.runner.targets[sample.seq_id] = self.lengths.of(key, seq.params, bool(self.spec.eos_token_ids))
        return seq


@dataclass(slots=True)
class PlanSetup:
    """What every simulation of one plan shares."""

    model: ResolvedModel
    kind: DeviceKind
    tokenizer: Any
    cost: CostModel
    lengths: OutputLengths
    task: Task  # --task with its settings (the sampling defaults among them)
    lookahead: int
    acceptance: float = 0.0  # --speculative-acceptance: the share of drafted tokens the simulation keeps

    def spec(self, config: EngineConfig, cache: CacheSpec | None = None) -> JobSpec:
        """The job as a run of `config` would take it (the rows a planned run copies from `cache`: lookups only)."""
        return JobSpec(config, self.task, self.lookahead, result_cache=cache)


# row index -> (prompt token ids: 4 B a token, settings, its images counted from their headers: () for none)
RowSample = dict[int, tuple[array, SamplingParams, tuple[PromptImage, ...]]]


@dataclass(slots=True)
class CheckedRows:
    """Pass 1: every row checked as the run checks it on arrival."""

    total: int
    errors: list[RowResult]  # in input order
    cached: int  # rows the run would copy from the result cache
    accepted: int  # rows that would run
    sample: RowSample  # the rows the simulations schedule: every accepted row, or an even sample of them
    adapters: dict[str, int] = field(default_factory=dict)  # rows that would run per LoRA adapter ("base": none)

    @property
    def scale(self) -> float:
        """Accepted rows per simulated row (1.0: every row simulated)."""
        return self.accepted / len(self.sample) if self.sample else 1.0

    def sample_images(self) -> dict[int, tuple[PromptImage, ...]]:
        """The sampled rows' images by row index (rows without images left out)."""
        return {index: images for index, (_, _, images) in self.sample.items() if images}


@dataclass(slots=True)
class Simulation:
    config: EngineConfig
    errors: list[RowResult]  # rows this simulation's settings fail (a smaller KV pool than the job's)
    report: dict[str, Any]  # the simulated run's report (build_report), in the cost model's time, of the sample
    scale: float  # CheckedRows.scale: the sample's totals times this are the job's
    drain: float  # the time from the last row's admission to the end: the tail, which a sample does not lengthen

    @property
    def wall(self) -> float:
        """The job's: the sample's time until every row is admitted, scaled, then its drain."""
        sample_wall = self.report["time"]["wall_seconds"]
        return (sample_wall - self.drain) * self.scale + self.drain

    def predicted(self) -> dict[str, Any]:
        """The whole job's prediction: the sample's totals scaled, its rates and fractions as they are."""
        r, t, u, k = self.report, self.report["throughput"], self.report["utilization"], self.scale
        steps_k = self.wall / max(r["time"]["wall_seconds"], 1e-12) if k != 1 else 1.0  # steps follow the time
        return {
            "wall_seconds": self.wall, "output_tokens_per_s": t["output_tokens_per_s"],
            "total_tokens_per_s": t["total_tokens_per_s"], "requests_per_s": t["requests_per_s"],
            "prompt_tokens": round(r["tokens"]["prompt"] * k), "output_tokens": round(r["tokens"]["output"] * k),
            "steps": round(u["steps"] * steps_k), "mean_batch_occupancy": u["mean_batch_occupancy"],
            "mean_kv_usage": u["mean_kv_usage"], "peak_kv_usage": u["peak_kv_usage"],
            "preemptions": round(u["preemptions"] * k), "recomputed_tokens": round(u["recomputed_tokens"] * k),
            "prefix_cache_hit_rate": u["prefix_cache_hit_rate"], "num_kv_blocks": u["kv_blocks_total"],
            "max_num_seqs": self.config.max_num_seqs, "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "latency_seconds": r["latency"]["seconds"]["total"], "simulated_rows": r["requests"]["total"],
            **({"speculative": self.speculative()} if "speculative" in r else {}),
        }

    def speculative(self) -> dict[str, Any]:
        """--speculative: drafted and kept tokens scaled to the job; the rates (acceptance, per step) as they are."""
        spec, k = self.report["speculative"], self.scale
        return {**spec, **{key: round(spec[key] * k) for key in ("drafted_tokens", "accepted_tokens", "draft_steps")}}


def planned_engine(config: EngineConfig, setup: PlanSetup,
                   row_images: dict[int, tuple[PromptImage, ...]] | None = None) -> PlannedEngine:
    """The engine a simulation steps: the run's on the planned device, the cost model for the model. The step limits
    the run would get on that device fill in what `config` leaves unset. `row_images`: replayed rows' images."""
    spec = setup.model.spec
    config = memory.with_step_limits(config, setup.kind.device)
    return on_cost_clock(PlannedEngine(
        config, PlannedRunner(setup.cost, spec.eos_token_ids, spec.vocab_size, setup.acceptance),
        setup.kind.kv_pool(config, setup.model), setup.model.max_model_len, spec=spec, tokenizer=setup.tokenizer,
        device=setup.model.device, dtype=setup.model.dtype, model_dir=setup.model.checkpoint.path,
        lengths=setup.lengths, row_images=row_images or {},
    ))


def check_rows(rows: Iterator[RawRow], config: EngineConfig, setup: PlanSetup, total_rows: int,
               cache: CacheSpec | None = None) -> CheckedRows:
    """Pass 1: every row through `LocalExecutor.prepare` and `Engine.check_prompt`, as the run takes it on
    arrival; nothing is scheduled. A row found in `cache` (opened for lookups only) is not simulated: the run
    would copy it. Every `every`-th row that would run goes to the sample (all of them up to PLAN_SIMULATED_ROWS)."""
    engine = planned_engine(config, setup)
    executor = LocalExecutor(engine, setup.spec(config, cache), JobMetrics(total_rows=total_rows))
    every = max(1, -(-total_rows // PLAN_SIMULATED_ROWS))
    checked = CheckedRows(total_rows, [], 0, 0, {})
    for index, raw in rows:
        work = executor.prepare(index, raw)
        if not isinstance(work, RowWork):
            if work.ok:
                checked.cached += 1
            else:
                checked.errors.append(work)
            continue
        request = work.requests[0]  # (a generation row's one request: prefill-only plans take every row instead)
        params = request.params
        prompt_ids, _, error = engine.check_prompt(request.prompt_ids, params, request.images)
        if error is not None:
            checked.errors.append(RowResult.failed(index, work.parsed.row_id, error, len(prompt_ids)))
            continue
        checked.accepted += 1
        if engine.config.loras:
            checked.adapters[params.lora or "base"] = checked.adapters.get(params.lora or "base", 0) + 1
        if index % every == 0:
            checked.sample[index] = (array("i", prompt_ids), params, tuple(request.images or ()))
    return checked


def simulate_rows(rows: Iterator[RawRow], config: EngineConfig, setup: PlanSetup, num_rows: int,
                  scale: float = 1.0, cache: CacheSpec | None = None,
                  row_images: dict[int, tuple[PromptImage, ...]] | None = None) -> tuple[Simulation, int]:
    """Pass 2: the rows (checked ones, replayed, with their images `row_images`) through LocalExecutor and the
    planned engine, driven by the job's own loop; (the simulation, the rows copied from `cache`: a prefill-only
    plan's single pass consults it)."""
    engine = planned_engine(config, setup, row_images)
    metrics = JobMetrics(total_rows=num_rows, clock=lambda: engine.runner.forward_seconds)
    executor = LocalExecutor(engine, setup.spec(engine.config, cache), metrics)
    errors: list[RowResult] = []

    def store(result: RowResult) -> bool:
        if not result.ok:
            errors.append(result)
        return True

    drive(RowFeed(rows), executor, store, metrics, NoProgress())
    report = build_report(metrics, engine.scheduler.stats, wall_seconds=metrics.now(), max_num_seqs=engine.config.max_num_seqs,
                          num_kv_blocks=engine.pool.num_blocks, settings={}, time_unit=setup.cost.unit)
    admitted = max((sample.t for sample in metrics.series if sample.waiting > 0), default=0.0)
    return Simulation(engine.config, errors, report, scale, drain=metrics.now() - admitted), metrics.cached_rows


def replay(sample: RowSample, defaults: SamplingParams) -> Callable[[], Iterator[RawRow]]:
    """The checked rows again, as token-id rows with the settings they differ from the defaults in (each
    simulation re-reads them; a row that only sets its prompt parses at the cost of its prompt). Their images are
    not in the rows: the engine takes them by index (`CheckedRows.sample_images`)."""
    def rows() -> Iterator[RawRow]:
        for index, (prompt_ids, params, _) in sample.items():
            if params is defaults:
                yield index, {"prompt_token_ids": list(prompt_ids)}
                continue
            # (getattr, not dataclasses.asdict: that deep-copies every field of every row of every simulation)
            settings = {k: v for k in SAMPLING_FIELDS if (v := getattr(params, k)) is not None and v != getattr(defaults, k)}
            if params.lora is not None:  # (a row field, not a sampling one)
                settings["lora"] = params.lora
            yield index, {"prompt_token_ids": list(prompt_ids), **settings}

    return rows


def simulate_checked(checked: CheckedRows, config: EngineConfig, setup: PlanSetup) -> Simulation:
    return simulate_rows(replay(checked.sample, setup.task.defaults)(), config, setup, len(checked.sample),
                         checked.scale, row_images=checked.sample_images())[0]


def simulate_every_row(rows: Iterator[RawRow], config: EngineConfig, setup: PlanSetup, total_rows: int,
                       cache: CacheSpec | None = None) -> tuple[CheckedRows, Simulation]:
    """A prefill-only job (--task): every row through the run's loop in one pass, checked and simulated (its rows
    are not replayed: a bi-encoder score row is two requests), so neither sampled nor searched."""
    simulation, cached = simulate_rows(rows, config, setup, total_rows, cache=cache)
    errors = sorted(simulation.errors, key=lambda r: r.index)
    simulation.errors = []  # (the job's own errors: the checked rows', not a setting's)
    ran = simulation.report["requests"]["total"] - len(errors) - cached
    return CheckedRows(total_rows, errors, cached, ran, {}), simulation


def search(first: Simulation, checked: CheckedRows, setup: PlanSetup) -> list[Simulation]:
    """A small coordinate search from the job's settings: --max-num-seqs at its token budget, then the
    token budget at the fastest of those. A setting under which a row that runs with the job's settings
    would fail (a smaller KV pool) is never the answer. Returns every simulation, the job's first."""
    tried = {(first.config.max_num_seqs, first.config.max_num_batched_tokens): first}
    best = first
    for name, values in (("max_num_seqs", SEARCH_MAX_NUM_SEQS), ("max_num_batched_tokens", SEARCH_MAX_NUM_BATCHED_TOKENS)):
        for value in values:
            config = replace(best.config, **{name: value})
            key = (config.max_num_seqs, config.max_num_batched_tokens)
            if key not in tried:
                tried[key] = simulate_checked(checked, config, setup)
        best = fastest(list(tried.values()))
    return list(tried.values())


def fastest(simulations: list[Simulation]) -> Simulation:
    """The quickest simulation that fails no row the first one ran (ties: the earlier one)."""
    allowed = [s for s in simulations if s is simulations[0] or not s.errors]
    return min(allowed, key=lambda s: s.wall)
