"""Tensor parallelism's split of the model: which rows or columns of each weight a rank holds.

Megatron's layout, as vLLM and nano-vllm use it:
    column-parallel  qkv_proj (q heads split; kv heads split, or replicated when there are fewer than ranks),
                     gate_up_proj and the experts' w13 (gate and up each split), embed_tokens / lm_head (vocab rows)
    row-parallel     o_proj, down_proj, the experts' w2 (input columns): each rank's output is a partial sum,
                     all-reduced once per block (`DecoderLayer`); their bias is added by rank 0 only
    replicated       norms, q/k norms, the MoE router and Qwen2-MoE's shared-expert gate; a vision-language model's
                     vision tower, whole (each rank encodes a share of a step's images: engine/tower_shares.py)
Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) splits by heads: q_proj / q_b_proj and kv_b_proj (each head's
up-projection W_UK | W_UV) column-parallel, o_proj row-parallel; the latent's projection (q_a_proj, kv_a_proj_with_mqa
and their norms) is replicated, so every rank caches every token's whole latent, as vLLM does (the spec's one latent
"KV head" is shared by all heads). gpt-oss's sinks (one per query head) go with their heads; its stacked experts
are stored [E, in, out] with gate and up interleaved, so a rank's gate and up rows are one stored range.
Every expert is split like a dense MLP (each rank holds a slice of every expert), so routing is unchanged; with
--expert-parallel (`MoESpec.expert_parallel`) each rank holds num_experts / N whole experts instead, and a shared
expert whole (cbatch/model/moe.py combines the ranks' experts).

FP8 checkpoints split their scales with their weights: a per-tensor scale is broadcast to the rows (then split as
per-channel ones), per-channel scales go with their rows, block scales with their blocks (a rank's rows and input
columns whole blocks, else `check_tensor_parallel` refuses the size). Packed integer checkpoints split on whole
groups; act-order ones after dequantization (cbatch/model/loader.py).

A packed parameter (qkv: [q | k | v]) is a list of `Part`s; a rank holds one range of each part, laid out in
the same order in its local (smaller) parameter. Loading maps a checkpoint tensor's place in the full model
(`Placement`, computed with the full spec) through these parts to the local rows it fills (`pieces`), so the
fused (Phi-3) and the separate (Llama) checkpoint layouts go through the same code.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from cbatch.config import ConfigError
from cbatch.model.mxfp4 import BLOCK as MXFP4_BLOCK
from cbatch.model.spec import ModelSpec
from cbatch.model.weights import Placement

VISION_TOWER = "visual."  # a vision-language model's tower and merger (model/vision.py): never split


@dataclass(frozen=True, slots=True)
class Part:
    """One part of a packed dimension: `size` elements in `unit`s (a head's `head_dim`, or 1)."""

    size: int
    unit: int = 1

    def rank_range(self, rank: int, world: int) -> tuple[int, int]:
        """The [start, stop) of this part that `rank` holds. Units split evenly; fewer units than ranks
        (kv heads): each rank holds one unit, shared by world / units ranks; vocab rows: ceil-split, the
        last rank's share may be short (its local rows past the vocab stay zero)."""
        units = self.size // self.unit
        if units % world == 0:
            per = units // world
            return rank * per * self.unit, (rank + 1) * per * self.unit
        if world % units == 0:
            unit = rank * units // world
            return unit * self.unit, (unit + 1) * self.unit
        per = -(-self.size // world)  # vocab: padded to a multiple of world
        return min(self.size, rank * per), min(self.size, (rank + 1) * per)

    def local_size(self, world: int) -> int:
        units = self.size // self.unit
        if units % world == 0 or world % units == 0:
            return self.size // world if units % world == 0 else self.unit
        return -(-self.size // world)


@dataclass(frozen=True, slots=True)
class Piece:
    """Checkpoint rows [src_start, src_stop) of `dim` (relative to the tensor as stored) go to local rows
    [dst_start, dst_start + src_stop - src_start) of the parameter's same dimension."""

    dim: int  # of the stored tensor and of its destination (an expert's own tensor, or a whole expert stack)
    src_start: int
    src_stop: int
    dst_start: int


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank `rank` of `world` tensor-parallel ranks. `Shard(0, 1)` is the whole model."""

    rank: int = 0
    world: int = 1

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The spec of this rank's model: its heads and MLP widths (vocab_size stays the full vocabulary:
        the sampler's)."""
        if self.world == 1:
            return spec
        kv = Part(spec.kv_size, spec.head_dim).local_size(self.world) // spec.head_dim
        moe = spec.moe
        if moe is not None and moe.expert_parallel:  # whole experts, a shared expert replicated
            moe = replace(moe, expert_range=self.expert_range(spec))
        elif moe is not None:
            moe = replace(moe, intermediate_size=moe.intermediate_size // self.world,
                          shared_expert_size=moe.shared_expert_size // self.world)
        return replace(spec, num_heads=spec.num_heads // self.world, num_kv_heads=kv,
                       intermediate_size=spec.intermediate_size // self.world, moe=moe)

    def expert_range(self, spec: ModelSpec) -> tuple[int, int]:
        """Expert parallelism: the [first, stop) of the experts this rank holds (a contiguous, equal share)."""
        per = spec.moe.num_experts // self.world
        return self.rank * per, (self.rank + 1) * per

    def local_expert(self, placement: Placement, spec: ModelSpec) -> Placement | None:
        """Expert parallelism: a checkpoint tensor of one expert at its place among this rank's experts, None
        for another rank's expert; any other placement as it is."""
        moe = spec.moe
        if placement.expert is None or moe is None or not moe.expert_parallel or self.world == 1:
            return placement
        first, stop = self.expert_range(spec)
        if not first <= placement.expert < stop:
            return None
        return replace(placement, expert=placement.expert - first)

    def local_vocab(self, vocab_size: int) -> int:
        return Part(vocab_size).local_size(self.world)

    def vocab_start(self, vocab_size: int) -> int:
        return Part(vocab_size).rank_range(self.rank, self.world)[0]

    def pieces(self, placement: Placement, kind: str, spec: ModelSpec) -> list[Piece] | None:
        """Where a checkpoint tensor placed at `placement` (in the full model) goes in this rank's parameter;
        None: the whole tensor, as is (replicated, or world 1); []: nothing of it (a row-parallel bias off rank 0)."""
        leaf = placement.module.rpartition(".")[2]
        if self.world > 1 and leaf == "experts" and spec.moe.expert_parallel:  # whole experts (`local_expert`)
            if placement.expert is not None:
                return None
            first, stop = self.expert_range(spec)
            return [Piece(0, first, stop, 0)]  # a stack of every expert [E, rows, cols]: this rank's
        split = _split(leaf, placement.slot, spec, placement.module)
        if self.world == 1 or split is None:
            return None
        axis, parts = split
        if axis == "row" and kind == "bias":
            return None if self.rank == 0 else []  # a partial sum's bias: added once
        dim = 0 if axis == "column" else 1
        if leaf == "experts" and placement.expert is None:
            dim += 1  # a stacked expert tensor [E, rows, ...] (or its biases [E, rows]), all experts at once
        full = placement.rows or slice(0, sum(p.size for p in parts))
        pieces = self._intersect(parts, full, dim)
        if placement.interleaved:  # gate i, up i stored side by side: this rank's [a, b) of each is the stored
            (gate, up) = pieces    # range [2a, 2b), which de-interleaves (`Placement.to_ours`) into its gate | up
            return [Piece(dim, 2 * gate.src_start, 2 * gate.src_stop, 0)]
        return pieces

    def ranges(self, module: str, spec: ModelSpec) -> tuple[str, list[tuple[int, int]]] | None:
        """(column | row, this rank's [start, stop) in each packed part of the split dimension) of dense module
        `module` (e.g. layers.0.self_attn.qkv_proj) of the full model `spec`; None: replicated. What LoRA factors
        are cut by (cbatch/lora/runtime.py)."""
        split = _split(module.rpartition(".")[2], "weight", spec, module)
        if split is None:
            return None
        axis, parts = split
        return axis, [part.rank_range(self.rank, self.world) for part in parts]

    def _intersect(self, parts: list[Part], full: slice, dim: int) -> list[Piece]:
        """The pieces of this rank's ranges inside `full` (the tensor's rows in the packed parameter)."""
        pieces = []
        full_offset = local_offset = 0
        for part in parts:
            start, stop = part.rank_range(self.rank, self.world)
            lo, hi = max(full.start, full_offset + start), min(full.stop, full_offset + stop)
            if lo < hi:
                pieces.append(Piece(dim, lo - full.start, hi - full.start, local_offset + lo - full_offset - start))
            full_offset += part.size
            local_offset += part.local_size(self.world)
        return pieces


def _split(leaf: str, slot: str, spec: ModelSpec, module: str) -> tuple[str, list[Part]] | None:
    """(column | row, the packed parts of the split dimension) of a parameter, or None (replicated)."""
    if module.startswith(VISION_TOWER):
        return None  # whole, on every rank
    head = spec.head_dim
    if spec.mla is not None and leaf in _MLA_HEAD_SPLIT:
        return _mla_split(leaf, spec)
    if leaf == "self_attn" and slot == "sinks":  # gpt-oss: one sink logit per query head
        return "column", [Part(spec.num_heads)]
    if leaf == "qkv_proj":
        return "column", [Part(spec.q_size, head), Part(spec.kv_size, head), Part(spec.kv_size, head)]
    if leaf == "o_proj":
        return "row", [Part(spec.q_size, head)]
    width = spec.intermediate_size
    if spec.moe is not None and spec.moe.expert_parallel and ".mlp.shared_expert" in module:
        return None  # replicated beside experts held whole: each rank's MoE output is complete
    if spec.moe is not None and (leaf == "experts" or ".mlp.shared_expert" in module):
        width = spec.moe.intermediate_size if leaf == "experts" else spec.moe.shared_expert_size
    if leaf == "gate_up_proj" or slot == "w13":
        return "column", [Part(width), Part(width)]
    if leaf == "down_proj" or slot == "w2":
        return "row", [Part(width)]
    if leaf in ("embed_tokens", "lm_head"):
        return "column", [Part(spec.vocab_size)]
    return None


_MLA_HEAD_SPLIT = ("q_proj", "q_b_proj", "kv_b_proj", "o_proj")  # MLA's per-head matrices (the rest: replicated)


def _mla_split(leaf: str, spec: ModelSpec) -> tuple[str, list[Part]]:
    """MLA's per-head matrices: each head's query rows (nope | rope), its kv_b_proj rows (W_UK | W_UV), and its
    value columns of o_proj's input."""
    mla, heads = spec.mla, spec.num_heads
    if leaf == "o_proj":
        return "row", [Part(heads * mla.v_head_dim, mla.v_head_dim)]
    per_head = mla.qk_nope_head_dim + mla.v_head_dim if leaf == "kv_b_proj" else mla.qk_head_dim
    return "column", [Part(heads * per_head, per_head)]


def with_expert_parallel(spec: ModelSpec) -> ModelSpec:
    """The spec with its experts spread whole over the ranks (--expert-parallel); a model without experts is
    refused (ConfigError on expert_parallel)."""
    if spec.moe is None:
        raise ConfigError("expert_parallel", f"the model ({spec.architecture}) has no experts to spread over the "
                                             f"ranks; leave --expert-parallel off")
    return replace(spec, moe=replace(spec.moe, expert_parallel=True))


def check_tensor_parallel(spec: ModelSpec, world: int) -> None:
    """Refuses (ConfigError on --tensor-parallel-size) a split the model's shapes do not allow; a split that cuts
    a quantized checkpoint's scale blocks names the sizes that work."""
    problem = _split_problem(spec, world)
    if problem is None:
        return
    quant = spec.quant
    if quant is not None and quant.packed is None and (quant.block is not None or quant.mxfp4) and \
            _shape_problem(spec, world) is None:
        works = ", ".join(str(w) for w in tensor_parallel_sizes(spec))
        problem += f"; use --tensor-parallel-size {works}"
        if spec.moe is not None and not spec.moe.expert_parallel and \
                _split_problem(replace(spec, moe=replace(spec.moe, expert_parallel=True)), world) is None:
            problem += f", or keep {world} ranks with --expert-parallel (whole experts, unsplit)"
    raise ConfigError("tensor_parallel_size", problem)


def tensor_parallel_sizes(spec: ModelSpec, limit: int = 64) -> list[int]:
    """The --tensor-parallel-size values up to `limit` this model splits into."""
    return [world for world in range(1, limit + 1) if _split_problem(spec, world) is None]


def _split_problem(spec: ModelSpec, world: int) -> str | None:
    """Why `world` ranks cannot split this model (a sentence without the fix's sizes), or None."""
    if world == 1:
        return None
    problem = _shape_problem(spec, world)
    if problem is not None or spec.quant is None:
        return problem
    if spec.quant.packed is not None:
        return _packed_problem(spec, world)
    return _mxfp4_problem(spec, world) if spec.quant.mxfp4 else _fp8_block_problem(spec, world)


def _shape_problem(spec: ModelSpec, world: int) -> str | None:
    sizes = [("attention heads", spec.num_heads)]
    if not all(spec.is_sparse(layer) for layer in range(spec.num_layers)):
        sizes.append(("MLP width", spec.intermediate_size))
    if spec.moe is not None and spec.moe.expert_parallel:
        sizes.append(("experts (--expert-parallel gives each rank whole experts)", spec.moe.num_experts))
    elif spec.moe is not None:
        sizes += [("expert width", spec.moe.intermediate_size), ("shared-expert width", spec.moe.shared_expert_size)]
    for what, size in sizes:
        if size % world:
            return f"{world} does not divide the model's {what} ({size}); use a divisor of {size}"
    kv = spec.num_kv_heads
    if kv % world and world % kv:
        return f"{world} and the model's {kv} KV heads do not divide one another; use a divisor or a multiple of {kv}"
    return None


def _split_widths(spec: ModelSpec) -> tuple[list[tuple[str, Part]], list[tuple[str, Part]]]:
    """(the column-parallel outputs, the row-parallel inputs): (layer, its split dimension) of the decoder's
    matmuls."""
    head = spec.head_dim
    if spec.mla is not None:  # (kv_b_proj is dequantized at load, from whole blocks of rows too)
        mla, heads = spec.mla, spec.num_heads
        outputs = [("q_proj/q_b_proj output (attention heads x qk_head_dim)", Part(heads * mla.qk_head_dim, mla.qk_head_dim)),
                   ("kv_b_proj output (attention heads x (qk_nope_head_dim + v_head_dim))",
                    Part(heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.qk_nope_head_dim + mla.v_head_dim))]
        inputs = [("o_proj input (attention heads x v_head_dim)", Part(heads * mla.v_head_dim, mla.v_head_dim))]
    else:
        outputs = [("q_proj output (attention heads x head_dim)", Part(spec.q_size, head)),
                   ("k_proj/v_proj output (KV heads x head_dim)", Part(spec.kv_size, head))]
        inputs = [("o_proj input (attention heads x head_dim)", Part(spec.q_size, head))]
    if any(not spec.is_sparse(layer) for layer in range(spec.num_layers)):
        outputs.append(("gate_proj/up_proj output (MLP width)", Part(spec.intermediate_size)))
        inputs.append(("down_proj input (MLP width)", Part(spec.intermediate_size)))
    if spec.moe is not None and not spec.moe.expert_parallel:  # (whole experts are not split)
        outputs.append(("experts' gate_proj/up_proj output", Part(spec.moe.intermediate_size)))
        inputs.append(("experts' down_proj input", Part(spec.moe.intermediate_size)))
        if spec.moe.shared_expert_size:
            outputs.append(("shared expert's gate_proj/up_proj output", Part(spec.moe.shared_expert_size)))
            inputs.append(("shared expert's down_proj input", Part(spec.moe.shared_expert_size)))
    return outputs, inputs


def _fp8_block_problem(spec: ModelSpec, world: int) -> str | None:
    """A block-quantized FP8 checkpoint splits its scales with their blocks: each rank's rows of a
    column-parallel weight, and its input columns of a row-parallel one, are whole blocks."""
    block = spec.quant.block
    if block is None:
        return None  # per-tensor scales are replicated, per-channel ones split with their rows
    outputs, inputs = _split_widths(spec)
    for (what, part), unit, dim in [*((o, block[0], "rows") for o in outputs), *((i, block[1], "columns") for i in inputs)]:
        local = part.local_size(world)
        if part.size and local % unit:
            return (f"{world} ranks split the {what} of {part.size} into {local} {dim} per rank, which cuts the FP8 "
                    f"checkpoint's {block[0]}x{block[1]} scale blocks")
    return None


def _mxfp4_problem(spec: ModelSpec, world: int) -> str | None:
    """An MXFP4 checkpoint (gpt-oss) holds its experts as stored on the GPU path, one e8m0 scale per 32 inputs: each
    rank's input columns of the experts' down_proj are whole blocks of 32 (their outputs split anywhere)."""
    moe = spec.moe
    if moe is None or moe.expert_parallel:
        return None
    local = moe.intermediate_size // world
    if local % MXFP4_BLOCK:
        return (f"{world} ranks split the experts' down_proj input of {moe.intermediate_size} into {local} columns per "
                f"rank, which cuts the MXFP4 checkpoint's {MXFP4_BLOCK}-column scale blocks")
    return None


def _packed_problem(spec: ModelSpec, world: int) -> str | None:
    """An integer checkpoint splits its row-parallel inputs (o_proj, down_proj, the experts' w2) on whole groups
    (and whole int32 words); act-order ones, whose groups are scattered over the input rows, hold those layers
    dequantized under tensor parallelism, so any split the shapes allow works."""
    packed = spec.quant.packed
    if packed.act_order:
        return None  # row-parallel layers are dequantized at load, each rank reading its input rows (loader.py)
    unit = packed.per_int32 if packed.group_size == -1 else max(packed.group_size, packed.per_int32)
    for what, part in _split_widths(spec)[1]:
        local = part.local_size(world)
        if local % unit:
            return (f"{world} ranks split the {what} of {part.size} into {local} rows, not whole groups of "
                    f"{unit} ({packed.describe()}); use a size that leaves each rank a multiple of {unit}")
    return None
