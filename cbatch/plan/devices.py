"""The machine a planned run will use (`--device-kind`, default this one), and its default cost model.

The device decides what `auto` settings become (dtype), the KV pool, and, without --cost-from, what a
step costs. The KV pool: on a CPU exactly as `cbatch run` sizes it (cbatch/engine/memory.py); on a GPU
from the preset's memory with the same formula as a run, the weights and activations estimated instead
of measured (a run measures them after loading; a vision-language model's images' reserve is the run's, the
tower's activations counted: engine/encoder_memory.py); --num-kv-blocks makes it exact either way.

Default cost model (no --cost-from): the roofline counting of cbatch/observe/roofline.py (`ModelWork`)
over the device's peaks, at fixed efficiencies (assumptions, not measurements):

    per_step          = weight bytes / (bandwidth x BANDWIDTH_EFFICIENCY) + step_overhead_s
                        (an AWQ / GPTQ / compressed-tensors int checkpoint on a GPU: its packed sizes)
    per_prefill_token = layer FLOPs per token / (peak FLOP/s x flop_efficiency)
    per_decode_token  = (layer + lm_head FLOPs per token) / (peak FLOP/s x flop_efficiency)
    per_context_token = KV bytes per token / (bandwidth x BANDWIDTH_EFFICIENCY)
                        + attention FLOPs per (query, key) pair / (peak FLOP/s x flop_efficiency)

With --tensor-parallel-size N every figure is one rank's (its heads, MLP width and KV heads: `Shard.local_spec`;
its share of the weights), and each token adds the bytes a rank sends over NVLink for it (cbatch/plan/collectives.py:
two ring all-reduces per layer, or for an MoE layer under --expert-parallel one all-reduce and the expert combine,
routed in prefill steps and padded in decode steps' CUDA graphs):
    per token += bytes sent per token / (NVLINK_TB_S x BANDWIDTH_EFFICIENCY)

GPU peaks are the datasheets' dense bf16/fp16 figures (roofline.DEVICE_PEAKS); float32 runs without
tensor cores at about 1/16 of them. A CPU's peak is estimated from its threads and vector ISA at an
assumed 2.5 GHz and 20 GB/s. Expect this to be off by a factor of 2 or more: a cost model fitted to a
real run's report on the same kind of machine (--cost-from) is what makes a prediction accurate.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from cbatch.bench.simulator import CostModel
from cbatch.config import EngineConfig, UserError
from cbatch.engine import memory
from cbatch.engine.encoder_memory import encoder_memory
from cbatch.engine.engine import KVPool
from cbatch.engine.resolve import ResolvedModel, resolve_device
from cbatch.model.shard import Shard, tensor_parallel_sizes, with_expert_parallel
from cbatch.model.spec import ModelSpec
from cbatch.observe.roofline import DEVICE_PEAKS, ModelWork
from cbatch.plan.collectives import CommBytes, comm_bytes_per_token

GPU_MEMORY_GIB = {"H200": 141, "H100 PCIe": 80, "H100": 80, "A100": 80, "L40S": 48, "L4": 24, "A10": 24}
FP32_SHARE_OF_PEAK = 1 / 16  # float32 on a GPU: CUDA cores, not tensor cores
BANDWIDTH_EFFICIENCY = 0.7
CPU_CLOCK_HZ = 2.5e9
CPU_BANDWIDTH_TB_S = 0.02
CPU_FP32_FLOPS_PER_CYCLE = {"AVX512": 64, "AVX2": 32}  # per core: 2 FMA units x lanes x 2
CUDA_CONTEXT_BYTES = 2**29  # the CUDA context and allocator slack next to the weights
MAX_SUGGESTED_RANKS = 8  # a layout suggested for a model that does not fit: one machine's GPUs
NVLINK_TB_S = 0.45  # one direction of an H100/H200 SXM's NVLink 4 (900 GB/s both ways), the ring all-reduce's bus


class PlanError(UserError):
    """A plan that cannot be made as asked: the message names the flag and the fix."""


def preset_names() -> dict[str, str]:
    """--device-kind spelling -> DEVICE_PEAKS name ("h100-pcie" -> "H100 PCIe")."""
    return {name.lower().replace(" ", "-"): name for name, _, _ in DEVICE_PEAKS}


@dataclass(frozen=True, slots=True)
class DeviceKind:
    name: str  # "cpu", or a GPU's name
    device: torch.device  # where the planned run computes
    peak_tflops: float | None  # dense bf16 (GPU) / fp32 vector (CPU) peak; None: an unknown GPU
    peak_tb_per_s: float | None
    memory_gib: float | None  # GPU memory; None on a CPU (the pool comes from host memory)
    flop_efficiency: float
    step_overhead_s: float  # scheduling and launches around each model call

    @property
    def is_this_machine(self) -> bool:
        """This process can run on it (so a result cache's device kind can be named)."""
        return self.device.type == "cpu" or (torch.cuda.is_available() and self.name == torch.cuda.get_device_name())

    def kv_pool(self, config: EngineConfig, model: ResolvedModel) -> KVPool:
        """The KV pool a run of `config` would get here (see the module docstring)."""
        ranks = config.tensor_parallel_size
        spec, dtype, max_model_len = Shard(0, ranks).local_spec(model.spec), model.dtype, model.max_model_len
        kv_dtype = memory.kv_cache_dtype(config, dtype)
        if config.num_kv_blocks is not None:
            blocks = config.num_kv_blocks
        elif self.memory_gib is None:
            blocks = memory.cpu_kv_blocks(config, spec, kv_dtype, max_model_len)
        else:
            try:
                blocks = self._gpu_kv_blocks(config, model)
            except MemoryError as exc:
                suggestion = self._fitting_layout(config, model)
                if not suggestion and (too_big := self._beyond_one_machine(config, model)):
                    raise PlanError(too_big) from None
                raise PlanError(f"--device-kind {self.name}: {exc}{suggestion}") from None
        return KVPool(blocks, memory.host_kv_blocks(config, spec, kv_dtype, blocks))

    def weight_bytes_per_rank(self, config: EngineConfig, model: ResolvedModel) -> float:
        """What rank 0 of `config`'s layout stores (no rank stores more): its share of the decoder's matrices (a
        vocab-parallel embedding and lm_head: 1/N of each; expert parallelism: its experts whole, a shared expert
        whole) at the bytes a GPU run keeps per weight, a vision-language model's tower whole in the model dtype
        (quantized checkpoints leave it in 16 bits), and the CUDA context."""
        ranks = config.tensor_parallel_size
        spec = Shard(0, ranks).local_spec(model.spec)
        params = spec.num_params() + spec.vocab_size * spec.hidden_size * (2 / ranks - 1)  # embedding, lm_head: 1/N each
        decoder = params * gpu_bytes_per_weight(model)
        tower = spec.tower_params() * (torch.finfo(model.dtype).bits // 8)
        return decoder + tower + CUDA_CONTEXT_BYTES

    def _gpu_kv_blocks(self, config: EngineConfig, model: ResolvedModel) -> int:
        """Blocks of one rank's KV pool in this GPU's memory (MemoryError: the weights leave no room). A
        vision-language model's step takes its images' reserve as a run does (engine/encoder_memory.py), the
        tower's activations counted where a run measures them."""
        spec = Shard(0, config.tensor_parallel_size).local_spec(model.spec)
        peak = activation_estimate(config, model)
        model_dir = model.checkpoint.path if model.checkpoint is not None else None
        if (encoder := encoder_memory(model.spec, model.dtype, model_dir, config, model.max_model_len)) is not None:
            peak = encoder.reserve(peak, config.max_num_batched_tokens, config.max_image_tokens_per_step)
        return memory.kv_blocks_in_gpu_memory(config, spec, memory.kv_cache_dtype(config, model.dtype),
                                              model.max_model_len, self.memory_gib * 2**30,
                                              self.weight_bytes_per_rank(config, model), peak)

    def _layouts(self, spec: ModelSpec) -> list[tuple[ModelSpec, bool]]:
        """(spec, expert parallel) of the layouts a plan may suggest: plain tensor parallelism, and expert
        parallelism where the model has experts."""
        if spec.moe is None:
            return [(spec, False)]
        spec = replace(spec, moe=replace(spec.moe, expert_parallel=False))
        return [(spec, False), (with_expert_parallel(spec), True)]

    def _beyond_one_machine(self, config: EngineConfig, model: ResolvedModel) -> str | None:
        """Why no setting can fit the model on one machine of these GPUs (None: --gpu-memory-utilization or smaller
        steps might): at MAX_SUGGESTED_RANKS ranks (or --tensor-parallel-size, if more), in the layout storing least
        per rank, with the whole GPU and the smallest default steps, no KV block is left."""
        ranks = max(config.tensor_parallel_size, MAX_SUGGESTED_RANKS)
        seqs, tokens = memory.GPU_MIN_STEP
        smallest = replace(config, gpu_memory_utilization=1.0, tensor_parallel_size=ranks,
                           max_num_seqs=min(config.max_num_seqs or seqs, seqs),
                           max_num_batched_tokens=min(config.max_num_batched_tokens or tokens, tokens))
        least = min(((self.weight_bytes_per_rank(replace(smallest, expert_parallel=expert), replace(model, spec=spec)),
                      expert, spec) for spec, expert in self._layouts(model.spec)), key=lambda option: option[0])
        weights, expert, spec = least
        try:
            self._gpu_kv_blocks(replace(smallest, expert_parallel=expert), replace(model, spec=spec))
            return None
        except MemoryError:
            pass
        flags = f"--tensor-parallel-size {ranks}" + (" --expert-parallel" if expert else "")
        by_memory = sorted(preset_names().items(), key=lambda preset: GPU_MEMORY_GIB[preset[1]])
        bigger = next((spelling for spelling, name in by_memory if GPU_MEMORY_GIB[name] > self.memory_gib
                       and not gpu_kind(name)._beyond_one_machine(config, model)), None)
        fix = (f"use a GPU with more memory (--device-kind {bigger} fits) or a smaller (quantized) checkpoint" if bigger
               else "use a smaller (quantized) checkpoint: more GPUs than one machine holds is not supported")
        return (f"--device-kind {self.name}: the model does not fit one machine's {ranks} GPUs: at {flags} each rank's "
                f"weights take {weights / 2**30:,.1f} GiB of the GPU's {self.memory_gib:,.1f} GiB, which leaves no room "
                f"for a KV cache even at --gpu-memory-utilization 1.0; {fix}")

    def _fitting_layout(self, config: EngineConfig, model: ResolvedModel) -> str:
        """'; LAYOUT fits ...': the fewest ranks (up to one 8-GPU machine; expert parallelism where the model has
        experts and it stores less) that leave room for a KV pool; '' when none does."""
        layouts = self._layouts(model.spec)
        for ranks in range(config.tensor_parallel_size + 1, MAX_SUGGESTED_RANKS + 1):
            fits = []
            for layout_spec, expert in layouts:
                if ranks not in tensor_parallel_sizes(layout_spec, ranks):
                    continue
                candidate = replace(config, tensor_parallel_size=ranks, expert_parallel=expert)
                planned = replace(model, spec=layout_spec)
                try:
                    blocks = self._gpu_kv_blocks(candidate, planned)
                except MemoryError:
                    continue
                fits.append((-blocks, expert, self.weight_bytes_per_rank(candidate, planned)))
            if fits:
                _, expert, weights = min(fits)
                flags = f"--tensor-parallel-size {ranks}" + (" --expert-parallel" if expert else "")
                return f"; {flags} fits ({weights / 2**30:,.1f} GiB of weights per rank)"
        return ""

    def comm_bytes(self, model: ResolvedModel, ranks: int, enforce_eager: bool = False) -> CommBytes:
        """What one rank sends per token (decode steps in CUDA graphs on a GPU unless `enforce_eager`)."""
        dtype_bytes = torch.finfo(model.dtype).bits // 8
        return comm_bytes_per_token(model.spec, ranks, dtype_bytes, self.memory_gib is not None and not enforce_eager)

    def default_cost(self, model: ResolvedModel, ranks: int = 1, enforce_eager: bool = False) -> CostModel:
        """The cost model of the module docstring for `ranks` ranks (`enforce_eager`: no CUDA graphs for decode)."""
        if self.peak_tflops is None or self.peak_tb_per_s is None:
            raise PlanError(f"no peak figures for {self.name}: give --cost-from a real run's report on it, "
                            f"or --device-kind one of cpu, {', '.join(preset_names())}")
        dtype_bytes = torch.finfo(model.dtype).bits // 8
        spec = Shard(0, ranks).local_spec(model.spec)
        work = ModelWork.of(spec, dtype_bytes, gpu_bytes_per_weight(model) if self.memory_gib else dtype_bytes)
        sent = self.comm_bytes(model, ranks, enforce_eager)
        link = NVLINK_TB_S * 1e12 * BANDWIDTH_EFFICIENCY
        peak = self.peak_tflops * (FP32_SHARE_OF_PEAK if dtype_bytes == 4 and self.memory_gib else 1.0)
        flops = peak * 1e12 * self.flop_efficiency
        bandwidth = self.peak_tb_per_s * 1e12 * BANDWIDTH_EFFICIENCY
        return CostModel(
            per_step=work.weight_bytes() / bandwidth + self.step_overhead_s,
            per_prefill_token=work.layer_flops_per_token / flops + sent.prefill / link,
            per_context_token=work.kv_bytes_per_token / bandwidth + work.flops_per_attention_pair / flops,
            unit="s",
            per_decode_token=(work.layer_flops_per_token + work.head_flops_per_token / ranks) / flops
            + sent.decode / link,
        )


def gpu_bytes_per_weight(model: ResolvedModel) -> float:
    """Bytes a GPU run stores per decoder weight (a vision tower's tensors left out: weights.is_tower_tensor): the
    compute dtype's, or for an AWQ / GPTQ / compressed-tensors int checkpoint the packed layers' real sizes
    (weights.stored_bytes_per_weight, from the safetensors headers), for an FP8 one a byte per FP8 matrix weight,
    for an MXFP4 checkpoint (gpt-oss) its experts' 4.25 bits (mxfp4.stored_bytes_per_weight)."""
    dtype_bytes = torch.finfo(model.dtype).bits // 8
    quant = model.spec.quant
    if model.checkpoint is not None and quant is not None and quant.mxfp4:
        from cbatch.model.mxfp4 import stored_bytes_per_weight as mxfp4_bytes_per_weight
        from cbatch.model.weights import TensorIndex

        files = sorted(model.checkpoint.path.glob("*.safetensors"))
        return mxfp4_bytes_per_weight(TensorIndex(files), dtype_bytes) if files else float(dtype_bytes)
    if quant is None:
        return float(dtype_bytes)
    from cbatch.model.weights import TensorIndex, is_tower_tensor, stored_bytes_per_weight

    files = sorted(model.checkpoint.path.glob("*.safetensors")) if model.checkpoint is not None else []
    if not files:  # a config.json alone (or a bare spec): an FP8 checkpoint's layers in FP8, its embeddings not
        fp8 = quant.packed is None and not quant.mxfp4
        return _fp8_spec_bytes_per_weight(model.spec, dtype_bytes) if fp8 else float(dtype_bytes)
    index = TensorIndex(files)
    if quant.packed is not None:
        return stored_bytes_per_weight(index, quant.packed, model.spec, dtype_bytes)
    # FP8: the GPU path keeps the FP8 matrices in one byte each (their float32 scales are a rounding error)
    stored = weights = 0
    for name in index.file_of:
        if not is_tower_tensor(name) and len(shape := index.shape(name)) >= 2:
            numel = shape[0] * shape[1] * (shape[2] if len(shape) > 2 else 1)
            weights += numel
            stored += numel * (1 if index.dtype_of[name].startswith("F8") else dtype_bytes)
    return stored / max(weights, 1)


def _fp8_spec_bytes_per_weight(spec: ModelSpec, dtype_bytes: int) -> float:
    """Bytes per weight of an FP8 checkpoint known by its config alone: every decoder matrix at one byte (as the
    GPU path keeps them; block scales are a rounding error), the lm_head (counted by `num_params`) at `dtype_bytes`."""
    head = spec.vocab_size * spec.hidden_size
    return ((spec.num_params() - head) + head * dtype_bytes) / spec.num_params()


def activation_estimate(config: EngineConfig, model: ResolvedModel) -> float:
    """Bytes of the largest step's activations: every projection's output for a full token budget, and
    float32 logits for every sequence (a run measures this instead: memory.profile_activation_peak)."""
    spec = model.spec
    dtype_bytes = torch.finfo(model.dtype).bits // 8
    per_token = spec.q_size + 2 * spec.kv_size + 2 * spec.intermediate_size + 4 * spec.hidden_size
    return config.max_num_batched_tokens * per_token * dtype_bytes + config.max_num_seqs * spec.vocab_size * 4


def cpu_kind() -> DeviceKind:
    """This machine's CPU: torch's threads x its vector ISA's FLOPs per cycle at an assumed clock."""
    per_cycle = CPU_FP32_FLOPS_PER_CYCLE.get(torch.backends.cpu.get_cpu_capability(), 16)
    peak = torch.get_num_threads() * per_cycle * CPU_CLOCK_HZ / 1e12
    return DeviceKind("cpu", torch.device("cpu"), peak, CPU_BANDWIDTH_TB_S, None, flop_efficiency=0.35,
                      step_overhead_s=0.002)


def gpu_kind(name: str, memory_gib: float | None = None) -> DeviceKind:
    """A GPU by its name: a preset's, or this machine's (its full CUDA name, matched as roofline matches
    it; `memory_gib` read from the device)."""
    key = next((k for k, _, _ in DEVICE_PEAKS if k.lower() in name.lower()), None)
    peaks = next(((t, b) for k, t, b in DEVICE_PEAKS if k == key), (None, None))
    return DeviceKind(name, torch.device("cuda"), peaks[0], peaks[1], memory_gib or GPU_MEMORY_GIB[key],
                      flop_efficiency=0.5, step_overhead_s=0.004)


def device_kind(name: str | None, config: EngineConfig) -> DeviceKind:
    """--device-kind NAME, or the machine --device names here (default: this one)."""
    if name is not None:
        spelling = name.strip().lower()
        if spelling == "cpu":
            return cpu_kind()
        if spelling not in preset_names():
            raise PlanError(f"--device-kind: must be one of cpu, {', '.join(preset_names())}, not {name!r}")
        return gpu_kind(preset_names()[spelling])
    device = resolve_device(config.device)
    if device.type != "cuda":
        return cpu_kind()
    properties = torch.cuda.get_device_properties(device)
    return gpu_kind(properties.name, properties.total_memory / 2**30)
