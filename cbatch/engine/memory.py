"""How many KV blocks the pool gets: forced, or from a memory budget (GPU: measured, CPU: a share of RAM),
and how large a step may be (max_num_seqs / max_num_batched_tokens when the user gives none).

GPU: budget = total x gpu_memory_utilization - memory in use after the weights - the peak activation
of the largest step (measured by running one dummy step of max_num_batched_tokens prompt tokens spread
over max_num_seqs sequences, each sampling with top-k/top-p: the torch sampler's worst case) - a reserve
for CUDA graphs (their pool and the logits of the largest decode graph). A vision-language model's step peak is
the larger of that and one vision-tower forward over the largest image batch a step encodes (measured too), plus
its encoder cache full (engine/encoder_memory.py). Invertible: the report states
the pool size, so a user can pick --num-kv-blocks or --gpu-memory-utilization from it.

Step size: the CPU runs up to 256 sequences and 2048 tokens a step (more rows make the decode GEMMs faster per
row: benchmarks/NOTES.md). A GPU starts from vLLM's H100
defaults (1024 sequences, 8192 tokens) and halves both while the activations leave the KV pool less than
MIN_POOL_SEQUENCES full-length sequences; max_num_seqs never exceeds the pool's blocks (a running
sequence holds at least one).
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from cbatch.config import EngineConfig, SamplingParams
from cbatch.fp8_kv import FP8_KV_DTYPE
from cbatch.model.spec import ModelSpec

if TYPE_CHECKING:
    from cbatch.engine.encoder_memory import EncoderMemory

CUDA_GRAPH_RESERVE = 512 * 2**20  # decode graphs' own pool and workspace, besides their logits
CPU_MAX_NUM_SEQS, CPU_MAX_NUM_BATCHED_TOKENS = 256, 2048
GPU_MAX_NUM_SEQS, GPU_MAX_NUM_BATCHED_TOKENS = 1024, 8192
GPU_MIN_STEP = (64, 2048)  # halving stops here
MIN_POOL_SEQUENCES = 4


def bytes_per_block(spec: ModelSpec, kv_dtype: torch.dtype, block_size: int) -> int:
    """KV bytes of one block in the cache's dtype (1 byte per element for fp8)."""
    return spec.kv_bytes_per_token(kv_dtype.itemsize) * block_size


def kv_per_token(spec: ModelSpec, kv_dtype: torch.dtype) -> dict[str, int | str]:
    """One token's KV bytes over every layer and how they come about (`cbatch plan` shows it): K and V per KV
    head, or MLA's latent, (kv_lora_rank + qk_rope_head_dim) x layers x dtype bytes."""
    size, layers = kv_dtype.itemsize, spec.num_layers
    if spec.mla is not None:
        how = (f"MLA latent: ({spec.mla.kv_lora_rank} + {spec.mla.qk_rope_head_dim}) x {layers} layers x {size} bytes")
    else:
        how = f"K and V: 2 x {layers} layers x {spec.num_kv_heads} KV heads x {spec.head_dim} x {size} bytes"
    return {"bytes_per_token": spec.kv_bytes_per_token(size), "layout": how}


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: --kv-cache-dtype fp8 (e4m3), else the model's dtype."""
    return FP8_KV_DTYPE if config.kv_cache_dtype == "fp8" else model_dtype


def cuda_graph_reserve(config: EngineConfig, spec: ModelSpec) -> int:
    """Memory the decode graphs hold besides the KV pool: their workspace and the float32 logits of the
    largest bucket (the lm_head and sampler run inside the graph)."""
    return 0 if config.enforce_eager else CUDA_GRAPH_RESERVE + config.max_num_seqs * spec.vocab_size * 4


def with_step_limits(config: EngineConfig, device: torch.device, max_num_seqs: int | None = None,
                     max_num_batched_tokens: int | None = None) -> EngineConfig:
    """`config` with its step limits filled in: the user's, else the given ones, else the device's defaults."""
    gpu = device.type == "cuda"
    seqs = config.max_num_seqs or max_num_seqs or (GPU_MAX_NUM_SEQS if gpu else CPU_MAX_NUM_SEQS)
    tokens = config.max_num_batched_tokens or max_num_batched_tokens or (
        GPU_MAX_NUM_BATCHED_TOKENS if gpu else CPU_MAX_NUM_BATCHED_TOKENS)
    return replace(config, max_num_seqs=seqs, max_num_batched_tokens=tokens)


def blocks_for_every_slot(config: EngineConfig, longest_sequence: int) -> int:
    """A pool that never binds: every slot holding a sequence of `longest_sequence` tokens (more blocks
    than every slot filled to the model's context can never be used)."""
    return config.max_num_seqs * -(-longest_sequence // config.block_size) + 1


def cpu_kv_blocks(config: EngineConfig, spec: ModelSpec, kv_dtype: torch.dtype, max_model_len: int) -> int:
    if config.kv_cache_memory_gb is not None:
        budget = config.kv_cache_memory_gb * 2**30
    else:
        budget = min(4 * 2**30, 0.25 * available_host_memory())
    return max(1, min(blocks_for_every_slot(config, max_model_len), int(budget // bytes_per_block(spec, kv_dtype, config.block_size))))


def available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * 2**30


def gpu_kv_blocks(config: EngineConfig, spec: ModelSpec, kv_dtype: torch.dtype, max_model_len: int,
                  activation_peak: int) -> int:
    device = torch.cuda.current_device()
    free, total = torch.cuda.mem_get_info(device)
    return kv_blocks_in_gpu_memory(config, spec, kv_dtype, max_model_len, total, total - free, activation_peak)


def kv_blocks_in_gpu_memory(config: EngineConfig, spec: ModelSpec, kv_dtype: torch.dtype, max_model_len: int,
                            total: float, in_use: float, activation_peak: float) -> int:
    """The GPU pool from `total` bytes of device memory, `in_use` of them already taken (weights), and the
    largest step's activations (measured by `profile_activation_peak`, or estimated by `cbatch plan`)."""
    budget = total * config.gpu_memory_utilization - in_use - activation_peak - cuda_graph_reserve(config, spec)
    blocks = int(budget // bytes_per_block(spec, kv_dtype, config.block_size))
    if blocks < 1:
        raise MemoryError(
            f"no GPU memory left for the KV cache (weights and activations use {in_use / 2**30:.1f} GiB of "
            f"{total / 2**30:.1f} GiB); raise --gpu-memory-utilization or lower --max-num-batched-tokens"
        )
    return min(blocks_for_every_slot(config, max_model_len), blocks)


def host_kv_blocks(config: EngineConfig, spec: ModelSpec, kv_dtype: torch.dtype, num_blocks: int) -> int:
    """Host slots for swapped-out blocks: --swap-space, never more than 4 pools' worth (none under recompute)."""
    if config.preemption == "recompute":
        return 0
    return min(int(config.swap_space_gb * 2**30 // bytes_per_block(spec, kv_dtype, config.block_size)), 4 * num_blocks)


def gpu_step_and_pool(config: EngineConfig, spec: ModelSpec, kv_dtype: torch.dtype, max_model_len: int,
                      make_runner, encoder: "EncoderMemory | None" = None) -> tuple[EngineConfig, int]:
    """(config with its step limits, KV blocks) on a GPU: the defaults halved while their activations leave
    the pool less than MIN_POOL_SEQUENCES sequences of max_model_len tokens (see the module docstring).
    `encoder` (a vision-language model's): the vision tower's peak and the encoder cache reserved too."""
    seqs, tokens = GPU_MAX_NUM_SEQS, GPU_MAX_NUM_BATCHED_TOKENS
    block_tokens_wanted = MIN_POOL_SEQUENCES * max_model_len
    while True:
        sized = with_step_limits(config, torch.device("cuda"), seqs, tokens)
        at_floor = (seqs, tokens) <= GPU_MIN_STEP or (config.max_num_seqs and config.max_num_batched_tokens)
        peak = profile_activation_peak(make_runner, sized, max_model_len)
        if encoder is not None:
            peak = encoder.reserve(peak, sized.max_num_batched_tokens, sized.max_image_tokens_per_step)
        try:
            blocks = gpu_kv_blocks(sized, spec, kv_dtype, max_model_len, peak)
        except MemoryError:  # no room for any KV at this step size: smaller steps, unless already smallest
            if at_floor:
                raise
            blocks = 0
        if blocks * config.block_size >= block_tokens_wanted or at_floor:
            break
        seqs, tokens = max(GPU_MIN_STEP[0], seqs // 2), max(GPU_MIN_STEP[1], tokens // 2)
    if not config.max_num_seqs:
        sized = replace(sized, max_num_seqs=max(1, min(sized.max_num_seqs, blocks)))
    return sized, blocks


def profile_activation_peak(make_runner, config: EngineConfig, max_model_len: int) -> int:
    """Bytes a step of max_num_batched_tokens prompt tokens over max_num_seqs sampling sequences allocates
    beyond what is already held (the sampling rows take top-k/top-p: the torch sampler's sort is its worst case).

    `make_runner(config, num_blocks)` builds a throw-away runner with a small KV pool for the dummy step.
    """
    from cbatch.engine.kv_blocks import BlockPool
    from cbatch.engine.step import StepPlan
    from cbatch.engine.sequence import Sequence

    lengths = dummy_step_lengths(config.max_num_batched_tokens, config.max_num_seqs, max_model_len - 1)
    pool = BlockPool(sum(-(-n // config.block_size) for n in lengths) + 1, config.block_size)
    runner = make_runner(config, pool.num_blocks)
    worst = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, top_k=50)
    plan = StepPlan(scheduled=[])
    for i, n in enumerate(lengths):
        seq = Sequence(seq_id=i, prompt_ids=[1] * n, params=worst)
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


def dummy_step_lengths(tokens: int, max_seqs: int, longest: int) -> list[int]:
    """Prompt lengths for a step of `tokens` tokens over as many sequences as allowed (<= max_seqs, each
    <= longest): every sequence samples, so the logits and the sampler see the most rows a step can have."""
    num = max(1, min(max_seqs, tokens))
    base, extra = divmod(tokens, num)
    return [min(max(1, longest), base + (i < extra)) for i in range(num)]
