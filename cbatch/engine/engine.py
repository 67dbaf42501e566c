"""The step loop tying scheduler, runner and model together, and the library API (`LLM.generate`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence as Seq

import torch

from cbatch.config import ConfigError, EngineConfig, SamplingParams
from cbatch.engine.kv_blocks import BlockPool
from cbatch.engine.policy import get_policy
from cbatch.engine.runner import ModelRunner
from cbatch.engine.scheduler import Scheduler
from cbatch.engine.sequence import FinishReason, Sequence, SequenceStatus
from cbatch.engine.step import StepInfo, admission_error, commit_step, length_finish
from cbatch.model.loader import (
    Checkpoint, build_model, init_random_weights, load_model, read_checkpoint, resolve_dtype, resolve_model_dir,
)
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


def kv_pool_blocks(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device, max_model_len: int) -> int:
    """Blocks in the KV pool: forced by --num-kv-blocks, else from the memory budget (never more than useful)."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    bytes_per_block = spec.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * config.block_size
    useful = config.max_num_seqs * -(-max_model_len // config.block_size) + 1
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = free - (1 - config.gpu_memory_utilization) * total
    elif config.kv_cache_memory_gb is not None:
        budget = config.kv_cache_memory_gb * 2**30
    else:
        budget = min(4 * 2**30, 0.25 * _available_memory())
    return max(1, min(useful, int(budget // bytes_per_block)))


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


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
        self.tokenizer = tokenizer
        self.model_dir = checkpoint.path if checkpoint is not None else None
        self.last_step = StepInfo()
        num_blocks = kv_pool_blocks(config, self.spec, self.dtype, self.device, self.max_model_len)
        self.pool = BlockPool(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            get_policy(config.policy), self.pool, config.max_num_seqs, config.max_num_batched_tokens, self.max_model_len
        )
        self.runner = ModelRunner(
            self.model, num_blocks, config.block_size, config.max_num_seqs, self.max_model_len,
            self.device, self.dtype, config.attention_backend, config.seed,
        )
        self._stop_checks: dict[int, list[str]] = {}
        self._next_id = 0

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
        if error is not None:
            seq.finish_reason, seq.error = FinishReason.ERROR, error
            seq.status = SequenceStatus.FINISHED
            return seq
        if params.stop:
            if self.tokenizer is None:
                raise ConfigError("stop strings need a tokenizer; this model has none")
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
