"""Building an engine: load the resolved model (cbatch/engine/resolve.py), size the KV pool and put scheduler
and runner together. `build_engine` consumes `resolve_model`'s result, so nothing is resolved twice.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from cbatch.config import EngineConfig
from cbatch.engine import memory
from cbatch.engine.engine import Engine, KVPool
from cbatch.engine.resolve import ResolvedModel, load_rank_model, resolve_model
from cbatch.engine.runner import ModelRunner
from cbatch.engine.tensor_parallel import start_group
from cbatch.engine.tower_calls import tower_budget
from cbatch.engine.warmup import warm_up
from cbatch.model.backend import Backend
from cbatch.model.layers import Linear
from cbatch.model.spec import ModelSpec
from cbatch.parallel.comm import SINGLE_RANK, Communicator


def graph_batch_limit(config: EngineConfig) -> int:
    """The largest decode batch worth a CUDA graph: max_num_seqs, or fewer when the job cannot run that many."""
    return min(config.max_num_seqs, config.cuda_graph_max_batch or config.max_num_seqs)


def build_engine(config: EngineConfig, resolved: ResolvedModel | None = None, *, random_weights_seed: int = 0,
                 show_progress: bool = False) -> Engine:
    """Loads the model (random weights for a weightless `resolved`), sizes the KV pool and the step (on a GPU,
    from memory), builds the engine. The engine's config has the step limits it runs with.
    `show_progress`: a tqdm bar over the checkpoint's tensors while they load (the library's default).
    With --tensor-parallel-size N this process is rank 0 and N - 1 worker processes hold the other shares."""
    resolved = resolved or resolve_model(config)
    if resolved.spec.mla is not None and not config.enforce_eager:
        # MLA attention runs the torch path on a GPU too (backend/mla.py: per-step host state): no decode graphs
        config = replace(config, enforce_eager=True)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device, dtype, spec = resolved.device, resolved.dtype, resolved.spec
    comm, peers = SINGLE_RANK, None
    if config.tensor_parallel_size > 1:
        comm, peers = start_group(config, resolved)
    model = load_rank_model(config, resolved, comm, device, random_weights_seed, show_progress)
    kv_dtype = memory.kv_cache_dtype(config, dtype)
    # LoRA adapters: their slots in the adapted layers, allocated before the KV pool is sized from what is free
    lora = load_loras(config, model, spec) if config.loras else None
    tuning = tune_kernels(config, resolved, model.backend, kv_dtype, comm, model)  # before memory is sized

    def make_runner(sized: EngineConfig, num_blocks: int, num_host_blocks: int = 0) -> ModelRunner:
        settings = dict(num_kv_blocks=num_blocks, block_size=sized.block_size, max_num_seqs=sized.max_num_seqs,
                        max_model_len=resolved.max_model_len, dtype=dtype, job_seed=sized.seed,
                        num_host_blocks=num_host_blocks, kv_dtype=kv_dtype, split_sampler=sized.split_sampler,
                        tower_tokens=tower_budget(sized.max_num_batched_tokens, sized.max_image_tokens_per_step))
        if peers is not None:
            peers.send_runner(**settings)  # the workers build the same runner over their shares
        runner = ModelRunner(model, device=device, **settings)
        runner.peers = peers
        return runner

    config, kv_pool = _kv_pool(config, resolved, model.spec, kv_dtype, make_runner,
                                 _encoder_memory(resolved, model, config))
    if config.async_scheduling is None:  # where the host can run ahead of the device
        config = replace(config, async_scheduling=device.type == "cuda" and comm.world == 1)
    runner = make_runner(config, kv_pool.num_blocks, kv_pool.num_host_blocks)
    if lora is not None:  # before the graphs and the warm-up
        runner.lora = lora
        if device.type == "cuda":
            lora.warm_up()  # the shrink / expand kernels compile now, not mid-run
    if device.type == "cuda" and model.backend.supports_cuda_graphs and not config.enforce_eager:
        runner.capture_decode_graphs(graph_batch_limit(config), resolved.max_model_len)
    if device.type == "cuda" and model.backend.needs_warmup:
        warm_up(runner, config, resolved.max_model_len)  # every kernel variant compiles now, not mid-run
    tokenizer = None
    model_dir = resolved.checkpoint.path if resolved.checkpoint is not None else None
    if model_dir is not None:
        from cbatch.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
    return Engine(config, runner, kv_pool, resolved.max_model_len, spec=spec, tokenizer=tokenizer, device=device,
                  dtype=dtype, model_dir=model_dir, kernel_tuning=tuning)


def load_loras(config: EngineConfig, model, spec: ModelSpec):
    """The job's LoRA adapters (checked against the full model `spec` again: preflight did it once) in the slots
    of `model` (this rank's share)."""
    from cbatch.lora.runtime import LoraSlots

    return LoraSlots.for_job(config.loras, model, spec, config.max_loras, config.max_lora_rank)


def add_loras(engine: Engine, loras: tuple[tuple[str, str], ...]) -> None:
    """More LoRA adapters (name, PEFT folder) for a built engine with nothing queued (the library's LoRARequest
    naming a new one): the slots made again for every adapter, without reloading the model, and a fresh
    scheduler (`Engine.reset`) whose admission knows them."""
    if engine.has_unfinished():
        raise RuntimeError("adapters can be added only between runs (requests are queued)")
    config = replace(engine.config, loras=engine.config.loras + tuple(loras))  # (checks the names)
    lora = load_loras(config, engine.runner.model, engine.spec)
    if engine.runner.peers is not None:
        engine.runner.peers.send_loras(config)  # each worker makes its slots again too
    engine.runner.lora = lora
    if engine.device is not None and engine.device.type == "cuda":
        lora.warm_up()
    engine.reset(loras=config.loras)


# start-up tuning times decode steps of this many sequences at this context (capped by max_model_len): the
# size of a full decode step on a GPU, where decode attention's time goes
TUNING_BATCH, TUNING_CONTEXT = 256, 2048


def tune_kernels(config: EngineConfig, resolved: ResolvedModel, backend: Backend, kv_dtype: torch.dtype,
                 comm: Communicator, model=None) -> dict | None:
    """Start-up tuning where the backend has it (the GPU's Triton kernels), on one rank (tensor-parallel ranks
    keep the kernels' own policy): decode attention's tiles, then (`config.decode_gemm`) cuBLAS or the Triton
    GEMM per decode layer shape of `model`; what was chosen, for the report, or None."""
    device, spec = resolved.device, resolved.spec
    if not (config.tune_kernels and backend.supports_tuning and device.type == "cuda" and comm.world == 1
            and spec.mla is None):  # MLA does not run the tuned paged-attention kernel
        return None
    from cbatch.kernels.tuning import DecodeShape

    shape = DecodeShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, config.block_size, resolved.dtype,
                        kv_dtype, TUNING_BATCH, min(resolved.max_model_len, TUNING_CONTEXT))
    result = backend.tune(shape, device, resolved.max_model_len).describe()
    torch.cuda.empty_cache()  # the synthetic K/V go back before the KV pool is sized
    # the Triton GEMM runs inside the decode graphs only (kernels/gemm.DecodeGemm): none, nothing to tune
    graphs = backend.supports_cuda_graphs and not config.enforce_eager
    linears = decode_gemm_layers(model) if config.decode_gemm and graphs and model is not None else []
    if linears:
        result["decode_gemm"] = backend.tune_linears(linears, device, gemm_buckets(config)).describe()
        torch.cuda.empty_cache()
    return result


def gemm_buckets(config: EngineConfig) -> tuple[int, ...]:
    """The decode GEMM's batch buckets a run can reach: up to the first that holds the largest decode graph (the
    job's rows when it says, else max_num_seqs when set; else all of them)."""
    from cbatch.kernels.gemm import ROW_BUCKETS

    limit = config.cuda_graph_max_batch or config.max_num_seqs
    if not limit:
        return ROW_BUCKETS
    return tuple(b for b in ROW_BUCKETS if b < limit) + tuple(b for b in ROW_BUCKETS if b >= limit)[:1]


def decode_gemm_layers(model) -> list[Linear]:
    """The decoder layers' plain 16-bit linear layers (qkv, o, gate_up, down: a decode step's GEMMs; not the
    lm_head, whose float32-logits GEMM is its own, nor FP8 / int4 layers, which have their kernels)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    return [m for m in layers.modules() if type(m) is Linear and m.weight is not None
            and m.weight.dtype in (torch.bfloat16, torch.float16)]


def _encoder_memory(resolved: ResolvedModel, model, config: EngineConfig):
    """What a vision-language model's images take on the GPU beside a text step (engine/encoder_memory.py), or None
    (a text model, the CPU)."""
    if resolved.device.type != "cuda" or getattr(model, "visual", None) is None:
        return None
    from cbatch.engine.encoder_memory import encoder_memory

    model_dir = resolved.checkpoint.path if resolved.checkpoint is not None else None
    return encoder_memory(model.spec, resolved.dtype, model_dir, config, resolved.max_model_len, model.visual)


def _kv_pool(config: EngineConfig, resolved: ResolvedModel, spec: ModelSpec, kv_dtype: torch.dtype,
             make_runner, encoder=None) -> tuple[EngineConfig, KVPool]:
    """(config with its step limits, pool): the pool forced by --num-kv-blocks, else from the memory budget
    (GPU: after profiled dummy steps, which also size the step; `encoder`: a vision-language model's images'
    share, engine/encoder_memory.py); the host swap space from --swap-space, never more than 4 pools' worth.
    `spec`: this rank's (its share of the KV heads)."""
    device = resolved.device
    if device.type == "cuda" and config.num_kv_blocks is None:
        config, num_blocks = memory.gpu_step_and_pool(config, spec, kv_dtype, resolved.max_model_len, make_runner,
                                                      encoder)
    else:
        config = memory.with_step_limits(config, device)
        num_blocks = config.num_kv_blocks or memory.cpu_kv_blocks(config, spec, kv_dtype, resolved.max_model_len)
    return config, KVPool(num_blocks, memory.host_kv_blocks(config, spec, kv_dtype, num_blocks))
