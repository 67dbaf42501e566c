"""`--task`: what a job asks of each row (generate, or a prefill-only task: embed, score, classify, reward) and the
settings a prefill-only job runs with, resolved once from the flags and the checkpoint (its head, its
sentence-transformers pooling config). A job the model cannot do is refused here with one line naming the fix."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from cbatch.config import UserError
from cbatch.engine.pooling import POOLING_MODES, TASKS, PoolingParams
from cbatch.model.pooling_config import model_pooling
from cbatch.model.spec import ModelSpec


class TaskError(UserError):
    """A --task the model cannot do, or a task flag that does not fit; the message names the fix."""


def job_pooling(task: str, pooling: str | None, normalize: bool | None, dimensions: int | None, spec: ModelSpec,
                model_dir: Path | None) -> PoolingParams | None:
    """The job's prefill-only settings (None for --task generate); raises TaskError for a task the model cannot
    do. Embedding models pool as their own config says unless --pooling / --normalize say otherwise; a
    classification head reads the last token (HF's *ForSequenceClassification)."""
    if task not in TASKS:
        raise TaskError(f"--task: one of {', '.join(TASKS)}, not {task!r}")
    if pooling is not None and pooling not in POOLING_MODES:
        raise TaskError(f"--pooling: one of {', '.join(POOLING_MODES)}, not {pooling!r}")
    arch = spec.architecture
    if task == "generate":
        if any(v is not None for v in (pooling, normalize, dimensions)):
            raise TaskError("--pooling, --normalize and --dimensions are for --task embed or score; add --task embed")
        if not spec.generates:
            fix = "use --task classify, reward or score" if spec.head == "classify" else "use --task embed or score"
            raise TaskError(f"--task generate: this {arch} has no language-model head; {fix}")
        return None
    classifier = spec.head == "classify"
    if task in ("classify", "reward") or (task == "score" and classifier):
        if not classifier:
            raise TaskError(f"--task {task}: needs a sequence classification head (a *ForSequenceClassification "
                            f"checkpoint); this is a {arch}, use --task embed")
        if task in ("reward", "score") and spec.num_labels != 1:
            raise TaskError(f"--task {task}: needs a head with one output; this {arch} has {spec.num_labels} labels, "
                            "use --task classify")
        if normalize is not None or dimensions is not None:
            raise TaskError(f"--normalize and --dimensions are for embeddings; leave them out for --task {task}")
        return PoolingParams(task, pooling or "last", head=True)
    # embed, or score with a bi-encoder (the cosine of two embeddings); a weightless shape has no folder
    own = model_pooling(model_dir) if model_dir is not None else None
    if pooling is None and own is None:
        raise TaskError(f"--task {task}: this {arch} has no pooling config (sentence-transformers modules.json with a "
                        "Pooling module); give --pooling last, mean or cls")
    if dimensions is not None and not 1 <= dimensions <= spec.hidden_size:
        raise TaskError(f"--dimensions: between 1 and the model's hidden size {spec.hidden_size}, not {dimensions}")
    normalized = normalize if normalize is not None else (own.normalize if own is not None else False)
    return PoolingParams(task, pooling or own.pooling, normalize=normalized, dimensions=dimensions)


def pooling_settings(params: PoolingParams | None) -> dict | None:
    """The settings a prefill-only job's records depend on (fingerprint, result cache identity)."""
    return asdict(params) if params is not None else None


__all__ = ["TaskError", "job_pooling", "pooling_settings"]
