"""Compute backends: the attention over the paged KV cache and the model's small ops, as one object.

An engine picks its backend once (`make_backend`) and builds its model with it; nothing is global, so
engines with different backends coexist in one process. A backend is found by its --attention-backend name in
the registry (registry.py), and asked what it can do through the flags of the `Backend` protocol (protocol.py).

    CpuBackend     the CPU path: TorchBackend with compiled decode attention, RMSNorm and SiLU-and-mul (built on first use)
    TorchBackend   plain torch: the reference, and the CPU path where no C++ compiler is found
    TritonBackend  `cbatch.kernels`: the GPU path (CPU tensors only under TRITON_INTERPRET=1)

Adding a backend is one file, NAME_backend.py in this folder, ending with its `register("NAME", ...)` call:
config.ATTENTION_BACKENDS reads the names from the file names, and this package imports every such file (which
registers it).
"""
from __future__ import annotations

import importlib
from pathlib import Path

from cbatch.config import BACKEND_FILE_SUFFIX
from cbatch.fp8_kv import FP8_KV_DTYPE
from cbatch.model.backend.cpu_backend import CpuBackend
from cbatch.model.backend.metadata import AttentionLayer, AttentionMetadata, KVLayer, kv_cache_shape
from cbatch.model.backend.protocol import Backend
from cbatch.model.backend.registry import BackendUnavailable, auto_choice, backend_name, make_backend, registered
from cbatch.model.backend.rotary import RotaryStep
from cbatch.model.backend.torch_backend import TorchBackend
from cbatch.model.backend.triton_backend import TritonBackend

for _path in sorted(Path(__file__).parent.glob(f"*{BACKEND_FILE_SUFFIX}")):  # registers each backend
    importlib.import_module(f"{__name__}.{_path.stem}")

__all__ = [
    "AttentionLayer", "AttentionMetadata", "Backend", "BackendUnavailable", "CpuBackend", "FP8_KV_DTYPE", "KVLayer",
    "RotaryStep", "TorchBackend", "TritonBackend", "auto_choice", "backend_name", "kv_cache_shape", "make_backend",
    "registered",
]
