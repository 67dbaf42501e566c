"""Which rows draft how many tokens this step (the scheduler asks), and what came of it (the scheduler tells).

Modes: `ngram` drafts wherever a row's own tokens offer a match (k tokens); `suffix` also looks in the job's
finished outputs and prompts (`SuffixTable`) and takes the longer match; `auto` is `suffix` with a cost model:
a row drafts j tokens only while the chance that all j are accepted, alpha ** j (alpha: the row's measured
acceptance per drafted token, starting from the job's), beats what the j-th token costs relative to a plain
decode token. With a step costing `fixed + tokens` token-times (`StepCost.fixed_tokens`: the weight reads and
launches a step pays whatever its size), a step of B rows spends (fixed + B) / B per plain token, and one
drafted token costs 1: it pays when alpha ** j > B / (fixed + B). A compute-bound step (B >> fixed) drafts only
rows whose drafts nearly always hold; the tail of a job (few rows) drafts freely; a row whose drafts fail stops.

Drafts never change a token (the scheduler keeps a draft only where it equals the target's own token), so every
choice here is about speed alone.
"""
from __future__ import annotations

from cbatch.engine.sequence import PLACEHOLDER, Sequence
from cbatch.engine.step import StepInfo
from cbatch.engine.speculative.ngram import NgramIndex, copy_from
from cbatch.engine.speculative.suffix import SuffixTable

PRIOR_ACCEPTANCE = 0.5  # alpha before any draft was verified
ACCEPTANCE_MEMORY = 0.7  # weight of the old estimate in each update of an exponential average
# auto: until this many drafted tokens were verified, every PROBE_EVERY-th row the cost model turns down drafts
# anyway (the job's alpha is measured, not assumed: a compute-bound start would otherwise never learn it)
PROBE_TOKENS = 256
PROBE_EVERY = 8


class StepCost:
    """A step's time as `fixed + tokens` in units of one token's compute, `fixed_tokens` fitted online (least
    squares over the steps seen, exponentially forgotten) from (scheduled tokens, seconds); a prior until the steps
    seen differ enough in size to fit a line. `fixed_tokens` set by hand (tests, the simulator) stays as given."""

    PRIOR_FIXED_TOKENS = 16.0
    MEMORY = 0.98

    def __init__(self, fixed_tokens: float | None = None) -> None:
        self.pinned = fixed_tokens is not None
        self.fixed_tokens = self.PRIOR_FIXED_TOKENS if fixed_tokens is None else fixed_tokens
        self._sums = [0.0] * 5  # weight, x, y, xx, xy

    def observe(self, tokens: int, seconds: float) -> None:
        if self.pinned or tokens <= 0 or seconds <= 0:
            return
        m = self.MEMORY
        w, sx, sy, sxx, sxy = (v * m for v in self._sums)
        w, sx, sy, sxx, sxy = w + 1, sx + tokens, sy + seconds, sxx + tokens * tokens, sxy + tokens * seconds
        self._sums = [w, sx, sy, sxx, sxy]
        var = sxx / w - (sx / w) ** 2
        if var < 1.0:  # all steps of about one size: no slope to fit
            return
        slope = (sxy / w - sx / w * sy / w) / var
        if slope <= 0:
            return
        intercept = sy / w - slope * sx / w
        self.fixed_tokens = max(0.0, intercept / slope)


class Speculator:
    def __init__(self, mode: str, k: int, min_n: int, max_n: int, cost: StepCost | None = None) -> None:
        assert mode in ("ngram", "suffix", "auto")
        self.mode, self.k, self.min_n, self.max_n = mode, k, min_n, max_n
        self.shared = SuffixTable(min_n, max_n) if mode != "ngram" else None
        self.cost = cost or StepCost()
        self._rows: dict[int, NgramIndex] = {}  # seq_id -> its own tokens' index
        self._alpha: dict[int, float] = {}  # seq_id -> its acceptance per drafted token (auto)
        self._job_alpha = PRIOR_ACCEPTANCE
        self._measured = 0  # drafted tokens verified so far
        self._declined = 0  # rows auto turned down (every PROBE_EVERY-th probes while the job's alpha is young)

    # ---- the scheduler asks -----------------------------------------------------------------------------
    @staticmethod
    def may_draft(seq: Sequence) -> bool:
        """A decoding row whose next token's sampling can be replayed per drafted position: its last token known
        on the host (not a step in flight's), no samples to fork, no static padding, no thinking budget; a grammar only where its matcher can be forked (structured.py)."""
        return (seq.output_ids and seq.output_ids[-1] != PLACEHOLDER and not seq.pending_children
                and seq.num_result_tokens is None and seq.params.thinking_token_budget is None
                and (seq.grammar is None or hasattr(seq.grammar.matcher, "fork"))
                and seq.params.lora is None and seq.pooling is None)

    def step_threshold(self, step_tokens: int) -> float:
        """auto: the chance of acceptance a drafted token needs to pay in a step of `step_tokens` plain tokens."""
        return step_tokens / (self.cost.fixed_tokens + step_tokens)

    def propose(self, seq: Sequence, limit: int, threshold: float = 0.0) -> list[int]:
        """At most `limit` (and k) tokens drafted for `seq`'s next positions; [] for none. `threshold` (auto): the
        acceptance chance each drafted token must beat."""
        limit = min(limit, self.k)
        if self.mode == "auto":
            alpha = self._alpha.get(seq.seq_id, self._job_alpha)
            j = 0
            while j < limit and alpha ** (j + 1) > threshold:
                j += 1
            if j == 0 and self._measured < PROBE_TOKENS:
                self._declined += 1
                j = limit if self._declined % PROBE_EVERY == 0 else 0
            limit = j
        if limit <= 0:
            return []
        tokens = seq.prompt_ids + seq.output_ids
        index = self._rows.get(seq.seq_id)
        if index is None:
            index = self._rows[seq.seq_id] = NgramIndex(self.min_n, self.max_n)
        index.extend(tokens)
        n, start = index.match(tokens)
        if self.shared is not None and self.shared.match_length(tokens) > n:
            return self.shared.propose(tokens, limit)
        if n == 0:
            return []
        return copy_from(tokens, start, limit)

    # ---- the scheduler tells ----------------------------------------------------------------------------
    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """`seq` verified `drafted` tokens, the first `accepted` of them equal to its own."""
        # per drafted token: accepted ones held; the first rejected one (if any) failed; the rest were never tried
        self._measured += drafted
        rate = accepted / (accepted + (accepted < drafted))
        m = ACCEPTANCE_MEMORY
        self._alpha[seq.seq_id] = m * self._alpha.get(seq.seq_id, self._job_alpha) + (1 - m) * rate
        self._job_alpha = 0.95 * self._job_alpha + 0.05 * rate

    def started(self, seq: Sequence) -> None:
        """A row started (suffix, auto): its prompt joins the job's table."""
        if self.shared is not None and seq.sample_index == 0 and seq.num_preemptions == 0:
            self.shared.add(seq.prompt_ids)

    def finished(self, seq: Sequence) -> None:
        """A row left: its index is dropped; its output joins the job's table (suffix, auto)."""
        self._rows.pop(seq.seq_id, None)
        self._alpha.pop(seq.seq_id, None)
        if self.shared is not None and seq.output_ids:
            self.shared.add(seq.result_ids)

    def observe_step(self, info: StepInfo, seconds: float) -> None:
        """A step's time, for auto's cost model. Only decode steps (verify rows included) are fitted: drafting
        competes with decodes, and a prefill token costs less than a sampled one (no lm_head, no sampling), so
        mixing prefill chunks in tilts the line towards a large fixed cost that decode steps do not have (on a CPU,
        where the step is compute-bound, that made auto draft where it lost 5%: benchmarks/RESULTS.md)."""
        if not info.prefill_tokens:
            self.cost.observe(info.scheduled_tokens, seconds)
