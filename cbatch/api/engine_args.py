"""`LLM(model, **settings)`: vLLM's engine keywords mapped onto cbatch's `EngineConfig` (its own field names work
too); a keyword cbatch cannot honour is refused by name, never ignored (docs/library.md has the table)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from cbatch.config import EngineConfig, UserError, mm_limits
from cbatch.model.pooling_config import ClassifierTokens

# vLLM's name -> EngineConfig's, where they differ
RENAMED = {"enable_prefix_caching": "enable_prefix_cache", "swap_space": "swap_space_gb",
           "enable_expert_parallel": "expert_parallel"}
# vLLM keywords for what cbatch always does: taken at that value only
FIXED: dict[str, Any] = {"pipeline_parallel_size": 1, "cpu_offload_gb": 0, "enable_chunked_prefill": True,
                         "disable_log_stats": True, "trust_remote_code": False}
DTYPES = {"half": "float16", "float": "float32"}  # vLLM's other names of cbatch's dtypes
KV_CACHE_DTYPES = {"fp8_e4m3": "fp8"}  # cbatch's fp8 KV cache is e4m3
TASKS = ("auto", "generate", "embed", "embedding", "classify", "score", "reward")  # vLLM's `task`
RUNNERS = ("auto", "generate", "pooling")  # vLLM's `runner`
# vLLM's `quantization` -> the checkpoint's quant_method it names (cbatch reads a checkpoint's own quantization)
QUANT_METHODS = {"fp8": "fp8", "compressed-tensors": "compressed-tensors", "awq": "awq", "awq_marlin": "awq",
                 "gptq": "gptq", "gptq_marlin": "gptq"}
_CONFIG_FIELDS = frozenset(f.name for f in fields(EngineConfig))
# vLLM's mm_processor_kwargs keys -> the EngineConfig fields that set them for every image of the engine
MM_PROCESSOR_KWARGS = {"do_pan_and_scan": "image_pan_and_scan", "min_pixels": "image_min_pixels",
                       "max_pixels": "image_max_pixels", "fps": "video_fps"}
# vLLM's hf_overrides keys cbatch honours: an LM-head reranker's (`architectures` routes it to a classifier there)
HF_OVERRIDES = ("classifier_from_token", "method", "is_original_qwen3_reranker", "architectures")


@dataclass(frozen=True, slots=True)
class LibrarySettings:
    config: EngineConfig
    enable_lora: bool = False  # LoRARequests may name adapters (the config's `loras` and new ones)
    task: str | None = None  # vLLM's task (embed, classify, score, reward): `encode`'s default pooling task
    quantization: str | None = None  # the checkpoint's quant_method it must have (checked once it is read)
    classifier: ClassifierTokens | None = None  # hf_overrides' classifier_from_token: an LM-head reranker


def library_settings(model: str | None, settings: dict[str, Any]) -> LibrarySettings:
    """The engine's config and the library's own settings from `LLM`'s keywords; a UserError naming the first
    keyword cbatch does not take (a ConfigError naming a bad value)."""
    settings = dict(settings)
    if settings.pop("trust_remote_code", False):
        raise UserError("trust_remote_code=True: cbatch runs no remote code; it runs the architectures it "
                        "implements itself (docs/models.md)")
    for name, value in FIXED.items():
        if name in settings and settings.pop(name) != value:
            raise UserError(f"{name}: cbatch supports only {value!r} (docs/library.md)")
    enable_lora = bool(settings.pop("enable_lora", False))
    task = _task(settings.pop("task", None), settings.pop("runner", None))
    quantization = settings.pop("quantization", None)
    if quantization is not None and quantization not in QUANT_METHODS:
        raise UserError(f"quantization={quantization!r}: cbatch quantizes nothing itself; it runs checkpoints "
                        f"quantized as {', '.join(sorted(set(QUANT_METHODS.values())))} (docs/models.md)")
    classifier = _classifier(settings.pop("hf_overrides", None))
    _image_settings(settings, settings.pop("mm_processor_kwargs", None))
    if "limit_mm_per_prompt" in settings:
        settings["limit_mm_per_prompt"] = mm_limits(settings["limit_mm_per_prompt"], "limit_mm_per_prompt")
    tokenizer = settings.pop("tokenizer", None)
    if tokenizer is not None and tokenizer != model:
        raise UserError("tokenizer: cbatch uses the model's own tokenizer; leave tokenizer out")
    for vllm_name, name in RENAMED.items():
        if vllm_name in settings:
            if name in settings:
                raise UserError(f"give {vllm_name} or {name}, not both")
            settings[name] = settings.pop(vllm_name)
    unknown = next((name for name in settings if name not in _CONFIG_FIELDS or name == "model"), None)
    if unknown is not None:
        raise UserError(f"LLM: cbatch does not take {unknown!r} (docs/library.md lists the keywords it maps); "
                        "leave it out")
    if "dtype" in settings:
        settings["dtype"] = _dtype(settings["dtype"])
    if "kv_cache_dtype" in settings:
        settings["kv_cache_dtype"] = KV_CACHE_DTYPES.get(settings["kv_cache_dtype"], settings["kv_cache_dtype"])
    if settings.get("seed", 0) is None:  # vLLM's "no seed": cbatch's runs are always seeded (default 0)
        del settings["seed"]
    return LibrarySettings(EngineConfig(model=model, **settings), enable_lora, task,
                           QUANT_METHODS.get(quantization) if quantization else None, classifier)


def _image_settings(settings: dict[str, Any], mm_processor_kwargs: dict[str, Any] | None) -> None:
    """vLLM's `mm_processor_kwargs` into `settings` as cbatch's image fields (do_pan_and_scan: image_pan_and_scan;
    min_pixels / max_pixels: image_min_pixels / image_max_pixels; fps: video_fps); any other key is refused by name."""
    for key, value in (mm_processor_kwargs or {}).items():
        name = MM_PROCESSOR_KWARGS.get(key)
        if name is None:
            raise UserError(f"mm_processor_kwargs: cbatch does not take {key!r}; it takes "
                            f"{', '.join(MM_PROCESSOR_KWARGS)} (docs/library.md)")
        if name in settings:
            raise UserError(f"give mm_processor_kwargs' {key} or {name}, not both")
        settings[name] = value


def _classifier(overrides: Any) -> ClassifierTokens | None:
    """vLLM's `hf_overrides` as far as cbatch honours it: an LM-head reranker's `classifier_from_token` (with
    `method`, `is_original_qwen3_reranker`; `architectures` only beside them, where vLLM routes to a classifier);
    any other key is refused by name."""
    if overrides is None:
        return None
    if not isinstance(overrides, dict):
        raise UserError("hf_overrides: cbatch takes a dict (an LM-head reranker's classifier_from_token)")
    unknown = next((k for k in overrides if k not in HF_OVERRIDES), None)
    if unknown is not None:
        raise UserError(f"hf_overrides: cbatch does not override {unknown!r} (it takes {', '.join(HF_OVERRIDES)}); "
                        "leave it out")
    if "classifier_from_token" not in overrides:
        raise UserError("hf_overrides: give classifier_from_token (its other keys go with it)")
    return ClassifierTokens.from_config(overrides)


def _dtype(value: Any) -> Any:
    """A dtype by vLLM's names or a torch.dtype, as cbatch's name (EngineConfig checks the result)."""
    name = str(value).removeprefix("torch.")
    return DTYPES.get(name, name)


def _task(task: str | None, runner: str | None) -> str | None:
    if task is not None and task not in TASKS:
        raise UserError(f"task={task!r}: cbatch's tasks are {', '.join(TASKS)}")
    if runner is not None and runner not in RUNNERS:
        raise UserError(f"runner={runner!r}: cbatch's runners are {', '.join(RUNNERS)}")
    if task in ("auto", "generate", None):
        return None
    return "embed" if task == "embedding" else task


def check_quantization(wanted: str | None, spec) -> None:
    """`quantization=` names the checkpoint's own quantization (cbatch reads it from config.json), or is refused."""
    have = spec.quant.method if spec.quant is not None else None
    if wanted is not None and wanted != have:
        raise UserError(f"quantization={wanted!r}: this checkpoint is {'not quantized' if have is None else have}; "
                        "cbatch quantizes nothing itself, it runs a checkpoint as it is quantized")


__all__ = ["LibrarySettings", "check_quantization", "library_settings"]
