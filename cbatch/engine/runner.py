"""Turns a StepPlan into one model call: builds the flat batch, runs the model, samples (and computes the
log-probabilities rows ask for: of sampled tokens, and of prompt tokens chunk by chunk).

The runner holds the KV storage (kv_cache.py: the KV tensors, swaps and forks' copies, and a persistent
block-table row per running sequence), builds each step's inputs (input_builder.py) with the row features
(row_features.py: LoRA, prompt log-probabilities, pooling, grammars), runs the model and samples. It never
decides who runs: it frees a sequence's row only when a plan names it preempted or finished.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from cbatch.engine.cpu_memory import keep_freed_memory
from cbatch.engine.image_rows import ImageRows
from cbatch.engine.input_builder import build_step_inputs
from cbatch.engine.kv_cache import BlockTableBuffer, KVCache
from cbatch.engine.row_features import AdapterRows, GrammarRows, PoolingRows, PromptLogprobRows, RowFeature
from cbatch.engine.sampler import SamplingBatch
from cbatch.engine.sampler_choice import fused_covers, sample_batch
from cbatch.engine.sampling_inputs import SamplingInputs
from cbatch.engine.sequence import Sequence
from cbatch.engine.staging import HostStaging, host_values
from cbatch.engine.step import StepLogprobs, StepOutput, StepPlan
from cbatch.engine.step_inputs import StepInputs
from cbatch.model.backend import Backend
from cbatch.model.decoder import ForwardContext, LlamaForCausalLM

if TYPE_CHECKING:
    from cbatch.lora.runtime import LoraSlots


class ModelRunner:
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
        tower_tokens: int | None = None,
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
        if device.type == "cpu":
            keep_freed_memory()  # activations stay resident between steps (see cpu_memory.py)
        self.kv_cache = KVCache(spec, num_kv_blocks, block_size, device, dtype, kv_dtype or dtype, num_host_blocks)
        self._table_shape = (2 * max_num_seqs, -(-max_model_len // block_size))
        # per-row features, asked in this order (pooling first: a pooling chunk is no other feature's)
        self.pooling, self.prompt_logprobs, self.adapters = PoolingRows(), PromptLogprobRows(), AdapterRows()
        self.features: list[RowFeature] = [self.pooling, self.prompt_logprobs, self.adapters,
                                           GrammarRows(spec.vocab_size, device)]
        # a vision-language model's image rows; `tower_tokens`: the most image tokens one vision-tower call takes
        # (engine/tower_calls.py; None: a step's images in one call)
        self.images = ImageRows(model, tower_tokens) if spec.vision is not None else None
        if self.images is not None:
            self.features.append(self.images)
        self.reset()
        self.graphs = None  # DecodeGraphs once `capture_decode_graphs` ran (CUDA + Triton backend)

    @property
    def lora(self) -> LoraSlots | None:
        """The job's `cbatch.lora.runtime.LoraSlots` (set by build.py), None without adapters."""
        return self.adapters.slots

    @lora.setter
    def lora(self, slots: LoraSlots | None) -> None:
        self.adapters.slots = slots

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int) -> None:
        """Captures the decode graphs (on every tensor-parallel rank: the collectives are captured too)."""
        from cbatch.engine.cuda_graphs import DecodeGraphs

        if self.peers is not None:
            self.peers.send_capture(max_num_seqs, max_model_len)

        graphs = DecodeGraphs(self.model, self.backend, self.kv_cache.view, max_num_seqs, max_model_len, self.block_size,
                              self.device, sample_in_graph=self.fused_sampling, sample_splits=self.sampler_splits)
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
        for feature in self.features:
            feature.reset()

    def idle(self) -> None:
        pass  # nothing to compute (a step waiting for arrivals)

    def memory(self) -> dict[str, int]:
        """What this rank holds (under tensor parallelism every rank holds the same, but a vision tower is rank
        0's alone): for the report."""
        weights = sum(t.numel() * t.element_size() for t in self.model.parameters())
        packed = getattr(self.model, "packed_logits_weight", None)  # a tied embedding's oneDNN copy for the logits
        weights += sum(m.packed.numel() * m.packed.element_size() for m in self.model.modules()
                       if getattr(m, "packed", None) is not None)
        if packed is not None:
            weights += packed.numel() * packed.element_size()
        return {"tensor_parallel_size": self.model.comm.world, "weight_bytes_per_rank": weights,
                "kv_cache_bytes_per_rank": self.kv_cache.nbytes}

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
            if step.offsets is None:
                step.logprobs.sampled.update((seq.seq_id, lp) for seq, lp in zip(step.seqs, logprobs) if lp is not None)
            else:  # a verified row's positions, in order, as one Logprobs (the scheduler keeps those it accepts)
                for seq, lp, offset in zip(step.seqs, logprobs, step.offsets):
                    if lp is not None:
                        if offset:
                            step.logprobs.sampled[seq.seq_id].extend(lp)
                        else:
                            step.logprobs.sampled[seq.seq_id] = lp
            # the next step's placeholders read these on the device: each sequence's row in `sampled`
            self._last_sampled = sampled
            self._last_row = dict(zip([seq.seq_id for seq in step.seqs], range(len(step.seqs))))
        return PendingStep(step.seqs, *tokens_to_host(sampled), step.logprobs, self, step.pool_ends, step.pooled,
                           step.offsets)

    @torch.inference_mode()
    def forward(self, plan: StepPlan) -> "StepLogits":
        """Runs the model on the plan's tokens; the logits of the rows that sample (None if none does, or
        if a decode graph sampled already), and the prompt log-probabilities of this step's chunks for the
        sequences that ask. Under tensor parallelism the step's inputs go to the other ranks first (`peers`):
        they run the same model call on their shares of the weights."""
        self.release(plan)
        self.begin_step()
        inputs, sampling_seqs, prompt_seqs, pool_rows, offsets = self._build(plan)
        if self.peers is not None:
            self.peers.send_step(inputs if self.images is None else self.images.for_workers(inputs))
        sampling = self.sampling.build(sampling_seqs, offsets, plan.drafts) if sampling_seqs else None
        if sampling is not None:  # (structured output: the constrained rows' bitmasks, filled while the model runs)
            for feature in self.features:
                feature.on_sampling(sampling_seqs, sampling)
        hidden, logits, tokens, prompt = self.run_step(inputs, sampling)
        logprobs = StepLogprobs(prompt={seq.seq_id: lp for seq, lp in zip(prompt_seqs, prompt)})
        pooled, ends = self.pooling.finish(hidden, pool_rows, self.model)
        return StepLogits(sampling_seqs, logits, sampling, logprobs, tokens, ends, pooled, offsets)

    def release(self, plan: StepPlan) -> None:
        """Frees the rows of the sequences `plan` names preempted, or finished in the previous update; cuts the
        block-table rows of those whose rejected drafts' blocks went back."""
        for seq, num_blocks in plan.trimmed:
            self.block_tables.truncate(seq, num_blocks)
        for seq in plan.preempted + plan.finished:
            self.block_tables.release(seq)
            self.sampling.release(seq)
            for feature in self.features:
                feature.release(seq)

    def _build(self, plan: StepPlan) -> tuple[StepInputs, list[Sequence], list[Sequence], list, list[int] | None]:
        """(the step's inputs as host arrays, the sequences that sample in logits-row order, the sequences whose
        prompt log-probabilities this step computes, in `prompt_rows` order, the pooling rows, each sampling
        row's drafted tokens before its position (None: no drafts))."""
        inputs, sampling_seqs, offsets = build_step_inputs(plan, self.block_tables, self.block_size,
                                                           self.backend.groups_decodes, self._last_row, self.features)
        return inputs, sampling_seqs, self.prompt_logprobs.seqs, self.pooling.rows, offsets

    def begin_step(self) -> None:
        """Starts a step's host -> device copies (before any of its inputs or sampling settings is made): on a
        GPU they go to the other pinned arena (`HostStaging`); every rank calls it once per step."""
        if self.staging is not None:
            self.staging.next_step()

    @torch.inference_mode()
    def run_step(self, inputs: StepInputs, sampling: SamplingBatch | None = None):
        """The step on this rank's model: block copies and swaps, the forward, the sampling rows' logits (or a
        decode graph's tokens), the prompt log-probabilities asked for. What every tensor-parallel rank runs
        (the others with `sampling` None). Returns (hidden, logits, tokens, [prompt Logprobs per prompt row])."""
        if inputs.copies:  # NOTE: first: a forked sample's copy of its parent's partial block, before any write
            self.kv_cache.copy_blocks(inputs.copies)
        if inputs.swap_out or inputs.swap_in:  # NOTE: after _build (nothing there may overwrite a swap_in), before the model
            self.kv_cache.swap(inputs.swap_out, inputs.swap_in)
        batch = inputs.to_device(self.device, self.block_size, self._last_sampled, self.staging)
        start = time.perf_counter()
        tokens = logits = None
        num_tokens, num_sampling = len(inputs.token_ids), len(inputs.logits_rows)
        put = None if self.staging is None else self.staging.to_device
        graphable = [feature.prepare(inputs, self.device, put) for feature in self.features]  # (every one asked)
        # a decode graph needs every row to sample once, in batch order (no sample forks off a 1-token chunk)
        if (self.graphs is not None and num_sampling == num_tokens and all(graphable)
                and self.graphs.can_run(batch.meta, num_tokens)):
            hidden, tokens = self.graphs.run(batch.input_ids, batch.positions, batch.meta, sampling)
            if not (self.fused_sampling and fused_covers(sampling)):
                tokens = None
                logits = self.model.compute_logits(hidden)  # [T, vocab] float32 for the torch sampler
        else:
            self.backend.prepare(batch.meta)
            extra = {key: value for feature in self.features for key, value in feature.forward_inputs().items()}
            ctx = ForwardContext(self.kv_cache.view, batch.meta, **extra)
            hidden = self.model(batch.input_ids, batch.positions, ctx)  # [T, hidden]
            if num_sampling:
                logits = self.model.compute_logits(hidden[batch.logits_indices])  # [N, vocab] float32
        prompt = self.prompt_logprobs.score(self.model, hidden, inputs.prompt_rows)
        self.forward_seconds += time.perf_counter() - start
        return hidden, logits, tokens, prompt


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
    offsets: list[int] | None = None  # per row of `tokens`: the drafted tokens before its position (None: no drafts)

    def result(self) -> StepOutput:
        """Waits for the step (and no later one); its tokens by sequence id (and the log-probabilities asked for)."""
        tokens, verified = {}, None
        if self.seqs:
            start = time.perf_counter()
            if self.ready is not None:
                self.ready.synchronize()
            if self.offsets is None:
                tokens = dict(zip([seq.seq_id for seq in self.seqs], self.tokens.tolist()))
            else:
                tokens, verified = _verified_tokens(self.seqs, self.tokens.tolist(), self.offsets)
            self.runner.forward_seconds += time.perf_counter() - start
        has_logprobs = self.logprobs.sampled or self.logprobs.prompt
        if self.pool_ends:
            tokens.update(dict.fromkeys(self.pool_ends, 0))
        # NOTE: read back here, not at launch: asynchronous scheduling builds the next step in between
        pooled = {seq_id: v.to("cpu") for seq_id, v in self.pooled.items()} if self.pooled else None
        return StepOutput(tokens, self.logprobs if has_logprobs else None, pooled, verified)


def _verified_tokens(seqs: list[Sequence], values: list[int], offsets: list[int]
                     ) -> tuple[dict[int, int], dict[int, list[int]]]:
    """(seq_id -> the token at each row's first position, seq_id -> every position's token, for the rows that
    verified drafts: those with a row at offset > 0)."""
    tokens: dict[int, int] = {}
    positions: dict[int, list[int]] = {}
    for seq, token, offset in zip(seqs, values, offsets):
        if offset == 0:
            tokens[seq.seq_id] = token
            positions[seq.seq_id] = [token]
        else:
            positions[seq.seq_id].append(token)
    return tokens, {seq_id: toks for seq_id, toks in positions.items() if len(toks) > 1}


@dataclass(slots=True)
class StepLogits:
    seqs: list[Sequence]  # the rows that sample, in the order of `logits`
    logits: torch.Tensor | None  # float32 [N, vocab]; None when no row samples or a decode graph sampled `tokens`
    sampling: SamplingBatch | None  # None when no row samples
    logprobs: StepLogprobs  # this step's prompt log-probabilities (`execute` adds the sampled tokens')
    tokens: torch.Tensor | None = None  # int64 [N] when already sampled (inside a decode graph)
    pool_ends: list[int] = field(default_factory=list)  # prefill-only rows ending this step
    pooled: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> float32 result
    offsets: list[int] | None = None  # per row of `seqs`: drafted tokens before its position (None: no drafts)
