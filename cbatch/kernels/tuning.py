"""Decode attention's tiles, picked on the device the engine runs on, at start-up.

A developer's machine has no GPU, so the tile sizes, warps and pipeline stages of the decode attention kernel
(its one hot loop: ~78% of a decode step's GPU time on an H200) cannot be tuned where the code is written. The
engine times each of a few candidates (`paged_attention.decode_tile_candidates`, every one of them checked
against the torch reference in the tests) on its own shapes, before its CUDA graphs are captured, and keeps
the fastest. Every tuner first launches each candidate once (compiling its kernel variant, ~1 s on a fresh
machine, and checking its output against the policy's), then times them under its budget (ATTENTION_BUDGET_S,
SPLIT_BUDGET_S, GEMM_BUDGET_S: timings, not compiles); the choice is cached per device, stack and shape in
`$XDG_CACHE_HOME/cbatch/kernel_tuning.json` (default `~/.cache/...`) with a "complete" flag (every candidate
timed): a complete entry makes a second start pay nothing, an incomplete one is tuned again. A device error in
any tuner (`_guarded`) leaves the policy's defaults, with one warning line, and the engine starts.

Timings are cold in L2 (an H100/H200 has 50 MB of it; a decode step reads its weights and KV from HBM): a timed
call rotates through copies of its operands, COLD_L2_BYTES (64 MB) of them in all (`_Rotating`: the GEMMs'
weights copied, split-KV's small probes over disjoint block tables of the synthetic pool; the tiles' full step
is 2 GiB of K/V already).

The timing runs on synthetic data of one layer's size (random queries, keys and values, a shuffled block
table): decode attention's time depends on the shapes, not the values. It is drawn on the device itself (a seeded
generator there: no CPU fill, no host-to-device copy) and sized so that the described shape is the one timed
(Qwen3-0.6B's 256 x 2048 in bf16 is 2 GiB) unless the device's free memory is short; the engine tunes before it
sizes its KV pool (cbatch/engine/build.py), so the synthetic K/V is freed before the pool takes its memory.

Split-KV (`tune_decode_splits`): when decode attention cuts a sequence's keys into segments, and into how many, is
a `paged_attention.SplitRule` (a programs-per-SM target and a minimum segment length). With the chosen tiles,
each launch that some candidate rule makes is timed at a few (batch, context) probes (the batches a decode graph
holds when the GPU is not full, contexts up to the model's limit), as the decode graph runs it: split for the
model's limit, each sequence filling the segments the rule gives its own length. Each rule is scored by how far
its launches are from the fastest at every probe (the sum of time / best time), and the default rule is kept
unless another scores clearly better. The rule then decides on the host (per launch) and in the kernel (per sequence,
by its own length), so a graph captured once splits every context as the rule says.

The decode GEMMs (`tune_decode_gemms`): per distinct layer shape (N, K, dtype, bias) and batch bucket (16 ... 256
rows), cuBLAS (F.linear) against the Triton candidates of `kernels/gemm.py`, on the layer's own weights and
random rows, each timed as a CUDA graph replay (where the decode step runs them: no host launch cost in the
time). Triton is kept only where it timed faster than cuBLAS. The candidates are timed round by round over the
buckets, the largest (256) first (`gemm_timing_order`), so GEMM_BUDGET_S cut short still times every bucket's
first candidates (the shapes left with candidates untimed are tuned again next start); cached in the same
file, one key per shape and bucket.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.nn.functional as F
import triton

from .gemm import GEMM_CANDIDATES, ROW_BUCKETS, DecodeGemm, GemmConfig, decode_linear, gemm_candidates
from ._utils import sm_count
from .paged_attention import (DecodeTiles, SplitRule, decode_tile_candidates, paged_attention,
                              split_rule_candidates)

MAX_SYNTHETIC_BYTES = 4 << 30  # the timed K/V of one layer at most; the context is shortened to fit
MAX_FREE_SHARE = 0.25  # ... and at most this share of the device's free memory (the weights are loaded already)
_FILL_CHUNK = 1 << 26  # elements per half-precision slab when filling an fp8 cache (no RNG kernel for fp8)
AGREEMENT = 1e-2  # a candidate whose output differs from the first's by more (relative) is refused
ATTENTION_BUDGET_S = 6.0  # the tile candidates' timings (their compiles come before it)
GEMM_BUDGET_S = 2.5  # the decode GEMMs' tuning, all shapes together (mostly Triton compiles on a first start)
GEMM_MARGIN = 0.98  # a Triton GEMM replaces cuBLAS only below this share of cuBLAS's time (not on noise)
SPLIT_BUDGET_S = 3.0  # split-KV's tuning (one compile of the split variant and its merge, then a few dozen timings)
SPLIT_MARGIN = 0.98  # another rule replaces the default only below this share of the default's score
SPLIT_PROBE_BATCHES = (4, 16, 32, 64, 128)  # decode batches where some candidate rule splits on today's GPUs
SPLIT_PROBE_CONTEXTS = (512, 2048, 8192)  # keys per sequence (those past the model's limit are left out)
COLD_L2_BYTES = 64 << 20  # a timing rotates through copies of its operands this large in all (H100/H200 L2: 50 MB)
MAX_COLD_COPIES = 64  # ... in at most this many copies


@dataclass(frozen=True)
class DecodeShape:
    """What decode attention's time depends on: the model's attention shape and the step's size."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    batch: int  # decoding sequences
    context: int  # keys per sequence

    @property
    def kv_bytes_per_key(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize  # K and V

    def blocks(self, batch: int, context: int) -> int:
        """Cache blocks that `batch` sequences of `context` keys take."""
        return batch * -(-context // self.block_size)

    def key(self, device_name: str) -> str:
        return (f"{_stack_key(device_name)} | "
                f"q {self.num_q_heads} kv {self.num_kv_heads} x {self.head_dim}, block {self.block_size}, "
                f"{str(self.q_dtype).removeprefix('torch.')} / {str(self.kv_dtype).removeprefix('torch.')} KV, "
                f"batch {self.batch} x context {self.context}")


@dataclass
class TuningResult:
    tiles: DecodeTiles  # the choice
    default: DecodeTiles  # what the kernel's own policy would have used
    times_us: dict[str, float] = field(default_factory=dict)  # per candidate timed ("cached": from the file)
    seconds: float = 0.0  # spent tuning (0 when cached)
    cached: bool = False
    shape: str = ""

    splits: SplitTuningResult | None = None  # split-KV's rule, when tuned (`tune_decode_splits`)
    complete: bool = True  # every candidate timed (False: the budget ran out, or a device error; tuned again next start)
    error: str | None = None  # the device error that left the policy's tiles in place (`_guarded`)

    def describe(self) -> dict:
        described = {"decode_attention": str(self.tiles), "policy_default": str(self.default), "cached": self.cached,
                     "complete": self.complete, "seconds": round(self.seconds, 2), "times_us": self.times_us,
                     "shape": self.shape, **_error_field(self.error)}
        if self.splits is not None:
            described["kv_splits"] = self.splits.describe()
        return described


@dataclass
class SplitTuningResult:
    rule: SplitRule  # the choice
    default: SplitRule  # the policy's
    scores: dict[str, float] = field(default_factory=dict)  # rule -> sum over probes of its time / the best time
    times_us: dict[str, dict[str, float]] = field(default_factory=dict)  # probe label -> launch label -> us
    seconds: float = 0.0  # spent tuning (0 when cached)
    cached: bool = False
    complete: bool = True  # every probe timed (False: the budget ran out; tuned again next start)
    error: str | None = None  # the device error that left the policy's rule in place (`_guarded`)

    def describe(self) -> dict:
        return {"rule": str(self.rule), "policy_default": str(self.default), "cached": self.cached,
                "complete": self.complete, "seconds": round(self.seconds, 2), "scores": self.scores,
                "times_us": self.times_us, **_error_field(self.error)}


def _stack_key(device_name: str) -> str:
    """The part of every cache key that names the device and the stack (a new driver of either: tune again)."""
    return f"{device_name} | torch {torch.__version__} | triton {triton.__version__}"


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def default_cache_path() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "cbatch" / "kernel_tuning.json"


def tune_decode_attention(shape: DecodeShape, device: torch.device, *, cache_path: Path | None = None,
                          budget_s: float | None = None,
                          time_us: Callable[[DecodeTiles, Callable[[], None]], float] | None = None) -> TuningResult:
    """The fastest decode tiles for `shape` on `device` (from the cache file when it has this key).

    `time_us(tiles, fn)` times one call of fn (tiles' launch) in microseconds (default: CUDA events, the median
    of several). Every
    candidate's output is compared with the first's before it may win. Candidates after `budget_s` seconds
    are skipped (the first is always timed; None: ATTENTION_BUDGET_S). A device error (the policy's own tiles failing, a timer that
    cannot run) leaves the policy's tiles, with one warning line (`_guarded`)."""
    default = decode_tile_candidates(shape.head_dim, shape.kv_dtype.itemsize == 1)[0]
    return _guarded("decode attention's tiles",
                    lambda: _tune_decode_attention(shape, device, cache_path,
                                                   ATTENTION_BUDGET_S if budget_s is None else budget_s, time_us),
                    lambda error: TuningResult(default, default, complete=False, error=error))


def _tune_decode_attention(shape: DecodeShape, device: torch.device, cache_path: Path | None, budget_s: float,
                           time_us: Callable[[DecodeTiles, Callable[[], None]], float] | None) -> TuningResult:
    shape = fitted_shape(shape, synthetic_budget(device))  # the shape timed is the one the key and report name
    candidates = decode_tile_candidates(shape.head_dim, shape.kv_dtype.itemsize == 1)
    default = candidates[0]
    key = shape.key(_device_name(device))
    cache_path = cache_path or default_cache_path()
    entry = _complete(_read_cache(cache_path).get(key))
    if entry is not None and DecodeTiles(**entry["tiles"]) in candidates:
        return TuningResult(DecodeTiles(**entry["tiles"]), default, entry.get("times_us", {}), 0.0, True, key)
    t0 = time.perf_counter()
    time_us = time_us or _cuda_time_us
    call, check = _synthetic_launch(shape, device)
    runnable = _runnable(candidates, check)  # every candidate compiled (and checked) before the clock starts
    deadline = time.perf_counter() + budget_s
    # the synthetic K/V of a full step (2 GiB for Qwen3-0.6B's 256 x 2048) is far past L2: every timing is cold
    times, ran = _timed_within(deadline, [(str(t), _skipped_on_error(lambda t=t: time_us(t, call(t)),
                                                                     required=t == default)) for t in runnable])
    complete = ran == len(runnable)
    best = min((t for t in runnable if str(t) in times), key=lambda t: times[str(t)])
    _write_cache(cache_path, key, {"tiles": asdict(best), "times_us": times, "complete": complete})
    return TuningResult(best, default, times, time.perf_counter() - t0, False, key, complete=complete)


R = TypeVar("R")


def _guarded(what: str, tune: Callable[[], R], fallback: Callable[[str], R]) -> R:
    """tune(), or, on any error there (a device-only failure: a kernel that does not compile or launch, a CUDA
    graph that cannot be captured, a timer that cannot run), `fallback(error)`: the policy's defaults, which
    every untuned launch uses, after one warning line on stderr. The engine starts either way."""
    try:
        return tune()
    except Exception as err:  # noqa: BLE001  whatever the device raised: the defaults are what runs untuned
        error = _one_line(err)
        print(f"cbatch: warning: start-up tuning of {what} failed ({error}); using the policy's defaults",
              file=sys.stderr, flush=True)
        return fallback(error)


def _one_line(err: BaseException, limit: int = 200) -> str:
    """`Type: first line of the message`, at most `limit` characters (a warning is one line)."""
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _error_field(error: str | None) -> dict:
    """A result's `describe()` names the device error that left the defaults in place, when there was one."""
    return {} if error is None else {"error": error}


T = TypeVar("T")
K = TypeVar("K")
V = TypeVar("V")


def _runnable(candidates: list[T], output: Callable[[T], torch.Tensor]) -> list[T]:
    """The candidates that run on this device and agree with the first (the policy's, which every untuned launch
    runs: its failure is raised, for `_guarded`), in order. Each is launched once here, so every kernel variant
    is compiled before any timing starts and the budgets time kernels, not compilers."""
    reference = output(candidates[0])
    if not torch.isfinite(reference).all():
        raise RuntimeError(f"the policy's own choice ({candidates[0]}) gave non-finite output")
    kept = [candidates[0]]
    for candidate in candidates[1:]:
        # a candidate this device cannot run (shared memory, registers: e.g. a GPU smaller than an H100), or whose
        # output disagrees (the tests hold every candidate to the reference; this guards the device), is never chosen
        try:
            if _agrees(output(candidate), reference):
                kept.append(candidate)
        except Exception:  # noqa: BLE001
            continue
    return kept


def _timed_within(deadline: float, timings: list[tuple[K, Callable[[], V | None]]],
                  at_least_one: bool = True) -> tuple[dict[K, V], int]:
    """(key -> each timing's result, in order, until perf_counter passes `deadline`; how many ran). The first
    always runs when `at_least_one`; a timing that returns None is left out."""
    results: dict[K, V] = {}
    for i, (key, timing) in enumerate(timings):
        if (i or not at_least_one) and time.perf_counter() > deadline:
            return results, i
        result = timing()
        if result is not None:
            results[key] = result
    return results, len(timings)


def _skipped_on_error(timing: Callable[[], V], required: bool = False) -> Callable[[], V | None]:
    """timing, or None where it fails on this device (a variant that cannot be captured in a graph, say: never
    chosen); a `required` one (the policy's own, the reference) raises, for `_guarded`."""
    if required:
        return timing

    def timed() -> V | None:
        try:
            return timing()
        except Exception:  # noqa: BLE001
            return None

    return timed


Launch = tuple[int, int]  # a split-KV decode launch as a graph runs it: (its splits, the segments a probe fills)


def split_probes(shape: DecodeShape, max_context: int, num_sms: int,
                 rules: list[SplitRule]) -> dict[tuple[int, int], dict[Launch, SplitRule]]:
    """(batch, context) -> the launches to time there, each with a rule that makes it: where the rules' launches
    differ, among the probes that fit the synthetic pool `shape` describes.

    A launch is what a decode graph of `batch` rows runs at that context: its split count is the rule's for the
    longest context (`max_context`, what the graph was captured for), and each sequence fills the segments
    the rule gives its own length. (1, 1) is the unsplit launch, the reference, always included."""
    pool_blocks = shape.blocks(shape.batch, shape.context)
    probes = {}
    for batch in SPLIT_PROBE_BATCHES:
        for context in SPLIT_PROBE_CONTEXTS:
            if context > max_context or shape.blocks(batch, context) > pool_blocks:
                continue
            launches: dict[Launch, SplitRule] = {(1, 1): rules[0]}
            for rule in rules:
                launches.setdefault(_launch(rule, batch, context, shape.num_kv_heads, max_context, num_sms), rule)
            if len(launches) > 1:
                probes[(batch, context)] = launches
    return probes


def _launch(rule: SplitRule, batch: int, context: int, num_kv_heads: int, max_context: int, num_sms: int) -> Launch:
    splits = rule.num_splits(batch, num_kv_heads, max_context, num_sms)
    return (splits, rule.segments(splits, context)) if splits > 1 else (1, 1)


def tune_decode_splits(shape: DecodeShape, tiles: DecodeTiles, device: torch.device, max_context: int, *,
                       cache_path: Path | None = None, budget_s: float = SPLIT_BUDGET_S,
                       rules: list[SplitRule] | None = None, num_sms: int | None = None,
                       time_us: Callable[[tuple[int, int, int, int], Callable[[], None]], float] | None = None,
                       ) -> SplitTuningResult:
    """`_tune_decode_splits`; a device error (the unsplit launch failing, a graph that cannot be captured)
    leaves the policy's rule, with one warning line (`_guarded`)."""
    rules = rules or split_rule_candidates()
    return _guarded("split-KV's rule",
                    lambda: _tune_decode_splits(shape, tiles, device, max_context, cache_path, budget_s, rules,
                                                num_sms, time_us),
                    lambda error: SplitTuningResult(rules[0], rules[0], complete=False, error=error))


def _tune_decode_splits(shape: DecodeShape, tiles: DecodeTiles, device: torch.device, max_context: int,
                        cache_path: Path | None, budget_s: float, rules: list[SplitRule], num_sms: int | None,
                        time_us: Callable[[tuple[int, int, int, int], Callable[[], None]], float] | None,
                        ) -> SplitTuningResult:
    """The split-KV rule for decode launches of `shape`'s model with `tiles` on `device`, contexts up to
    `max_context` (from the cache file when it has a complete entry).

    `time_us((batch, context, splits, segments), fn)` times one call of fn in microseconds (default: replays of a
    CUDA graph of fn, as the decode graphs run it: a small probe's ~10 us launch timed eagerly would time the
    host's two launches of a split, not the GPU's work). Probes (`split_probes`) are timed in order, each
    launch's output checked against the unsplit one first; the probes after `budget_s` seconds, or that the
    device's free memory could not hold, are left out of every rule's score (and the choice is tuned again
    next start)."""
    default = rules[0]
    num_sms = num_sms or sm_count(device)
    key = (f"{shape.key(_device_name(device))} | kv splits, {tiles}, {num_sms} SMs, contexts <= {max_context}, "
           f"rules {'; '.join(map(str, rules))}")
    cache_path = cache_path or default_cache_path()
    entry = _complete(_read_cache(cache_path).get(key))
    by_name = {str(r): r for r in rules}
    if entry and entry.get("rule") in by_name:
        return SplitTuningResult(by_name[entry["rule"]], default, entry.get("scores", {}), entry.get("times_us", {}),
                                 0.0, True, True)
    probes = split_probes(shape, max_context, num_sms, rules)
    if not probes:  # every rule launches alike here (short contexts, or a batch that fills the GPU): nothing to time
        return SplitTuningResult(default, default, {}, {}, 0.0, False, True)
    start = time.perf_counter()
    time_us = time_us or _graph_time_us
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the tile tuning's synthetic K/V, so the free memory below counts it free
    pool = _SyntheticKV(fitted_shape(shape, synthetic_budget(device)), device)
    fitting = {p: launches for p, launches in probes.items() if pool.fits(*p)}  # the device's free memory may be short
    timings = [(p, _split_probe_timing(pool, p, launches, tiles, time_us)) for p, launches in fitting.items()]
    deadline = time.perf_counter() + budget_s  # every probe's launches compiled and checked above
    measured, ran = _timed_within(deadline, timings)
    complete = ran == len(timings) == len(probes)
    scores = {}
    for rule in rules:
        picks = {p: _launch(rule, p[0], p[1], shape.num_kv_heads, max_context, num_sms) for p in measured}
        if all(picks[p] in measured[p] for p in measured):
            scores[str(rule)] = round(sum(measured[p][picks[p]] / min(measured[p].values()) for p in measured), 4)
    best = min((r for r in rules if str(r) in scores), key=lambda r: scores[str(r)], default=default)
    if str(default) in scores and scores[str(best)] >= SPLIT_MARGIN * scores[str(default)]:
        best = default
    times_us = {f"batch {b} x context {c}": {f"{n} splits, {seg} filled": round(t, 2) for (n, seg), t in ts.items()}
                for (b, c), ts in measured.items()}
    _write_cache(cache_path, key, {"rule": str(best), "scores": scores, "times_us": times_us, "complete": complete})
    return SplitTuningResult(best, default, scores, times_us, time.perf_counter() - start, False, complete)


@dataclass(frozen=True)
class GemmShape:
    """One decode GEMM problem: a layer shape (weight [n, k] of `dtype`, with or without bias) at batches of up to
    `rows` rows (a bucket of `gemm.ROW_BUCKETS`)."""

    n: int
    k: int
    dtype: torch.dtype
    bias: bool
    rows: int

    @property
    def label(self) -> str:
        return f"{self.n}x{self.k}{'+bias' if self.bias else ''} M<={self.rows}"

    def key(self, device_name: str) -> str:
        return (f"{_stack_key(device_name)} | gemm {str(self.dtype).removeprefix('torch.')} "
                f"N {self.n} K {self.k}{' + bias' if self.bias else ''}, rows <= {self.rows}")


@dataclass
class GemmTuningResult:
    choices: dict[GemmShape, GemmConfig | None]  # None: cuBLAS
    times_us: dict[str, dict[str, float]] = field(default_factory=dict)  # shape label -> candidate -> us
    seconds: float = 0.0  # spent tuning (0 when every shape came from the cache)
    cached: bool = False  # every shape from the cache
    complete: bool = True  # every candidate timed (False: the budget ran out; tuned again next start)
    error: str | None = None  # the device error that left cuBLAS everywhere (`_guarded`)

    def gemm_for(self, weight: torch.Tensor, bias: torch.Tensor | None) -> DecodeGemm | None:
        """The layer's `DecodeGemm` (its choice per bucket), or None where cuBLAS won every bucket."""
        picks = {s.rows: c for s, c in self.choices.items()
                 if (s.n, s.k, s.dtype, s.bias) == (weight.shape[0], weight.shape[1], weight.dtype, bias is not None)}
        return DecodeGemm(picks) if any(c is not None for c in picks.values()) else None

    def describe(self) -> dict:
        return {"triton": sum(c is not None for c in self.choices.values()), "shapes": len(self.choices),
                "chosen": {s.label: str(c) if c is not None else "cublas" for s, c in self.choices.items()},
                "cached": self.cached, "complete": self.complete, "seconds": round(self.seconds, 2),
                "times_us": self.times_us, **_error_field(self.error)}


def gemm_shapes(weights: list[tuple[torch.Tensor, torch.Tensor | None]],
                buckets: tuple[int, ...] = ROW_BUCKETS) -> dict[GemmShape, tuple[torch.Tensor, torch.Tensor | None]]:
    """The distinct problems of these layers' (weight, bias): one per shape and bucket, the first layer's tensors."""
    problems: dict[GemmShape, tuple[torch.Tensor, torch.Tensor | None]] = {}
    for weight, bias in weights:
        for rows in buckets:
            shape = GemmShape(weight.shape[0], weight.shape[1], weight.dtype, bias is not None, rows)
            problems.setdefault(shape, (weight, bias))
    return problems


def tune_decode_gemms(weights: list[tuple[torch.Tensor, torch.Tensor | None]], device: torch.device, *,
                      cache_path: Path | None = None, budget_s: float = GEMM_BUDGET_S,
                      buckets: tuple[int, ...] = ROW_BUCKETS,
                      time_us: Callable[[tuple[GemmShape, str], Callable[[], None]], float] | None = None,
                      ) -> GemmTuningResult:
    """`_tune_decode_gemms`; a device error (cuBLAS's own timing failing, a graph that cannot be captured)
    leaves cuBLAS for every shape, with one warning line (`_guarded`)."""
    return _guarded("the decode GEMMs",
                    lambda: _tune_decode_gemms(weights, device, cache_path, budget_s, buckets, time_us),
                    lambda error: GemmTuningResult(dict.fromkeys(gemm_shapes(weights, buckets)), complete=False,
                                                   error=error))


def _tune_decode_gemms(weights: list[tuple[torch.Tensor, torch.Tensor | None]], device: torch.device,
                       cache_path: Path | None, budget_s: float, buckets: tuple[int, ...],
                       time_us: Callable[[tuple[GemmShape, str], Callable[[], None]], float] | None,
                       ) -> GemmTuningResult:
    """cuBLAS or a Triton config for each distinct (layer shape, batch bucket) of `weights` (the layers' own
    (weight [N, K], bias) on `device`), from the cache file when it has a complete entry.

    `time_us((shape, candidate), fn)` times one call of fn in microseconds (default: replays of a CUDA graph of
    fn); candidate is "cublas" or str(GemmConfig). cuBLAS is timed first on every shape; then the Triton
    candidates one by one over every shape they fit (one compile each), until `budget_s` has passed. A
    candidate whose output disagrees with cuBLAS's (or that fails on this device) is never chosen."""
    name = _device_name(device)
    cache_path = cache_path or default_cache_path()
    problems = gemm_shapes(weights, buckets)
    by_name = {str(c): c for c in GEMM_CANDIDATES}
    choices: dict[GemmShape, GemmConfig | None] = {}
    times: dict[str, dict[str, float]] = {}
    todo = []
    cache = _read_cache(cache_path)
    for shape in problems:
        entry = _complete(cache.get(shape.key(name)))
        if entry and (entry.get("choice") == "cublas" or entry.get("choice") in by_name):
            choices[shape] = by_name.get(entry["choice"])
            times[shape.label] = entry.get("times_us", {})
        else:
            todo.append(shape)
    if not todo:
        return GemmTuningResult(choices, times, 0.0, True, True)
    start = time.perf_counter()
    time_us = time_us or _graph_time_us
    gen = torch.Generator(device=device).manual_seed(0)
    copies = {}  # (n, k, dtype, bias) -> the layer's (weight, bias) and copies of them: the timings rotate through
    runs = {}  # shape -> (its rotating call per candidate, the candidates that run here, compiled and checked)
    for shape in todo:
        weight, bias = problems[shape]
        rotation = copies.setdefault((shape.n, shape.k, shape.dtype, shape.bias), _cold_copies(weight, bias))
        x = torch.randn(shape.rows, shape.k, generator=gen, device=device, dtype=shape.dtype)
        runs[shape] = _gemm_calls(x, rotation), _runnable(["cublas", *gemm_candidates(shape.rows)],
                                                         lambda c, x=x, w=weight, b=bias: _gemm(x, w, b, c).float())
    deadline = time.perf_counter() + budget_s
    for shape in todo:  # cuBLAS on every shape, whatever the budget: the reference each candidate must beat
        times[shape.label] = {"cublas": time_us((shape, "cublas"), runs[shape][0]("cublas"))}
    order = [(s, c) for s, c in gemm_timing_order(todo) if c in runs[s][1]]
    timed, ran = _timed_within(deadline, [((s, str(c)), _skipped_on_error(
        lambda s=s, c=c: time_us((s, str(c)), runs[s][0](c)))) for s, c in order], at_least_one=False)
    for (shape, label), us in timed.items():
        times[shape.label][label] = us
    untimed = {s for s, _ in order[ran:]}  # the budget ran out before some of their candidates
    complete, entries = True, {}
    for shape in todo:
        measured = times[shape.label]
        best = min(measured, key=measured.get)
        if best != "cublas" and measured[best] >= GEMM_MARGIN * measured["cublas"]:
            best = "cublas"
        choices[shape] = by_name.get(best)
        shape_complete = shape not in untimed
        complete = complete and shape_complete
        entries[shape.key(name)] = {"choice": best, "times_us": measured, "complete": shape_complete}
    _write_entries(cache_path, entries)
    return GemmTuningResult(choices, times, time.perf_counter() - start, False, complete)


def gemm_timing_order(shapes: list[GemmShape]) -> list[tuple[GemmShape, GemmConfig]]:
    """(shape, candidate) in the order the Triton candidates are timed: round r times each bucket's r-th candidate,
    the largest bucket first (256 rows: most of a full run's decode steps), so a budget cut short leaves every
    bucket with its first candidates timed, not the small buckets with all of theirs and the large with none."""
    rows = sorted({s.rows for s in shapes}, reverse=True)
    order = []
    for r in range(len(GEMM_CANDIDATES)):
        for bucket in rows:
            fitting = gemm_candidates(bucket)
            if r < len(fitting):
                order += [(s, fitting[r]) for s in shapes if s.rows == bucket]
    return order


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, candidate: GemmConfig | str) -> torch.Tensor:
    """x @ weight.T (+ bias) by cuBLAS ("cublas") or the Triton GEMM with `candidate`'s config."""
    return F.linear(x, weight, bias) if candidate == "cublas" else decode_linear(x, weight, bias, candidate)


def _gemm_calls(x: torch.Tensor, rotation: list[tuple[torch.Tensor, torch.Tensor | None]]):
    """candidate -> a `_Rotating` call of the GEMM with it, each call on the next copy of the layer's weights."""
    return lambda candidate: _Rotating([lambda w=w, b=b: _gemm(x, w, b, candidate) for w, b in rotation])


def _split_probe_timing(pool: _SyntheticKV, probe: tuple[int, int], launches: dict[Launch, SplitRule],
                        tiles: DecodeTiles, time_us) -> Callable[[], dict[Launch, float]]:
    """Checks every launch at `probe` against the unsplit one now (compiling each variant: before the clock) and
    returns the timing of those that agree; the unsplit launch (what every decode step runs) must time."""
    batch, context = probe
    timed, check = pool.launch(batch, context)
    runnable = _runnable(list(launches), lambda launch: check(tiles, launch[0], launches[launch]))

    def timing() -> dict[Launch, float]:
        times = {}
        for launch in runnable:
            run = timed(tiles, launch[0], launches[launch])
            us = _skipped_on_error(lambda: time_us((batch, context, *launch), run), required=launch == (1, 1))()
            if us is not None:
                times[launch] = us
        return times

    return timing


def cold_copies(nbytes: int) -> int:
    """Copies of `nbytes` of operands that a timing rotates through so that together they hold COLD_L2_BYTES (at
    most MAX_COLD_COPIES): each call then reads from HBM, as a decode step does, not from the 50 MB L2."""
    return max(1, min(MAX_COLD_COPIES, -(-COLD_L2_BYTES // max(1, nbytes))))


def _cold_copies(weight: torch.Tensor, bias: torch.Tensor | None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The layer's (weight, bias) and copies of them, `cold_copies` of its bytes in all."""
    count = cold_copies(weight.nbytes + (bias.nbytes if bias is not None else 0))
    return [(weight, bias)] + [(weight.clone(), None if bias is None else bias.clone()) for _ in range(count - 1)]


class _Rotating:
    """A timed call: each call runs the next of `calls` (one per copy of the operands), in turn; `period` of them.
    Timed back to back (a graph of `period` x n calls), every call reads operands the calls before it evicted."""

    def __init__(self, calls: list[Callable[[], object]]) -> None:
        self.calls, self.period, self.next = calls, len(calls), 0

    def __call__(self) -> None:
        call = self.calls[self.next]
        self.next = (self.next + 1) % self.period
        call()


def synthetic_budget(device: torch.device) -> int:
    """Bytes the synthetic K/V may take on `device`: MAX_SYNTHETIC_BYTES, or less where the GPU's free memory is short."""
    if device.type != "cuda":
        return MAX_SYNTHETIC_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return min(MAX_SYNTHETIC_BYTES, int(free * MAX_FREE_SHARE))


def fitted_shape(shape: DecodeShape, budget_bytes: int) -> DecodeShape:
    """`shape`, its context shortened where batch x context keys of K and V would exceed `budget_bytes`."""
    context = max(1, min(shape.context, budget_bytes // max(1, shape.batch * shape.kv_bytes_per_key)))
    return shape if context == shape.context else replace(shape, context=context)


def _random(size: tuple[int, ...], dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Standard-normal values of `dtype`, drawn on `device` (fp8 through half-precision slabs of bounded size)."""
    if dtype.itemsize >= 2:
        return torch.randn(size, generator=gen, device=device, dtype=dtype)
    out = torch.empty(size, dtype=dtype, device=device)
    for part in out.view(-1).split(_FILL_CHUNK):
        part.copy_(torch.randn(part.numel(), generator=gen, device=device, dtype=torch.float16))
    return out


class _SyntheticKV:
    """One layer's random K/V cache on `device` with room for `shape.batch` sequences of `shape.context` keys,
    every tensor drawn there from a seeded generator (no CPU fill, no host-to-device copy); timed launches of any
    batch x context that fits read it through a shuffled block table."""

    def __init__(self, shape: DecodeShape, device: torch.device) -> None:
        self.shape, self.device = shape, device
        self.gen = torch.Generator(device=device).manual_seed(0)
        self.num_blocks = shape.blocks(shape.batch, shape.context)
        cache_shape = (self.num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        self.k = _random(cache_shape, shape.kv_dtype, device, self.gen)
        self.v = _random(cache_shape, shape.kv_dtype, device, self.gen)
        self.scales = torch.full((shape.num_kv_heads,), 0.5, device=device) if shape.kv_dtype.itemsize == 1 else None
        self.order = torch.randperm(self.num_blocks, generator=self.gen, device=device).to(torch.int32)

    def fits(self, batch: int, context: int) -> bool:
        return self.shape.blocks(batch, context) <= self.num_blocks

    def block_tables(self, batch: int, context: int) -> list[torch.Tensor]:
        """Disjoint [batch, blocks per sequence] tables over the shuffled pool: as many as the pool holds, up to
        `cold_copies` of the launch's K/V bytes (a small probe's K/V would otherwise sit in L2 when timed)."""
        per_launch = self.shape.blocks(batch, context)
        launch_bytes = per_launch * self.shape.block_size * self.shape.kv_bytes_per_key
        count = max(1, min(self.num_blocks // per_launch, cold_copies(launch_bytes)))
        return [self.order[i * per_launch: (i + 1) * per_launch].view(batch, -1) for i in range(count)]

    def launch(self, batch: int, context: int):
        """(timed(tiles, num_splits, rule) -> a `_Rotating` call over `block_tables`, check(tiles, num_splits,
        rule) -> output on the first table) for `batch` random queries at `context` keys each; num_splits None:
        the kernel's own choice; rule: paged_attention's split_rule."""
        shape, device = self.shape, self.device
        tables = self.block_tables(batch, context)
        q = _random((batch, shape.num_q_heads, shape.head_dim), shape.q_dtype, device, self.gen)
        out = torch.empty_like(q)
        seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
        scale = shape.head_dim ** -0.5

        def run(table: torch.Tensor, tiles: DecodeTiles, num_splits: int | None, rule: SplitRule | None) -> None:
            paged_attention(q, self.k, self.v, out, query_start_loc, seq_lens, table, scale, 1, context,
                            num_splits=num_splits, k_scale=self.scales, v_scale=self.scales, decode_tiles=tiles,
                            split_rule=rule)

        def timed(tiles: DecodeTiles, num_splits: int | None = None, rule: SplitRule | None = None) -> _Rotating:
            return _Rotating([lambda t=t: run(t, tiles, num_splits, rule) for t in tables])

        def check(tiles: DecodeTiles, num_splits: int | None = None, rule: SplitRule | None = None) -> torch.Tensor:
            out.fill_(float("nan"))
            run(tables[0], tiles, num_splits, rule)
            return out.float().clone()

        return timed, check


def _synthetic_launch(shape: DecodeShape, device: torch.device):
    """(timed(tiles) -> a `_Rotating` call, check(tiles) -> output) over one random decode batch of `shape` on
    `device` (the whole pool: one table)."""
    return _SyntheticKV(shape, device).launch(shape.batch, shape.context)


def _agrees(out: torch.Tensor, reference: torch.Tensor) -> bool:
    if not torch.isfinite(out).all():
        return False
    return ((out - reference).norm() / reference.norm().clamp_min(1e-12)).item() < AGREEMENT


def _cuda_time_us(what, fn: Callable[[], None], repeats: int = 7, inner: int = 3) -> float:
    """Median microseconds per call, CUDA events around `inner` calls (the first call compiled already)."""
    fn()
    torch.cuda.synchronize()

    def run() -> None:
        for _ in range(inner):
            fn()

    return _median_event_us(run, inner, repeats)


def _graph_time_us(what, fn: Callable[[], None], repeats: int = 7, inner: int = 10) -> float:
    """Median microseconds per call of fn replayed from a CUDA graph of `inner` calls (a multiple of a `_Rotating`
    fn's period: each replay runs every copy alike): what a decode step's graph pays for it (a few-microsecond
    GEMM launched eagerly would time the host's launch instead)."""
    period = getattr(fn, "period", 1)
    inner = period * -(-inner // period)
    fn()  # compiles (Triton) and warms up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    return _median_event_us(graph.replay, inner, repeats)


def _median_event_us(run: Callable[[], None], calls: int, repeats: int) -> float:
    """Median over `repeats` of the microseconds per call of run() (which makes `calls` calls), by CUDA events."""
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def _read_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, unreadable or damaged: tune again and rewrite it
        return {}
    return data if isinstance(data, dict) else {}


def _complete(entry: object) -> dict | None:
    """A cache entry whose tuning timed every candidate (else None: tuned again, this start)."""
    return entry if isinstance(entry, dict) and entry.get("complete") else None


def _write_cache(path: Path, key: str, entry: dict) -> None:
    """Adds `key` to the cache file (whole: temp file + rename). A cache that cannot be written (read-only home,
    full disk) only means tuning again next time."""
    _write_entries(path, {key: entry})


def _write_entries(path: Path, entries: dict[str, dict]) -> None:
    """`_write_cache` for several keys at once (one rewrite of the file)."""
    data = _read_cache(path)
    data.update(entries)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(data, f, indent=1)
        os.replace(f.name, path)
    except OSError:
        with contextlib.suppress(OSError, NameError):
            os.unlink(f.name)


__all__ = ["DecodeShape", "GemmShape", "GemmTuningResult", "SplitTuningResult", "TuningResult", "default_cache_path",
           "fitted_shape", "gemm_shapes", "split_probes", "synthetic_budget", "tune_decode_attention",
           "tune_decode_gemms", "tune_decode_splits"]
