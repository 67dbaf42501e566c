"""A checkpoint's own pooling settings, read from its sentence-transformers files: `modules.json` lists the
modules (Transformer, Pooling, Normalize, ...), `<Pooling path>/config.json` names the pooling (sentence-
transformers 3-5: `pooling_mode_lasttoken: true` etc.; 6: `"pooling_mode": "lasttoken"`). A module cbatch does
not apply (Dense, LayerNorm, ...) is refused by name rather than silently skipped.

An LM-head reranker's classifier tokens (`ClassifierTokens`): vLLM's `classifier_from_token` (+ `method`,
`is_original_qwen3_reranker`), read from config.json or given per job (--classifier-from-token, `hf_overrides`)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbatch.model.errors import UnsupportedModelError

# sentence-transformers' pooling names -> cbatch's (engine/pooling.py POOLING_MODES)
_ST_MODES = {"lasttoken": "last", "mean": "mean", "mean_tokens": "mean", "cls": "cls", "cls_token": "cls"}
_APPLIED = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True, slots=True)
class ModelPooling:
    pooling: str  # last | mean | cls
    normalize: bool  # a Normalize module follows the pooling


def model_pooling(model_dir: Path) -> ModelPooling | None:
    """The pooling `model_dir`'s sentence-transformers files give, or None when it has none."""
    path = model_dir / "modules.json"
    if not path.is_file():
        return None
    try:
        modules = json.loads(path.read_text())
        kinds = [(str(m["type"]).rpartition(".")[2], str(m.get("path", ""))) for m in modules]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UnsupportedModelError(f"{path} is not a readable sentence-transformers modules.json ({exc})") from None
    other = next((kind for kind, _ in kinds if kind not in _APPLIED), None)
    if other is not None:
        raise UnsupportedModelError(f"{path}: the sentence-transformers module {other} is not supported; cbatch "
                                    f"applies {', '.join(_APPLIED)}")
    pooling_dir = next((folder for kind, folder in kinds if kind == "Pooling"), None)
    if pooling_dir is None:
        return None
    return ModelPooling(_pooling_mode(model_dir / pooling_dir / "config.json"),
                        normalize=any(kind == "Normalize" for kind, _ in kinds))


def _pooling_mode(path: Path) -> str:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"{path}: the pooling config is not readable ({exc})") from None
    modes = [cfg["pooling_mode"]] if isinstance(cfg.get("pooling_mode"), str) else \
        [k.removeprefix("pooling_mode_") for k, v in cfg.items() if k.startswith("pooling_mode_") and v is True]
    if len(modes) != 1 or modes[0] not in _ST_MODES:
        raise UnsupportedModelError(f"{path}: pooling {'+'.join(modes) or 'none'} is not supported; cbatch pools "
                                    "lasttoken, mean or cls (one of them)")
    return _ST_MODES[modes[0]]


# vLLM's `method`s of reading a causal LM's head as a classifier (cbatch.engine.pooling.TokenLogitsHead)
CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")


@dataclass(frozen=True, slots=True)
class ClassifierTokens:
    """vLLM's `classifier_from_token`: vocabulary tokens (their spelling in the vocabulary, e.g. Qwen's "yes") whose
    LM-head logits at the last prompt position are a classifier's outputs. `method` as vLLM names it:
    from_2_way_softmax (two tokens [false, true]: one output, logit(true) - logit(false)) or no_post_processing (one
    output per token, its logit). Left out: from_2_way_softmax for two tokens, no_post_processing otherwise (vLLM
    asks for it, but for Qwen3's `is_original_qwen3_reranker`)."""

    tokens: tuple[str, ...]
    method: str | None = None

    def __post_init__(self) -> None:
        if not self.tokens or not all(isinstance(t, str) and t for t in self.tokens):
            raise UnsupportedModelError("classifier_from_token: give a list of vocabulary tokens, e.g. [\"no\", \"yes\"]")
        if self.method is not None and self.method not in CLASSIFIER_METHODS:
            raise UnsupportedModelError(f"method {self.method!r}: one of {', '.join(CLASSIFIER_METHODS)} "
                                        "(vLLM's classifier_from_token methods)")
        if self.resolved_method == "from_2_way_softmax" and len(self.tokens) != 2:
            raise UnsupportedModelError(f"classifier_from_token with from_2_way_softmax takes two tokens [false, true], "
                                        f"got {len(self.tokens)}")

    @property
    def resolved_method(self) -> str:
        if self.method is not None:
            return self.method
        return "from_2_way_softmax" if len(self.tokens) == 2 else "no_post_processing"

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "ClassifierTokens | None":
        """The tokens a config.json (or vLLM's `hf_overrides`) names, or None. Qwen3's `is_original_qwen3_reranker`
        means from_2_way_softmax, as in vLLM."""
        tokens = cfg.get("classifier_from_token")
        if tokens is None:
            return None
        if not isinstance(tokens, (list, tuple)):
            raise UnsupportedModelError(f"classifier_from_token: a list of tokens, got {tokens!r}")
        method = cfg.get("method") or ("from_2_way_softmax" if cfg.get("is_original_qwen3_reranker") else None)
        return cls(tuple(tokens), method)


def model_classifier_tokens(model_dir: Path) -> ClassifierTokens | None:
    """The classifier tokens `model_dir`'s config.json names, or None."""
    path = model_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # (read_config refused an unreadable one before any task is resolved)
    return ClassifierTokens.from_config(cfg if isinstance(cfg, dict) else {})


__all__ = ["CLASSIFIER_METHODS", "ClassifierTokens", "ModelPooling", "model_classifier_tokens", "model_pooling"]
