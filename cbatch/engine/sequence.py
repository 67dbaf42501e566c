"""One request's state as the scheduler and the runner see it."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cbatch.config import SamplingParams
from cbatch.engine.images import SeqImages
from cbatch.engine.logprobs import Logprobs
from cbatch.engine.pooling import PoolingParams
from cbatch.engine.stop import StopChecker
from cbatch.engine.structured import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # never started, or preempted (waiting to be recomputed or swapped back in)
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_tokens (or the model's context) reached
    ERROR = "error"  # could not run (e.g. does not fit the KV pool even alone)


# An output token sampled by a step still on the device (asynchronous scheduling): the scheduler counts it,
# the runner reads the real id from that step's sampled tokens, `Scheduler.apply_tokens` writes it in.
PLACEHOLDER = -1

@dataclass(eq=False, slots=True)
class Sequence:
    """A request in flight.

    Invariant: the tokens the model has seen are `token_ids[:num_computed]`; a step schedules
    `num_tokens - num_computed` of them at most (decode: 1, prefill chunk: k), and the sequence
    samples a new token in a step whose chunk reaches `num_tokens`.
    """

    seq_id: int  # position in the job (input order); also the tie-breaker for every ordering
    prompt_ids: list[int]
    params: SamplingParams
    eos_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    # static batching: a finished member keeps its slot (and computes) until its group ends;
    # the tokens it makes after `num_result_tokens` are padding work, not output.
    num_result_tokens: int | None = None
    # step counters for the report
    arrival_step: int = 0
    first_scheduled_step: int | None = None
    first_token_step: int | None = None
    finish_step: int | None = None
    # prefix cache: chained hashes of the full blocks of `token_ids` (computed lazily, only ever
    # extended: tokens are only appended), and how many of `block_ids` were offered to the cache
    block_hashes: list[int] = field(default_factory=list)
    block_keys: list[tuple] = field(default_factory=list)  # (parent hash, the block's tokens) of each hash
    num_registered_blocks: int = 0
    # swap preemption: host slots holding the KV of `token_ids[:num_computed]` while preempted
    host_block_ids: list[int] = field(default_factory=list)
    stop: StopChecker | None = None  # the request's stop strings (needs the tokenizer)
    # n samples of one row: the first requested sample is the parent; it computes the prompt once and, when
    # it samples its first token, the scheduler forks `children` (the other samples) onto its KV blocks
    row_index: int = -1  # the input row (its seed's source); -1: the seq_id
    sample_index: int = 0  # which of the row's `n` samples: its seed is derived from (row seed, sample index)
    children: list["Sequence"] = field(default_factory=list)
    forked: bool = False  # the children have been forked (they run on their own from then on)
    logprobs: Logprobs | None = None  # of the output tokens, when params.logprobs is set
    prompt_logprobs: Logprobs | None = None  # of prompt tokens 1.. (token 0 has none), when params.prompt_logprobs is set
    # a prefill-only request (embed, score, classify, reward: engine/pooling.py): ends with its prompt; `pooled`
    # is its float32 result (an embedding or the head's logits), set by the engine from the step that ends it
    pooling: PoolingParams | None = None
    pooled: object = None

    def __post_init__(self) -> None:
        self.prompt_len = len(self.prompt_ids)
        if self.row_index < 0:
            self.row_index = self.seq_id
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = Logprobs()
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = Logprobs()
    grammar: GrammarState | None = None  # structured output: the matcher of the request's constraint
    images: SeqImages | None = None  # a vision-language prompt's images (engine/images.py); None: text only
    think_ids: tuple[int, int] | None = None  # a thinking budget's (think-start, think-end) tokens (engine/thinking.py)
    # len(prompt_ids), kept in the object itself: the prompt never changes, and the host step's per-row passes
    # read it for every running sequence (a slot read, not a trip to the list)
    prompt_len: int = field(init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    def token_at(self, index: int) -> int:
        n = self.prompt_len
        return self.prompt_ids[index] if index < n else self.output_ids[index - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = self.prompt_len
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def result_ids(self) -> list[int]:
        """The completion's token ids (static batching's padding work cut off)."""
        n = self.num_result_tokens
        return self.output_ids if n is None else self.output_ids[:n]

    @property
    def estimated_work(self) -> int:
        """Tokens this request will put through the model: what longest-first sorts by."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def pending_children(self) -> int:
        """Samples that will fork from this sequence when it samples its first token."""
        return 0 if self.forked else len(self.children)

    @property
    def samples(self) -> list["Sequence"]:
        """This row's sequences in sample order: the parent, then its children."""
        return [self, *self.children]

    @property
    def needs_every_position(self) -> bool:
        """Every prompt position must be computed here (no prefix-cache hits): prompt log-probabilities not all
        computed yet, or a pooling that reads every position (mean, cls)."""
        return self.prompt_logprobs_missing or (self.pooling is not None and self.pooling.every_position)

    @property
    def prompt_logprobs_missing(self) -> bool:
        """Prompt log-probabilities asked for and not all computed (prefix-cache hits would skip them)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids) - 1
