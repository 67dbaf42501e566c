"""Builds a step's inputs (`StepInputs`) from its plan: orders the rows (`batch_order`), takes the quiet decodes as
runs and every other row one by one, and asks the row features (row_features.py: LoRA, prompt log-probabilities,
pooling, ...) for their rows and arrays. NOTE: `quiet_decode_tokens` is the negation of the per-row path for the
rows it takes: tests/test_host_step.py compares the two.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from cbatch.engine.kv_cache import BlockTableBuffer
from cbatch.engine.row_features import RowFeature
from cbatch.engine.sequence import PLACEHOLDER, Sequence
from cbatch.engine.step import StepPlan
from cbatch.engine.step_inputs import StepInputs


def build_step_inputs(plan: StepPlan, block_tables: BlockTableBuffer, block_size: int, by_context: bool,
                      last_row: dict[int, int], features: list[RowFeature]
                      ) -> tuple[StepInputs, list[Sequence], list[int] | None]:
    """(the step's inputs as host arrays, the sequences that sample in logits-row order, each sampling row's
    drafted tokens before its position (None: no row verifies drafts)); the row features keep their own rows of
    the step. `by_context`: decodes ordered by context length (`batch_order`); `last_row`: seq_id -> its row in
    the previous step's sampled tokens (the placeholders' sources).

    A row verifying drafts (`plan.drafts`: speculative decoding) becomes 1 + len(drafts) one-token rows at the end
    of the batch, row j feeding its j-th token (its last one, then the drafts) at position num_computed + j with
    context num_computed + j + 1: to attention exactly a decode row each (the KV of the whole step is stored before
    any row attends), so every position's logits are a plain decode step's. Each samples."""
    scheduled, verify = plan.scheduled, []
    if plan.drafts:
        verify = [(seq, plan.drafts[seq.seq_id]) for seq, _ in scheduled if seq.seq_id in plan.drafts]
        scheduled = [row for row in scheduled if row[0].seq_id not in plan.drafts]
    # the features see every row of the step, the verify rows after the plain ones (their `fill` indexes its
    # per-row values by `order`: an image row's M-RoPE delta applies to its verify rows too)
    expanded = [(seq, 1) for seq, drafted in verify for _ in range(len(drafted) + 1)]
    keys = [k for feature in features if (k := feature.order_keys(scheduled + expanded)) is not None]
    # NOTE: one feature at most orders the batch (LoRA's adapter slots); every feature is asked each step
    ordered, starts, q_lens, order = batch_order(scheduled, by_context, keys[0][: len(scheduled)] if keys else None)
    seqs = [seq for seq, _ in ordered]
    rows = block_tables.sync(seqs + [seq for seq, _ in verify])
    if verify:
        ordered, starts, q_lens, rows = _with_verify_rows(ordered, starts, q_lens, rows, verify)
        if not isinstance(order, slice):  # (a whole slice already takes them, in place)
            order = np.concatenate([order, np.arange(len(seqs), len(seqs) + len(expanded))])
    n = len(ordered)
    cu_q = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_q[1:])
    for feature in features:
        feature.start_step()
    # The flat batch's Python side: quiet decodes in runs (slices), the other rows one by one, in batch order.
    flat = _FlatRows(last_row, [f for f in features if type(f).add_row is not RowFeature.add_row])
    offsets = cu_q.tolist()
    start = 0
    num_plain = len(seqs)  # the rows before the verified ones
    fed = quiet_decode_tokens(ordered[:num_plain] if verify else ordered)
    for i in ([i for i, token in enumerate(fed) if token is None] if None in fed else []) + [num_plain]:
        if i > start:
            flat.add_decodes(seqs[start:i], fed[start:i], offsets[start])
        if i < num_plain:
            flat.add_row(seqs[i], ordered[i][1], offsets[i])
        start = i + 1
    sampling_offsets = None
    if verify:
        sampling_offsets = [0] * len(flat.sampling_seqs)
        offset = offsets[num_plain]
        for seq, drafted in verify:
            flat.add_verified(seq, drafted, offset)
            sampling_offsets.extend(range(len(drafted) + 1))
            offset += len(drafted) + 1
    num_tokens = offsets[-1]
    if num_tokens == n and int(q_lens.min()) == 1:  # one token per row (decodes)
        token_seq, positions = np.arange(n), starts.copy()
    else:
        token_seq = np.repeat(np.arange(n), q_lens)  # [T] batch index of each token
        positions = starts[token_seq] + (np.arange(num_tokens) - cu_q[:-1][token_seq])
    seq_lens = starts + q_lens
    num_cols = -(-int(seq_lens.max()) // block_size)
    table = block_tables.table[rows, :num_cols]  # [B, num_cols]
    slots = table[token_seq, positions // block_size].astype(np.int64) * block_size + positions % block_size
    inputs = StepInputs(flat.token_ids, positions, cu_q, seq_lens, np.ascontiguousarray(table), slots,
                        flat.logits_rows, [], plan.copies, plan.swap_out, plan.swap_in,
                        flat.placeholder_rows, flat.placeholder_sources)
    for feature in features:
        feature.fill(inputs, order, q_lens)
    return inputs, flat.sampling_seqs, sampling_offsets


def _with_verify_rows(ordered: list[tuple[Sequence, int]], starts: np.ndarray, q_lens: np.ndarray, rows: np.ndarray,
                      verify: list[tuple[Sequence, list[int]]]):
    """`batch_order`'s rows followed by each verified row's one-token rows (see `build_step_inputs`); `rows`: the
    block-table rows of `ordered`'s sequences, then one per verified sequence."""
    plain = len(ordered)
    sizes = [len(drafted) + 1 for _, drafted in verify]
    extra_starts = np.concatenate([seq.num_computed + np.arange(size) for (seq, _), size in zip(verify, sizes)])
    ordered = ordered + [(seq, 1) for (seq, _), size in zip(verify, sizes) for _ in range(size)]
    starts = np.concatenate([starts, extra_starts.astype(np.int64)])
    q_lens = np.concatenate([q_lens, np.ones(len(extra_starts), dtype=np.int64)])
    rows = np.concatenate([rows[:plain], np.repeat(rows[plain:], sizes)])
    return ordered, starts, q_lens, rows


@dataclass(slots=True)
class _FlatRows:
    """The Python lists of a step's flat batch, filled row by row (or run by run) in batch order."""

    last_row: dict[int, int]  # seq_id -> its row in the previous step's sampled tokens (placeholders)
    features: list[RowFeature]  # those with rows of their own (`add_row`), in the order they are asked
    token_ids: list[int] = field(default_factory=list)
    sampling_seqs: list[Sequence] = field(default_factory=list)  # in logits-row order
    logits_rows: list[int] = field(default_factory=list)  # the flat rows whose hidden states sample
    # asynchronous scheduling: the flat rows whose token the step in flight samples, and each one's row in its tokens
    placeholder_rows: list[int] = field(default_factory=list)
    placeholder_sources: list[int] = field(default_factory=list)

    def add_row(self, seq: Sequence, num_new: int, offset: int) -> None:
        """Any row: its chunk's tokens from flat row `offset` on; it samples if the chunk reaches its end."""
        if num_new == 1:
            token = seq.token_at(seq.num_computed)
            if token == PLACEHOLDER:  # sampled by the step still in flight: read on the device
                self.placeholder_rows.append(offset)
                self.placeholder_sources.append(self.last_row[seq.seq_id])
            self.token_ids.append(token)
        else:
            self.token_ids.extend(seq.tokens(seq.num_computed, seq.num_computed + num_new))
        for feature in self.features:
            if feature.add_row(seq, num_new, offset):
                return  # the feature's alone (a prefill-only chunk: the pooler's, never the sampler's)
        if seq.num_computed + num_new == seq.num_tokens:  # this chunk reaches the end: sample
            # the samples it forks draw their first token from the same logits row
            samples = seq.samples if seq.pending_children else [seq]
            self.sampling_seqs.extend(samples)
            self.logits_rows.extend([offset + num_new - 1] * len(samples))

    def add_verified(self, seq: Sequence, drafted: list[int], offset: int) -> None:
        """A row verifying `drafted`: its last token and the drafts at flat rows offset.., each sampling."""
        self.token_ids.append(seq.token_at(seq.num_computed))  # (never a placeholder: see Speculator.may_draft)
        self.token_ids.extend(drafted)
        self.sampling_seqs.extend([seq] * (len(drafted) + 1))
        self.logits_rows.extend(range(offset, offset + len(drafted) + 1))

    def add_decodes(self, seqs: list[Sequence], tokens: list[int], offset: int) -> None:
        """A run of quiet decodes (`quiet_decode_tokens`) feeding `tokens` at flat rows offset, offset + 1, ...: what
        `add_row` does for each of them (its last token, which it samples), for the run at once."""
        if tokens.count(PLACEHOLDER) == len(tokens):  # asynchronous scheduling's steady state: all in flight
            self.placeholder_rows.extend(range(offset, offset + len(seqs)))
            self.placeholder_sources.extend([self.last_row[s.seq_id] for s in seqs])
        elif PLACEHOLDER in tokens:
            picked = [j for j, token in enumerate(tokens) if token == PLACEHOLDER]
            self.placeholder_rows.extend([offset + j for j in picked])
            self.placeholder_sources.extend([self.last_row[seqs[j].seq_id] for j in picked])
        self.token_ids.extend(tokens)
        self.sampling_seqs.extend(seqs)
        self.logits_rows.extend(range(offset, offset + len(seqs)))


def quiet_decode_tokens(rows: list[tuple[Sequence, int]]) -> list[int | None]:
    """Per row: the token a quiet decode feeds (`token_at(num_computed)`: its last), None for any other row.
    A quiet decode: one token, the sequence's last (it samples), no samples to fork, no row feature's work (prompt
    log-probabilities, pooling: a new feature with rows of its own adds its test here).
    (One pass of inlined tests: it runs over every row.)"""
    return [(s.output_ids or s.prompt_ids)[-1]
            if n == 1 and s.num_computed + 1 == s.prompt_len + len(s.output_ids)
            and not (s.children and not s.forked) and s.prompt_logprobs is None and s.pooling is None else None
            for s, n in rows]


def batch_order(scheduled: list[tuple[Sequence, int]], by_context: bool, keys: np.ndarray | None = None
                ) -> tuple[list[tuple[Sequence, int]], np.ndarray, np.ndarray, np.ndarray | slice]:
    """The plan's rows in batch order, with their computed counts and chunk lengths (int64 arrays in that order)
    and the order (plan indices, or a whole slice): decodes first (`by_context`: shortest context first), then
    prefill chunks, each in plan order (a stable sort). TorchBackend attends neighbouring decode rows together
    (`groups_decodes`), so similar lengths pad less, and its groups become slices of the batch. Otherwise the
    order is free: sampled tokens go back by sequence id, and rows of equal `keys` (a row feature's, >= -1: LoRA's
    adapter slots) are put together, so each adapter's delta takes one slice of the batch. (A decode-only step in
    plan order is the plan itself: no sort.)"""
    n = len(scheduled)
    computed = np.fromiter([seq.num_computed for seq, _ in scheduled], np.int64, n)
    q_lens = np.fromiter([num_new for _, num_new in scheduled], np.int64, n)
    decode = q_lens == 1
    if by_context:
        key = np.where(decode, computed, np.iinfo(np.int64).max)
    elif keys is not None:
        key = (~decode) * (int(keys.max()) + 2) + keys
    elif decode.all():
        return scheduled, computed, q_lens, slice(None)
    else:
        key = ~decode
    order = np.argsort(key, kind="stable")
    return [scheduled[i] for i in order.tolist()], computed[order], q_lens[order], order
