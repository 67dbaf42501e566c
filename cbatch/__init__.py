"""cbatch: offline LLM batch inference with continuous batching over a paged KV cache."""
from cbatch.api import __all__ as _API
from cbatch.config import EngineConfig

__all__ = sorted({"EngineConfig", *_API})


def __getattr__(name: str):
    if name in _API:  # lazy: importing cbatch must not import torch (nor the library's modules)
        import cbatch.api

        return getattr(cbatch.api, name)
    raise AttributeError(name)
