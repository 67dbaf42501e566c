"""An estimate of the FLOP/s and memory bandwidth a job achieved, against the device's peak.

Counted from per-step counters, not measured: FLOPs = 2 x (active weights: a mixture of experts counts
its top-k experts) per token + 4 x heads x head_dim per attended (query, key) pair per layer; bytes = the
weights a step reads (every dense weight, and the experts its tokens pick: `ModelSpec.params_read`) at
their stored size (1 byte for FP8 weights) + the KV read (each scheduled sequence's context) + the KV
written. Divided by the time inside the model call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cbatch.model.spec import ModelSpec
from cbatch.observe.metrics import StepSample

# Dense bf16/fp16 tensor-core TFLOP/s and memory TB/s from the vendors' datasheets (SXM parts).
DEVICE_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 989.0, 4.8),
    ("H100 PCIe", 756.0, 2.0),
    ("H100", 989.0, 3.35),
    ("A100", 312.0, 2.04),
    ("L40S", 362.0, 0.864),
    ("L4", 121.0, 0.3),
    ("A10", 125.0, 0.6),
)


def device_peak(name: str) -> tuple[float, float] | None:
    """(peak TFLOP/s, peak TB/s) for a CUDA device name, or None when unknown."""
    for key, tflops, tbps in DEVICE_PEAKS:
        if key.lower() in name.lower():
            return tflops, tbps
    return None


@dataclass(frozen=True, slots=True)
class ModelWork:
    """What one unit of work costs a model, in FLOPs and bytes (the counting above): shared by the
    achieved-rate estimate here and the default cost model of `cbatch plan` (cbatch/plan/devices.py).
    A mixture of experts computes with its top-k experts per token and reads the experts a step's tokens pick."""

    spec: ModelSpec
    bytes_per_weight: float  # the weights' stored size (1 for FP8 weights kept FP8)
    layer_flops_per_token: float  # 2 x the weights a token passes through in the layers (active experts only)
    head_flops_per_token: float  # 2 x the lm_head weights, for tokens that sample
    flops_per_attention_pair: float  # 4 x layers x heads x head_dim per (query, key) pair
    kv_bytes_per_token: float  # one token's K and V over all layers

    @classmethod
    def of(cls, spec: ModelSpec, dtype_bytes: int, bytes_per_weight: float | None = None) -> "ModelWork":
        head_params = spec.vocab_size * spec.hidden_size
        return cls(
            spec=spec,
            bytes_per_weight=float(dtype_bytes if bytes_per_weight is None else bytes_per_weight),
            layer_flops_per_token=2.0 * (spec.active_params() - head_params),
            head_flops_per_token=2.0 * head_params,
            flops_per_attention_pair=4.0 * spec.num_layers * spec.num_heads * spec.head_dim,
            kv_bytes_per_token=float(spec.kv_bytes_per_token(dtype_bytes)),
        )

    def weight_bytes(self, tokens: float = float("inf")) -> float:
        """Bytes of weights a step of `tokens` tokens reads (default: a large step, every expert)."""
        return self.spec.params_read(tokens) * self.bytes_per_weight


def hardware_estimate(spec: ModelSpec, dtype_bytes: int, samples: list[StepSample], forward_seconds: float,
                      device_name: str | None, half_precision: bool, weight_bytes: float | None = None) -> dict[str, Any]:
    """`weight_bytes`: bytes per stored weight (less than dtype_bytes when FP8 weights stay FP8)."""
    work = ModelWork.of(spec, dtype_bytes, weight_bytes)
    flops = 0.0
    bytes_moved = 0.0
    for s in samples:
        flops += work.layer_flops_per_token * s.scheduled_tokens + work.head_flops_per_token * (s.output_tokens or 0)
        flops += work.flops_per_attention_pair * s.attention_pairs
        # a bucket of several steps: the experts touched by its average step, `steps` times
        bytes_moved += work.weight_bytes(s.scheduled_tokens / max(s.steps, 1)) * s.steps
        bytes_moved += work.kv_bytes_per_token * (s.context_tokens + s.scheduled_tokens)
    seconds = max(forward_seconds, 1e-9)
    out: dict[str, Any] = {
        "device_name": device_name or "cpu",
        "model_flops": flops,
        "bytes_moved": bytes_moved,
        "achieved_tflops": flops / seconds / 1e12,
        "achieved_gb_per_s": bytes_moved / seconds / 1e9,
        "peak_tflops": None,
        "peak_gb_per_s": None,
        "flops_utilization": None,
        "bandwidth_utilization": None,
    }
    peak = device_peak(device_name) if device_name else None
    if peak is not None and half_precision:
        out["peak_tflops"], out["peak_gb_per_s"] = peak[0], peak[1] * 1000
        out["flops_utilization"] = out["achieved_tflops"] / peak[0]
        out["bandwidth_utilization"] = out["achieved_gb_per_s"] / out["peak_gb_per_s"]
    return out


def stored_bytes_per_weight(model) -> float:
    """Bytes per weight of a live model's decoder matrices as stored (a vision tower, `visual`, left out: its steps
    are not the decoder's): FP8 ones at 1; packed int ones (layers.Int4Linear, packed experts) at their words,
    scales and zeros over the weights they hold."""
    from cbatch.model.layers import Int4Linear
    from cbatch.model.moe import Experts

    stored = weights = 0
    for name, module in model.named_modules():
        if name.partition(".")[0] == "visual":
            continue
        own = [p for p in module.parameters(recurse=False) if p is not getattr(module, "bias", None)]
        if isinstance(module, Int4Linear):
            stored += sum(p.numel() * p.element_size() for p in own)
            weights += module.in_features * module.out_features
            continue
        if isinstance(module, Experts) and module.w13_zero is not None:
            stored += sum(p.numel() * p.element_size() for p in own)
            weights += (module.w13.numel() + module.w2.numel()) * (32 // module.int_layout[1])
            continue
        for p in own:
            if p.dim() >= 2:  # the matrices (FP8 ones included)
                stored += p.numel() * p.element_size()
                weights += p.numel()
    return stored / max(1, weights)


def engine_hardware(engine, samples: list[StepSample], forward_seconds: float) -> dict[str, Any]:
    """`hardware_estimate` for a live engine (device name read from CUDA when it runs there)."""
    import torch

    name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None
    dtype_bytes = torch.finfo(engine.dtype).bits // 8
    weight_bytes = stored_bytes_per_weight(engine.runner.model)
    estimate = hardware_estimate(engine.spec, dtype_bytes, samples, forward_seconds, name, dtype_bytes == 2,
                                 weight_bytes=weight_bytes or dtype_bytes)
    tuning = {"kernel_tuning": engine.kernel_tuning} if getattr(engine, "kernel_tuning", None) else {}
    load = getattr(engine.runner.model, "expert_load", None)  # expert parallelism: rank 0 counts every rank's
    experts = {"expert_parallel": load.summary()} if load is not None else {}
    return {**estimate, "memory": engine.runner.memory(), **tuning, **experts}  # per rank under tensor parallelism
