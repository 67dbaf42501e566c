"""The library API: `LLM(model=...).generate(prompts, params)`, an engine built once and run to completion."""
from __future__ import annotations

from typing import Iterable, Sequence as Seq

from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.engine import RequestOutput, run_to_completion


class LLM:
    """Library API: `LLM(model=...).generate(prompts, params)` returns outputs in input order. Loading and
    generation show tqdm progress bars (in a notebook too) unless `use_tqdm=False`."""

    def __init__(self, model: str | None = None, use_tqdm: bool = True, **engine_settings) -> None:
        self.engine = build_engine(EngineConfig(model=model, **engine_settings), show_progress=use_tqdm)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Iterable[str] | None = None,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        prompt_token_ids: Iterable[list[int]] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give either prompts or prompt_token_ids")
        token_lists = (
            [list(p) for p in prompt_token_ids]
            if prompt_token_ids is not None
            else [self.engine.tokenizer.encode(p) for p in prompts]
        )
        params = sampling_params or SamplingParams()
        per_row = list(params) if isinstance(params, (list, tuple)) else [params] * len(token_lists)
        return run_to_completion(self.engine, token_lists, per_row, use_tqdm)


__all__ = ["LLM"]
