"""Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k experts, and
each expert's gated MLP runs on its own tokens only (the backend's `fused_moe`: a grouped torch loop on
CPU, the Triton fused-MoE kernels on GPU).

Routing, as each family's HF code defines it: softmax over the router logits in float32, top-k, then
    Mixtral     weights renormalised to sum to 1, kept in float32
    Qwen*-MoE   renormalised only with norm_topk_prob, then cast to the activations' dtype
Qwen2-MoE adds a shared expert (a dense MLP) scaled by sigmoid(shared_expert_gate(x)) to every token.

Expert parallelism (--expert-parallel, `MoESpec.expert_range`): each rank holds num_experts / N whole experts and a
whole shared expert. Under tensor parallelism every rank already has every token's hidden state (attention's
all-reduce), so dispatch is a local selection; the combine is one all-reduce of the per-slot outputs [T, k, H],
in which each (token, slot) is non-zero on the one rank holding its expert (a sum with zeros: exact), after which
every rank sums a token's k slots in the one-rank order (`fused_moe_slots`, then `.sum(dim=1)` as `fused_moe`
does): the output is bitwise one rank's, and complete, so the decoder layer does not all-reduce it again. It
moves k times the bytes of the dense all-reduce; an all-to-all of the routed tokens (DeepEP-style, with data
parallel attention) is the faster layout where attention is not tensor-parallel.
"""
from __future__ import annotations

import torch
from torch import nn

from cbatch.model.backend import Backend
from cbatch.model.int4 import IntExperts, PackedQuant
from cbatch.model.layers import MLP, Linear
from cbatch.model.quant import FP8_DTYPE
from cbatch.model.spec import ModelSpec
from cbatch.parallel.comm import SINGLE_RANK, Communicator


class Experts(nn.Module):
    """Every expert's weights stacked: w13 [E, 2I, H] (gate | up, as HF packs gate_up_proj), w2 [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.w13_scale: nn.Parameter | None = None  # FP8 only: [E, 2I] per channel or [E, 2I/bn, H/bk] per block
        self.w2_scale: nn.Parameter | None = None
        self.block: tuple[int, int] | None = None
        self.w13_zero: nn.Parameter | None = None  # packed ints only: uint8 [E, 2I, groups], [E, H, groups]
        self.w2_zero: nn.Parameter | None = None
        self.int_layout: tuple[int, int] = (0, 0)  # packed ints: (group_size, bits)

    def keep_fp8(self, block: tuple[int, int] | None) -> None:
        """Holds the weights in FP8 with their scales (the GPU path). Called before the weights exist (meta device)."""
        self.block = block
        for name in ("w13", "w2"):
            weight = getattr(self, name)
            experts, rows, cols = weight.shape
            setattr(self, name, nn.Parameter(torch.empty(weight.shape, dtype=FP8_DTYPE), requires_grad=False))
            shape = (experts, rows) if block is None else (experts, -(-rows // block[0]), -(-cols // block[1]))
            setattr(self, f"{name}_scale", nn.Parameter(torch.empty(shape, dtype=torch.float32), requires_grad=False))


    def keep_int(self, quant: PackedQuant) -> None:
        """Holds the weights packed (the GPU path): int32 [E, N, K * bits / 32] with float32 scales and uint8 zeros
        [E, N, groups]. Called before the weights exist (meta device)."""
        self.int_layout = (quant.group_size, quant.bits)
        for name in ("w13", "w2"):
            experts, rows, cols = getattr(self, name).shape
            groups = quant.groups(cols)
            setattr(self, name, nn.Parameter(torch.empty(experts, rows, cols // quant.per_int32, dtype=torch.int32),
                                             requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(torch.empty(experts, rows, groups, dtype=torch.float32),
                                                        requires_grad=False))
            setattr(self, f"{name}_zero", nn.Parameter(torch.empty(experts, rows, groups, dtype=torch.uint8),
                                                       requires_grad=False))

    def int_experts(self) -> IntExperts | None:
        if self.w13_zero is None:
            return None
        return IntExperts(self.w13_zero, self.w2_zero, *self.int_layout)


class ExpertLoad:
    """Expert parallelism's load balance: the (token, expert) assignments each rank's experts took, summed over
    the MoE layers and steps, counted on the device (no host sync; captured in decode graphs too)."""

    def __init__(self, world: int, experts_per_rank: int) -> None:
        self.world, self.experts_per_rank = world, experts_per_rank
        self.counts: torch.Tensor | None = None  # int64 [world + 1]: per rank, then the layer-steps counted

    def allocate(self, device: torch.device) -> None:
        self.counts = torch.zeros(self.world + 1, dtype=torch.int64, device=device)

    def add(self, ids: torch.Tensor) -> None:
        """ids [T, k]: one MoE layer's routing in one step."""
        ranks = (ids // self.experts_per_rank).reshape(-1)
        self.counts.scatter_add_(0, ranks, torch.ones_like(ranks))
        self.counts[self.world] += 1

    def summary(self) -> dict[str, object]:
        """For the report: each rank's assignments (all layers and steps), their mean per MoE layer and step, and
        the busiest rank's over the mean (1.0: even)."""
        counts = self.counts.tolist()
        per_rank, layer_steps = counts[: self.world], counts[self.world]
        mean = sum(per_rank) / self.world
        return {"ranks": self.world, "assignments": per_rank, "layer_steps": layer_steps,
                "tokens_per_rank_per_layer_step": [round(c / max(1, layer_steps), 2) for c in per_rank],
                "imbalance": round(max(per_rank) / mean, 3) if mean else 1.0}


class SparseMoeBlock(nn.Module):
    def __init__(self, spec: ModelSpec, backend: Backend, comm: Communicator = SINGLE_RANK,
                 load: ExpertLoad | None = None) -> None:
        super().__init__()
        moe = spec.moe
        self.backend = backend
        self.comm = comm
        self.top_k = moe.top_k
        self.renormalize = moe.renormalize
        self.weights_in_model_dtype = moe.weights_in_model_dtype
        self.activation = spec.hidden_act
        self.gate = Linear(spec.hidden_size, moe.num_experts, bias=False)  # the router (every expert's logit)
        first, stop = moe.expert_range or (0, moe.num_experts)
        self.first_expert = first if moe.expert_range is not None else None  # None: every expert here
        self.load = load
        # an expert-parallel block's output is complete on every rank: the decoder layer all-reduces only partial ones
        self.complete_output = moe.expert_range is not None and comm.world > 1
        self.experts = Experts(stop - first, spec.hidden_size, moe.intermediate_size)
        self.shared_expert = None
        self.shared_expert_gate = None
        if moe.shared_expert_size:
            self.shared_expert = MLP(spec.hidden_size, moe.shared_expert_size, False, spec.hidden_act, backend)
            self.shared_expert_gate = Linear(spec.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k], expert ids [T, k])."""
        logits = self.gate(x)  # [T, E] in the activations' dtype
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(logits.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        e = self.experts
        if self.first_expert is None:
            out = self.backend.fused_moe(x, e.w13, e.w2, weights, ids, self.activation, e.w13_scale, e.w2_scale,
                                         e.block, e.int_experts())
        else:  # expert parallelism: this rank's slots, every rank's gathered by an exact sum, then one rank's order
            slots = self.backend.fused_moe_slots(x, e.w13, e.w2, weights, ids, self.activation, e.w13_scale,
                                                 e.w2_scale, e.block, e.int_experts(), self.first_expert)  # [T, k, H]
            out = self.comm.all_reduce(slots).sum(dim=1)
            if self.load is not None:
                self.load.add(ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def feed_forward(spec: ModelSpec, layer: int, backend: Backend, comm: Communicator = SINGLE_RANK,
                 load: ExpertLoad | None = None) -> nn.Module:
    """Layer `layer`'s MLP: the experts where the spec makes it sparse, the dense gated MLP otherwise."""
    if spec.is_sparse(layer):
        return SparseMoeBlock(spec, backend, comm, load)
    return MLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, spec.hidden_act, backend)
