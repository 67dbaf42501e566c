"""A checkpoint's own pooling settings, read from its sentence-transformers files: `modules.json` lists the
modules (Transformer, Pooling, Normalize, ...), `<Pooling path>/config.json` names the pooling (sentence-
transformers 3-5: `pooling_mode_lasttoken: true` etc.; 6: `"pooling_mode": "lasttoken"`). A module cbatch does
not apply (Dense, LayerNorm, ...) is refused by name rather than silently skipped."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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


__all__ = ["ModelPooling", "model_pooling"]
