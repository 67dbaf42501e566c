"""The runner's side of sampling: the rows that sample this step -> a `SamplingBatch` (settings, seeds and
the logits processors' tensors), and the per-sequence token statistics the penalties read (and the thinking
counts of rows with a thinking budget: cbatch/engine/thinking.py).

`TokenCounts` keeps, for every running sequence with a penalty, a row of output-token counts and a row
of prompt-token presence in two persistent tensors on the model's device. A step adds only the tokens
sampled since the sequence's last step (one per row while decoding): nothing is recounted. Rows are
freed when a plan names the sequence preempted or finished (as the block tables' rows are).
"""
from __future__ import annotations

from typing import Callable, Mapping, Sequence as Values

import torch

from cbatch.config import distinct_params
from cbatch.engine.sampler import ForcedTokens, LogitsProcessors, Penalties, SamplingBatch, SparseLogits, sample_seed
from cbatch.engine.sequence import Sequence
from cbatch.engine.staging import host_values
from cbatch.engine.thinking import ThinkingBudgets


class TokenCounts:
    """Output-token counts [rows, vocab] (int32) and prompt-token masks [rows, vocab] (bool), one row per
    penalised sequence, grown by doubling when more sequences need rows than it has."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.counts = torch.zeros((0, vocab_size), dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros((0, vocab_size), dtype=torch.bool, device=device)
        self._free: list[int] = []
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._counted: dict[int, int] = {}  # seq_id -> output tokens already in its row

    def rows(self, seqs: list[Sequence]) -> torch.Tensor:
        """Brings each sequence's row up to date (a new one gets its prompt and output counted once);
        returns their rows, int64 [len(seqs)]."""
        rows, count_rows, count_tokens, prompt_rows, prompt_tokens = [], [], [], [], []
        for seq in seqs:
            row = self._row_of.get(seq.seq_id)
            if row is None:
                row = self._take(seq.seq_id)
                prompt_rows.extend([row] * len(seq.prompt_ids))
                prompt_tokens.extend(seq.prompt_ids)
            new = seq.output_ids[self._counted[seq.seq_id]:]  # NOTE: usually one token, the last step's
            count_rows.extend([row] * len(new))
            count_tokens.extend(new)
            self._counted[seq.seq_id] = len(seq.output_ids)
            rows.append(row)
        if prompt_rows:
            self.prompt_mask[self._index(prompt_rows), self._index(prompt_tokens)] = True
        if count_rows:
            ones = torch.ones(len(count_rows), dtype=torch.int32, device=self.device)
            self.counts.index_put_((self._index(count_rows), self._index(count_tokens)), ones, accumulate=True)
        return self._index(rows)

    def release(self, seq: Sequence) -> None:
        row = self._row_of.pop(seq.seq_id, None)
        if row is not None:
            del self._counted[seq.seq_id]
            self._free.append(row)

    def _take(self, seq_id: int) -> int:
        if not self._free:
            self._grow()
        row = self._free.pop()
        self.counts[row].zero_()
        self.prompt_mask[row].zero_()
        self._row_of[seq_id] = row
        self._counted[seq_id] = 0
        return row

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
        mask = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
        counts[:old], mask[:old] = self.counts, self.prompt_mask
        self.counts, self.prompt_mask = counts, mask
        self._free.extend(range(new - 1, old - 1, -1))

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)


class SamplingInputs:
    """Builds each step's `SamplingBatch` from the sequences that sample, in the order of the logits."""

    def __init__(self, vocab_size: int, device: torch.device, job_seed: int,
                 put: Callable[[Values, torch.dtype], torch.Tensor] | None = None) -> None:
        self.device = device
        self.job_seed = job_seed
        # host values -> device tensors (`staging.host_values`): NOTE: every tensor of a SamplingBatch is made
        # through it, so that a step scheduled ahead never waits for the one in flight
        self.put = put or host_values(device, None)
        self.token_counts = TokenCounts(vocab_size, device)
        self.thinking = ThinkingBudgets()
        self._seeds: dict[int, int] = {}  # seq_id -> its effective seed (fixed for the sequence's life)

    def release(self, seq: Sequence) -> None:
        self.token_counts.release(seq)
        self.thinking.release(seq)
        self._seeds.pop(seq.seq_id, None)

    def build(self, seqs: list[Sequence], offsets: list[int] | None = None,
              drafts: Mapping[int, list[int]] | None = None) -> SamplingBatch:
        """The settings of the rows that sample, in logits order. `offsets` (speculative decoding): per row, the
        drafted tokens (`drafts[seq_id]`) before its position; a row at offset j samples as a decode step would
        after those j tokens were appended: its position, min_tokens and penalty counts see them."""
        params = [s.params for s in seqs]
        # NOTE: rows usually share a few SamplingParams objects: each option is looked for once per distinct
        # object, and the per-row work is done only for an option some row uses (the host step stays short)
        distinct = distinct_params(params)
        if len(distinct) == 1:
            p, n = distinct[0], len(params)
            temperatures, top_ps, top_ks = [float(p.temperature)] * n, [float(p.top_p)] * n, [int(p.top_k)] * n
        else:
            temperatures = [float(p.temperature) for p in params]
            top_ps = [float(p.top_p) for p in params]
            top_ks = [int(p.top_k) for p in params]
        batch = SamplingBatch(temperatures=temperatures, top_ps=top_ps, top_ks=top_ks, seeds=self._seeds_of(seqs),
                              positions=[len(s.output_ids) for s in seqs], put=self.put)
        if offsets is not None:
            batch.positions = [p + j for p, j in zip(batch.positions, offsets)]
            batch.draft_offsets, batch.drafts = offsets, drafts
        if any(p.min_p > 0 for p in distinct):
            batch.min_ps = [float(p.min_p) for p in params]
        if any(p.logprobs is not None for p in distinct):
            batch.logprobs = [p.logprobs for p in params]
        batch.processors = LogitsProcessors(
            bias=self._sparse([(r, t, float(b)) for r, p in enumerate(params) for t, b in p.logit_bias.items()])
            if any(p.logit_bias for p in distinct) else None,
            banned=self._sparse([(r, t, -float("inf")) for r, s in enumerate(seqs)
                                 for t in _banned(s, offsets[r] if offsets is not None else 0)])
            if any(p.min_tokens > 0 for p in distinct) else None,
            penalties=self._penalties(seqs, offsets, drafts) if any(p.penalized for p in distinct) else None,
            forced=self._forced(seqs) if any(p.thinking_token_budget is not None for p in distinct) else None,
        )
        return batch

    def _seeds_of(self, seqs: list[Sequence]) -> list[int]:
        seeds = [self._seeds.get(s.seq_id) for s in seqs]
        if None in seeds:  # sequences seen for the first time
            seeds = [self._seed(s) if seed is None else seed for s, seed in zip(seqs, seeds)]
        return seeds

    def _seed(self, seq: Sequence) -> int:
        seed = self._seeds.get(seq.seq_id)
        if seed is None:
            seed = self._seeds[seq.seq_id] = sample_seed(seq.params.seed, self.job_seed, seq.row_index, seq.sample_index)
        return seed

    def _sparse(self, entries: list[tuple[int, int, float]]) -> SparseLogits | None:
        if not entries:
            return None
        rows, tokens, values = zip(*entries)
        return SparseLogits(self.put(rows, torch.int64), self.put(tokens, torch.int64), self.put(values, torch.float32))

    def _forced(self, seqs: list[Sequence]) -> ForcedTokens | None:
        entries = self.thinking.forced(seqs)
        if not entries:
            return None
        rows, tokens = zip(*entries)
        return ForcedTokens(self.put(rows, torch.int64), self.put(tokens, torch.int64))

    def _penalties(self, seqs: list[Sequence], offsets: list[int] | None = None,
                   drafts: Mapping[int, list[int]] | None = None) -> Penalties | None:
        picked = [r for r, s in enumerate(seqs) if s.params.penalized]
        if not picked:
            return None
        rows = self.token_counts.rows([seqs[r] for r in picked])
        counts, mask = self.token_counts.counts, self.token_counts.prompt_mask
        output_counts = counts.index_select(0, rows)
        if offsets is not None:  # a verified row's position j counts the j drafts before it as output
            extra = [(i, t) for i, r in enumerate(picked) if offsets[r] for t in drafts[seqs[r].seq_id][: offsets[r]]]
            if extra:
                at, tokens = zip(*extra)
                output_counts.index_put_((self.put(at, torch.int64), self.put(tokens, torch.int64)),
                                         torch.ones(len(at), dtype=torch.int32, device=self.device), accumulate=True)

        names = ("repetition_penalty", "frequency_penalty", "presence_penalty")
        values = {name: [float(getattr(seqs[r].params, name)) for r in picked] for name in names}
        repetition, frequency, presence = (self.put(values[name], torch.float32) for name in names)
        return Penalties(
            rows=self.put(picked, torch.int64), repetition=repetition, frequency=frequency,
            presence=presence, output_counts=output_counts, prompt_mask=mask.index_select(0, rows),
            used=(any(v != 1.0 for v in values[names[0]]), any(values[names[1]]), any(values[names[2]])),
        )


def _banned(seq: Sequence, drafted: int = 0) -> list[int]:
    """Tokens that may not come yet: EOS (unless ignored) and stop_token_ids, before min_tokens (vLLM). `drafted`:
    tokens drafted before the position (speculative decoding)."""
    p = seq.params
    if len(seq.output_ids) + drafted >= p.min_tokens:
        return []
    eos = [] if p.ignore_eos else sorted(seq.eos_ids)
    return sorted(set(eos) | set(p.stop_token_ids))
