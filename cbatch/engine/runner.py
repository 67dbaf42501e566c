"""Turns a StepPlan into one model call: builds the flat batch, runs the model, samples (and computes the
log-probabilities rows ask for: of sampled tokens, and of prompt tokens chunk by chunk).

The runner owns the KV tensors and a persistent block-table buffer: each running sequence has a
row in it, and a step only writes the blocks that were added since the last step (no rebuilding
of whole tables in Python). It never decides who runs: it frees a sequence's row only when a plan
names it preempted or finished.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from cbatch.model.backend import AttentionMetadata, Backend, kv_cache_shape
from cbatch.engine.cpu_memory import keep_freed_memory, lazily_zeroed
from cbatch.engine.sampler_choice import fused_covers, sample_batch
from cbatch.engine.logprobs import prompt_logprobs
from cbatch.engine.pooler import Pooler
from cbatch.engine.sampler import SamplingBatch
from cbatch.engine.sampling_inputs import SamplingInputs
from cbatch.engine.step import StepLogprobs, StepOutput, StepPlan
from cbatch.engine.staging import HostStaging, host_values
from cbatch.engine.structured import TokenMasks
from cbatch.engine.sequence import PLACEHOLDER, Sequence
from cbatch.model.decoder import ForwardContext, KVCacheView, LlamaForCausalLM


class BlockTableBuffer:
    """Rows of block ids, one row per running sequence, kept up to date incrementally."""

    def __init__(self, num_rows: int, max_blocks_per_seq: int) -> None:
        self.table = np.zeros((num_rows, max_blocks_per_seq), dtype=np.int32)
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._row_of: dict[int, int] = {}  # seq_id -> row
        self._written = [0] * num_rows  # row -> blocks already copied into it

    def sync(self, seqs: list[Sequence]) -> np.ndarray:
        """Copies the sequences' new blocks into their rows (taking a row, in order, for each one seen for the
        first time); returns their rows, int64 [len(seqs)]. Only rows whose sequence gained blocks are written."""
        row_of, written = self._row_of, self._written
        rows = [row_of.get(s.seq_id) for s in seqs]
        if None in rows:
            rows = [self._take(s.seq_id) if r is None else r for s, r in zip(seqs, rows)]
        for seq, row in [(s, r) for s, r in zip(seqs, rows) if len(s.block_ids) > written[r]]:
            blocks = seq.block_ids
            self.table[row, written[row] : len(blocks)] = blocks[written[row]:]
            written[row] = len(blocks)
        return np.array(rows, dtype=np.int64)

    def _take(self, seq_id: int) -> int:
        row = self._row_of[seq_id] = self._free_rows.pop()
        self._written[row] = 0
        return row

    def release(self, seq: Sequence) -> None:
        """Frees `seq`'s row (it finished or was preempted: its blocks are gone)."""
        row = self._row_of.pop(seq.seq_id, None)
        if row is not None:
            self._free_rows.append(row)


class ModelRunner:
    _block_dim = 2  # the block dimension of `kv_cache`: [layers, K|V, *kv_cache_shape(...)]

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_kv_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        job_seed: int = 0,
        num_host_blocks: int = 0,
        kv_dtype: torch.dtype | None = None,
        split_sampler: bool = True,
    ) -> None:
        spec = model.spec
        self.model = model
        self.device = device
        self.block_size = block_size
        self.job_seed = job_seed
        self.backend: Backend = model.backend
        # the GPU path samples with the one-pass kernel where it covers the batch (cbatch/engine/sampler_choice.py)
        # (not under tensor parallelism: there the logits are gathered from the ranks outside the graph)
        self.fused_sampling = self.backend.fused_sampling and model.comm.world == 1
        # the kernel's programs per row: None = enough to fill the GPU (EngineConfig.split_sampler), 1 = no split
        self.sampler_splits: int | None = None if split_sampler else 1
        self.peers = None  # tensor parallelism: the other ranks (cbatch.engine.tensor_parallel.Peers), sent every step
        self.staging = HostStaging(device) if device.type == "cuda" else None  # pinned, non-blocking input copies
        # One allocation for every layer's K and V
        kv_dtype = kv_dtype or dtype
        shape = (spec.num_layers, 2, *kv_cache_shape(num_kv_blocks, block_size, spec.num_kv_heads, spec.head_dim))
        # NOTE: attention reads whole blocks, padding included (masked), so every block a table can name
        # must hold finite values: the pool starts zeroed. On CPU its pages become resident only when
        # written, so memory tracks the KV actually used, not the budget.
        if device.type == "cpu":
            keep_freed_memory()  # activations stay resident between steps (see cpu_memory.py)
            self.kv_cache = lazily_zeroed(shape, kv_dtype)
        else:
            self.kv_cache = torch.zeros(shape, device=device, dtype=kv_dtype)
        # fp8: one scale per (layer, K|V, kv head); 1.0 = the values as they are (saturated at +-448)
        scales = None
        if kv_dtype != dtype:
            scales = torch.ones(spec.num_layers, 2, spec.num_kv_heads, dtype=torch.float32, device=device)
        self.kv_view = KVCacheView([self.kv_cache[i, 0] for i in range(spec.num_layers)],
                                   [self.kv_cache[i, 1] for i in range(spec.num_layers)], scales)
        self._table_shape = (2 * max_num_seqs, -(-max_model_len // block_size))
        self.reset()
        self.graphs = None  # DecodeGraphs once `capture_decode_graphs` ran (CUDA + Triton backend)
        self.num_host_blocks = num_host_blocks  # swap space in blocks; allocated at the first swap
        self.token_masks = TokenMasks(spec.vocab_size, device)  # structured output
        self._host_kv: torch.Tensor | None = None
        self.lora = None  # cbatch.lora.runtime.LoraSlots when the job has LoRA adapters (build.py)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Captures the decode graphs (on every tensor-parallel rank: the collectives are captured too)."""
        from cbatch.engine.cuda_graphs import DecodeGraphs

        if self.peers is not None:
            self.peers.send_capture(max_num_seqs, max_model_len)

        graphs = DecodeGraphs(self.model, self.backend, self.kv_view, max_num_seqs, max_model_len, self.block_size, self.device,
                              sample_in_graph=self.fused_sampling, sample_splits=self.sampler_splits)
        graphs.capture_all()
        self.graphs = graphs

    def reset(self) -> None:
        """Forgets every sequence (a new scheduler starts over); the KV tensors are kept."""
        # rows for 2 x max_num_seqs: static batching keeps finished members in the batch until their group
        # ends, and a finished sequence's row is freed by the next plan
        self.block_tables = BlockTableBuffer(*self._table_shape)
        self.sampling = SamplingInputs(self.model.spec.vocab_size, self.device, self.job_seed,
                                       host_values(self.device, self.staging))
        self.forward_seconds = 0.0  # time inside the model call, for the report
        self._last_sampled: torch.Tensor | None = None  # int64 [N] on the device: the last launched step's tokens
        self._last_row: dict[int, int] = {}  # seq_id -> its row in `_last_sampled`
        self.pooler = Pooler()  # prefill-only requests' partial pools (mean sums, cls vectors)

    def idle(self) -> None:
        pass  # nothing to compute (a step waiting for arrivals)

    def memory(self) -> dict[str, int]:
        """What this rank holds (every rank holds the same, under tensor parallelism): for the report."""
        weights = sum(t.numel() * t.element_size() for t in self.model.parameters())
        packed = getattr(self.model, "packed_logits_weight", None)  # a tied embedding's oneDNN copy for the logits
        weights += sum(m.packed.numel() * m.packed.element_size() for m in self.model.modules()
                       if getattr(m, "packed", None) is not None)
        if packed is not None:
            weights += packed.numel() * packed.element_size()
        return {"tensor_parallel_size": self.model.comm.world, "weight_bytes_per_rank": weights,
                "kv_cache_bytes_per_rank": self.kv_cache.numel() * self.kv_cache.element_size()}

    def close(self) -> None:
        """Stops the tensor-parallel workers, if any (the KV tensors go with the runner)."""
        if self.peers is not None:
            self.peers.close()
            self.peers = None

    def execute(self, plan: StepPlan) -> StepOutput:
        """Runs one step; returns the sampled token of every sequence whose chunk reached its end (and of
        the samples such a sequence forks), with the log-probabilities asked for."""
        return self.launch(plan).result()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> "PendingStep":
        """Starts one step: the model call and the sampling are queued on the device; `result()` waits for the
        tokens. Asynchronous scheduling schedules the next step in between (a CPU runs it all here)."""
        try:
            step = self.forward(plan)
        except Exception as exc:  # under tensor parallelism: a dead worker is named, not reported as a bug
            if self.peers is None:
                raise
            raise self.peers.failure(exc) from None
        sampled, logprobs = None, []
        if step.seqs:
            start = time.perf_counter()
            if step.tokens is not None:  # sampled inside a decode graph: the graph's sampler covered the batch
                # NOTE: a copy: the graph's output buffer is rewritten by the next replay, which asynchronous
                # scheduling launches before this step's tokens are read (a device copy, queued like a kernel)
                sampled, logprobs = step.tokens.clone(), [None] * len(step.seqs)
            else:
                sampled, logprobs = sample_batch(step.logits, step.sampling, self.fused_sampling,
                                                 num_splits=self.sampler_splits)
            self.forward_seconds += time.perf_counter() - start
            step.logprobs.sampled.update((seq.seq_id, lp) for seq, lp in zip(step.seqs, logprobs) if lp is not None)
            # the next step's placeholders read these on the device: each sequence's row in `sampled`
            self._last_sampled = sampled
            self._last_row = dict(zip([seq.seq_id for seq in step.seqs], range(len(step.seqs))))
        return PendingStep(step.seqs, *tokens_to_host(sampled), step.logprobs, self, step.pool_ends, step.pooled)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> "StepLogits":
        """Runs the model on the plan's tokens; the logits of the rows that sample (None if none does, or
        if a decode graph sampled already), and the prompt log-probabilities of this step's chunks for the
        sequences that ask. Under tensor parallelism the step's inputs go to the other ranks first (`peers`):
        they run the same model call on their shares of the weights."""
        for seq in plan.preempted + plan.finished:
            self.block_tables.release(seq)
            self.sampling.release(seq)
            self.pooler.forget(seq)
        self.begin_step()
        inputs, sampling_seqs, prompt_seqs, pool_rows = self._build(plan)
        if self.peers is not None:
            self.peers.send_step(inputs)
        sampling = self.sampling.build(sampling_seqs) if sampling_seqs else None
        if sampling is not None:  # structured output: the constrained rows' bitmasks, filled while the model runs
            sampling.grammar_masks = self.token_masks.start(sampling_seqs)
        hidden, logits, tokens, prompt = self.run_step(inputs, sampling)
        logprobs = StepLogprobs(prompt={seq.seq_id: lp for seq, lp in zip(prompt_seqs, prompt)})
        pooled = self.pooler.pool(hidden, pool_rows, self.model.classify) if pool_rows else {}
        # every pooling row whose chunk ends its sequence gets a dummy token (prompt end, or static padding)
        ends = [seq.seq_id for seq, num_new, _ in pool_rows if seq.num_computed + num_new == seq.num_tokens]
        return StepLogits(sampling_seqs, logits, sampling, logprobs, tokens, ends, pooled)

    def begin_step(self) -> None:
        """Starts a step's host -> device copies (before any of its inputs or sampling settings is made): on a
        GPU they go to the other pinned arena (`HostStaging`); every rank calls it once per step."""
        if self.staging is not None:
            self.staging.next_step()

    @torch.inference_mode()
    def run_step(self, inputs: "StepInputs", sampling: SamplingBatch | None = None):
        """The step on this rank's model: block copies and swaps, the forward, the sampling rows' logits (or a
        decode graph's tokens), the prompt log-probabilities asked for. What every tensor-parallel rank runs
        (the others with `sampling` None). Returns (hidden, logits, tokens, [prompt Logprobs per prompt row])."""
        if inputs.copies:  # NOTE: first: a forked sample's copy of its parent's partial block, before any write
            self.copy_blocks(inputs.copies)
        if inputs.swap_out or inputs.swap_in:  # NOTE: after _build (nothing there may overwrite a swap_in), before the model
            self.swap(inputs.swap_out, inputs.swap_in)
        batch = inputs.to_device(self.device, self.block_size, self._last_sampled, self.staging)
        start = time.perf_counter()
        tokens = logits = None
        num_tokens, num_sampling = len(inputs.token_ids), len(inputs.logits_rows)
        # a decode graph needs every row to sample once, in batch order (no sample forks off a 1-token chunk)
        if self.lora is not None:  # each token's adapter slot for the adapted layers (none: the base model)
            if inputs.lora_slots is None:
                self.lora.step.clear()
            else:
                self.lora.step.set(inputs.lora_slots, self.lora.num_slots, self.device,
                                   None if self.staging is None else self.staging.to_device)
        # the decode graphs hold the base model only: steps with adapter rows run eagerly
        if (self.graphs is not None and num_sampling == num_tokens and inputs.lora_slots is None
                and self.graphs.can_run(batch.meta, num_tokens)):
            hidden, tokens = self.graphs.run(batch.input_ids, batch.positions, batch.meta, sampling)
            if not (self.fused_sampling and fused_covers(sampling)):
                tokens = None
                logits = self.model.compute_logits(hidden)  # [T, vocab] float32 for the torch sampler
        else:
            self.backend.prepare(batch.meta)
            hidden = self.model(batch.input_ids, batch.positions, ForwardContext(self.kv_view, batch.meta))  # [T, hidden]
            if num_sampling:
                logits = self.model.compute_logits(hidden[batch.logits_indices])  # [N, vocab] float32
        prompt = [prompt_logprobs(self.model.compute_logits, hidden[first : first + len(targets)], targets, k,
                                  self.model.spec.vocab_size) for first, targets, k in inputs.prompt_rows]
        self.forward_seconds += time.perf_counter() - start
        return hidden, logits, tokens, prompt

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copies whole KV blocks (every layer, K and V): (source, destination) pairs; byte copies, as swaps."""
        cache = self.kv_cache.view(torch.uint8)  # index ops do not take every dtype (fp8)
        src, dst = (torch.tensor(ids, dtype=torch.int64, device=self.device) for ids in zip(*copies))
        cache.index_copy_(self._block_dim, dst, cache.index_select(self._block_dim, src))

    @torch.inference_mode()
    def swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Copies preempted sequences' KV blocks to host slots (`swap_out`: (device, host) pairs), then
        swapped-back sequences' slots into their new device blocks (`swap_in`: (host, device) pairs).

        The host buffer has the cache's layout with `num_host_blocks` along the block dimension (pinned
        when the cache is on a GPU); it is a separate buffer even on CPU. NOTE: out before in: a block
        swapped out this step may be the target of a swap_in or of this step's new tokens.
        """
        dim = self._block_dim
        cache = self.kv_cache.view(torch.uint8)  # byte copies: index ops do not take every dtype (fp8)
        if self._host_kv is None:
            shape = list(cache.shape)
            shape[dim] = self.num_host_blocks
            self._host_kv = torch.empty(shape, dtype=torch.uint8, pin_memory=self.device.type == "cuda")
        if swap_out:
            dev, host = (torch.tensor(ids, dtype=torch.int64) for ids in zip(*swap_out))
            self._host_kv.index_copy_(dim, host, cache.index_select(dim, dev.to(self.device)).cpu())
        if swap_in:
            host, dev = (torch.tensor(ids, dtype=torch.int64) for ids in zip(*swap_in))
            blocks = self._host_kv.index_select(dim, host).to(self.device, non_blocking=True)
            cache.index_copy_(dim, dev.to(self.device), blocks)

    def _build(self, plan: StepPlan) -> tuple["StepInputs", list[Sequence], list[Sequence], list]:
        """(the step's inputs as host arrays, the sequences that sample in logits-row order, the sequences
        whose prompt log-probabilities this step computes, in `prompt_rows` order, the pooling rows)."""
        row_slots = self._row_slots(plan.scheduled)  # LoRA: each row's adapter slot (plan order), or None
        ordered, starts, q_lens, order = _batch_order(plan.scheduled, self.backend.groups_decodes, row_slots)
        n = len(ordered)
        seqs = [seq for seq, _ in ordered]
        rows = self.block_tables.sync(seqs)
        cu_q = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q_lens, out=cu_q[1:])
        # The flat batch's Python side: quiet decodes in runs (slices), the other rows one by one, in batch order.
        flat = _FlatRows(self._last_row)
        offsets = cu_q.tolist()
        start = 0
        fed = quiet_decode_tokens(ordered)
        for i in ([i for i, token in enumerate(fed) if token is None] if None in fed else []) + [n]:
            if i > start:
                flat.add_decodes(seqs[start:i], fed[start:i], offsets[start])
            if i < n:
                flat.add_row(seqs[i], ordered[i][1], offsets[i])
            start = i + 1
        num_tokens = offsets[-1]
        if num_tokens == n and int(q_lens.min()) == 1:  # one token per row (decodes)
            token_seq, positions = np.arange(n), starts.copy()
        else:
            token_seq = np.repeat(np.arange(n), q_lens)  # [T] batch index of each token
            positions = starts[token_seq] + (np.arange(num_tokens) - cu_q[:-1][token_seq])
        seq_lens = starts + q_lens
        num_cols = -(-int(seq_lens.max()) // self.block_size)
        table = self.block_tables.table[rows, :num_cols]  # [B, num_cols]
        slots = table[token_seq, positions // self.block_size].astype(np.int64) * self.block_size + positions % self.block_size
        inputs = StepInputs(flat.token_ids, positions, cu_q, seq_lens, np.ascontiguousarray(table), slots,
                            flat.logits_rows, flat.prompt_rows, plan.copies, plan.swap_out, plan.swap_in,
                            flat.placeholder_rows, flat.placeholder_sources,
                            None if row_slots is None else np.repeat(row_slots[order], q_lens))
        return inputs, flat.sampling_seqs, flat.prompt_seqs, flat.pool_rows

    def _row_slots(self, scheduled: list[tuple[Sequence, int]]) -> np.ndarray | None:
        """int32 [B]: each scheduled row's LoRA adapter slot (-1: the base model), or None when no row has one."""
        if self.lora is None:
            return None
        adapters = [seq.params.lora for seq, _ in scheduled]
        if all(name is None for name in adapters):
            return None
        return self.lora.row_slots(adapters)


@dataclass(slots=True)
class _FlatRows:
    """The Python lists of a step's flat batch, filled row by row (or run by run) in batch order."""

    last_row: dict[int, int]  # seq_id -> its row in the previous step's sampled tokens (placeholders)
    token_ids: list[int] = field(default_factory=list)
    sampling_seqs: list[Sequence] = field(default_factory=list)  # in logits-row order
    logits_rows: list[int] = field(default_factory=list)  # the flat rows whose hidden states sample
    prompt_seqs: list[Sequence] = field(default_factory=list)
    prompt_rows: list[tuple[int, list[int], int]] = field(default_factory=list)
    # asynchronous scheduling: the flat rows whose token the step in flight samples, and each one's row in its tokens
    placeholder_rows: list[int] = field(default_factory=list)
    placeholder_sources: list[int] = field(default_factory=list)
    pool_rows: list[tuple[Sequence, int, int]] = field(default_factory=list)  # prefill-only: (seq, chunk, first row)

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
        if seq.pooling is not None:  # prefill-only: its chunk goes to the pooler, never to the sampler
            self.pool_rows.append((seq, num_new, offset))
            return
        if seq.prompt_logprobs is not None and seq.prompt_logprobs_missing:  # (the cheap test first)
            for first_row, targets in _prompt_logprob_rows(seq, num_new, offset):
                self.prompt_seqs.append(seq)
                self.prompt_rows.append((first_row, targets, seq.params.prompt_logprobs))
        if seq.num_computed + num_new == seq.num_tokens:  # this chunk reaches the end: sample
            # the samples it forks draw their first token from the same logits row
            samples = seq.samples if seq.pending_children else [seq]
            self.sampling_seqs.extend(samples)
            self.logits_rows.extend([offset + num_new - 1] * len(samples))

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
    A quiet decode: one token, the sequence's last (it samples), no samples to fork, no prompt log-probabilities.
    (One pass of inlined tests: it runs over every row.)"""
    return [(s.output_ids or s.prompt_ids)[-1]
            if n == 1 and s.num_computed + 1 == s.prompt_len + len(s.output_ids)
            and not (s.children and not s.forked) and s.prompt_logprobs is None and s.pooling is None else None
            for s, n in rows]


@dataclass(slots=True)
class StepInputs:
    """One step's model inputs as host arrays: what the runner builds from a plan, and all a tensor-parallel
    rank needs to run the same step (small: sent to the other ranks every step)."""

    token_ids: list[int]  # [T]
    positions: np.ndarray  # int64 [T]
    query_start_loc: np.ndarray  # int64 [B + 1]
    seq_lens: np.ndarray  # int64 [B]
    block_table: np.ndarray  # int32 [B, num_cols]
    slot_mapping: np.ndarray  # int64 [T]
    logits_rows: list[int]  # [N]: the flat rows whose hidden states sample
    prompt_rows: list[tuple[int, list[int], int]]  # (first flat row, the prompt tokens its positions predict, top k)
    copies: list[tuple[int, int]]  # KV block copies (source, destination), before anything else
    swap_out: list[tuple[int, int]]  # (device block, host slot)
    swap_in: list[tuple[int, int]]  # (host slot, device block)
    placeholder_rows: list[int] = field(default_factory=list)  # flat rows whose token the last step samples
    placeholder_sources: list[int] = field(default_factory=list)  # and each one's row in that step's tokens
    lora_slots: np.ndarray | None = None  # int32 [T]: each token's LoRA adapter slot (-1: base); None: no adapter rows

    def to_device(self, dev: torch.device, block_size: int, last_sampled: torch.Tensor | None = None,
                  staging: HostStaging | None = None) -> "_Batch":
        """The step's tensors on `dev` (on a GPU through `staging`'s pinned buffers, copies that do not wait for
        the step in flight); placeholder tokens (asynchronous scheduling) taken from `last_sampled`, the tokens
        the previous step sampled, without a round trip through the host."""
        put = torch.from_numpy if staging is None else staging.to_device
        q_lens = np.diff(self.query_start_loc)
        meta = AttentionMetadata(
            query_start_loc=put(self.query_start_loc.astype(np.int32)),
            seq_lens=put(self.seq_lens.astype(np.int32)),
            block_table=put(self.block_table),
            slot_mapping=put(self.slot_mapping),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(self.seq_lens.max()),
            query_lens_host=q_lens.tolist(),
            seq_lens_host=self.seq_lens.tolist(),
            block_size=block_size,
        )
        input_ids = put(np.array(self.token_ids, dtype=np.int64))
        if self.placeholder_rows:
            rows, sources = (put(np.array(x, dtype=np.int64)) for x in (self.placeholder_rows, self.placeholder_sources))
            input_ids[rows] = last_sampled[sources]
        return _Batch(
            input_ids=input_ids,
            positions=put(self.positions),
            meta=meta,
            logits_indices=put(np.array(self.logits_rows, dtype=np.int64)),
        )


def tokens_to_host(sampled: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.cuda.Event | None]:
    """Queues the copy of a step's tokens to the host right behind the step, and an event that marks it done.

    NOTE: never read them with a plain `.tolist()` later: by then asynchronous scheduling has launched the next
    step on the same stream, and a blocking device -> host copy waits for that step too, so the GPU would idle
    while the host schedules the one after it (seen on an H200: ~25% of every decode step). The event waits
    for this step alone. Returns (host tensor, event); on a CPU (no event) the tokens themselves."""
    if sampled is None or sampled.device.type != "cuda":
        return sampled, None
    host = sampled.to("cpu", non_blocking=True)  # into pinned memory (torch pins non-blocking D2H targets)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


@dataclass(slots=True)
class PendingStep:
    """A launched step: its tokens are on their way to the host until `result()`."""

    seqs: list[Sequence]  # the rows that sample, in the order of `tokens`
    tokens: torch.Tensor | None  # int64 [N] on the host once `ready` completes; None when no row samples
    ready: torch.cuda.Event | None  # recorded behind the copy (None: on a CPU, nothing to wait for)
    logprobs: StepLogprobs
    runner: ModelRunner  # the wait for the device counts as its model time
    pool_ends: list[int] = field(default_factory=list)  # prefill-only rows ending this step: a dummy token each
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)  # their results (engine/pooling.py)

    def result(self) -> StepOutput:
        """Waits for the step (and no later one); its tokens by sequence id (and the log-probabilities asked for)."""
        tokens = {}
        if self.seqs:
            start = time.perf_counter()
            if self.ready is not None:
                self.ready.synchronize()
            tokens = dict(zip([seq.seq_id for seq in self.seqs], self.tokens.tolist()))
            self.runner.forward_seconds += time.perf_counter() - start
        has_logprobs = self.logprobs.sampled or self.logprobs.prompt
        if self.pool_ends:
            tokens.update(dict.fromkeys(self.pool_ends, 0))
        # NOTE: read back here, not at launch: asynchronous scheduling builds the next step in between
        pooled = {seq_id: v.to("cpu") for seq_id, v in self.pooled.items()} if self.pooled else None
        return StepOutput(tokens, self.logprobs if has_logprobs else None, pooled)


@dataclass(slots=True)
class StepLogits:
    seqs: list[Sequence]  # the rows that sample, in the order of `logits`
    logits: torch.Tensor | None  # float32 [N, vocab]; None when no row samples or a decode graph sampled `tokens`
    sampling: SamplingBatch | None  # None when no row samples
    logprobs: StepLogprobs  # this step's prompt log-probabilities (`execute` adds the sampled tokens')
    tokens: torch.Tensor | None = None  # int64 [N] when already sampled (inside a decode graph)
    pool_ends: list[int] = field(default_factory=list)  # prefill-only rows ending this step
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> float32 result


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


def _batch_order(scheduled: list[tuple[Sequence, int]], by_context: bool, adapters: np.ndarray | None = None
                 ) -> tuple[list[tuple[Sequence, int]], np.ndarray, np.ndarray, np.ndarray | slice]:
    """The plan's rows in batch order, with their computed counts and chunk lengths (int64 arrays in that order)
    and the order (plan indices, or a whole slice): decodes first (`by_context`: shortest context first), then
    prefill chunks, each in plan order (a stable sort). TorchBackend attends neighbouring decode rows together
    (`groups_decodes`), so similar lengths pad less, and its groups become slices of the batch. Otherwise the
    order is free: sampled tokens go back by sequence id, and rows of one LoRA adapter (`adapters`: each row's
    slot) are put together, so each adapter's delta takes one slice of the batch. (A decode-only step in plan
    order is the plan itself: no sort.)"""
    n = len(scheduled)
    computed = np.fromiter([seq.num_computed for seq, _ in scheduled], np.int64, n)
    q_lens = np.fromiter([num_new for _, num_new in scheduled], np.int64, n)
    decode = q_lens == 1
    if by_context:
        key = np.where(decode, computed, np.iinfo(np.int64).max)
    elif adapters is not None:
        key = (~decode) * (int(adapters.max()) + 2) + adapters
    elif decode.all():
        return scheduled, computed, q_lens, slice(None)
    else:
        key = ~decode
    order = np.argsort(key, kind="stable")
    return [scheduled[i] for i in order.tolist()], computed[order], q_lens[order], order


class _Batch:
    __slots__ = ("input_ids", "positions", "meta", "logits_indices")

    def __init__(self, input_ids, positions, meta, logits_indices) -> None:
        self.input_ids = input_ids  # int64 [T]
        self.positions = positions  # int64 [T]
        self.meta = meta
        self.logits_indices = logits_indices  # int64 [N]: rows of the hidden states that sample
