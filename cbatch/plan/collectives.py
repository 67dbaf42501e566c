"""The bytes one tensor-parallel rank sends per token, layer by layer, for `cbatch plan`'s default cost model.

With N ranks, H = hidden, b bytes per value, every layer all-reduces attention's output, and each layer's MLP
output is all-reduced too, except an MoE layer under --expert-parallel, whose combine replaces that all-reduce
(cbatch/parallel/expert_combine.py; docs/tensor-parallel.md gives the same figures):

    ring all-reduce of one hidden vector   2 (N - 1) / N x H x b
    expert combine, routed (eager steps)   (N - 1) / N x (k / N + 1) x H x b    (even routing, k = top_k)
    expert combine, padded (CUDA graphs)   (N - 1) / N x (k + 1) x H x b

Prefill and mixed steps run eager; decode steps run inside CUDA graphs on a GPU unless --enforce-eager. The
cost model prices every decode token alike, so a decode token of a mixed (eager) step is priced at the padded
rate: an overestimate of at most k / N + 1 against k + 1 per MoE layer.
"""
from __future__ import annotations

from dataclasses import dataclass

from cbatch.model.spec import ModelSpec


@dataclass(frozen=True, slots=True)
class CommBytes:
    """Bytes one rank sends per token of a step."""

    prefill: float  # a token of an eager step (prefill chunks, and every token on a CPU)
    decode: float  # a decode token (inside a CUDA graph where the run captures them)

    def per_step(self, prefill_tokens: int, decode_tokens: int) -> float:
        return self.prefill * prefill_tokens + self.decode * decode_tokens


def comm_bytes_per_token(spec: ModelSpec, ranks: int, dtype_bytes: int, decode_in_graphs: bool) -> CommBytes:
    """One rank's bytes per token of the whole (unsharded) `spec` split over `ranks`; expert parallelism is
    `spec.moe.expert_parallel`. Zero at one rank."""
    if ranks == 1:
        return CommBytes(0.0, 0.0)
    share = (ranks - 1) / ranks
    vector = spec.hidden_size * dtype_bytes
    all_reduce = 2 * share * vector
    moe = spec.moe
    combined = sum(moe.sparse_layers) if moe is not None and moe.expert_parallel else 0  # layers without MLP all-reduce
    dense = spec.num_layers * all_reduce + (spec.num_layers - combined) * all_reduce  # attention's, and the MLPs'
    if not combined:
        return CommBytes(dense, dense)
    routed = share * (moe.top_k / ranks + 1) * vector
    padded = share * (moe.top_k + 1) * vector
    return CommBytes(dense + combined * routed, dense + combined * (padded if decode_in_graphs else routed))
