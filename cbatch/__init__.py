"""cbatch: offline LLM batch inference with continuous batching over a paged KV cache."""
from cbatch.config import EngineConfig, SamplingParams

__all__ = ["EngineConfig", "LLM", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":  # lazy: importing cbatch must not import torch
        from cbatch.engine.llm import LLM

        return LLM
    raise AttributeError(name)
