"""The model an engine runs: resolved before anything loads (`resolve_model`: folder, config.json, device,
dtype, context length; what a job's preflight checks and fingerprints), then one rank's copy loaded with its
compute backend (`load_rank_model`). Rank 0's build (cbatch/engine/build.py) and every tensor-parallel worker
(cbatch/engine/tensor_parallel.py) load it the same way.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch

from cbatch.config import ConfigError, EngineConfig
from cbatch.model.backend import Backend, BackendUnavailable, auto_choice, make_backend
from cbatch.model.cpu_features import bf16_speed_warning
from cbatch.model.decoder import LlamaForCausalLM
from cbatch.model.loader import Checkpoint, build_model, init_random_weights, load_model, read_checkpoint, resolve_dtype, resolve_model_dir
from cbatch.model.shard import check_tensor_parallel, with_expert_parallel
from cbatch.model.siglip_spec import SiglipSpec
from cbatch.model.spec import ModelSpec
from cbatch.model.vision_spec import takes_videos
from cbatch.parallel.comm import Communicator


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
    the model's shapes cannot split, image pixel bounds for a model whose processor takes none, and pan-and-scan
    for a model without it."""
    checkpoint = None
    if spec is None:
        from cbatch.model.default_model import default_model_dir

        checkpoint = read_checkpoint(resolve_model_dir(config.model) if config.model else default_model_dir())
        spec = checkpoint.spec
    if config.expert_parallel:
        spec = with_expert_parallel(spec)
        checkpoint = replace(checkpoint, spec=spec) if checkpoint is not None else None  # (what load_model reads)
    if (config.image_min_pixels is not None or config.image_max_pixels is not None) and (
            spec.vision is None or isinstance(spec.vision, SiglipSpec)):
        why = "reads no images" if spec.vision is None else "resizes every image to its tower's square"
        raise ConfigError("image_min_pixels" if config.image_min_pixels is not None else "image_max_pixels",
                          f"this {spec.architecture} {why}; leave the pixel bounds out")
    video_settings = [name for name in ("video_min_pixels", "video_max_pixels", "video_fps")
                      if getattr(config, name) is not None]
    if video_settings and not takes_videos(spec.vision):
        raise ConfigError(video_settings[0], f"this {spec.architecture} reads no videos (Qwen2-VL, Qwen2.5-VL and "
                                             "Qwen3-VL do); leave the video settings out")
    if config.image_pan_and_scan is not None and not isinstance(spec.vision, SiglipSpec):
        why = "reads no images" if spec.vision is None else "has no pan-and-scan (Gemma 3's option)"
        raise ConfigError("image_pan_and_scan", f"this {spec.architecture} {why}; leave it out")
    check_tensor_parallel(spec, config.tensor_parallel_size)
    if spec.mla is not None and config.kv_cache_dtype == "fp8":
        raise ConfigError("kv_cache_dtype", "fp8 is not supported for multi-head latent attention models (DeepSeek-V2/V3, "
                                            "Kimi K2), whose latent cache is already small; use --kv-cache-dtype auto")
    device = device if device is not None else resolve_device(config.device)
    max_model_len = min(config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings)
    dtype = resolve_dtype(config.dtype, spec, device)
    if (warning := bf16_speed_warning(dtype, device)) is not None:
        print(f"cbatch: warning: {warning}", file=sys.stderr)
    return ResolvedModel(spec, device, dtype, max_model_len, checkpoint)


def engine_backend(config: EngineConfig, device: torch.device) -> Backend:
    """The compute backend --attention-backend names for `device` (a ConfigError when it cannot run there). `auto`
    says on stderr which backend made for the device it passed over, and why (the CPU's kernels without a compiler)."""
    try:
        backend = make_backend(config.attention_backend, device)
    except BackendUnavailable as exc:
        raise ConfigError("attention_backend", f"{config.attention_backend}: {exc}") from None
    if not config.split_kv:  # every rank's backend (tensor-parallel workers build theirs here too)
        backend.split_kv = False
    if config.attention_backend == "auto":
        for note in auto_choice(device)[1]:
            print(f"cbatch: note: {note}", file=sys.stderr)
    return backend


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
    model.fp32_logits = config.fp32_logits  # GPU, 16-bit: float32 logits from the lm_head GEMM
    return model
