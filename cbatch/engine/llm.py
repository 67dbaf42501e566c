"""The library API: `LLM(model=...).generate(prompts, params)`, an engine built once and run to completion."""
from __future__ import annotations

from typing import Iterable, Sequence as Seq

from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.engine import RequestOutput, run_to_completion
from cbatch.engine.pooling import PoolingParams


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

    # ---- prefill-only tasks (docs/tasks.md): one prefill per input, no decoding --------------------------
    def embed(self, prompts: Iterable[str], pooling: str | None = None, normalize: bool | None = None,
              dimensions: int | None = None) -> list[list[float]]:
        """The embedding of each text (float32 values), pooled as the model's sentence-transformers config says
        unless `pooling` (last | mean | cls) / `normalize` say otherwise; `dimensions`: Matryoshka."""
        params = self._task("embed", pooling, normalize, dimensions).pooling
        return self._pool([self.engine.tokenizer.encode(p) for p in prompts], params)

    def classify(self, prompts: Iterable[str]) -> list[dict]:
        """{"label", "probs"} of each text, from the model's sequence classification head."""
        task = self._task("classify")
        return [task.row_columns([v], self.engine)
                for v in self._pool([self.engine.tokenizer.encode(p) for p in prompts], task.pooling)]

    def reward(self, prompts: Iterable[str]) -> list[float]:
        """The reward model's score of each text (its head's one logit)."""
        return [v[0] for v in self._pool([self.engine.tokenizer.encode(p) for p in prompts], self._task("reward").pooling)]

    def score(self, text_1: Seq[str], text_2: Seq[str]) -> list[float]:
        """Each pair's score: a cross-encoder's sigmoid(logit) of the pair, or an embedding model's cosine."""
        task = self._task("score")
        params, tok = task.pooling, self.engine.tokenizer
        if params.head:
            return [task.row_columns([v], self.engine)["score"]
                    for v in self._pool([tok.encode(a, b) for a, b in zip(text_1, text_2)], params)]
        vectors = self._pool([tok.encode(t) for t in [*text_1, *text_2]], params)
        return [task.row_columns([a, b], self.engine)["score"] for a, b in zip(vectors[: len(text_1)], vectors[len(text_1):])]

    def _task(self, task: str, pooling: str | None = None, normalize: bool | None = None, dimensions: int | None = None):
        """The prefill-only task with these settings, resolved against the model as a job's is (cbatch/tasks/)."""
        from types import SimpleNamespace

        from cbatch.tasks import make_task

        options = SimpleNamespace(task=task, defaults=SamplingParams(), pooling=pooling, normalize=normalize,
                                  dimensions=dimensions, reasoning_split=True)
        return make_task(options, self.engine.spec, self.engine.model_dir)

    def _pool(self, token_lists: list[list[int]], params: PoolingParams) -> list[list[float]]:
        engine = self.engine
        seqs = [engine.add_request(ids, SamplingParams(), pooling=params) for ids in token_lists]
        while engine.has_unfinished():
            engine.step()
        outs = [engine.output_of(s) for s in seqs]
        failed = next((o for o in outs if o.finish_reason == "error"), None)
        if failed is not None:
            raise ValueError(f"input {outs.index(failed)}: {failed.error}")
        return [o.pooled for o in outs]


__all__ = ["LLM"]
