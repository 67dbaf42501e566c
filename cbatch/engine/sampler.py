"""Token selection: one pipeline over the batch's logits, in tensor ops (no per-row Python over the vocabulary).

    raw logits [N, vocab] float32
      -> (capture) log-probabilities of the raw logits, for rows that ask (vLLM v1's default `raw_logprobs`)
      -> processors, rows that have them: logit_bias -> min_tokens (EOS and stop_token_ids banned)
         -> repetition / frequency / presence penalties
         -> forced tokens (a spent thinking budget: the think-end token) [`process_logits`]
         -> structured output: tokens outside each constrained row's grammar at -inf (xgrammar bitmask)
      -> greedy rows: argmax
      -> random rows: temperature -> softmax -> min_p -> top-k / top-p   [`sampling_probs`]
         -> exponential race with counter-based noise                     [`select_tokens`]

The race: argmax of p / E, E ~ Exp(1), is a sample from p; the noise E comes from a counter-based hash of
(seed, output position, vocabulary id). A seeded request therefore gets the same tokens alone or inside
any batch, on any device, after any preemption; sample i of a row with n samples draws with the seed
derived from (row seed, i) (`sample_seed`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from cbatch.engine.logprobs import Logprobs, score
from cbatch.engine.staging import host_tensor

_MASK32 = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class SparseLogits:
    """Values added at (row, token) places of the logits: logit_bias entries, or -inf for banned tokens."""

    rows: torch.Tensor  # int64 [M]
    tokens: torch.Tensor  # int64 [M]
    values: torch.Tensor  # float32 [M]

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_put_((self.rows, self.tokens), self.values, accumulate=True)


@dataclass(slots=True)
class Penalties:
    """The rows with a penalty, with their settings and token statistics (vLLM's definitions):
    repetition (HF / CTRL): a logit of a token seen in the prompt or the output is divided by the
    penalty when positive, multiplied when not; frequency: minus penalty x the token's count in the
    output; presence: minus penalty once for a token present in the output."""

    rows: torch.Tensor  # int64 [P]: rows of the batch
    repetition: torch.Tensor  # float32 [P]
    frequency: torch.Tensor  # float32 [P]
    presence: torch.Tensor  # float32 [P]
    output_counts: torch.Tensor  # int32 [P, vocab]: occurrences of each token in the row's output
    prompt_mask: torch.Tensor  # bool [P, vocab]: tokens of the row's prompt
    used: tuple[bool, bool, bool] = (True, True, True)  # (repetition, frequency, presence): some row uses it

    def apply(self, logits: torch.Tensor) -> None:
        rows = logits.index_select(0, self.rows)  # [P, vocab]
        in_output = self.output_counts > 0
        repetition, frequency, presence = self.used
        if repetition:
            seen = self.prompt_mask | in_output
            penalty = self.repetition[:, None]
            rows = torch.where(seen, torch.where(rows > 0, rows / penalty, rows * penalty), rows)
        if frequency:
            rows -= self.frequency[:, None] * self.output_counts
        if presence:
            rows -= self.presence[:, None] * in_output
        logits.index_copy_(0, self.rows, rows)


@dataclass(slots=True)
class ForcedTokens:
    """Rows whose next token is decided (a thinking budget spent: the think-end token): every other logit of
    the row at -inf."""

    rows: torch.Tensor  # int64 [F]
    tokens: torch.Tensor  # int64 [F]

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_fill_(0, self.rows, -float("inf"))
        logits.index_put_((self.rows, self.tokens), torch.zeros_like(self.tokens, dtype=logits.dtype))


@dataclass(slots=True)
class LogitsProcessors:
    """What changes the logits before selection, each for the rows that use it (None: no row does)."""

    bias: SparseLogits | None = None  # logit_bias
    banned: SparseLogits | None = None  # min_tokens: EOS and stop_token_ids at -inf until min_tokens
    penalties: Penalties | None = None
    forced: ForcedTokens | None = None  # thinking budgets: the think-end token, last (nothing after undoes it)

    def __bool__(self) -> bool:
        return self.bias is not None or self.banned is not None or self.penalties is not None or self.forced is not None


@dataclass(slots=True)
class SamplingBatch:
    """Per-row settings of the rows that sample this step (host lists; tensors built on demand)."""

    temperatures: list[float]
    top_ps: list[float]
    top_ks: list[int]
    seeds: list[int]  # effective seed: the request's, else derived from the job seed and the row's id
    positions: list[int]  # index of the token being sampled within the completion
    min_ps: list[float] = field(default_factory=list)  # empty: no row uses min_p
    logprobs: list[int | None] = field(default_factory=list)  # k per row (None: not asked); empty: no row asks
    processors: LogitsProcessors = field(default_factory=LogitsProcessors)
    grammar_masks: Any = None  # structured output: a `structured.PendingMasks` of the constrained rows, or None
    # host values -> a tensor on the logits' device (`staging.host_values`: on a GPU through pinned memory, so
    # that building the step's sampling inputs never waits for the step in flight); None: `staging.host_tensor`
    put: Callable[[Sequence, torch.dtype], torch.Tensor] | None = None
    # speculative decoding: per row, the drafted tokens before its position (None: no row verifies drafts), and
    # seq_id -> the drafts (what a row's position-dependent settings, penalties and grammar mask see)
    draft_offsets: list[int] | None = None
    drafts: Any = None

    def on_device(self, values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`values` (host) as a tensor on `device`."""
        if self.put is None:
            return host_tensor(values, dtype, device)
        return self.put(values, dtype)

    @property
    def all_greedy(self) -> bool:
        return all(t == 0.0 for t in self.temperatures)

    @property
    def plain(self) -> bool:
        """Only temperature, top-k, top-p and seeds: no processor, no min_p, no log-probabilities, no grammar."""
        return not self.processors and not any(self.min_ps) and not self.logprobs and self.grammar_masks is None


@dataclass(slots=True)
class SamplerOutput:
    tokens: torch.Tensor  # int64 [N]
    logprobs: list[Logprobs | None]  # per row: its token's log-probability and top k (None: not asked)


def sample_seed(seed: int | None, job_seed: int, row_index: int, sample_index: int) -> int:
    """A sequence's effective seed: the row's own seed, else (job seed << 32) ^ row index; sample i > 0 of
    a row with n samples mixes i in (splitmix64), sample 0 keeps the row's seed. A signed int64."""
    base = seed if seed is not None else (job_seed << 32) ^ row_index
    if sample_index == 0:
        return base
    x = (base + sample_index * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer on int64 tensors holding values < 2**32 (products stay below 2**59)."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _MASK32
    return (x >> 16) ^ x


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """E ~ Exp(1) of shape [N, vocab], a pure function of (seed, position, vocab id)."""
    device = seeds.device
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    row = _hash32(_hash32(lo) ^ hi)
    row = _hash32(row ^ (positions * 0x61C88647 & _MASK32))  # [N]
    col = _hash32(torch.arange(vocab_size, device=device, dtype=torch.int64) * 0x27D4EB2D & _MASK32)  # [V]
    bits = _hash32(row[:, None] ^ col[None, :])  # [N, V] uniform in [0, 2**32)
    uniform = (bits.double() + 0.5) / 4294967296.0  # (0, 1), never 0
    return (-torch.log(uniform)).float()


def sample_step(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """logits float32 [N, vocab] -> the sampled tokens and, for rows that ask, their log-probabilities."""
    asking = [r for r, k in enumerate(batch.logprobs) if k is not None]
    raw = None
    if asking:  # NOTE: the capture point: raw logits, before any processor (vLLM v1's default)
        raw = torch.log_softmax(logits[asking] if len(asking) < logits.shape[0] else logits, dim=-1)
    tokens = sample(logits, batch)
    out: list[Logprobs | None] = [None] * logits.shape[0]
    if raw is not None:
        scored = score(raw, tokens[asking], [batch.logprobs[r] for r in asking])
        for r, logprobs in zip(asking, scored):
            out[r] = logprobs
    return SamplerOutput(tokens, out)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """logits float32 [N, vocab] -> token ids int64 [N]. The grammar masks apply last, after the processors
    (a token a grammar forbids stays forbidden whatever its bias)."""
    logits = process_logits(logits, batch.processors)
    if batch.grammar_masks is not None:
        batch.grammar_masks.apply(logits)  # in place: `logits` is the runner's, or the processors' copy
    return select_tokens(logits, batch)


def process_logits(logits: torch.Tensor, processors: LogitsProcessors) -> torch.Tensor:
    """The logits after logit_bias, min_tokens, the penalties and forced tokens (a new tensor when any applies)."""
    if not processors:
        return logits
    logits = logits.clone()
    for step in (processors.bias, processors.banned, processors.penalties, processors.forced):
        if step is not None:
            step.apply(logits)
    return logits


def select_tokens(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Processed logits [N, vocab] -> tokens [N]: argmax for greedy rows, the seeded race for the others.
    NOTE: no host synchronisation: which rows are random is read off the host lists, every tensor made from
    host values goes through `batch.on_device`."""
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    device = logits.device
    picked = [i for i, t in enumerate(batch.temperatures) if t > 0]
    random_rows = batch.on_device(picked, torch.int64, device)
    temps = batch.on_device([batch.temperatures[i] for i in picked], torch.float32, device)
    probs = sampling_probs(logits[random_rows], temps, [batch.top_ks[i] for i in picked], [batch.top_ps[i] for i in picked],
                           [batch.min_ps[i] for i in picked] if batch.min_ps else [], batch.on_device)
    seeds = batch.on_device([batch.seeds[i] for i in picked], torch.int64, device)
    positions = batch.on_device([batch.positions[i] for i in picked], torch.int64, device)
    noise = exponential_noise(seeds, positions, logits.shape[-1])
    chosen = (probs / noise).argmax(dim=-1)
    out = greedy.clone()
    out[random_rows] = chosen
    return out


def sampling_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_ks: list[int], top_ps: list[float],
                   min_ps: list[float], on_device: Callable[..., torch.Tensor] = host_tensor) -> torch.Tensor:
    """The distribution random rows draw from: softmax(logits / T), then min_p (tokens below min_p x the
    top probability dropped, the rest renormalised), then top-k / top-p (unnormalised: the race does
    not need it). logits [R, vocab] -> probabilities [R, vocab]. `on_device(values, dtype, device)` makes
    the settings' tensors (`SamplingBatch.on_device`; default `staging.host_tensor`)."""
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    if any(p > 0.0 for p in min_ps):
        probs = _min_p(probs, on_device(min_ps, probs.dtype, probs.device))
    return _top_k_top_p(probs, top_ks, top_ps, on_device)


def _min_p(probs: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """vLLM's min_p: tokens whose probability is below min_p x the row's largest are dropped; the rest
    renormalised (so a later top-p sees the filtered distribution). Rows with min_p 0 stay as they are."""
    threshold = min_ps[:, None] * probs.amax(dim=-1, keepdim=True)
    kept = torch.where(probs >= threshold, probs, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.where(min_ps[:, None] > 0, kept, probs)


def _top_k_top_p(probs: torch.Tensor, top_ks: list[int], top_ps: list[float],
                 on_device: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Zeroes the probabilities outside each row's top-k and top-p nucleus (kept in vocab order)."""
    if all(k == 0 for k in top_ks) and all(p >= 1.0 for p in top_ps):
        return probs
    vocab = probs.shape[-1]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ks = on_device([k if k > 0 else vocab for k in top_ks], torch.int64, probs.device)
    ps = on_device(top_ps, probs.dtype, probs.device)
    rank = torch.arange(vocab, device=probs.device)
    cumulative = sorted_probs.cumsum(dim=-1)
    # keep a token while the mass before it is below p: the token that crosses p stays in
    keep = (rank[None, :] < ks[:, None]) & ((cumulative - sorted_probs) < ps[:, None])
    keep[:, 0] = True
    kept = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
    return kept
