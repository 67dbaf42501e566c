"""Building an engine: resolve the model (folder, config, device, dtype: no weights), then load it,
size the KV pool and put scheduler and runner together.

`resolve_model` is what a job's preflight checks and fingerprints before anything loads; `build_engine`
consumes its result, so nothing is resolved twice.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch

from cbatch.config import ConfigError, EngineConfig
from cbatch.engine import memory
from cbatch.engine.engine import Engine, KVPool
from cbatch.engine.runner import ModelRunner
from cbatch.engine.warmup import warm_up
from cbatch.model.backend import Backend, BackendUnavailable, cpu_kernels, make_backend
from cbatch.model.cpu_features import bf16_speed_warning
from cbatch.model.llama import LlamaForCausalLM
from cbatch.model.loader import Checkpoint, build_model, init_random_weights, load_model, read_checkpoint, resolve_dtype, resolve_model_dir
from cbatch.model.shard import check_tensor_parallel
from cbatch.model.spec import ModelSpec
from cbatch.parallel.comm import SINGLE_RANK, Communicator
from cbatch.parallel.group import start_group


@dataclass(frozen=True, slots=True)
class ResolvedModel:
    """A model as an engine will run it, known before its weights load."""

    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    checkpoint: Checkpoint | None = None  # None: a weightless shape with random weights (benchmarks)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda: no CUDA device is available here; use cpu")
    return torch.device(name)


def resolve_model(config: EngineConfig, spec: ModelSpec | None = None, device: torch.device | None = None) -> ResolvedModel:
    """`config.model` (or the default model) read up to its config.json; or a bare `spec` (random weights).
    `device`: the one a planned run will use (`cbatch plan`), instead of `config.device` here. Warns (one
    stderr line) when the dtype is bfloat16 on a CPU without native bfloat16. Refuses a --tensor-parallel-size
    the model's shapes cannot split."""
    checkpoint = None
    if spec is None:
        from cbatch.model.default_model import default_model_dir

        checkpoint = read_checkpoint(resolve_model_dir(config.model) if config.model else default_model_dir())
        spec = checkpoint.spec
    check_tensor_parallel(spec, config.tensor_parallel_size)
    device = device if device is not None else resolve_device(config.device)
    max_model_len = min(config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    dtype = resolve_dtype(config.dtype, spec, device)
    if (warning := bf16_speed_warning(dtype, device)) is not None:
        print(f"cbatch: warning: {warning}", file=sys.stderr)
    return ResolvedModel(spec, device, dtype, max_model_len, checkpoint)


def engine_backend(config: EngineConfig, device: torch.device) -> Backend:
    """The compute backend --attention-backend names for `device` (a ConfigError when it cannot run there)."""
    try:
        backend = make_backend(config.attention_backend, device)
    except BackendUnavailable as exc:
        raise ConfigError("attention_backend", f"{config.attention_backend}: {exc}") from None
    if config.attention_backend == "auto" and device.type == "cpu" and backend.name == "torch":
        print(f"cbatch: note: the compiled CPU kernels are not available ({cpu_kernels.available()}); "
              "running the plain-torch path, which is slower", file=sys.stderr)
    return backend


def build_engine(config: EngineConfig, resolved: ResolvedModel | None = None, *, random_weights_seed: int = 0,
                 show_progress: bool = False) -> Engine:
    """Loads the model (random weights for a weightless `resolved`), sizes the KV pool and the step (on a GPU,
    from memory), builds the engine. The engine's config has the step limits it runs with.
    `show_progress`: a tqdm bar over the checkpoint's tensors while they load (the library's default).
    With --tensor-parallel-size N this process is rank 0 and N - 1 worker processes hold the other shares."""
    resolved = resolved or resolve_model(config)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device, dtype, spec = resolved.device, resolved.dtype, resolved.spec
    comm, peers = SINGLE_RANK, None
    if config.tensor_parallel_size > 1:
        comm, peers = start_group(config, resolved)
    model = load_rank_model(config, resolved, comm, device, random_weights_seed, show_progress)
    kv_dtype = memory.kv_cache_dtype(config, dtype)
    tuning = tune_kernels(config, resolved, model.backend, kv_dtype, comm)  # before memory is sized

    def make_runner(sized: EngineConfig, num_blocks: int, num_host_blocks: int = 0) -> ModelRunner:
        settings = dict(num_kv_blocks=num_blocks, block_size=sized.block_size, max_num_seqs=sized.max_num_seqs,
                        max_model_len=resolved.max_model_len, dtype=dtype, job_seed=sized.seed,
                        num_host_blocks=num_host_blocks, kv_dtype=kv_dtype)
        if peers is not None:
            peers.send_runner(**settings)  # the workers build the same runner over their shares
        runner = ModelRunner(model, device=device, **settings)
        runner.peers = peers
        return runner

    config, kv = _kv_pool(config, resolved, model.spec, kv_dtype, make_runner)
    if config.async_scheduling is None:  # where the host can run ahead of the device
        config = replace(config, async_scheduling=device.type == "cuda" and comm.world == 1)
    runner = make_runner(config, kv.num_blocks, kv.num_host_blocks)
    if device.type == "cuda" and model.backend.supports_cuda_graphs and not config.enforce_eager:
        runner.capture_decode_graphs(config.max_num_seqs, resolved.max_model_len)
    if device.type == "cuda" and model.backend.name == "triton":
        warm_up(runner, config, resolved.max_model_len)  # every kernel variant compiles now, not mid-run
    tokenizer = None
    model_dir = resolved.checkpoint.path if resolved.checkpoint is not None else None
    if model_dir is not None:
        from cbatch.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(model_dir)
    return Engine(config, runner, kv, resolved.max_model_len, spec=spec, tokenizer=tokenizer, device=device,
                  dtype=dtype, model_dir=model_dir, kernel_tuning=tuning)


# start-up tuning times decode steps of this many sequences at this context (capped by max_model_len): the
# size of a full decode step on a GPU, where decode attention's time goes
TUNING_BATCH, TUNING_CONTEXT = 256, 2048


def tune_kernels(config: EngineConfig, resolved: ResolvedModel, backend: Backend, kv_dtype: torch.dtype,
                 comm: Communicator) -> dict | None:
    """Start-up tuning where the backend has it (the GPU's Triton kernels), on one rank (tensor-parallel ranks
    keep the kernels' own policy); what was chosen, for the report, or None."""
    device, spec = resolved.device, resolved.spec
    if not (config.tune_kernels and backend.supports_tuning and device.type == "cuda" and comm.world == 1):
        return None
    from cbatch.kernels.tuning import DecodeShape

    shape = DecodeShape(spec.num_heads, spec.num_kv_heads, spec.head_dim, config.block_size, resolved.dtype,
                        kv_dtype, TUNING_BATCH, min(resolved.max_model_len, TUNING_CONTEXT))
    result = backend.tune(shape, device).describe()
    torch.cuda.empty_cache()  # the synthetic K/V go back before the KV pool is sized
    return result


def load_rank_model(config: EngineConfig, resolved: ResolvedModel, comm: Communicator, device: torch.device,
                    random_weights_seed: int = 0, show_progress: bool = False) -> LlamaForCausalLM:
    """This rank's model on `device` (the whole model on one rank): the checkpoint's weights, or random ones for
    a weightless `resolved`; prepacked for oneDNN on CPU."""
    backend = engine_backend(config, device)
    dtype = resolved.dtype
    if resolved.checkpoint is not None:
        model = load_model(resolved.checkpoint, resolved.max_model_len, device, dtype, backend, show_progress, comm)
    else:
        model = build_model(resolved.spec, resolved.max_model_len, device, dtype, backend, comm=comm)
        init_random_weights(model, random_weights_seed)
    if device.type == "cpu":
        model.prepack_for_cpu()
    return model


def _kv_pool(config: EngineConfig, resolved: ResolvedModel, spec: ModelSpec, kv_dtype: torch.dtype,
             make_runner) -> tuple[EngineConfig, KVPool]:
    """(config with its step limits, pool): the pool forced by --num-kv-blocks, else from the memory budget
    (GPU: after profiled dummy steps, which also size the step); the host swap space from --swap-space,
    never more than 4 pools' worth. `spec`: this rank's (its share of the KV heads)."""
    device = resolved.device
    if device.type == "cuda" and config.num_kv_blocks is None:
        config, num_blocks = memory.gpu_step_and_pool(config, spec, kv_dtype, resolved.max_model_len, make_runner)
    else:
        config = memory.with_step_limits(config, device)
        num_blocks = config.num_kv_blocks or memory.cpu_kv_blocks(config, spec, kv_dtype, resolved.max_model_len)
    return config, KVPool(num_blocks, memory.host_kv_blocks(config, spec, kv_dtype, num_blocks))
