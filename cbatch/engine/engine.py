"""The step loop tying scheduler and runner together, and the library API (`LLM.generate`).

    Engine.step():  scheduler.schedule() -> StepPlan -> runner.execute(plan) -> sampled tokens
                    -> scheduler.update(plan, sampled) -> the sequences that finished

The runner is a model (`ModelRunner`) or the simulator's cost model (`cbatch.bench.simulator`): the
engine, and so every loop that drives it, is the same for both. Engines are built in `build.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, Sequence as Seq

import torch

from cbatch.config import Constraint, EngineConfig, SamplingParams
from cbatch.engine.kv_blocks import BlockPool
from cbatch.engine.scheduler import Scheduler, StepInfo, StepPlan
from cbatch.engine.sequence import FinishReason, Sequence, SequenceStatus
from cbatch.engine.stop import StopChecker, find_stop
from cbatch.engine.structured import ConstraintError, Grammars
from cbatch.model.spec import ModelSpec


class Runner(Protocol):
    """What the engine steps: a model, or the simulator's cost model."""

    forward_seconds: float  # time inside the model call (or the simulated clock), for the report

    def execute(self, plan: StepPlan) -> Mapping[int, int]: ...
    def idle(self) -> None: ...  # a step with nothing to run (waiting for arrivals)
    def reset(self) -> None: ...


@dataclass(slots=True)
class RequestOutput:
    seq_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # None when the engine has no tokenizer (weightless benchmark models)
    finish_reason: str
    error: str | None = None


@dataclass(frozen=True, slots=True)
class KVPool:
    """The KV pool's size, fixed when the engine is built (the runner's tensors have it)."""

    num_blocks: int
    num_host_blocks: int = 0  # swap space


@dataclass(eq=False)
class Engine:
    """One scheduler and one runner, stepped together. `reset(policy)` starts over with a fresh scheduler
    (same pool size and settings) on the same runner. Built by `cbatch.engine.build`."""

    config: EngineConfig
    runner: Runner
    kv: KVPool
    max_model_len: int
    spec: ModelSpec | None = None  # None: a simulation with no model named
    tokenizer: Any = None  # None: token-id prompts only
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    model_dir: Path | None = None

    def __post_init__(self) -> None:
        self._eos_ids = frozenset(self.spec.eos_token_ids) if self.spec is not None else frozenset()
        self.grammars: Grammars | None = None  # structured output: built at the first constrained request
        self._next_id = 0
        self.reset()

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        from cbatch.engine.build import build_engine

        return build_engine(config)

    def reset(self, policy: str | None = None) -> None:
        """A fresh scheduler and block pool under `policy` (default: the config's); the runner forgets
        every sequence but keeps its KV tensors."""
        if policy is not None:
            self.config = replace(self.config, policy=policy)
        self.scheduler = make_scheduler(self.config, self.kv, self.max_model_len)
        self.runner.reset()

    @property
    def pool(self) -> BlockPool:
        return self.scheduler.pool

    @property
    def last_step(self) -> StepInfo:
        return self.scheduler.last_step

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, seq_id: int | None = None) -> Sequence:
        """Queues a request; a request that cannot run comes back already finished with an error."""
        if seq_id is None:
            seq_id = self._next_id
        self._next_id = max(self._next_id, seq_id + 1)
        seq = Sequence(seq_id=seq_id, prompt_ids=list(prompt_ids), params=params, eos_ids=self._eos_ids)
        error = params.validate() or self.scheduler.admission_error(len(prompt_ids), params)
        if error is None and params.stop:
            if self.tokenizer is None:
                error = "stop strings need a tokenizer; this model has none"
            else:
                seq.stop = StopChecker(self.tokenizer, params.stop)
        if error is None and params.constraint is not None:
            error = self._start_grammar(seq, params.constraint)
        if error is not None:
            seq.finish_reason, seq.error = FinishReason.ERROR, error
            seq.status = SequenceStatus.FINISHED
            return seq
        self.scheduler.add(seq)
        return seq

    def _start_grammar(self, seq: Sequence, constraint: Constraint) -> str | None:
        """Gives `seq` a matcher for its constraint (compiled once per engine); the error naming the field
        for a constraint the grammar engine rejects."""
        if self.tokenizer is None or self.spec is None:
            return f"{constraint.source or constraint.kind}: structured output needs a tokenizer; this model has none"
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.spec.vocab_size, self._eos_ids)
        try:
            seq.grammar = self.grammars.start(constraint)
        except ConstraintError as exc:
            return str(exc)
        return None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Schedules and runs one step; returns the sequences that left the batch finished. With nothing
        runnable (waiting for arrivals) the step is idle: counted, nothing computed."""
        plan = self.scheduler.schedule()
        if not plan:
            if self.scheduler.has_work():
                raise RuntimeError("scheduler made no progress with work pending (a bug: please report it)")
            self.scheduler.last_step = StepInfo()
            self.runner.idle()
            return []
        sampled = self.runner.execute(plan)
        return self.scheduler.update(plan, sampled)

    def output_of(self, seq: Sequence) -> RequestOutput:
        token_ids = seq.result_ids
        text = None
        if self.tokenizer is not None and seq.finish_reason is not FinishReason.ERROR:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            cut = find_stop(text, seq.params.stop) if seq.params.stop else None
            if cut is not None:
                text = text[:cut]
        return RequestOutput(
            seq_id=seq.seq_id,
            prompt_token_ids=seq.prompt_ids,
            token_ids=token_ids,
            text=text,
            finish_reason=seq.finish_reason.value if seq.finish_reason else "error",
            error=seq.error,
        )


def make_scheduler(config: EngineConfig, kv: KVPool, max_model_len: int) -> Scheduler:
    """The one way a scheduler is built (engine, bench, simulator): every scheduling setting of `config`."""
    from cbatch.engine.policy import PreemptionPolicy, PriorityOrder, get_policy

    pool = BlockPool(kv.num_blocks, config.block_size, enable_caching=config.enable_prefix_cache)
    return Scheduler(
        get_policy(config.policy), pool, config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
        priority=PriorityOrder(config.priority_aging_steps), preemption=PreemptionPolicy(config.preemption),
        reserve=config.admission == "reserve", num_host_blocks=kv.num_host_blocks,
    )


class LLM:
    """Library API: `LLM(model=...).generate(prompts, params)` returns outputs in input order."""

    def __init__(self, model: str | None = None, **engine_settings) -> None:
        self.engine = Engine.from_config(EngineConfig(model=model, **engine_settings))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Iterable[str] | None = None,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        prompt_token_ids: Iterable[list[int]] | None = None,
    ) -> list[RequestOutput]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give either prompts or prompt_token_ids")
        token_lists = (
            [list(p) for p in prompt_token_ids]
            if prompt_token_ids is not None
            else [self.engine.tokenizer.encode(p) for p in prompts]
        )
        params = sampling_params or SamplingParams()
        per_row = list(params) if isinstance(params, (list, tuple)) else [params] * len(token_lists)
        return run_to_completion(self.engine, token_lists, per_row)


def run_to_completion(engine: Engine, token_lists: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
    """Runs every request through the engine; outputs in input order."""
    seqs = [engine.add_request(ids, p) for ids, p in zip(token_lists, params)]
    while engine.has_unfinished():
        engine.step()
    return [engine.output_of(s) for s in seqs]


__all__ = ["Engine", "KVPool", "LLM", "RequestOutput", "Runner", "make_scheduler", "run_to_completion"]
