"""An estimate of the FLOP/s and memory bandwidth a job achieved, against the device's peak.

Counted from per-step counters, not measured: FLOPs = 2 x (active weights: a mixture of experts counts
its top-k experts) per token + 4 x heads x head_dim per attended (query, key) pair per layer; bytes = the
weights a step reads (every dense weight, and the experts its tokens pick: `ModelSpec.params_read`) at
their stored size (1 byte for FP8 weights) + the KV read (each scheduled sequence's context) + the KV
written. Divided by the time inside the model call.
"""
from __future__ import annotations

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


def hardware_estimate(spec: ModelSpec, dtype_bytes: int, samples: list[StepSample], forward_seconds: float,
                      device_name: str | None, half_precision: bool, weight_bytes: float | None = None) -> dict[str, Any]:
    """`weight_bytes`: bytes per stored weight (less than dtype_bytes when FP8 weights stay FP8)."""
    h = spec.hidden_size
    layer_params = spec.active_params() - spec.vocab_size * h  # per token through every layer
    head_params = spec.vocab_size * h  # lm_head: only for tokens that sample
    kv_per_token = spec.kv_bytes_per_token(dtype_bytes)
    weight_bytes = dtype_bytes if weight_bytes is None else weight_bytes
    flops = 0.0
    bytes_moved = 0.0
    for s in samples:
        sampled = s.output_tokens or 0
        flops += 2.0 * layer_params * s.scheduled_tokens + 2.0 * head_params * sampled
        flops += 4.0 * spec.num_layers * spec.num_heads * spec.head_dim * s.attention_pairs
        # a bucket of several steps: the experts touched by its average step, `steps` times
        weights_read = spec.params_read(s.scheduled_tokens / max(s.steps, 1)) * s.steps
        bytes_moved += weights_read * weight_bytes + kv_per_token * (s.context_tokens + s.scheduled_tokens)
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


def engine_hardware(engine, samples: list[StepSample], forward_seconds: float) -> dict[str, Any]:
    """`hardware_estimate` for a live engine (device name read from CUDA when it runs there)."""
    import torch

    name = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None
    dtype_bytes = torch.finfo(engine.dtype).bits // 8
    params = [p for p in engine.runner.model.parameters() if p.dim() >= 2]  # the matrices (FP8 ones included)
    weight_bytes = sum(p.numel() * p.element_size() for p in params) / max(1, sum(p.numel() for p in params))
    return hardware_estimate(engine.spec, dtype_bytes, samples, forward_seconds, name, dtype_bytes == 2,
                             weight_bytes=weight_bytes or dtype_bytes)
