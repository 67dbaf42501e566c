"""The library API (docs/library.md): vLLM's offline `LLM` and its request and output shapes over cbatch's
engine, above every other layer. Names load on first use: `import cbatch` must not import torch."""
from __future__ import annotations

import importlib

_MODULES = {
    "LLM": "llm",
    "SamplingParams": "sampling", "StructuredOutputsParams": "sampling", "GuidedDecodingParams": "sampling",
    "LoRARequest": "sampling",
    "TextPrompt": "inputs", "TokensPrompt": "inputs",
    "RequestOutput": "outputs", "CompletionOutput": "outputs", "Logprob": "outputs", "PoolingOutput": "outputs",
    "PoolingRequestOutput": "outputs", "EmbeddingOutput": "outputs", "EmbeddingRequestOutput": "outputs",
    "ClassificationOutput": "outputs", "ClassificationRequestOutput": "outputs", "ScoringOutput": "outputs",
    "ScoringRequestOutput": "outputs",
}

__all__ = sorted(_MODULES)


def __getattr__(name: str):
    if name not in _MODULES:
        raise AttributeError(name)
    return getattr(importlib.import_module(f"cbatch.api.{_MODULES[name]}"), name)
