"""Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks each token's top-k experts, and
each expert's gated MLP runs on its own tokens only (the backend's `fused_moe`: a grouped torch loop on
CPU, the Triton fused-MoE kernels on GPU).

Routing, as each family's HF code defines it: softmax over the router logits in float32, top-k, then
    Mixtral     weights renormalised to sum to 1, kept in float32
    Qwen*-MoE   renormalised only with norm_topk_prob, then cast to the activations' dtype
    gpt-oss     the router has a bias; the top-k logits first, then a softmax over those k (activations' dtype)
Qwen2-MoE adds a shared expert (a dense MLP) scaled by sigmoid(shared_expert_gate(x)) to every token.

DeepSeek-V2/V3 and Kimi K2 route with `GroupLimitedRouter` (float32, as HF keeps their router) and add their
shared experts ungated:
    V2          softmax scores; top-k of them (greedy), or only among the topk_group groups whose best expert
                scores highest (group_limited_greedy); weights = scores x routed_scaling_factor
    V3 / K2     noaux_tc: sigmoid scores; groups ranked by the sum of their two best (scores +
                e_score_correction_bias), top-k (by the same biased scores) inside the topk_group best groups;
                weights = the unbiased scores, renormalised with norm_topk_prob, x routed_scaling_factor
gpt-oss's experts add biases to both projections and use a clamped SwiGLU (backend/clamped_swiglu.py).

Expert parallelism (--expert-parallel, `MoESpec.expert_range`): each rank holds num_experts / N whole experts and a
whole shared expert. Under tensor parallelism every rank already has every token's hidden state (attention's
all-reduce), so dispatch is a local selection: each rank computes the slots [T, k, H] of its own experts
(`fused_moe_slots`; the other slots zero). The combine (parallel/expert_combine.py) sends each computed slot to
its token's owner rank (an all-to-all), the owner sums a token's k slots in the one-rank order (`.sum(dim=1)` as
`fused_moe` does) and the owners' sums are all-gathered: the output is bitwise one rank's, and complete, so the
decoder layer does not all-reduce it again. The shared expert runs whole on every rank, on every token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cbatch.model.backend import Backend
from cbatch.model.backend.clamped_swiglu import ClampedSwiGLU
from cbatch.model.int4 import IntExperts, PackedQuant
from cbatch.model.layers import MLP, Linear
from cbatch.model.mxfp4 import BLOCK as MXFP4_BLOCK
from cbatch.model.quant import FP8_DTYPE
from cbatch.model.spec import ModelSpec, MoESpec
from cbatch.parallel.comm import SINGLE_RANK, Communicator
from cbatch.parallel.expert_combine import combine_slots


class Experts(nn.Module):
    """Every expert's weights stacked: w13 [E, 2I, H] (gate | up, as HF packs gate_up_proj), w2 [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # gpt-oss: each expert's biases, w13_bias [E, 2I] (gate | up), w2_bias [E, H]
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size)) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size)) if bias else None
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

    def keep_mxfp4(self) -> None:
        """Holds the weights as MXFP4 checkpoints store them (the GPU path): uint8 e2m1 pairs [E, N, K / 32, 16] and
        uint8 e8m0 scales [E, N, K / 32] (model/mxfp4.py). Called before the weights exist (meta device)."""
        for name in ("w13", "w2"):
            experts, rows, cols = getattr(self, name).shape
            blocks = cols // MXFP4_BLOCK
            setattr(self, name, nn.Parameter(torch.empty(experts, rows, blocks, MXFP4_BLOCK // 2, dtype=torch.uint8),
                                             requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(torch.empty(experts, rows, blocks, dtype=torch.uint8),
                                                        requires_grad=False))

    def int_experts(self) -> IntExperts | None:
        if self.w13_zero is None:
            return None
        return IntExperts(self.w13_zero, self.w2_zero, *self.int_layout)


class GroupLimitedRouter(nn.Module):
    """DeepSeek's router (see the module docstring): weight float32 [E, H] and, for noaux_tc, the float32
    e_score_correction_bias [E] that steers the choice but not the weights."""

    def __init__(self, moe: MoESpec, hidden_size: int) -> None:
        super().__init__()
        self.sigmoid = moe.grouped_scoring == "sigmoid"
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.num_groups, self.topk_groups = moe.num_groups, moe.topk_groups
        self.routed_scaling_factor = moe.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = None
        if self.sigmoid:
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (float32 routing weights [T, k], expert ids [T, k])."""
        logits = F.linear(x.float(), self.weight)  # [T, E]
        if self.sigmoid:
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
        else:
            scores = choice = logits.softmax(dim=-1)
        if self.topk_groups < self.num_groups:
            grouped = choice.view(x.shape[0], self.num_groups, -1)  # [T, G, E / G]
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if self.sigmoid else grouped.amax(dim=-1)
            kept_groups = torch.topk(group_scores, k=self.topk_groups, dim=-1, sorted=False)[1]  # [T, topk_groups]
            kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
            outside = ~kept.unsqueeze(-1).expand_as(grouped).reshape_as(choice)
            choice = choice.masked_fill(outside, float("-inf") if self.sigmoid else 0.0)
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class ExpertLoad:
    """Expert parallelism's load balance: the (token, expert) assignments each rank's experts took, summed over
    the MoE layers and steps, and the layer-steps in which a rank's experts took none; counted on the device (no
    host sync; captured in decode graphs too)."""

    def __init__(self, world: int, experts_per_rank: int) -> None:
        self.world, self.experts_per_rank = world, experts_per_rank
        # int64 [2 * world + 1]: assignments per rank, then idle layer-steps per rank, then the layer-steps counted
        self.counts: torch.Tensor | None = None

    def allocate(self, device: torch.device) -> None:
        self.counts = torch.zeros(2 * self.world + 1, dtype=torch.int64, device=device)

    def add(self, ids: torch.Tensor) -> None:
        """ids [T, k]: one MoE layer's routing in one step."""
        ranks = (ids // self.experts_per_rank).reshape(-1)
        taken = self.counts.new_zeros(self.world).scatter_add_(0, ranks, torch.ones_like(ranks))  # (no sync: graphs)
        self.counts[: self.world] += taken
        self.counts[self.world : 2 * self.world] += taken == 0
        self.counts[2 * self.world] += 1

    def summary(self) -> dict[str, object]:
        """For the report: each rank's assignments (all layers and steps), their mean per MoE layer and step, the
        busiest rank's over the mean (1.0: even), and the layer-steps each rank's experts sat out."""
        counts = self.counts.tolist()
        per_rank, idle, layer_steps = counts[: self.world], counts[self.world : 2 * self.world], counts[-1]
        mean = sum(per_rank) / self.world
        return {"ranks": self.world, "assignments": per_rank, "layer_steps": layer_steps,
                "tokens_per_rank_per_layer_step": [round(c / max(1, layer_steps), 2) for c in per_rank],
                "imbalance": round(max(per_rank) / mean, 3) if mean else 1.0, "idle_layer_steps": idle}


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
        self.routing = moe.routing
        self.activation: str | ClampedSwiGLU = spec.hidden_act
        if moe.swiglu_limit is not None:
            self.activation = ClampedSwiGLU(moe.swiglu_alpha, moe.swiglu_limit)
        # the router (every expert's logit): DeepSeek's, or a linear layer whose softmax top-k `route` takes
        self.gate = (GroupLimitedRouter(moe, spec.hidden_size) if moe.grouped_scoring
                     else Linear(spec.hidden_size, moe.num_experts, bias=moe.biased))
        first, stop = moe.expert_range or (0, moe.num_experts)
        self.first_expert = first if moe.expert_range is not None else None  # None: every expert here
        self.local_experts = stop - first
        self.load = load
        # an expert-parallel block's output is complete on every rank: the decoder layer all-reduces only partial ones
        self.complete_output = moe.expert_range is not None and comm.world > 1
        self.experts = Experts(stop - first, spec.hidden_size, moe.intermediate_size, bias=moe.biased)
        self.shared_expert = None
        self.shared_expert_gate = None
        if moe.shared_expert_size:
            self.shared_expert = MLP(spec.hidden_size, moe.shared_expert_size, False, spec.hidden_act, backend)
            if moe.shared_expert_gated:
                self.shared_expert_gate = Linear(spec.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (routing weights [T, k], expert ids [T, k])."""
        if isinstance(self.gate, GroupLimitedRouter):
            return self.gate(x)
        logits = self.gate(x)  # [T, E] in the activations' dtype
        if self.routing == "topk_softmax":  # gpt-oss: softmax over the k chosen logits only
            top, ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1, dtype=top.dtype), ids
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
                                         e.block, e.int_experts(), w13_bias=e.w13_bias, w2_bias=e.w2_bias)
        else:  # expert parallelism: this rank's experts' slots, each sent to its token's owner to be summed
            slots = self.backend.fused_moe_slots(x, e.w13, e.w2, weights, ids, self.activation, e.w13_scale,
                                                 e.w2_scale, e.block, e.int_experts(), self.first_expert,
                                                 e.w13_bias, e.w2_bias)  # [T, k, H]
            expert_ranks = ids.sort(dim=1).values // self.local_experts  # [T, k], in the slots' (ascending) order
            out = combine_slots(slots, expert_ranks, self.comm)
            if self.load is not None:
                self.load.add(ids)
        if self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out


def feed_forward(spec: ModelSpec, layer: int, backend: Backend, comm: Communicator = SINGLE_RANK,
                 load: ExpertLoad | None = None) -> nn.Module:
    """Layer `layer`'s MLP: the experts where the spec makes it sparse, the dense gated MLP otherwise."""
    if spec.is_sparse(layer):
        return SparseMoeBlock(spec, backend, comm, load)
    return MLP(spec.hidden_size, spec.intermediate_size, spec.mlp_bias, spec.hidden_act, backend)
