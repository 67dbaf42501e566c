"""Per-row features of a step: what a row asks beyond its tokens and its sampling (a LoRA adapter, prompt
log-probabilities, pooling, a grammar's mask) as small objects that the input builder (input_builder.py) and the
runner ask, in place of a branch each. A new per-row feature (images: image_rows.py; speculative drafts) is one more object.

A feature's hooks, in the order a step calls them; each does nothing by default:
  order_keys(scheduled)         build (rank 0): int [B] in plan order, keys >= -1 whose equal rows the batch
                                order keeps together, or None
  start_step()                  build: the previous step's rows forgotten
  add_row(seq, num_new, offset) build: every row but the quiet decodes (NOTE: input_builder.quiet_decode_tokens
                                must never take a row a feature's `add_row` would record); True: the chunk is the
                                feature's alone (no later feature sees it and it does not sample)
  fill(inputs, order, q_lens)   build: its arrays into `StepInputs` (what every tensor-parallel rank gets)
  on_sampling(seqs, batch)      rank 0, the step's sampling rows built, before the model runs
  prepare(inputs, ...)          every rank, before the model; False: the step may not run in a decode graph
  forward_inputs()              every rank, after prepare: what it adds to the model call's ForwardContext
  release(seq) / reset()        a plan named `seq` preempted or finished / the runner forgets every sequence
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from cbatch.engine.logprobs import Logprobs, prompt_logprobs
from cbatch.engine.pooler import Pooler, PoolRow
from cbatch.engine.sampler import SamplingBatch
from cbatch.engine.sequence import Sequence
from cbatch.engine.structured import TokenMasks
from cbatch.model.decoder import LlamaForCausalLM

from cbatch.engine.step_inputs import StepInputs

if TYPE_CHECKING:
    from cbatch.lora.runtime import LoraSlots


class RowFeature:
    """The hooks (see the module's docstring); a feature overrides those it needs."""

    def order_keys(self, scheduled: list[tuple[Sequence, int]]) -> np.ndarray | None:
        return None

    def start_step(self) -> None:
        pass

    def add_row(self, seq: Sequence, num_new: int, offset: int) -> bool:
        return False

    def fill(self, inputs: StepInputs, order: np.ndarray | slice, q_lens: np.ndarray) -> None:
        pass

    def on_sampling(self, seqs: list[Sequence], batch: SamplingBatch) -> None:
        pass

    def prepare(self, inputs: StepInputs, device: torch.device, put: Callable | None) -> bool:
        return True

    def forward_inputs(self) -> dict:
        return {}

    def release(self, seq: Sequence) -> None:
        pass

    def reset(self) -> None:
        pass


class PoolingRows(RowFeature):
    """Prefill-only rows (engine/pooling.py): their chunks go to the `Pooler`, never to the sampler."""

    def __init__(self) -> None:
        self.reset()
        self.start_step()

    def reset(self) -> None:
        self.pooler = Pooler()  # partial pools (mean sums, cls vectors) of prompts part-way through

    def release(self, seq: Sequence) -> None:
        self.pooler.forget(seq)

    def start_step(self) -> None:
        self.rows: list[PoolRow] = []  # (seq, its chunk's tokens, first flat row)

    def add_row(self, seq: Sequence, num_new: int, offset: int) -> bool:
        if seq.pooling is None:
            return False
        self.rows.append((seq, num_new, offset))
        return True

    def finish(self, hidden: torch.Tensor, rows: list[PoolRow], model: LlamaForCausalLM
               ) -> tuple[dict[int, torch.Tensor], list[int]]:
        """({seq_id: float32 result} of the rows whose prompt ends this step, the seq_ids of the rows whose chunk
        ends their sequence: each gets a dummy token (prompt end, or static padding)). hidden: [T, hidden_size]."""
        pooled = self.pooler.pool(hidden, rows, model) if rows else {}
        return pooled, [seq.seq_id for seq, num_new, _ in rows if seq.num_computed + num_new == seq.num_tokens]


class PromptLogprobRows(RowFeature):
    """Rows asking `prompt_logprobs` that still lack some: their chunk's prompt positions (`StepInputs.prompt_rows`),
    scored on every rank after the model (the logits are gathered across tensor-parallel ranks)."""

    def __init__(self) -> None:
        self.start_step()

    def start_step(self) -> None:
        self.seqs: list[Sequence] = []  # in `rows` order
        self.rows: list[tuple[int, list[int], int]] = []  # (first flat row, the prompt tokens it predicts, top k)

    def add_row(self, seq: Sequence, num_new: int, offset: int) -> bool:
        if seq.prompt_logprobs is not None and seq.prompt_logprobs_missing:  # (the cheap test first)
            for first_row, targets in _prompt_logprob_rows(seq, num_new, offset):
                self.seqs.append(seq)
                self.rows.append((first_row, targets, seq.params.prompt_logprobs))
        return False

    def fill(self, inputs: StepInputs, order: np.ndarray | slice, q_lens: np.ndarray) -> None:
        inputs.prompt_rows = self.rows

    @staticmethod
    def score(model: LlamaForCausalLM, hidden: torch.Tensor, rows: list[tuple[int, list[int], int]]) -> list[Logprobs]:
        """The Logprobs of each of `rows` (`StepInputs.prompt_rows`) from the step's hidden states [T, hidden_size]."""
        return [prompt_logprobs(model.compute_logits, hidden[first : first + len(targets)], targets, k,
                                model.spec.vocab_size) for first, targets, k in rows]


def _prompt_logprob_rows(seq: Sequence, num_new: int, first_row: int) -> list[tuple[int, list[int]]]:
    """[(flat row of the first position, the prompt tokens those positions predict)] for the prompt
    positions of this chunk whose log-probabilities `seq` still lacks, or [].

    NOTE: position q predicts prompt token q + 1; `seq.prompt_logprobs` holds positions 0..m-1, and
    m >= num_computed (no prefix-cache hits for such a sequence), so the positions are [m, end)."""
    start = len(seq.prompt_logprobs)
    end = min(seq.num_computed + num_new, seq.prompt_len - 1)
    if start >= end:
        return []
    return [(first_row + start - seq.num_computed, seq.prompt_ids[start + 1 : end + 1])]


class AdapterRows(RowFeature):
    """LoRA adapters per row: each row's adapter slot (the batch keeps an adapter's rows together, so its delta
    takes one slice) and each token's (`StepInputs.lora_slots`), set in the adapted layers before the model.
    `slots`: the job's `LoraSlots` (build.py), None without adapters."""

    def __init__(self) -> None:
        self.slots: LoraSlots | None = None
        self._row_slots: np.ndarray | None = None  # int32 [B] in plan order, this step's; None: no adapter rows

    def order_keys(self, scheduled: list[tuple[Sequence, int]]) -> np.ndarray | None:
        self._row_slots = None
        if self.slots is None:
            return None
        adapters = [seq.params.lora for seq, _ in scheduled]
        if all(name is None for name in adapters):
            return None
        self._row_slots = self.slots.row_slots(adapters)  # -1: the base model; the adapters made resident
        return self._row_slots

    def fill(self, inputs: StepInputs, order: np.ndarray | slice, q_lens: np.ndarray) -> None:
        if self._row_slots is not None:
            rows = self._row_slots[order]
            if len(rows) < len(q_lens):  # speculative verify rows, after the others: base-model rows (adapter rows
                rows = np.concatenate([rows, np.full(len(q_lens) - len(rows), -1, rows.dtype)])  # never draft)
            inputs.lora_slots = np.repeat(rows, q_lens)  # int32 [T]
            inputs.lora_resident = tuple(self.slots.resident)

    def prepare(self, inputs: StepInputs, device: torch.device, put: Callable | None) -> bool:
        if self.slots is not None:  # each token's adapter slot for the adapted layers (none: the base model)
            if inputs.lora_slots is None:
                self.slots.step.clear()
            else:
                self.slots.hold(inputs.lora_resident)  # (a worker rank: rank 0's slots; rank 0: as they are)
                self.slots.step.set(inputs.lora_slots, self.slots.num_slots, device, put)
        return inputs.lora_slots is None  # the decode graphs hold the base model only


class GrammarRows(RowFeature):
    """Structured output (engine/structured.py): the constrained sampling rows' bitmasks, filled in a worker
    thread while the model runs and applied before selection."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.token_masks = TokenMasks(vocab_size, device)

    def on_sampling(self, seqs: list[Sequence], batch: SamplingBatch) -> None:
        batch.grammar_masks = self.token_masks.start(seqs, batch.draft_offsets, batch.drafts)
