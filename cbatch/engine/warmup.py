"""Runs dummy steps through a runner before the engine serves, so that every Triton kernel variant a run
can launch compiles now and not inside a step (the benchmarks print the compiles of their timed window:
`cbatch.kernels.jit_stats`, which must stay 0).

A variant is fixed by the kernels' compile-time switches, which depend only on the step's shape class:
decode-only or mixed, the prefill tile (from the longest chunk: 2..8, 16, 32, 64+ query tokens), split-KV
or not (a few sequences at a long context), and which sampler runs (greedy, temperature, top-k falls back
to torch). Runtime sizes (batch, lengths, strides) are never specialised on (do_not_specialize), so each
class needs one step. Contexts are faked (a sequence claims `context - q_len` computed tokens over
blocks of the real pool that hold finite leftovers), so no step here costs more than a short prefill.
"""
from __future__ import annotations

from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.kv_blocks import BlockPool
from cbatch.engine.step import StepPlan
from cbatch.engine.sequence import Sequence

# one row of each kind the sampler distinguishes: greedy, temperature (the kernel), top-k (the torch sampler)
ROW_PARAMS = (SamplingParams(max_tokens=1), SamplingParams(max_tokens=1, temperature=0.7, seed=1),
              SamplingParams(max_tokens=1, temperature=0.7, top_k=5, seed=2))


def warm_up_shapes(config: EngineConfig, max_model_len: int) -> list[list[tuple[int, int]]]:
    """The steps to run: each a list of (context after the step, query tokens) per sequence."""
    longest = max(2, max_model_len - 1)
    long_context = min(longest, 4096)  # a few sequences this long take the split-KV path
    steps = [[(2, 1)], [(3, 1)] * 3, [(5, 1)] * min(config.max_num_seqs, 37), [(long_context, 1)],
             [(long_context, 1), (9, 1)]]
    budget = min(config.max_num_batched_tokens - 1, longest - 1)
    q_len = 2
    while q_len <= budget:  # every prefill tile size, each beside a decode row, fresh and after cached context
        steps.append([(q_len, q_len), (q_len + 3, 1)])
        steps.append([(min(longest, q_len + 7), q_len)])
        q_len *= 2
    if budget >= 2:
        steps.append([(budget, budget)])
    return steps


def warm_up(runner, config: EngineConfig, max_model_len: int) -> int:
    """Runs the warm-up steps that fit the runner's pool; returns how many ran. The runner forgets them."""
    pool = BlockPool(runner.kv_cache.num_blocks, config.block_size, enable_caching=False)
    ran = 0
    for shape in warm_up_shapes(config, max_model_len):
        needed = sum(pool.blocks_for(context) for context, _ in shape)
        too_long = any(context > max_model_len for context, _ in shape)
        if too_long or needed > pool.num_free or len(shape) > config.max_num_seqs:
            continue  # this model, pool or step limit never produces such a step
        plan = StepPlan(scheduled=[])
        for i, (context, q_len) in enumerate(shape):
            seq = Sequence(seq_id=-1 - i, prompt_ids=[1] * context, params=ROW_PARAMS[i % len(ROW_PARAMS)])
            seq.num_computed = context - q_len
            seq.block_ids = pool.allocate(pool.blocks_for(context))
            plan.scheduled.append((seq, q_len))
        runner.execute(plan)
        runner.reset()  # forgets the dummy sequences' block-table rows
        for seq, _ in plan.scheduled:
            pool.release(seq.block_ids)
        ran += 1
    return ran
