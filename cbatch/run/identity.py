"""The output identity: every job setting that decides what a row's output is, besides the row itself (its prompt
and its own sampling settings). The resume fingerprint (run/preflight.py) and the result-cache key
(run/result_cache.py) are both made from it, so they cannot disagree, and a new output-changing setting is one
EngineConfig field with its metadata (config.OUTPUT_ALWAYS / OUTPUT_CHANGED) or one entry of its task's `identity`.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch

from cbatch.model.backend import backend_name
from cbatch.tasks.base import Task


def output_identity(config: Any, task: Task, device: torch.device, dtype: torch.dtype, max_model_len: int,
                    job_seed: bool = True) -> dict[str, Any]:
    """The engine settings whose field's metadata marks them as changing outputs, with the values the engine runs
    (the resolved device type, dtype, attention backend and context length, not `auto`), and the task's settings.
    Fields marked FILES (the checkpoint, the adapters) are left to the caller, which digests their files; the job's
    seed only with `job_seed` (the result cache keys each row by the seed it uses instead). `config`: an
    EngineConfig (or a subclass: tests add a field)."""
    resolved = {"device": device.type, "dtype": str(dtype), "max_model_len": max_model_len,
                "attention_backend": backend_name(config.attention_backend, device)}
    identity: dict[str, Any] = {}
    for f in fields(config):
        rule = f.metadata.get("output")
        if rule in ("always", "changed") or (rule == "seed" and job_seed):
            value = resolved.get(f.name, getattr(config, f.name))
            if rule != "changed" or getattr(config, f.name) != f.default:
                identity[f.name] = value
    return {**identity, **task.identity()}


__all__ = ["output_identity"]
