"""What the scheduler counts, once per step (never per token): the report and the dashboard read it."""
from __future__ import annotations

from dataclasses import dataclass, field

from cbatch.engine.step import StepInfo

# Why waiting work was not admitted in a step (one reason per step, counted in SchedulerStats).
STALL_REASONS = (
    "no_free_blocks", "token_budget", "max_num_seqs", "reserved", "after_preemption", "static_group", "prefix_pending",
    "closed", "max_loras", "encoder_budget",
)


@dataclass(slots=True)
class SchedulerStats:
    """Counters the report and the dashboard read; updated once per step, never per token."""

    steps: int = 0
    scheduled_tokens: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0  # computed tokens dropped by recompute preemptions (the cache may give some back)
    computed_prompt_tokens: int = 0  # prompt tokens run through the model (a row's n samples share one prompt)
    forked_samples: int = 0  # samples that started on their parent's prompt KV (n > 1)
    padding_tokens: int = 0  # static batching: tokens computed for members that already finished
    occupancy_sum: float = 0.0  # sum over steps of running / max_num_seqs
    kv_usage_sum: float = 0.0  # sum over steps of used / total blocks
    peak_kv_blocks: int = 0
    # prefix cache
    prefix_cache_queries: int = 0  # sequences that looked up the cache when starting
    prefix_cache_query_tokens: int = 0  # their tokens
    prefix_cache_hit_tokens: int = 0  # of those, tokens found cached (not computed)
    prefix_cache_hit_image_tokens: int = 0  # of those, image placeholder tokens (their image's KV not computed again)
    # swap preemption
    swap_preemptions: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    # admission stalls: steps in which waiting work was left waiting, by reason
    stalled_no_free_blocks: int = 0
    stalled_token_budget: int = 0
    stalled_max_num_seqs: int = 0
    stalled_reserved: int = 0  # reserve admission: the prompt fit, prompt + max_tokens did not
    stalled_after_preemption: int = 0
    stalled_static_group: int = 0
    stalled_prefix_pending: int = 0  # the head shares a prefix block another sequence computes this step
    stalled_closed: int = 0  # admission closed (the job's deadline came: nothing new starts)
    stalled_max_loras: int = 0  # the head's LoRA adapter would be one more than --max-loras among the running rows
    stalled_encoder_budget: int = 0  # the head's first image would pass this step's --max-image-tokens-per-step
    # speculative decoding (engine/speculative/): tokens drafted and verified, those kept, steps with drafts
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_steps: int = 0
    # queue wait (steps from arrival to first scheduling) per priority class
    wait_steps_by_priority: dict[int, list[int]] = field(default_factory=dict)

    def count_step(self, info: StepInfo, padding_tokens: int, occupancy: float, used_blocks: int, num_blocks: int) -> int:
        """One step's counters (`occupancy`: running / max_num_seqs); returns its number (1-based)."""
        self.steps += 1
        self.scheduled_tokens += info.scheduled_tokens
        self.computed_prompt_tokens += info.prompt_tokens
        self.padding_tokens += padding_tokens
        self.occupancy_sum += occupancy
        self.kv_usage_sum += used_blocks / num_blocks
        self.peak_kv_blocks = max(self.peak_kv_blocks, used_blocks)
        if info.drafted_tokens:
            self.drafted_tokens += info.drafted_tokens
            self.draft_steps += 1
        return self.steps

    @property
    def acceptance_rate(self) -> float:
        """Drafted tokens kept (speculative decoding); 0 without drafts."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / max(self.prefix_cache_query_tokens, 1)

    @property
    def admission_stalls(self) -> dict[str, int]:
        return {reason: getattr(self, f"stalled_{reason}") for reason in STALL_REASONS}
