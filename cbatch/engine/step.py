"""The messages of one step, in the order they flow: the scheduler's `StepPlan` (what to compute, with its
`StepInfo`), the runner's `StepOutput` (the sampled tokens, with `StepLogprobs` where asked), which the scheduler
applies. Scheduler, runners (model, simulator, planner) and observers import them from here."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from cbatch.engine.logprobs import Logprobs
from cbatch.engine.sequence import Sequence


@dataclass(slots=True)
class StepInfo:
    """What one step did, for per-step metrics and the simulator's cost model."""

    scheduled_tokens: int = 0
    prefill_tokens: int = 0  # tokens of chunks longer than one (prompt and recompute work)
    context_tokens: int = 0  # sum over scheduled sequences of their context after the step (KV read)
    attention_pairs: int = 0  # (query token, key token) pairs attended this step (attention FLOPs)
    sampled_tokens: int = 0  # new tokens that count as output (static padding excluded); set by `update`
    prompt_tokens: int = 0  # tokens of prompts computed (recomputes included, prefix-cache hits not)
    drafted_tokens: int = 0  # speculative tokens verified (in `scheduled_tokens`, not in `prefill_tokens`)
    accepted_tokens: int = 0  # of those, the ones kept; set by `update`

    @classmethod
    def of(cls, scheduled: list[tuple[Sequence, int]], drafts: Mapping[int, list[int]] | None = None) -> "StepInfo":
        """The work of a plan's `scheduled` list, before the step runs. (Sums over columns: it runs every step.)
        `drafts`: the plan's drafted tokens (a verified row's chunk is its last token and its drafts)."""
        computed = [seq.num_computed for seq, _ in scheduled]
        new = [num_new for _, num_new in scheduled]
        info = cls(scheduled_tokens=sum(new), prefill_tokens=sum(n for n in new if n > 1))
        if drafts:
            info.drafted_tokens = sum(len(d) for d in drafts.values())
            info.prefill_tokens -= sum(n for (seq, n) in scheduled if seq.seq_id in drafts)
        info.context_tokens = sum(computed) + info.scheduled_tokens
        # query i of the chunk (0-based) sees context - num_new + i + 1 keys (causal): num_new * computed +
        # num_new * (num_new + 1) / 2 pairs in all, computed + 1 for a decode
        if info.scheduled_tokens == len(new) and not info.prefill_tokens:  # decodes only
            info.attention_pairs = info.context_tokens
        else:
            info.attention_pairs = sum(n * c + n * (n + 1) // 2 for c, n in zip(computed, new))
        info.prompt_tokens = sum(min(c + n, seq.prompt_len) - c
                                 for (seq, n), c in zip(scheduled, computed) if c < seq.prompt_len)
        return info


@dataclass(slots=True)
class StepPlan:
    """What one model step computes."""

    scheduled: list[tuple[Sequence, int]]  # (sequence, tokens to compute this step), decodes first
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # left the batch in the previous update
    info: StepInfo = field(default_factory=StepInfo)  # the step's work (filled when the plan is complete)
    # NOTE: the runner copies swap_out before swap_in, both before the model call. A device block in
    # swap_out may be handed to another sequence in this very step (it is copied out first); a host
    # slot read by swap_in is reused only from the next step on.
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block)
    # NOTE: copied first, before swap_out: the last step forked samples, each child gets its own copy of
    # the parent's partial last block (copy-on-write: full blocks are shared, never written)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source block, destination block)
    step: int = 0  # its number (1-based), for the first-token and finish steps of the sequences whose tokens it brings
    # per row, set by `Scheduler.account`: True where accounting was only "computed + 1, placeholder appended"
    # (`quiet_rows.quiet_decodes`); `apply_tokens` takes its quiet rows among these (None before `account`: none)
    accounted_quiet: list[bool] | None = None
    # speculative decoding: seq_id -> the tokens drafted after its last token; such a row's chunk is its last token
    # and these (1 + len tokens), each position sampled as a decode step would (engine/speculative/)
    drafts: dict[int, list[int]] = field(default_factory=dict)
    # rows whose rejected drafts' blocks the last update gave back: (sequence, blocks it keeps); the runner cuts its
    # block-table row to that length before this step is built
    trimmed: list[tuple[Sequence, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass(slots=True)
class StepLogprobs:
    """The log-probabilities a step computed, for the sequences that ask (cbatch/engine/logprobs.py)."""

    sampled: dict[int, Logprobs] = field(default_factory=dict)  # seq_id -> its new token's (one position)
    prompt: dict[int, Logprobs] = field(default_factory=dict)  # seq_id -> the prompt positions of its chunk


@dataclass(slots=True)
class StepOutput:
    """What a runner returns for a step."""

    tokens: Mapping[int, int]  # seq_id -> sampled token, for every sequence whose chunk reached its end
    logprobs: StepLogprobs | None = None  # None: no sequence asked
    # prefill-only requests whose prompt ended this step: seq_id -> float32 result (engine/pooling.py); their
    # `tokens` entry is a dummy the scheduler appends, which ends them (max_tokens 1)
    pooled: Mapping[int, object] | None = None
    # speculative decoding: seq_id -> the target's token at each position of a row's verified chunk (its last token
    # and each draft: 1 + drafts); `tokens` holds the first of them. None: no row verified drafts
    verified: Mapping[int, list[int]] | None = None
