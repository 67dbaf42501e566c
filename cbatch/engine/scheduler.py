"""Iteration-level scheduler: decides, every step, which sequences run and how many tokens each gets.

One token budget (vLLM v1's rule): a sequence has `num_computed` of `num_tokens` tokens in the KV cache; each
step gives it tokens so that computed catches up. Decode (1 token), chunked prefill (k tokens), recompute after
preemption and prefix-cache hits all fall out of that rule.

Order inside a step: running decodes first (never starved), then chunked prefills, then admission of waiting
requests while budget, slots and KV blocks last. When blocks run out, the least important running sequence
(lowest priority class, newest admitted among equals) is preempted, by recompute (its blocks freed) or swap
(copied to host memory first), and requeued ahead of never-started work of its class; no admission that step.

The policies are objects (policy.py): admission order, priority classes with aging, preemption mode;
the admission variants too (batching.py): static groups, and `reserve` admission (a request starts only
when its whole prompt + max_tokens fits). Blocks are the KV manager's (kv_manager.py), the finish rules
finish.py's, the step's messages step.py's.

The scheduler never touches tensors: swaps are (device block, host block) pairs in the StepPlan, which the
runner copies before the model call. One direction per step: `schedule()` -> StepPlan -> the runner computes it -> `update(plan, sampled)`
applies the sampled tokens, decides who finished (EOS, stop strings, max_tokens, context) and returns
them. Every change to a sequence's state happens here; the runner frees its per-sequence rows only as
a plan says (`preempted`, and `finished`: the sequences that left in the previous update).
"""
from __future__ import annotations

import heapq
from typing import Mapping

from cbatch.config import SamplingParams, distinct_params
from cbatch.engine.batching import OptimisticAdmission
from cbatch.engine.encoder_budget import EncoderBudget
from cbatch.engine.finish import at_length_limit, finish_reason
from cbatch.engine.images import whole_images
from cbatch.engine.kv_blocks import BlockPool
from cbatch.engine.kv_manager import KVManager, Start
from cbatch.engine.policy import AdmissionPolicy, PreemptionPolicy, PriorityOrder
from cbatch.engine.quiet_rows import quiet_decodes, quiet_samples, split_quiet
from cbatch.engine.sequence import PLACEHOLDER, FinishReason, Sequence, SequenceStatus
from cbatch.engine.speculative import Speculator
from cbatch.engine.stats import SchedulerStats
from cbatch.engine.step import StepInfo, StepLogprobs, StepPlan


class Scheduler:
    def __init__(
        self,
        policy: AdmissionPolicy,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        *,
        priority: PriorityOrder = PriorityOrder(),
        preemption: PreemptionPolicy = PreemptionPolicy(),
        admission: OptimisticAdmission = OptimisticAdmission(),
        num_host_blocks: int = 0,
        speculator: Speculator | None = None,
        max_image_tokens_per_step: int | None = None,
    ) -> None:
        self.policy, self._order = policy, policy.new_key()  # the admission order's key (it may remember groups)
        self.batching = policy.batching()  # continuous, or static groups
        self.admission = admission  # optimistic, or reserve (prompt + max_tokens must fit: never preempts)
        self.priority = priority
        self.preemption = preemption
        self.stats = SchedulerStats()
        self.kv_manager = KVManager(pool, num_host_blocks, max_model_len, self.stats)
        self.pool, self.host = pool, self.kv_manager.host
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.running: list[Sequence] = []  # admission order: newest last
        self._waiting: list[tuple[tuple, Sequence]] = []  # heap: (priority class, resumed first, order)
        self._num_requeued = 0
        self._left: list[Sequence] = []  # finished since the last plan with work: the next plan tells the runner
        self._reserved_slots = 0  # batch slots admitted parents hold for the samples they will fork
        self.last_step = StepInfo()
        self._at_limit: set[int] = set()  # sequences a placeholder took to max_tokens / the context: not scheduled again
        self._applying_step = 0  # the step whose tokens `apply_tokens` applies (1-based): first-token and finish steps
        # every token that may stop some sequence this scheduler has seen (EOS ids, stop_token_ids): a sampled
        # token outside it cannot stop its sequence, whatever the sequence's own settings
        self._stop_tokens: set[int] = set()
        # speculative decoding (engine/speculative/): who drafts what; None: off
        self.speculator = speculator
        self.encoder = EncoderBudget(max_image_tokens_per_step)  # the vision tower's image tokens per step
        self._trimmed: list[tuple[Sequence, int]] = []  # rows whose rejected drafts' blocks went back: the next plan says

    def admission_error(self, prompt_len: int, params: SamplingParams) -> str | None:
        """Why a request can never run here (too long for the model, or for the KV pool even alone), or None."""
        return self.kv_manager.never_fits(prompt_len, params)

    # ---- queue ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self._watch_stop_tokens(seq)
        seq.status = SequenceStatus.WAITING
        seq.arrival_step = self.stats.steps
        heapq.heappush(self._waiting, ((self.priority.rank(seq), 1, 0, self._order(seq)), seq))

    def _watch_stop_tokens(self, seq: Sequence) -> None:
        """Keeps `_stop_tokens` a superset of `seq`'s (and its samples') stop tokens."""
        for sample in seq.samples:
            self._stop_tokens.update(sample.eos_ids, sample.params.stop_token_ids)

    def _requeue(self, seq: Sequence) -> None:
        """A preempted sequence goes ahead of never-started work of its class, latest preempted first."""
        self._num_requeued += 1
        heapq.heappush(self._waiting, ((self.priority.rank(seq), 0, -self._num_requeued, ()), seq))

    def withdraw_waiting(self) -> list[Sequence]:
        """Takes every waiting sequence out of the queue, unfinished (a job's deadline). They hold no device
        blocks; a swapped-out one gives its host slots back."""
        withdrawn = [seq for _, seq in self._waiting]
        self._waiting = []
        for seq in withdrawn:
            self.host.release(seq.host_block_ids)
            seq.host_block_ids = []
        return withdrawn

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self.running or self._waiting)

    def peek_waiting(self) -> Sequence | None:
        return self._waiting[0][1] if self._waiting else None

    def pop_waiting(self) -> Sequence:
        return heapq.heappop(self._waiting)[1]

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan(scheduled=[])
        budget = self.max_num_batched_tokens
        self.kv_manager.begin_step()
        self.encoder.begin_step()

        # Running sequences: decodes first, then chunked prefills continuing, both in admission order.
        decodes, prefills = self._pending()
        drafts = self._draft(decodes, prefills, budget) if self.speculator is not None and decodes else None
        growing = self._quiet_schedule(decodes, budget) if not drafts else None
        if growing is not None:  # quiet decodes: no row can be cut, skipped or preempted
            for seq in growing:
                self.grow(seq, 1, plan)  # never preempts: the free blocks cover every growing row
            plan.scheduled.extend(decodes)
            budget -= len(decodes)
            decodes = []
        budget = self._schedule_running(decodes + prefills, plan, budget, drafts)

        if plan.preempted:
            # NOTE: no admission after a preemption: the freed blocks go to the running sequences
            # first, and a swap_in never shares a step with a swap_out.
            if self._waiting:
                self.stats.stalled_after_preemption += 1
        else:
            budget = self.batching.admit(self, plan, budget)

        if plan.scheduled:  # NOTE: an empty plan never reaches the runner: its news waits for the next one
            self._count(plan)  # (an idle step is counted by `count_idle`, when the engine idles)
            plan.finished, self._left = self._left, []
            plan.trimmed, self._trimmed = self._trimmed, []
            plan.copies = self.kv_manager.take_copies()
        return plan

    def _pending(self) -> tuple[list[tuple[Sequence, int]], list[tuple[Sequence, int]]]:
        """The running sequences to schedule as (sequence, uncomputed tokens): the decodes (1), then the
        prefills (> 1), each in admission order. Those a placeholder took to their limit are left out
        (asynchronous scheduling: they finish when the tokens of the step in flight are applied).
        NOTE (speed: this runs every step over every running row): `num_uncomputed` is inlined."""
        pending = [(s, s.prompt_len + len(s.output_ids) - s.num_computed) for s in self.running]
        if self._at_limit:
            pending = [p for p in pending if p[0].seq_id not in self._at_limit]
        decodes = [p for p in pending if p[1] == 1]
        prefills = [p for p in pending if p[1] > 1] if len(decodes) < len(pending) else []
        return decodes, prefills

    def _quiet_schedule(self, decodes: list[tuple[Sequence, int]], budget: int) -> list[Sequence] | None:
        """The decodes that need a new block, when `decodes` can be scheduled all at once: the budget covers
        them, the batching allows it (static groups keep finished members running), and the free blocks
        cover every one that grows, so `_schedule_running` would schedule each of them, in this order,
        without a preemption. None otherwise (`_schedule_running` takes them one by one)."""
        if len(decodes) > budget or not self.batching.quiet_rows:
            return None
        growing, need = self.kv_manager.growing_decodes(decodes)
        return growing if need <= self.pool.num_free else None

    def _schedule_running(self, pending: list[tuple[Sequence, int]], plan: StepPlan, budget: int,
                          drafts: dict[int, list[int]] | None = None) -> int:
        """Schedules `pending` (running sequences, uncomputed tokens) in order, one by one, while the budget
        lasts; grows their blocks, preempting less important sequences where needed. Returns the budget left (0
        while a row waits for budget to compute an image whole, so that admission does not starve it).
        `drafts`: seq_id -> tokens drafted after its last one (a decode verifying them computes 1 + drafts)."""
        capacity = self.pool.block_size
        batching = self.batching
        image_waits = False  # (new rows would keep taking the budget a whole image needs: engine/images.py)
        for seq, uncomputed in pending:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                continue
            drafted = drafts.get(seq.seq_id) if drafts else None
            num_new = min(uncomputed + len(drafted), budget) if drafted else whole_images(seq, min(uncomputed, budget))
            if num_new == 0:  # an image to compute whole, past the budget left: no admission until it fits
                image_waits = True
                continue
            if seq.images is not None and not (num_new := self.encoder.fit(seq, seq.num_computed, num_new)):
                continue  # its next image waits for the next step's encoder budget
            if seq.num_result_tokens is not None and batching.padding_blocked(self, seq, num_new):
                continue
            fits = seq.num_computed + num_new <= len(seq.block_ids) * capacity  # no new block needed
            if not fits and not self.grow(seq, num_new, plan):
                continue  # `seq` itself was preempted
            plan.scheduled.append((seq, num_new))
            budget -= num_new
            self.encoder.take(seq, seq.num_computed, num_new)
            if drafted:
                if num_new > 1:
                    plan.drafts[seq.seq_id] = drafted[: num_new - 1]
            elif num_new > 1:
                self.kv_manager.note_chunk(seq, num_new)
        return 0 if image_waits else budget

    def _draft(self, decodes: list[tuple[Sequence, int]], prefills: list[tuple[Sequence, int]], budget: int
               ) -> dict[int, list[int]]:
        """seq_id -> the tokens the speculator drafts after each decode's last one, within what is left once every
        decode has its token: the budget (a draft never displaces a decode) and the free blocks (a draft never
        preempts), each draft short of the row's max_tokens and the model's context."""
        room = budget - len(decodes)
        if room <= 0:
            return {}
        spec, size = self.speculator, self.pool.block_size
        spare = self.pool.num_free - self.kv_manager.growing_decodes(decodes)[1]
        threshold = spec.step_threshold(len(decodes) + min(room, sum(n for _, n in prefills)))
        drafts: dict[int, list[int]] = {}
        for seq, _ in decodes:
            if room <= 0:
                break
            if not spec.may_draft(seq):
                continue
            limit = min(room, seq.params.max_tokens - len(seq.output_ids) - 1, self.max_model_len - seq.num_tokens - 1)
            held = max(len(seq.block_ids), self.pool.blocks_for(seq.num_computed + 1))
            limit = min(limit, (held + spare) * size - seq.num_computed - 1)  # positions the blocks can hold
            drafted = spec.propose(seq, limit, threshold) if limit > 0 else []
            if drafted:
                spare -= max(0, self.pool.blocks_for(seq.num_computed + 1 + len(drafted)) - held)
                room -= len(drafted)
                drafts[seq.seq_id] = drafted
        return drafts

    def grow(self, seq: Sequence, num_new: int, plan: StepPlan) -> bool:
        """Gives `seq` the blocks for `num_new` more tokens, preempting less important sequences if needed.
        Returns False when `seq` itself had to be preempted."""
        need = self.kv_manager.blocks_needed(seq, num_new)
        while need > self.pool.num_free:
            victim = self._pick_victim(seq, plan)
            self._preempt(victim, plan)
            if victim is seq:
                return False
        self.kv_manager.grow(seq, need)
        return True

    # ---- preemption -------------------------------------------------------------------------
    def _pick_victim(self, seq: Sequence, plan: StepPlan) -> Sequence:
        """The running sequence of the worst priority class not yet scheduled this step, newest first
        among equals; `seq` itself when there is none or every candidate outranks it."""
        rank = self.priority.rank
        scheduled_ids = {s.seq_id for s, _ in plan.scheduled}  # (built here: preemption is rare, steps are not)
        victim: Sequence | None = None
        for other in reversed(self.running):
            if other is seq or other.seq_id in scheduled_ids:
                continue
            if victim is None or rank(other) > rank(victim):
                victim = other
        if victim is None or rank(victim) < rank(seq):
            return seq
        return victim

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self.running.remove(seq)
        self._reserved_slots -= seq.pending_children
        self.kv_manager.cache_computed(seq)  # NOTE: its cached blocks outlive it in the LRU
        if self.batching.may_swap and self.preemption.swaps(seq, self.host.num_free):
            self.kv_manager.swap_out(seq, plan)
        else:
            self.stats.recomputed_tokens += seq.num_computed
            seq.num_computed = 0
        self.kv_manager.free(seq)
        seq.num_registered_blocks = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self._requeue(seq)
        plan.preempted.append(seq)
        self.stats.preemptions += 1

    # ---- admission --------------------------------------------------------------------------
    def admit_in_order(self, plan: StepPlan, budget: int) -> int:
        """Starts waiting sequences in queue order while budget, slots and blocks last (continuous batching).

        NOTE: admission stops at the first request that does not fit (never skips it): skipping would
        starve long requests and the priority order.
        """
        while self._waiting:
            seq = self._waiting[0][1]
            reason = self._admission_blocker(budget, seq) or self._try_start(seq, budget, plan)
            if reason is not None:
                self.stall(reason)
                break
            self.pop_waiting()
            budget -= plan.scheduled[-1][1]
        return budget

    def _admission_blocker(self, budget: int, seq: Sequence) -> str | None:
        if budget == 0:
            return "token_budget"
        return None if self.has_slots(seq) else "max_num_seqs"

    def has_slots(self, seq: Sequence) -> bool:
        """Batch slots for `seq` and the samples it will fork. NOTE: a row with more samples than
        max_num_seqs starts alone: the children without a slot wait and are recomputed.
        A sequence a placeholder took to its limit holds no slot: it is never scheduled again and leaves when the
        step in flight's tokens are applied (asynchronous scheduling admits in its place one step sooner, as the
        synchronous order does; the runner has rows for 2 x max_num_seqs)."""
        used = len(self.running) - len(self._at_limit) + self._reserved_slots
        return used + 1 + seq.pending_children <= self.max_num_seqs or (used == 0 and not self.running)

    def _try_start(self, seq: Sequence, budget: int, plan: StepPlan) -> str | None:
        """Starts `seq` with the blocks for its next chunk (reusing cached prefix blocks or its swapped
        copy) and schedules that chunk; returns why not instead when the blocks are not there."""
        start = self.kv_manager.prepare_start(seq, budget, self.encoder.fit if seq.images is not None else None)
        if not isinstance(start, Start):
            return start
        if (reason := self.admission.refuses(self, seq, start.hits)) is not None:
            return reason
        self.kv_manager.start(seq, start, plan)
        self.start(seq)
        plan.scheduled.append((seq, start.num_new))
        self.encoder.take(seq, seq.num_computed, start.num_new)
        return None

    def start(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        self._reserved_slots += seq.pending_children
        if seq.first_scheduled_step is None:
            seq.first_scheduled_step = self.stats.steps + 1  # the step being built (1-based)
            waits = self.stats.wait_steps_by_priority.setdefault(seq.params.priority, [])
            waits.append(self.stats.steps - seq.arrival_step)
            if self.speculator is not None:
                self.speculator.started(seq)
        self.running.append(seq)

    def stall(self, reason: str) -> None:
        name = f"stalled_{reason}"
        setattr(self.stats, name, getattr(self.stats, name) + 1)

    # ---- bookkeeping ------------------------------------------------------------------------
    def count_idle(self) -> None:
        """A step with nothing to run (waiting for arrivals): counted like any step. An empty schedule while a
        step is in flight (asynchronous scheduling: its rows are at their limits) is no step: it only waits."""
        self._count(StepPlan(scheduled=[]))

    def _count(self, plan: StepPlan) -> None:
        plan.info = StepInfo.of(plan.scheduled, plan.drafts)
        plan.step = self.stats.count_step(plan.info, self.batching.padding_tokens(plan),
                                          len(self.running) / self.max_num_seqs, self.pool.num_used, self.pool.num_blocks)

    # ---- after the step ---------------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: Mapping[int, int], logprobs: StepLogprobs | None = None,
               verified: Mapping[int, list[int]] | None = None) -> list[Sequence]:
        """Applies a computed step; returns the sequences that left the batch finished. `sampled`: seq_id -> token
        of every sequence whose chunk reached its last token, and of the samples it forks; `logprobs`: those asked.
        Its halves, `account` (what the step computed) and `apply_tokens` (what it sampled), run apart under
        asynchronous scheduling: the next step is scheduled between them. The step's counters go to `last_step`."""
        self.account(plan)
        return self.apply_tokens(plan, sampled, logprobs, verified)

    def account(self, plan: StepPlan) -> None:
        """What a launched step computes, before its tokens are known: the computed counts advance, and each
        sequence that samples holds a PLACEHOLDER output token (the next step's input, read on the device
        from this step's sampled tokens). A sequence the placeholder takes to its length limit is not
        scheduled again: it finishes when the step's tokens are applied. Then the blocks the step completed go to the
        prefix cache, in plan order: from the next step on, others may share them."""
        plan.accounted_quiet = quiet_decodes(plan, self.max_model_len)
        quiet, rest = split_quiet(plan.scheduled, plan.accounted_quiet)
        for seq in quiet:  # `_account_row`'s whole effect on these rows
            seq.num_computed += 1
            seq.output_ids.append(PLACEHOLDER)
        drafts = plan.drafts
        for seq, num_new in rest:  # (a verified row computed its last token; its drafts count once verified)
            self._account_row(seq, num_new - len(drafts[seq.seq_id]) if seq.seq_id in drafts else num_new, plan.step)
        if self.pool.enable_caching:
            size, finished = self.pool.block_size, SequenceStatus.FINISHED
            for seq in [s for s, _ in plan.scheduled if s.num_computed // size > s.num_registered_blocks]:
                if seq.status is not finished:  # (its work was discarded: see `_account_row`)
                    self.kv_manager.cache_computed(seq)

    def _account_row(self, seq: Sequence, num_new: int, step: int) -> None:
        """`account` for one row (see there), but the prefix cache's."""
        if seq.is_finished:  # finished when the previous step's tokens were applied: this step's work is discarded
            return
        seq.num_computed += num_new
        if seq.num_computed < seq.num_tokens or seq.pending_children:
            return  # a prompt chunk short of the end (or a fork: `apply_tokens` appends its tokens)
        seq.output_ids.append(PLACEHOLDER)
        if seq.first_token_step is None:
            seq.first_token_step = step
        if seq.num_result_tokens is None and at_length_limit(seq, self.max_model_len):
            self._at_limit.add(seq.seq_id)

    def apply_tokens(self, plan: StepPlan, sampled: Mapping[int, int], logprobs: StepLogprobs | None = None,
                     verified: Mapping[int, list[int]] | None = None) -> list[Sequence]:
        """A step's sampled tokens replace its placeholders; returns the sequences that left the batch finished
        (EOS, stop, grammar, length). `verified`: the rows that verified drafts, their target's token at each
        position (`StepOutput.verified`). See `update`."""
        info = plan.info
        finished: list[Sequence] = []
        self._applying_step = plan.step
        quiet, rest = split_quiet(plan.scheduled, quiet_samples(plan, sampled, self._stop_tokens, self.batching.quiet_rows))
        for seq in quiet:  # `_append`'s whole effect on these rows (none of them is in `_at_limit`)
            seq.output_ids[-1] = sampled[seq.seq_id]
        info.sampled_tokens += len(quiet)
        for seq, num_new in rest:
            if logprobs is not None and seq.seq_id in logprobs.prompt:
                seq.prompt_logprobs.extend(logprobs.prompt[seq.seq_id])
            if seq.is_finished:
                continue  # discarded work (see `account`)
            if seq.pending_children:  # NOTE: before the parent's token, which may finish it and free its blocks
                if seq.num_computed < seq.num_tokens:
                    continue  # a prompt chunk short of the end
                finished.extend(self._fork(seq, sampled, logprobs, info))
            elif not seq.output_ids or seq.output_ids[-1] != PLACEHOLDER:
                continue  # a prompt chunk short of the end: nothing sampled
            self._at_limit.discard(seq.seq_id)
            if plan.drafts and seq.seq_id in plan.drafts:
                finished.extend(self._apply_verified(seq, plan.drafts[seq.seq_id], sampled, verified, logprobs, info))
                continue
            finished.extend(self._append(seq, sampled[seq.seq_id], logprobs, info))
        if plan.preempted:  # a static group may have lost its last unfinished members
            finished.extend(self._release_all(self.batching.stranded(self)))
        self.last_step = info
        self._left.extend(finished)
        return finished

    def can_schedule_ahead(self, inflight: StepPlan) -> bool:
        """Whether the next step may be scheduled before `inflight`'s tokens are applied (asynchronous
        scheduling): no sequence in it needs its sampled token on the host to prepare its next step (a grammar's
        mask, the penalties' counts, a thinking budget's count, log-probabilities, the samples it forks), no static
        group, and enough free blocks that the next schedule cannot preempt (a victim's in-flight token would land
        on a waiting sequence)."""
        if not self.batching.schedules_ahead or inflight.drafts:  # (the next drafts need this step's tokens)
            return False
        seqs = [seq for seq, _ in inflight.scheduled]
        if any([s.grammar is not None or s.prompt_logprobs is not None or (s.children and not s.forked) for s in seqs]):
            return False
        if any(p.penalized or p.logprobs is not None or p.thinking_token_budget is not None
               for p in distinct_params([s.params for s in seqs])):
            return False
        return self.kv_manager.next_tokens_blocks(self.running, self._at_limit) <= self.pool.num_free

    def _apply_verified(self, seq: Sequence, drafted: list[int], sampled: Mapping[int, int],
                        verified: Mapping[int, list[int]] | None, logprobs: StepLogprobs | None,
                        info: StepInfo) -> list[Sequence]:
        """A row that verified `drafted`: its target's tokens are appended one by one, as many decode steps would
        append them (finish rules per token), while the drafts equal them, and the first that differs too (the
        target's own token: accepted + 1 tokens). A kept draft's KV was computed from the right token: computed.
        The blocks the rejected ones took go back. Returns the sequences that left the batch finished."""
        targets = verified.get(seq.seq_id) if verified is not None else None
        if targets is None:  # a runner that does not verify (a cost model): its one token, no draft kept
            targets = [sampled[seq.seq_id]]
        accepted = 0
        while accepted < min(len(drafted), len(targets) - 1) and drafted[accepted] == targets[accepted]:
            accepted += 1
        self.speculator.verified(seq, len(drafted), accepted)
        info.accepted_tokens += accepted
        self.stats.accepted_tokens += accepted
        for i in range(accepted + 1):
            left = self._append(seq, targets[i], logprobs, info, position=i)
            if seq.is_finished or seq.num_result_tokens is not None:
                return left
            if i < accepted:
                seq.num_computed += 1  # the draft this token equals was fed at its position
        keep = self.kv_manager.trim(seq)
        if keep is not None:
            self._trimmed.append((seq, keep))
        return []

    def _append(self, seq: Sequence, token: int, logprobs: StepLogprobs | None, info: StepInfo,
                position: int | None = None) -> list[Sequence]:
        """Puts a sampled token in its placeholder, or appends it (a forked sample's first token, a verified
        draft's `position`), with its log-probabilities; returns the sequences that leave the batch finished because of it."""
        if seq.output_ids and seq.output_ids[-1] == PLACEHOLDER:
            seq.output_ids[-1] = token
        else:
            seq.output_ids.append(token)
        if seq.logprobs is not None and logprobs is not None:
            mine = logprobs.sampled[seq.seq_id]
            seq.logprobs.extend(mine if position is None else mine.at(position))
        if seq.first_token_step is None:
            seq.first_token_step = self._applying_step
        if seq.num_result_tokens is not None:
            return []  # static batching: a finished member computing padding
        info.sampled_tokens += 1
        reason = finish_reason(seq, token, self.max_model_len)
        return self.finish(seq, reason) if reason is not None else []

    def _fork(self, parent: Sequence, sampled: Mapping[int, int], logprobs: StepLogprobs | None,
              info: StepInfo) -> list[Sequence]:
        """Starts the other samples of `parent`'s row on its prompt KV, each with its own first token (drawn
        from the same logits with its own seed): the full blocks are shared by reference, the partial last
        block is copied for each child (in the next plan, before anything writes). A child that finds no
        free slot or block waits and is recomputed, like a preempted sequence. Returns the children that
        finished at their first token."""
        parent.forked = True
        self._watch_stop_tokens(parent)  # (its children, in case they were given after `add`)
        self._reserved_slots -= len(parent.children)
        finished: list[Sequence] = []
        for child in parent.children:
            child.arrival_step, child.first_scheduled_step = parent.arrival_step, parent.first_scheduled_step
            child.prompt_logprobs = parent.prompt_logprobs  # complete: computed once, by the parent
            attached = len(self.running) < self.max_num_seqs and self.kv_manager.can_share_prompt(parent)
            if attached:
                self.kv_manager.share_prompt(parent, child)
                child.status = SequenceStatus.RUNNING
                self.running.append(child)
                self.stats.forked_samples += 1
            finished.extend(self._append(child, sampled[child.seq_id], logprobs, info))
            if not attached and not child.is_finished:
                child.status = SequenceStatus.WAITING
                self._requeue(child)
        return finished

    def finish(self, seq: Sequence, reason: FinishReason) -> list[Sequence]:
        """Marks `seq` done; returns the sequences that now leave the batch (static groups leave together)."""
        seq.finish_reason = reason
        seq.num_result_tokens = len(seq.output_ids)
        seq.finish_step = self._applying_step
        return self._release_all(self.batching.leaving(self, seq))

    def _release_all(self, leaving: list[Sequence]) -> list[Sequence]:
        for seq in leaving:
            if seq in self.running:
                self.running.remove(seq)
            self.kv_manager.free(seq)
            seq.images = None  # (its images' pixels go now, not when the next plan, which names it finished, does)
            seq.status = SequenceStatus.FINISHED
            if self.speculator is not None:
                self.speculator.finished(seq)
        return leaving
