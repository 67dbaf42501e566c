"""How many KV blocks the pool gets: forced, or from a memory budget (GPU: measured, CPU: a share of RAM).

GPU: budget = total x gpu_memory_utilization - memory in use after the weights - the peak activation
of the largest step (measured by running one dummy step of max_num_batched_tokens prefill tokens)
- a reserve for CUDA graphs. Invertible: the report states the pool size, so a user can pick
--num-kv-blocks or --gpu-memory-utilization from it.
"""
from __future__ import annotations

import torch

from cbatch.config import EngineConfig, SamplingParams
from cbatch.model.spec import ModelSpec

CUDA_GRAPH_RESERVE = 512 * 2**20  # decode graphs' own pool and workspace


def bytes_per_block(spec: ModelSpec, dtype: torch.dtype, block_size: int) -> int:
    return spec.kv_bytes_per_token(torch.finfo(dtype).bits // 8) * block_size


def blocks_for_every_slot(config: EngineConfig, longest_sequence: int) -> int:
    """A pool that never binds: every slot holding a sequence of `longest_sequence` tokens (more blocks
    than every slot filled to the model's context can never be used)."""
    return config.max_num_seqs * -(-longest_sequence // config.block_size) + 1


def cpu_kv_blocks(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, max_model_len: int) -> int:
    if config.kv_cache_memory_gb is not None:
        budget = config.kv_cache_memory_gb * 2**30
    else:
        budget = min(4 * 2**30, 0.25 * available_host_memory())
    return max(1, min(blocks_for_every_slot(config, max_model_len), int(budget // bytes_per_block(spec, dtype, config.block_size))))


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def gpu_kv_blocks(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, max_model_len: int, activation_peak: int) -> int:
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    return kv_blocks_in_gpu_memory(config, spec, dtype, max_model_len, total, total - free, activation_peak)


def kv_blocks_in_gpu_memory(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, max_model_len: int,
                            total: float, in_use: float, activation_peak: float) -> int:
    """The GPU pool from `total` bytes of device memory, `in_use` of them already taken (weights), and the
    largest step's activations (measured by `profile_activation_peak`, or estimated by `cbatch plan`)."""
    reserve = 0 if config.enforce_eager else CUDA_GRAPH_RESERVE
    budget = total * config.gpu_memory_utilization - in_use - activation_peak - reserve
    blocks = int(budget // bytes_per_block(spec, dtype, config.block_size))
    if blocks < 1:
        raise MemoryError(
            f"no GPU memory left for the KV cache (weights and activations use {in_use / 2**30:.1f} GiB of "
            f"{total / 2**30:.1f} GiB); raise --gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return min(blocks_for_every_slot(config, max_model_len), blocks)


def host_kv_blocks(config: EngineConfig, spec: ModelSpec, dtype: torch.dtype, num_blocks: int) -> int:
    """Host slots for swapped-out blocks: --swap-space, never more than 4 pools' worth (none under recompute)."""
    if config.preemption == "recompute":
        return 0
    return min(int(config.swap_space_gb * 2**30 // bytes_per_block(spec, dtype, config.block_size)), 4 * num_blocks)


def profile_activation_peak(make_runner, config: EngineConfig, max_model_len: int) -> int:
    """Bytes a step of max_num_batched_tokens prefill tokens allocates beyond what is already held.

    `make_runner(num_blocks)` builds a throw-away runner with a small KV pool for the dummy step.
    """
    from cbatch.engine.kv_blocks import BlockPool
    from cbatch.engine.scheduler import StepPlan
    from cbatch.engine.sequence import Sequence

    tokens = config.max_num_batched_tokens
    per_seq = max(1, min(tokens, max_model_len - 1))
    lengths = [per_seq] * (tokens // per_seq) + ([tokens % per_seq] if tokens % per_seq else [])
    pool = BlockPool(sum(-(-n // config.block_size) for n in lengths) + 1, config.block_size)
    runner = make_runner(pool.num_blocks)
    plan = StepPlan(scheduled=[])
    for i, n in enumerate(lengths[: config.max_num_seqs]):
        seq = Sequence(seq_id=i, prompt_ids=[1] * n, params=SamplingParams(max_tokens=1))
        seq.block_ids = pool.allocate(pool.blocks_for(n))
        plan.scheduled.append((seq, n))
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    runner.execute(plan)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    del runner
    torch.cuda.empty_cache()
    return max(0, peak)
