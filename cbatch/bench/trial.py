"""One trial of `cbatch bench`: a workload under one policy through an engine, real or simulated.

The workload's requests become rows (`prompt_token_ids`, `max_tokens`, EOS ignored) handed to the same
driver and executor as `cbatch run`, each at its arrival step. The engine's runner is the model (a
checkpoint, or a weightless shape with random weights) or the simulator's cost model; one engine
serves every policy of a comparison (`Engine.reset(policy)` between trials), so trials differ only in
their scheduling.
"""
from __future__ import annotations

import io
import random
from typing import Any, Callable

import numpy as np

from cbatch.bench.result import BenchRun
from cbatch.bench.workload import BenchRequest, random_prompt
from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.engine import Engine
from cbatch.engine.images import placeholder_tokens
from cbatch.engine.resolve import resolve_model
from cbatch.model.siglip_spec import SiglipSpec
from cbatch.observe.metrics import JobMetrics
from cbatch.observe.progress import NoProgress
from cbatch.run.driver import drive
from cbatch.run.executor import Executor, LocalExecutor
from cbatch.run.job_spec import JobSpec
from cbatch.tasks.generate_task import GenerateTask
from cbatch.tasks.results import RowResult

GREEDY = SamplingParams()


def make_bench_engine(config: EngineConfig, model_config: str | None, seed: int) -> Engine:
    """A checkpoint's engine (`config.model`), or a preset/config.json shape with random weights."""
    if model_config is None:
        return build_engine(config)
    from cbatch.model.presets import preset_spec

    return build_engine(config, resolve_model(config, preset_spec(model_config)), random_weights_seed=seed)


def warm_up(engine: Engine, seed: int, image_size: tuple[int, int] | None = None) -> None:
    """A few short requests first, so one-off costs (allocator, kernel compilation) stay out of the timing; with
    `image_size`, one with an image of that size too (the vision tower's first call)."""
    rng = random.Random(seed)
    vocab = engine.spec.vocab_size
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(min(4, engine.config.max_num_seqs)):
        engine.add_request(random_prompt(rng, 16 + 8 * i, vocab), params)
    if image_size is not None:  # read and expanded as a bench row's image (GenerateTask), not one of the workload's
        task = GenerateTask(GREEDY)
        row = {"prompt_token_ids": image_placeholder(engine.spec.vision) + [min(3, vocab - 1)] * 8, "max_tokens": 4,
               "images": [synthetic_image(image_size, (seed, WARM_UP, 0))]}
        for request in task.requests(engine, task.parse(0, row)).requests:
            engine.add_request(request.prompt_ids, params, images=request.images)
    while engine.has_unfinished():
        engine.step()


def workload_prompts(requests: list[BenchRequest], vocab_size: int, seed: int, shared_prefix: int = 0,
                     vision: Any = None) -> list[list[int]]:
    """Seeded random prompts of the workload's lengths (identical for every policy); the first
    `shared_prefix` tokens are the same in every prompt (a system prompt; `make_workload` counted them in
    each request's length). A vision-language model's prompts (`vision`: its VisionSpec or SiglipSpec) draw no
    image or video token (one would be an image's placeholder without its image: an error row); a request's
    images put their placeholders after the shared prefix, as a chat template writes them."""
    gen = np.random.default_rng(seed)
    low = min(3, vocab_size - 1)
    special = image_special_tokens(vision) if vision is not None else []

    def tokens(count: int) -> list[int]:
        drawn = gen.integers(low, vocab_size, size=max(0, count))
        return np.where(np.isin(drawn, special), low, drawn).tolist()  # (a drawn placeholder would be an image's)

    prefix = tokens(shared_prefix)
    run = image_placeholder(vision) if vision is not None else []
    return [prefix[: r.prompt_len] + run * len(r.image_sizes) + tokens(r.prompt_len - shared_prefix)
            for r in requests]


def image_placeholder(vision: Any) -> list[int]:
    """What a chat template writes per image: Qwen's <|vision_start|><|image_pad|><|vision_end|>, Gemma 3's
    <start_of_image> (io/images.expand_placeholders makes each its run)."""
    if isinstance(vision, SiglipSpec):
        return [vision.boi_token_id]
    frame = (vision.vision_start_token_id, vision.image_token_id, vision.vision_end_token_id)
    return [token for token in frame if token is not None]


def image_special_tokens(vision: Any) -> list[int]:
    """Every token an image's or a video's run is made of or framed by."""
    if isinstance(vision, SiglipSpec):
        return [vision.boi_token_id, vision.image_token_id, vision.eoi_token_id]
    frame = (vision.vision_start_token_id, vision.vision_end_token_id)
    return [*placeholder_tokens(vision), *(token for token in frame if token is not None)]


WARM_UP = 2**31 - 1  # the warm-up image's place in synthetic_image's key (no request's index)


def synthetic_image(size: tuple[int, int], key: tuple[int, ...]) -> bytes:
    """A PNG of `size` (width, height): random colours in 16-pixel cells, its own for each key (seed, request,
    image: the encoder cache and the prefix cache never share two requests' images), a few tens of KB."""
    from PIL import Image

    width, height = size
    cells = np.random.default_rng(list(key)).integers(0, 256, size=(-(-height // 16), -(-width // 16), 3),
                                                      dtype=np.uint8)
    pixels = cells.repeat(16, axis=0).repeat(16, axis=1)[:height, :width]
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def workload_images(requests: list[BenchRequest], seed: int) -> list[list[bytes]]:
    """Each request's synthetic images (PNG bytes, ~25 KB for a 896 x 1152 page), made once before any trial is
    timed and given to every trial: the job reads and preprocesses them as a row's, it does not draw them."""
    return [[synthetic_image(size, (seed, index, k)) for k, size in enumerate(r.image_sizes)]
            for index, r in enumerate(requests)]


class WorkloadFeed:
    """The workload's rows, each handed to the executor once the engine reaches its arrival step."""

    def __init__(self, requests: list[BenchRequest], prompts: list[list[int]], steps: Callable[[], int],
                 images: list[list[bytes]] | None = None) -> None:
        order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        self._rows = [(requests[i].arrival, i, {"prompt_token_ids": prompts[i], "max_tokens": requests[i].output_len,
                                                  "ignore_eos": True, **({"images": images[i]} if images and images[i]
                                                                         else {})}) for i in order]
        self._steps = steps
        self._next = 0
        self.exhausted = not self._rows

    def fill(self, executor: Executor) -> None:
        while self._next < len(self._rows) and self._rows[self._next][0] <= self._steps():
            _, index, row = self._rows[self._next]
            self._next += 1
            executor.submit(index, row)
        self.exhausted = self._next == len(self._rows)


def run_trial(engine: Engine, requests: list[BenchRequest], prompts: list[list[int]], policy: str,
              clock: Callable[[], float] | None = None, label: str | None = None,
              images: list[list[bytes]] | None = None, **settings: Any) -> BenchRun:
    """Runs the workload under `policy` (and other scheduling `settings`, e.g. enable_prefix_cache) on
    `engine` (reset first); time from the first step, on `clock` (wall time, or the simulator's cost clock).
    `images`: each request's (`workload_images`)."""
    engine.reset(policy, **settings)
    run = BenchRun(policy, label=label or policy)
    run.finish_step, run.finish_time = [None] * len(requests), [None] * len(requests)
    metrics = run.metrics = JobMetrics(total_rows=len(requests), **({"clock": clock} if clock else {}))
    executor = LocalExecutor(engine, JobSpec(engine.config, GenerateTask(GREEDY)), metrics)
    steps = lambda: engine.scheduler.stats.steps  # noqa: E731

    def store(result: RowResult) -> bool:
        run.finish_step[result.index], run.finish_time[result.index] = steps(), metrics.now()
        return True

    drive(WorkloadFeed(requests, prompts, steps, images), executor, store, metrics, NoProgress())
    run.wall = metrics.now()
    metrics.forward_seconds = engine.runner.forward_seconds
    run.stats, run.num_kv_blocks = engine.scheduler.stats, engine.pool.num_blocks
    return run
