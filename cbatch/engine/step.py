"""What happens after a step computed its plan: the one piece of bookkeeping the engine and the
simulator share (count computed tokens, append sampled tokens, finish checks, release the finished).

The engine gets its sampled tokens from the model; the simulator (cbatch/bench/simulator.py) makes
them up. Everything else about a step is the same code, so the simulator cannot drift from the engine.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from cbatch.config import SamplingParams
from cbatch.engine.kv_blocks import BlockPool
from cbatch.engine.scheduler import Scheduler, StepPlan
from cbatch.engine.sequence import FinishReason, Sequence


@dataclass(slots=True)
class StepInfo:
    """What the last step did, for per-step metrics."""

    scheduled_tokens: int = 0
    prefill_tokens: int = 0  # tokens of chunks longer than one (prompt and recompute work)
    sampled_tokens: int = 0  # new tokens that count as output (static padding excluded)
    context_tokens: int = 0  # sum over scheduled sequences of their context after the step (KV read)
    attention_pairs: int = 0  # (query token, key token) pairs attended this step (attention FLOPs)


def admission_error(prompt_len: int, params: SamplingParams, max_model_len: int, pool: BlockPool) -> str | None:
    """Why a request can never run (too long for the model, or for the KV pool even alone), or None."""
    if prompt_len == 0:
        return "the prompt is empty"
    if prompt_len >= max_model_len:
        return f"the prompt has {prompt_len} tokens; the model's context is {max_model_len}"
    need = pool.blocks_for(min(prompt_len + params.max_tokens, max_model_len))
    if need > pool.num_blocks:
        return (
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) needs {need} KV blocks "
            f"but the pool has {pool.num_blocks}; lower max_tokens or raise --num-kv-blocks"
        )
    return None


def length_finish(seq: Sequence, token: int, max_model_len: int) -> FinishReason | None:
    """EOS (unless ignored), max_tokens or the model's context: the checks that need no tokenizer."""
    if token in seq.eos_ids and not seq.params.ignore_eos:
        return FinishReason.STOP
    if len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None


def commit_step(
    scheduler: Scheduler,
    plan: StepPlan,
    sampled: Mapping[int, int],
    finish_reason: Callable[[Sequence, int], FinishReason | None],
    on_release: Callable[[Sequence], None] | None = None,
) -> tuple[list[Sequence], StepInfo]:
    """Applies a computed step: returns the sequences that left the batch finished, and the step's info.

    `sampled` maps seq_id -> token for every sequence whose chunk reached its last token (those
    sample; the others computed part of a prompt).
    """
    info = StepInfo()
    finished: list[Sequence] = []
    step = scheduler.stats.steps
    for seq, num_new in plan.scheduled:
        info.scheduled_tokens += num_new
        if num_new > 1:
            info.prefill_tokens += num_new
        seq.num_computed += num_new
        info.context_tokens += seq.num_computed
        # query i of the chunk (0-based) sees num_computed - num_new + i + 1 keys (causal)
        info.attention_pairs += num_new * seq.num_computed - num_new * (num_new - 1) // 2
        if seq.num_computed < seq.num_tokens:
            continue  # a prompt chunk short of the end: nothing sampled
        token = sampled[seq.seq_id]
        seq.output_ids.append(token)
        if seq.first_token_step is None:
            seq.first_token_step = step
        if seq.num_result_tokens is not None:
            continue  # static batching: a finished member computing padding
        info.sampled_tokens += 1
        reason = finish_reason(seq, token)
        if reason is not None:
            for done in scheduler.finish(seq, reason):
                if on_release is not None:
                    on_release(done)
                finished.append(done)
    if plan.preempted:  # a static group may have lost its last unfinished members
        for done in scheduler.release_stranded_group():
            if on_release is not None:
                on_release(done)
            finished.append(done)
    return finished, info
