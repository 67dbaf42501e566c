"""Thinking budgets (`SamplingParams.thinking_token_budget`, vLLM's name): a thinking model may write at most N
tokens inside `<think>...</think>`; at the budget the sampler forces the think-end token, and the model answers.

Per sequence a counter: whether it is inside the thinking and how many thinking tokens it has written. Like the
penalties' counts (sampling_inputs.TokenCounts) it is brought up to date from the tokens sampled since the
sequence's last step, and forgotten when the sequence is preempted or finishes (rebuilt from its tokens after).
The thinking counted is the completion's: opened by the think-start token in the completion, or by the prompt
when its last think marker is a start (a template that opens the thinking itself). Several thinking blocks
share one budget. Only the step at the budget changes the logits: every token before it is the one an
unbounded run samples.
"""
from __future__ import annotations

from dataclasses import dataclass

from cbatch.engine.sequence import Sequence
from cbatch.tokenizer import count_thinking, thinking_opened


@dataclass(slots=True)
class _Count:
    counted: int  # output tokens already read
    inside: bool  # within <think>...</think> after them
    used: int  # thinking tokens written so far


class ThinkingBudgets:
    def __init__(self) -> None:
        self._counts: dict[int, _Count] = {}  # seq_id -> its count

    def forced(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """(row, the think-end token) for each row of `seqs` (the step's sampling rows, in logits order) whose
        next token must close its thinking: inside it with its budget spent."""
        out = []
        for row, seq in enumerate(seqs):
            budget = seq.params.thinking_token_budget
            if budget is None or seq.think_ids is None:
                continue
            count = self._update(seq)
            if count.inside and count.used >= budget:
                out.append((row, seq.think_ids[1]))
        return out

    def release(self, seq: Sequence) -> None:
        self._counts.pop(seq.seq_id, None)

    def _update(self, seq: Sequence) -> _Count:
        count = self._counts.get(seq.seq_id)
        if count is None:
            count = self._counts[seq.seq_id] = _Count(0, thinking_opened(seq.prompt_ids, seq.think_ids), 0)
        # NOTE: usually one token, the last step's
        count.inside, used = count_thinking(seq.output_ids[count.counted:], seq.think_ids, count.inside)
        count.used += used
        count.counted = len(seq.output_ids)
        return count


__all__ = ["ThinkingBudgets"]
