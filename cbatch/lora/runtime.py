"""LoRA at run time: a fixed number of adapter slots (--max-loras) in every adapted linear layer, the step's
token -> slot map, and the delta added to the layer's output.

Every adapted module (`Linear.lora`, a `LoraTarget`) holds its slots' stacked factors
    a [S, P * R, in]    b [S, out, P * R]     (S = --max-loras, P = the module's packed parts, R = --max-lora-rank)
with part p's factors at rank rows/columns [p * R, p * R + r) and at its output rows of b; everything else is
zero, and each part's scale is folded into its b. So one adapter's delta on a packed module is two matmuls:
    out[tokens] += (x[tokens] @ a[slot].T) @ b[slot].T
Zero padding adds exact zeros: the result is that of the adapter's own rank.

Under tensor parallelism the factors are cut as their base layer (`Shard.ranges`): a column-parallel module
(qkv_proj, gate_up_proj) holds its rows of each part's B and the whole A; a row-parallel one (o_proj, down_proj)
its input columns of A and the whole B, so each rank adds B (A_r x_r), a partial sum the layer's all-reduce
completes with the base's. Rank 0 assigns the slots; the workers load the adapters its step names (`hold`).

The scheduler keeps at most S adapters among a step's rows (cbatch/engine/adapter_admission.py); `LoraSlots.assign`
gives each of them a slot, copying an adapter's factors in when it is not resident (least recently used
slot not in this step). Tensors keep their shapes, so a CUDA graph could hold them; the decode graphs run
only steps without adapter rows (engine/row_features.py, `AdapterRows`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cbatch.lora.adapter import PACKED, LoraAdapter, load_adapter, module_in_size, module_out_sizes
from cbatch.model.shard import Shard
from cbatch.model.spec import ModelSpec


MAX_RUNS = 4  # an adapter's tokens in at most this many contiguous runs take a slice each; more are gathered


@dataclass(slots=True)
class LoraStep:
    """One step's tokens by slot: `groups` (slot, the flat rows of its tokens: a slice when contiguous, else an
    int64 index tensor), and the same sorted for the Triton kernels. `active` False: no token has an adapter."""

    active: bool = False
    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    sorted_tokens: torch.Tensor | None = None  # int32 [T'] the adapted tokens' rows, by slot
    slot_counts: torch.Tensor | None = None  # int32 [S] tokens of each slot
    slot_starts: torch.Tensor | None = None  # int32 [S] where each slot's tokens start in `sorted_tokens`
    max_count: int = 0  # the most tokens of any slot (the kernels' grid)

    def set(self, token_slots: np.ndarray, num_slots: int, device: torch.device, put=None) -> None:
        """token_slots: int [T], -1 for base-model tokens. `put`: host array -> device tensor (the runner's
        pinned staging on a GPU, so asynchronous scheduling never waits for the device); the groups (the torch
        path's) only off the GPU."""
        put = put or (lambda array: torch.from_numpy(array).to(device))
        adapted = token_slots >= 0
        self.active = bool(adapted.any())
        self.groups = []
        if not self.active:
            return
        order = np.argsort(token_slots, kind="stable")[np.count_nonzero(~adapted):]  # base tokens (-1) sort first
        counts = np.bincount(token_slots[adapted], minlength=num_slots).astype(np.int32)
        starts = np.zeros(num_slots, dtype=np.int32)
        np.cumsum(counts[:-1], out=starts[1:])
        self.max_count = int(counts.max())
        self.sorted_tokens, self.slot_counts, self.slot_starts = put(order.astype(np.int32)), put(counts), put(starts)
        if device.type == "cuda":
            return
        for slot in np.flatnonzero(counts).tolist():
            rows = order[starts[slot] : starts[slot] + counts[slot]]
            breaks = np.flatnonzero(np.diff(rows) != 1) + 1  # where a contiguous run of its rows ends
            if len(breaks) < MAX_RUNS:  # a slice per run (the runner puts an adapter's decodes and prefills together)
                bounds = [0, *breaks.tolist(), len(rows)]
                self.groups += [(slot, slice(int(rows[i]), int(rows[j - 1]) + 1)) for i, j in zip(bounds, bounds[1:])]
            else:
                self.groups.append((slot, put(rows.astype(np.int64))))

    def clear(self) -> None:
        self.active = False
        self.groups = []


class LoraTarget:
    """The slots of one adapted module (set as its `lora`): adds the step's deltas to its output."""

    def __init__(self, step: LoraStep, num_slots: int, parts: int, rank: int, in_size: int, out_size: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.step = step
        self.rank = rank  # R: each part's rank columns
        self.a = torch.zeros(num_slots, parts * rank, in_size, device=device, dtype=dtype)  # [S, P * R, in]
        self.b = torch.zeros(num_slots, out_size, parts * rank, device=device, dtype=dtype)  # [S, out, P * R]

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [T, out] += each adapted token's delta (in place); x [T, in]."""
        if self.step.active:
            from cbatch.lora.ops import add_lora

            add_lora(x, out, self.a, self.b, self.step)
        return out


def _dense_modules(model) -> list[tuple[int, str, torch.nn.Module]]:
    """(layer, our module name, the module) for every module an adapter may target."""
    out = []
    for i, layer in enumerate(model.layers):
        out += [(i, "qkv_proj", layer.self_attn.qkv_proj), (i, "o_proj", layer.self_attn.o_proj)]
        mlp = layer.mlp
        if hasattr(mlp, "gate_up_proj"):
            out += [(i, "gate_up_proj", mlp.gate_up_proj), (i, "down_proj", mlp.down_proj)]
    return out


class LoraSlots:
    """The runner's adapters: every adapter of the job (on the host), the slots of the modules any of them
    adapts, and which adapter each slot holds."""

    def __init__(self, model, adapters: list[LoraAdapter], num_slots: int, max_rank: int,
                 full_spec: ModelSpec | None = None) -> None:
        spec: ModelSpec = model.spec  # this rank's share (the whole model on one rank)
        full_spec = full_spec or spec  # the adapters' shapes
        shard = Shard(model.comm.rank, model.comm.world)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.adapters = {a.name: a for a in adapters}
        self.num_slots, self.max_rank = num_slots, max_rank
        self.step = LoraStep()
        used = {key for a in adapters for key in a.parts}  # (layer, module) some adapter adapts
        self.targets: dict[tuple[int, str], LoraTarget] = {}
        for layer, name, module in _dense_modules(model):
            if (layer, name) in used:
                target = LoraTarget(self.step, num_slots, PACKED[name], max_rank, module_in_size(spec, name),
                                    sum(module_out_sizes(spec, name)), self.device, self.dtype)
                module.lora = target
                self.targets[(layer, name)] = target
        # (layer, module) -> (column | row, this rank's [start, stop) of each part's rows or of the inputs)
        self._ranges = {key: shard.ranges(f"layers.{key[0]}.{_BLOCK[key[1]]}.{key[1]}", full_spec) for key in self.targets}
        self._out_sizes = {name: module_out_sizes(spec, name) for name in PACKED}
        self.resident: list[str | None] = [None] * num_slots  # slot -> adapter name
        self._last_used = [0] * num_slots
        self._clock = 0
        self.loads = 0  # adapter copies into a slot (tests, benchmarks)

    def assign(self, names: set[str]) -> dict[str, int]:
        """A slot for each adapter of a step (at most `num_slots`: the scheduler's limit), loading the ones
        not resident into the least recently used slots this step does not need."""
        if len(names) > self.num_slots:
            raise RuntimeError(f"{len(names)} adapters in one step, more than --max-loras {self.num_slots}")
        self._clock += 1
        slot_of = {name: slot for slot, name in enumerate(self.resident) if name in names}
        free = sorted((s for s in range(self.num_slots) if self.resident[s] not in slot_of),
                      key=lambda s: (self.resident[s] is not None, self._last_used[s]))
        for name in sorted(names - set(slot_of)):
            slot = free.pop(0)
            self._load(slot, self.adapters[name])
            slot_of[name] = slot
        for slot in slot_of.values():
            self._last_used[slot] = self._clock
        return slot_of

    def row_slots(self, row_adapters: list[str | None]) -> np.ndarray:
        """int32 [B]: each row's slot (-1: the base model), its adapter made resident."""
        names = {n for n in row_adapters if n is not None}
        slot_of = self.assign(names) if names else {}
        return np.array([-1 if n is None else slot_of[n] for n in row_adapters], dtype=np.int32)

    @torch.no_grad()
    def warm_up(self) -> None:
        """Runs every adapted module's delta once on a dummy token (a GPU engine compiles the Triton kernels now,
        not mid-run: each module shape is one shrink and one expand variant). Slot 0's factors are whatever it
        holds; the outputs are thrown away."""
        step = LoraStep()
        step.set(np.zeros(1, dtype=np.int32), self.num_slots, self.device)
        from cbatch.lora.ops import add_lora

        for target in self.targets.values():
            x = torch.zeros(1, target.a.shape[2], device=self.device, dtype=self.dtype)
            out = torch.zeros(1, target.b.shape[1], device=self.device, dtype=self.dtype)
            add_lora(x, out, target.a, target.b, step)

    @classmethod
    def for_job(cls, loras: tuple[tuple[str, str], ...], model, full_spec: ModelSpec, num_slots: int,
                max_rank: int) -> LoraSlots:
        """The job's adapters (name, PEFT folder), checked against the full model `full_spec`, in the slots of
        `model` (one tensor-parallel rank's share of it, or the whole)."""
        adapters = [load_adapter(name, path, full_spec, max_rank) for name, path in loras]
        return cls(model, adapters, num_slots, max_rank, full_spec)

    def hold(self, resident: tuple[str | None, ...]) -> None:
        """Makes each slot hold the adapter `resident` names (a worker rank following rank 0's `assign`)."""
        for slot, name in enumerate(resident):
            if name is not None and self.resident[slot] != name:
                self._load(slot, self.adapters[name])

    @torch.no_grad()
    def _load(self, slot: int, adapter: LoraAdapter) -> None:
        r = self.max_rank
        for (layer, name), target in self.targets.items():
            target.a[slot].zero_()
            target.b[slot].zero_()
            starts = np.cumsum([0, *self._out_sizes[name]]).tolist()
            axis, ranges = self._ranges[(layer, name)]
            for part, lp in adapter.parts.get((layer, name), {}).items():
                rank = lp.a.shape[0]
                a, b = lp.a, lp.b
                if axis == "column":  # this rank's output rows of the part
                    b = b[ranges[part][0] : ranges[part][1]]
                else:  # row-parallel (one part): this rank's input columns
                    a = a[:, ranges[0][0] : ranges[0][1]]
                target.a[slot, part * r : part * r + rank].copy_(a)
                target.b[slot, starts[part] : starts[part + 1], part * r : part * r + rank].copy_(b * lp.scale)
        self.resident[slot] = adapter.name
        self.loads += 1


_BLOCK = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}  # module's parent
