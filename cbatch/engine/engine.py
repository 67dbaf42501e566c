"""The step loop tying scheduler and runner together, and `run_to_completion` (a batch of requests through it).

    Engine.step():  scheduler.schedule() -> StepPlan -> runner.execute(plan) -> StepOutput (sampled tokens,
                    log-probabilities) -> scheduler.update(plan, ...) -> the sequences that finished

A request with `n` samples is one parent sequence (the row's seq_id) and n - 1 children (negative
seq_ids, never a row's), forked onto the parent's prompt KV by the scheduler; each finishes on its own.

The runner is a model (`ModelRunner`) or the simulator's cost model (`cbatch.bench.simulator`): the
engine, and so every loop that drives it, is the same for both. Engines are built in `build.py`; the library
API (`LLM.generate`) is `llm.py`.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Protocol, Sequence as Seq

import torch

from cbatch.config import Constraint, EngineConfig, SamplingParams
from cbatch.engine.batching import ClosedAdmission
from cbatch.engine.images import PromptImage, SeqImages, placeholder_tokens, seq_images
from cbatch.engine.kv_blocks import BlockPool
from cbatch.engine.logprobs import Logprobs
from cbatch.engine.pooling import PoolingParams
from cbatch.engine.scheduler import Scheduler
from cbatch.engine.speculative import Speculator
from cbatch.engine.step import StepInfo, StepOutput, StepPlan
from cbatch.engine.sequence import FinishReason, Sequence, SequenceStatus
from cbatch.engine.stop import StopChecker, find_stop
from cbatch.engine.structured import ConstraintError, Grammars
from cbatch.model.spec import ModelSpec
from cbatch.tokenizer import think_token_ids


class PendingResult(Protocol):
    """A launched step (`Runner.launch`): `result()` waits for it and returns its tokens."""

    def result(self) -> StepOutput: ...


class Runner(Protocol):
    """What the engine steps: a model, or the simulator's cost model. Every runner satisfies all of it
    (tests/test_runner_protocol.py): the engine calls `launch` when it schedules ahead, `execute` otherwise."""

    forward_seconds: float  # time inside the model call (or the simulated clock), for the report

    def execute(self, plan: StepPlan) -> StepOutput: ...  # launch(plan).result()
    def launch(self, plan: StepPlan) -> PendingResult: ...  # starts the step; its tokens when `result()` is called
    def idle(self) -> None: ...  # a step with nothing to run (waiting for arrivals)
    def close(self) -> None: ...  # frees what outlives the engine's objects (tensor-parallel worker processes)
    def reset(self) -> None: ...


@dataclass(slots=True)
class RequestOutput:
    """One sample of one request (a request with n samples has n outputs)."""

    seq_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # None when the engine has no tokenizer (weightless benchmark models)
    finish_reason: str
    error: str | None = None
    row_index: int = 0  # the request's seq_id (its row): the same for all its samples
    sample_index: int = 0
    logprobs: Logprobs | None = None  # of `token_ids`, when asked
    prompt_logprobs: Logprobs | None = None  # of prompt tokens 1.., when asked
    pooled: list[float] | None = None  # a prefill-only request's result: its embedding, or its head's logits


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
    kv_pool: KVPool
    max_model_len: int
    spec: ModelSpec | None = None  # None: a simulation with no model named
    tokenizer: Any = None  # None: token-id prompts only
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    model_dir: Path | None = None
    kernel_tuning: dict | None = None  # what start-up tuning chose (GPU), for the report
    # what a step's time is measured on for `--speculative auto`'s cost model: wall time, or a simulation's cost
    # clock (bench/simulator.py: deterministic)
    step_clock: Callable[[], float] = time.perf_counter
    # rows' images are decoded into pixels for the vision tower; False (cbatch plan's engine): their headers give
    # each one's size, which alone sets its placeholder tokens
    decodes_images: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self._eos_ids = frozenset(self.spec.eos_token_ids) if self.spec is not None else frozenset()
        self.grammars: Grammars | None = None  # structured output: built at the first constrained request
        self._think_ids = think_token_ids(self.tokenizer)  # what a thinking budget forces (None: no thinking tokens)
        self._next_id = 0
        self._child_ids = itertools.count(-1, -1)  # seq_ids of forked samples: negative, never a row's
        self._prefill_params: dict[int, tuple[SamplingParams, SamplingParams]] = {}  # id -> (settings, prefill-only's)
        self.reset()

    def close(self) -> None:
        """Releases what outlives the engine's objects (tensor-parallel worker processes). Idempotent."""
        self.runner.close()

    def reset(self, policy: str | None = None, **settings: Any) -> None:
        """A fresh scheduler and block pool under `policy` (default: the config's) and any other scheduling
        `settings` (EngineConfig fields, e.g. enable_prefix_cache); the runner forgets every sequence but
        keeps its KV tensors."""
        if policy is not None:
            settings["policy"] = policy
        if settings:
            self.config = replace(self.config, **settings)
        self.scheduler = make_scheduler(self.config, self.kv_pool, self.max_model_len)
        self._inflight: tuple[StepPlan, Any] | None = None  # asynchronous scheduling: the launched step whose tokens are not applied yet
        self.steps_ahead = 0  # steps launched before the previous one's tokens were applied
        self.runner.reset()

    @property
    def pool(self) -> BlockPool:
        return self.scheduler.pool

    @property
    def last_step(self) -> StepInfo:
        return self.scheduler.last_step

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, seq_id: int | None = None,
                    samples: Seq[int] | None = None, pooling: PoolingParams | None = None,
                    images: Seq[PromptImage] | None = None) -> Sequence:
        """Queues a request; a request that cannot run comes back already finished with an error.

        `samples`: which of its `params.n` samples to run (default all; a resumed row may need only some):
        the first is the returned parent, the others its `children`. `pooling`: a prefill-only request
        (engine/pooling.py): one sample, one (dummy) output position that ends it with its prompt. `images`: the
        prompt's images in placeholder order (a vision-language model's; engine/images.py)."""
        if pooling is not None:  # (one object per distinct settings: the host step checks each object once)
            params = self._prefill_params.setdefault(id(params), (params, _prefill_only(params)))[1]
        if seq_id is None:
            seq_id = self._next_id
        self._next_id = max(self._next_id, seq_id + 1)
        prompt_ids, mm, error = self.check_prompt(prompt_ids, params, images)
        if error is not None:
            return Sequence(seq_id=seq_id, prompt_ids=prompt_ids, params=params, eos_ids=self._eos_ids,
                            status=SequenceStatus.FINISHED, finish_reason=FinishReason.ERROR, error=error)
        samples = list(range(params.n)) if samples is None else sorted(samples)
        if not samples or samples[0] < 0 or samples[-1] >= params.n:
            raise ValueError(f"samples must be some of 0..{params.n - 1}, got {samples}")
        seq = self._sequence(seq_id, seq_id, samples[0], prompt_ids, params)
        seq.pooling = pooling
        seq.children = [self._sequence(next(self._child_ids), seq_id, i, prompt_ids, params) for i in samples[1:]]
        for sample in seq.samples:  # (every sample: a forked one recomputes its prompt after a preemption)
            sample.images = mm
        self.scheduler.add(seq)
        return seq

    def check_request(self, prompt_ids: Seq[int], params: SamplingParams) -> tuple[list[int], str | None]:
        """(the prompt the request runs on, why it cannot run or None): what `add_request` checks before queueing."""
        keep = params.truncate_prompt_tokens  # vLLM's: a longer prompt runs on its last `keep` tokens
        prompt_ids = list(prompt_ids[-keep:] if keep is not None and keep >= 1 else prompt_ids)
        error = params.validate() or self.scheduler.admission_error(len(prompt_ids), params) or self._token_error(params)
        if error is None and params.stop and self.tokenizer is None:
            error = "stop strings need a tokenizer; this model has none"
        if error is None and params.constraint is not None:
            error = self._grammar_error(params.constraint)
        if error is None and params.lora is not None:
            error = self.lora_error(params.lora)
        if error is None and params.thinking_token_budget is not None and self._think_ids is None:
            error = ("thinking_token_budget: this model's tokenizer has no <think> and </think> tokens, so it has no "
                     "thinking to bound; drop the field (or --thinking-budget)")
        return prompt_ids, error

    def check_prompt(self, prompt_ids: Seq[int], params: SamplingParams, images: Seq[PromptImage] | None = None
                     ) -> tuple[list[int], SeqImages | None, str | None]:
        """(the prompt the request runs on, its images placed in it or None, why it cannot run or None): every check
        `add_request` makes before queueing (`check_request`, then `seq_images`)."""
        prompt_ids, error = self.check_request(prompt_ids, params)
        placed = self.seq_images(prompt_ids, images) if error is None else None
        if isinstance(placed, str):
            return prompt_ids, None, placed
        return prompt_ids, placed, error

    def seq_images(self, prompt_ids: list[int], images: Seq[PromptImage] | None) -> SeqImages | str | None:
        """The request's images placed in its prompt (engine/images.py), None without images, or why they do not fit."""
        vision = self.spec.vision if self.spec is not None else None
        if not images:
            if vision is not None and not set(placeholder_tokens(vision)).isdisjoint(prompt_ids):
                return "the prompt has image or video placeholder tokens but the row gives no images or videos"
            return None
        if vision is None:
            name = self.spec.architecture if self.spec is not None else "model"
            return f"this {name} reads no images; drop the row's images or use a vision-language model"
        over = self.mm_limit_error([image.video for image in images])
        if over is not None:
            return over
        placed = seq_images(prompt_ids, list(images), vision)
        budget = self.scheduler.max_num_batched_tokens
        largest = max(image.num_tokens for image in images)
        if isinstance(placed, SeqImages) and placed.bidirectional and largest > budget:  # (an image is one chunk)
            return (f"an image of this {self.spec.architecture} is {largest} tokens, computed in one step, more than "
                    f"--max-num-batched-tokens {budget}; raise it to at least {largest}")
        return placed

    def mm_limit_error(self, videos: Seq[bool]) -> str | None:
        """Why a prompt with these images (False) and videos (True) is over the engine's limit_mm_per_prompt, or None
        where it is within it. Checked before a row's images are read (GenerateTask) and when a request is added."""
        for kind, limit in self.config.limit_mm_per_prompt:
            count = sum(video == (kind == "video") for video in videos)
            if count > limit:
                return (f"the prompt has {count} {kind}{'s' if count > 1 else ''}, more than the {limit} the engine's "
                        "limit_mm_per_prompt (--limit-mm-per-prompt) allows in one prompt")
        return None

    def extra_seq_id(self) -> int:
        """A seq_id no row has (negative, as forked samples'): a request of a row beyond its own (a bi-encoder
        score row's second text)."""
        return next(self._child_ids)

    def _sequence(self, seq_id: int, row_index: int, sample_index: int, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        seq = Sequence(seq_id=seq_id, prompt_ids=prompt_ids, params=params, eos_ids=self._eos_ids, row_index=row_index,
                       sample_index=sample_index)
        if params.stop and self.tokenizer is not None:
            seq.stop = StopChecker(self.tokenizer, params.stop)
        if params.constraint is not None:  # each sample its own matcher (checked by `_grammar_error` first)
            seq.grammar = self.grammars.start(params.constraint)
        if params.thinking_token_budget is not None:
            seq.think_ids = self._think_ids
        return seq

    @property
    def lora_names(self) -> list[str]:
        """The LoRA adapters rows may name (--lora, --lora-dir)."""
        return [name for name, _ in self.config.loras]

    def lora_error(self, name: str) -> str | None:
        """None when `name` is one of the job's adapters; else the error naming it and the fix."""
        if name in self.lora_names:
            return None
        known = f"its adapters are {', '.join(self.lora_names)}" if self.config.loras else "it has none"
        return (f"lora {name!r}: no LoRA adapter of that name in this job ({known}); give it with "
                f"--lora {name}=PATH, or fix the row's `lora`")

    def _grammar_error(self, constraint: Constraint) -> str | None:
        """None when the constraint compiles (once per engine: `Grammars` caches it); else the error naming
        the field for a constraint the grammar engine rejects."""
        if self.tokenizer is None or self.spec is None:
            return f"{constraint.source or constraint.kind}: structured output needs a tokenizer; this model has none"
        if self.grammars is None:
            self.grammars = Grammars(self.tokenizer, self.spec.vocab_size, self._eos_ids)
        try:
            self.grammars.start(constraint)
        except ConstraintError as exc:
            return str(exc)
        return None

    def _token_error(self, params: SamplingParams) -> str | None:
        """A stop_token_ids or logit_bias token outside the model's vocabulary."""
        return (self.vocabulary_error("stop_token_ids", params.stop_token_ids)
                or self.vocabulary_error("logit_bias", params.logit_bias))

    def vocabulary_error(self, what: str, tokens: Iterable[int]) -> str | None:
        """The message naming `what` when one of `tokens` is outside the model's vocabulary; else None (and always
        None for a model without a spec)."""
        vocab = self.spec.vocab_size if self.spec is not None else None
        outside = next((t for t in tokens if t >= vocab), None) if vocab else None
        return None if outside is None else f"{what} has token id {outside}, outside the model's vocabulary (ids 0..{vocab - 1})"

    def close_admission(self) -> None:
        """No request starts from now on (a job's deadline): the waiting ones leave the queue unfinished (their
        caller reports them), the running ones go on to their ends (a preempted one waits, never to start)."""
        self.scheduler.admission = ClosedAdmission()
        self.scheduler.withdraw_waiting()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Schedules and runs one step; returns the sequences that left the batch finished. With nothing
        runnable (waiting for arrivals) the step is idle: counted, nothing computed. With asynchronous
        scheduling a call launches one step and applies the tokens of the one before it (`_step_ahead`)."""
        if self.config.async_scheduling:
            return self._step_ahead()
        plan = self.scheduler.schedule()
        if not plan:
            return self._idle()
        speculator = self.scheduler.speculator
        start = self.step_clock() if speculator is not None else 0.0
        out = self.runner.execute(plan)
        if speculator is not None:  # (auto's cost model: what a step of this work took)
            speculator.observe_step(plan.info, self.step_clock() - start)
        _take_pooled(plan, out)
        return self.scheduler.update(plan, out.tokens, out.logprobs, out.verified)

    def _step_ahead(self) -> list[Sequence]:
        """Asynchronous scheduling (vLLM v1, SGLang's overlap scheduler): step N+1 is scheduled, built and
        launched while the device runs step N, whose placeholders it reads on the device; then N's tokens are applied
        (they come back: EOS, stop strings, lengths), overlapping N+1 on the device. A sequence that
        finished at N computed one discarded token in N+1. When N+1 needs N's tokens on the host first
        (`Scheduler.can_schedule_ahead`), this call only applies N's tokens and the next one schedules as usual."""
        inflight = self._inflight
        if inflight is not None and not self.scheduler.can_schedule_ahead(inflight[0]):
            self._inflight = None
            return self._apply_tokens(*inflight)
        plan = self.scheduler.schedule()
        if not plan:
            if inflight is None:
                return self._idle()
            self._inflight = None
            return self._apply_tokens(*inflight)
        pending = self.runner.launch(plan)
        self.steps_ahead += inflight is not None
        finished = self._apply_tokens(*inflight) if inflight is not None else []
        self.scheduler.account(plan)
        self._inflight = (plan, pending)
        return finished

    def _apply_tokens(self, plan: StepPlan, pending) -> list[Sequence]:
        out = pending.result()
        _take_pooled(plan, out)
        return self.scheduler.apply_tokens(plan, out.tokens, out.logprobs, out.verified)

    def _idle(self) -> list[Sequence]:
        if self.scheduler.has_work():
            raise RuntimeError("scheduler made no progress with work pending (a bug: please report it)")
        self.scheduler.count_idle()
        self.scheduler.last_step = StepInfo()
        self.runner.idle()
        return []

    def output_of(self, seq: Sequence) -> RequestOutput:
        token_ids = seq.result_ids if seq.pooling is None else []  # (a prefill-only request's token is a dummy)
        return RequestOutput(
            seq_id=seq.seq_id,
            prompt_token_ids=seq.prompt_ids,
            token_ids=token_ids,
            text=self._text(seq, token_ids),
            finish_reason=_finish_reason(seq),
            error=seq.error,
            row_index=seq.row_index,
            sample_index=seq.sample_index,
            logprobs=seq.logprobs.head(len(token_ids)) if seq.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs,
            pooled=seq.pooled.tolist() if seq.pooled is not None else None,
        )

    def _text(self, seq: Sequence, token_ids: list[int]) -> str | None:
        """The completion's text: up to its stop string; without the stop token that ended it (vLLM)."""
        if self.tokenizer is None or seq.finish_reason is FinishReason.ERROR or seq.pooling is not None:
            return None
        stopped_by_string = seq.stop is not None and seq.stop.match_from is not None
        if stopped_by_string:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            cut = find_stop(text, seq.params.stop, seq.stop.match_from)
            return text if cut is None else text[:cut]
        if seq.finish_reason is FinishReason.STOP and token_ids and token_ids[-1] in seq.params.stop_token_ids:
            token_ids = token_ids[:-1]
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _finish_reason(seq: Sequence) -> str:
    """A finished sequence's reason; a prefill-only request that ran is complete: "stop"."""
    if seq.finish_reason is None or seq.finish_reason is FinishReason.ERROR:
        return "error"
    return "stop" if seq.pooling is not None else seq.finish_reason.value


def _prefill_only(params: SamplingParams) -> SamplingParams:
    """A pooling request's settings: one sample, one output position (the dummy that ends it), EOS and a thinking
    budget moot."""
    if (params.max_tokens == 1 and params.n == 1 and params.ignore_eos and params.min_tokens == 0
            and params.thinking_token_budget is None):
        return params
    return replace(params, max_tokens=1, n=1, ignore_eos=True, min_tokens=0, thinking_token_budget=None)


def _take_pooled(plan: StepPlan, out: StepOutput) -> None:
    """Hands each prefill-only request ending in `plan` its result (the runner's pooled vector), before the
    update that finishes it."""
    if out.pooled:
        for seq, _ in plan.scheduled:
            if seq.seq_id in out.pooled:
                seq.pooled = out.pooled[seq.seq_id]


def make_scheduler(config: EngineConfig, kv_pool: KVPool, max_model_len: int) -> Scheduler:
    """The one way a scheduler is built (engine, bench, simulator): every scheduling setting of `config`."""
    from cbatch.engine.batching import ADMISSIONS
    from cbatch.engine.policy import PreemptionPolicy, PriorityOrder, get_policy

    pool = BlockPool(kv_pool.num_blocks, config.block_size, enable_caching=config.enable_prefix_cache)
    policy, admission = get_policy(config.policy), ADMISSIONS[config.admission]()
    if config.loras:  # at most --max-loras adapters among the running rows; waiting rows taken adapter by adapter
        from cbatch.engine.adapter_admission import AdapterLimit, grouped_by_adapter

        admission = AdapterLimit(admission, config.max_loras)
        if config.lora_grouping:
            policy = replace(policy, new_key=grouped_by_adapter(policy.new_key))
    return Scheduler(
        policy, pool, config.max_num_seqs, config.max_num_batched_tokens, max_model_len,
        priority=PriorityOrder(config.priority_aging_steps), preemption=PreemptionPolicy(config.preemption),
        admission=admission, num_host_blocks=kv_pool.num_host_blocks, speculator=make_speculator(config),
        max_image_tokens_per_step=config.max_image_tokens_per_step,
    )


def make_speculator(config: EngineConfig) -> Speculator | None:
    """The job's draft sources and choices (`--speculative`), None when off."""
    if config.speculative == "off":
        return None
    return Speculator(config.speculative, config.speculative_tokens, config.speculative_min_ngram,
                      config.speculative_max_ngram)


def run_to_completion(engine: Engine, token_lists: list[list[int]], params: list[SamplingParams],
                      use_tqdm: bool = False, seq_ids: Seq[int] | None = None,
                      pooling: PoolingParams | None = None,
                      images: Seq[Seq[PromptImage] | None] | None = None) -> list[RequestOutput]:
    """Runs every request through the engine; outputs in input order, a request's n samples in sample order.
    `use_tqdm`: a bar over finished requests with the output token rate (tqdm.auto: a widget in notebooks).
    `seq_ids`: each request's (its seed's row index, as `cbatch run` gives a row its input index); `pooling`:
    prefill-only requests; `images`: each request's (a vision-language model's, placeholders expanded)."""
    ids_of = list(seq_ids) if seq_ids is not None else [None] * len(token_lists)
    images_of = list(images) if images is not None else [None] * len(token_lists)
    seqs = [engine.add_request(ids, p, seq_id=i, pooling=pooling, images=im)
            for ids, p, i, im in zip(token_lists, params, ids_of, images_of)]
    what = "generating" if pooling is None else pooling.task
    bar = _progress_bar(sum(len(s.samples) for s in seqs), what) if use_tqdm else None  # one tick a sample
    finished_tokens = 0
    while engine.has_unfinished():
        finished = engine.step()
        if bar is not None and finished:
            bar.update(len(finished))
            if pooling is None:
                finished_tokens += sum(len(s.result_ids) for s in finished)
                bar.set_postfix_str(f"{finished_tokens / max(bar.format_dict['elapsed'], 1e-9):,.1f} output tok/s",
                                    refresh=False)
    if bar is not None:
        bar.close()
    return [engine.output_of(sample) for s in seqs for sample in s.samples]


def _progress_bar(total: int, what: str):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"cbatch: {what}", unit="req", dynamic_ncols=True)


__all__ = ["Engine", "KVPool", "PendingResult", "RequestOutput", "Runner", "make_scheduler", "run_to_completion"]
