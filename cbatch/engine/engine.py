"""The step loop tying scheduler, runner and model together, and the library API (`LLM.generate`)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterable, Sequence as Seq

import torch

from cbatch.config import ConfigError, EngineConfig, SamplingParams
from cbatch.engine import memory
from cbatch.engine.kv_blocks import BlockPool
from cbatch.engine.policy import PreemptionPolicy, PriorityOrder, get_policy
from cbatch.engine.runner import ModelRunner
from cbatch.engine.scheduler import Scheduler
from cbatch.engine.sequence import FinishReason, Sequence, SequenceStatus
from cbatch.engine.step import StepInfo, admission_error, commit_step, length_finish
from cbatch.model.loader import (
    Checkpoint, build_model, init_random_weights, load_model, read_checkpoint, resolve_dtype, resolve_model_dir,
)
from cbatch.model.layers import use_fused_kernels
from cbatch.model.spec import ModelSpec


@dataclass(slots=True)
class RequestOutput:
    seq_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None  # None when the engine has no tokenizer (weightless benchmark models)
    finish_reason: str
    error: str | None = None
    # step counters for latency reports
    arrival_step: int = 0
    first_scheduled_step: int | None = None
    first_token_step: int | None = None
    finish_step: int | None = None
    num_preemptions: int = 0


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available here; use --device cpu")
    return torch.device(name)


class Engine:
    """Owns one model and runs requests through it, one step at a time."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None, spec: ModelSpec | None = None,
                 tokenizer=None, random_weights_seed: int | None = None) -> None:
        """Either a checkpoint (weights and, if present, tokenizer), or a bare spec with random weights."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.spec = checkpoint.spec if checkpoint is not None else spec
        assert self.spec is not None
        self.dtype = resolve_dtype(config.dtype, self.spec, self.device)
        self.max_model_len = min(config.max_model_len or self.spec.max_position_embeddings, self.spec.max_position_embeddings)
        if checkpoint is not None:
            self.model = load_model(checkpoint, self.max_model_len, self.device, self.dtype)
        else:
            model = build_model(self.spec, self.max_model_len, self.device, self.dtype)
            self.model = init_random_weights(model, random_weights_seed or 0)
        if self.device.type == "cpu":
            self.model.prepack_for_cpu()
        self.tokenizer = tokenizer
        self.model_dir = checkpoint.path if checkpoint is not None else None
        self.last_step = StepInfo()
        use_triton = config.attention_backend == "triton" or (config.attention_backend == "auto" and self.device.type == "cuda")
        if use_triton and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(
                "--attention-backend triton: on a CPU it runs only under the Triton interpreter "
                "(TRITON_INTERPRET=1, for testing); use --attention-backend torch"
            )
        # The Triton path also routes RMSNorm, rotary and SiLU-and-mul through cbatch.kernels.
        use_fused_kernels(use_triton)
        num_blocks = self._kv_pool_blocks()
        self.pool = BlockPool(num_blocks, config.block_size, enable_caching=config.enable_prefix_cache)
        num_host_blocks = 0
        if config.preemption != "recompute":  # --swap-space, but never more than 4 pools' worth
            block_bytes = self.spec.kv_bytes_per_token(torch.finfo(self.dtype).bits // 8) * config.block_size
            num_host_blocks = min(int(config.swap_space_gb * 2**30 // block_bytes), 4 * num_blocks)
        self.scheduler = Scheduler(
            get_policy(config.policy), self.pool, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len,
            priority=PriorityOrder(config.priority_aging_steps), preemption=PreemptionPolicy(config.preemption),
            reserve=config.admission == "reserve", num_host_blocks=num_host_blocks,
        )
        self.runner = self._make_runner(num_blocks)
        self.runner.num_host_blocks = num_host_blocks
        if self.device.type == "cuda" and use_triton and not config.enforce_eager:
            self.runner.capture_decode_graphs(config.max_num_seqs, self.max_model_len)
        self._stop_checks: dict[int, list[str]] = {}
        self._next_id = 0

    def _make_runner(self, num_blocks: int) -> ModelRunner:
        c = self.config
        return ModelRunner(
            self.model, num_blocks, c.block_size, c.max_num_seqs, self.max_model_len,
            self.device, self.dtype, c.attention_backend, c.seed,
        )

    def _kv_pool_blocks(self) -> int:
        """Forced by --num-kv-blocks, else from the memory budget (GPU: after a profiled dummy step)."""
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        if self.device.type != "cuda":
            return memory.cpu_kv_blocks(c, self.spec, self.dtype, self.max_model_len)
        peak = memory.profile_activation_peak(self._make_runner, c, self.max_model_len)
        return memory.gpu_kv_blocks(c, self.spec, self.dtype, self.max_model_len, peak)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        from cbatch.model.default_model import default_model_dir
        from cbatch.tokenizer import load_tokenizer

        model_dir = resolve_model_dir(config.model) if config.model else default_model_dir()
        checkpoint = read_checkpoint(model_dir)
        return cls(config, checkpoint=checkpoint, tokenizer=load_tokenizer(model_dir))

    # ---- requests -------------------------------------------------------------------------------
    def admission_error(self, prompt_len: int, params: SamplingParams) -> str | None:
        """Why a request can never run here (too long for the model or for the KV pool), or None."""
        return admission_error(prompt_len, params, self.max_model_len, self.pool)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, seq_id: int | None = None) -> Sequence:
        """Queues a request; a request that cannot run comes back already finished with an error."""
        if seq_id is None:
            seq_id = self._next_id
        self._next_id = max(self._next_id, seq_id + 1)
        eos = frozenset(self.spec.eos_token_ids)
        seq = Sequence(seq_id=seq_id, prompt_ids=list(prompt_ids), params=params, eos_ids=eos)
        error = params.validate() or self.admission_error(len(prompt_ids), params)
        if error is None and params.stop and self.tokenizer is None:
            error = "stop strings need a tokenizer; this model has none"

        if error is not None:
            seq.finish_reason, seq.error = FinishReason.ERROR, error
            seq.status = SequenceStatus.FINISHED
            return seq
        if params.stop:
            self._stop_checks[seq_id] = params.stop
        self.scheduler.add(seq)
        return seq

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Schedules and runs one model step; returns the sequences that left the batch finished."""
        plan = self.scheduler.schedule()
        if not plan:
            if self.scheduler.has_work():
                raise RuntimeError("scheduler made no progress with work pending (a bug: please report it)")
            return []
        sampled = self.runner.execute(plan)
        finished, self.last_step = commit_step(self.scheduler, plan, sampled, self._finish_reason, self._release)
        return finished

    def _release(self, seq: Sequence) -> None:
        self.runner.release(seq)
        self._stop_checks.pop(seq.seq_id, None)

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        """Stop strings (they need the tokenizer), then EOS / max_tokens / context (shared with the simulator)."""
        stops = self._stop_checks.get(seq.seq_id)
        if stops and _find_stop(self.tokenizer.decode(seq.output_ids, skip_special_tokens=True), stops) is not None:
            return FinishReason.STOP
        return length_finish(seq, token, self.max_model_len)

    def output_of(self, seq: Sequence) -> RequestOutput:
        token_ids = seq.result_ids
        text = None
        if self.tokenizer is not None and seq.finish_reason is not FinishReason.ERROR:
            text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
            cut = _find_stop(text, seq.params.stop) if seq.params.stop else None
            if cut is not None:
                text = text[:cut]
        return RequestOutput(
            seq_id=seq.seq_id,
            prompt_token_ids=seq.prompt_ids,
            token_ids=token_ids,
            text=text,
            finish_reason=seq.finish_reason.value if seq.finish_reason else "error",
            error=seq.error,
            arrival_step=seq.arrival_step,
            first_scheduled_step=seq.first_scheduled_step,
            first_token_step=seq.first_token_step,
            finish_step=seq.finish_step,
            num_preemptions=seq.num_preemptions,
        )


def _find_stop(text: str, stops: list[str]) -> int | None:
    """Index where the earliest stop string begins in `text`, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


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
    base = engine._next_id
    seqs = [engine.add_request(ids, p, seq_id=base + i) for i, (ids, p) in enumerate(zip(token_lists, params))]
    while engine.has_unfinished():
        engine.step()
    return [engine.output_of(s) for s in seqs]


__all__ = ["Engine", "LLM", "RequestOutput", "run_to_completion", "resolve_device"]
