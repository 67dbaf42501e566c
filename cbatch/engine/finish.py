"""When a sequence stops: the finish rules applied to each sampled token (stop strings, a complete grammar, EOS,
stop tokens, max_tokens, the model's context), apart from the scheduler that applies them."""
from __future__ import annotations

from cbatch.engine.sequence import FinishReason, Sequence


def at_length_limit(seq: Sequence, max_model_len: int) -> bool:
    """`seq` holds max_tokens output tokens, or fills the model's context."""
    return len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= max_model_len


def finish_reason(seq: Sequence, token: int, max_model_len: int) -> FinishReason | None:
    """Why `token`, just appended to `seq`, ends it (None: it goes on). A stop string (checked incrementally on
    the new text), a complete grammar, EOS unless ignored, a stop token, max_tokens or the model's context.
    Before min_tokens, only the last two (vLLM)."""
    params = seq.params
    may_stop = len(seq.output_ids) >= params.min_tokens
    if seq.stop is not None and seq.stop.append(token, may_stop):
        return FinishReason.STOP
    if seq.grammar is not None:  # structured output: complete when the grammar took its stop token
        try:
            if seq.grammar.accept(token):
                return FinishReason.STOP
        except RuntimeError as exc:
            seq.error = str(exc)
            return FinishReason.ERROR
    if may_stop and ((token in seq.eos_ids and not params.ignore_eos) or token in params.stop_token_ids):
        return FinishReason.STOP
    if at_length_limit(seq, max_model_len):
        return FinishReason.LENGTH
    return None
