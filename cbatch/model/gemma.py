"""Gemma 2 and Gemma 3 (text): the decoder layer whose structure differs from Llama's.

Every RMSNorm scales by (1 + weight) in float32 (`unit_offset`), and each block is wrapped in two norms:
    h = x + post_attention_norm(attention(input_norm(x)))
    out = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))
The rest of Gemma lives in the shared code, switched by the spec: embeddings scaled by sqrt(hidden_size)
and final-logit soft-capping (`LlamaForCausalLM`), the attention's query_pre_attn_scalar, logit
soft-capping, per-layer sliding window and per-layer RoPE table, and Gemma 3's q/k norms (`Attention`),
the GELU-tanh gated MLP (`layers.MLP`).
"""
from __future__ import annotations

import torch
from torch import nn

from cbatch.model.backend import Backend, RotaryStep
from cbatch.model.layers import RMSNorm
from cbatch.model.spec import ModelSpec
from cbatch.parallel.comm import SINGLE_RANK, Communicator


class GemmaDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, self_attn: nn.Module, mlp: nn.Module, backend: Backend,
                 comm: Communicator = SINGLE_RANK) -> None:
        super().__init__()
        self.comm = comm  # tensor parallelism: attention's and the MLP's partial sums all-reduced (DecoderLayer)

        def norm() -> RMSNorm:
            return RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend, unit_offset=spec.norm_unit_offset)

        self.input_layernorm = norm()
        self.self_attn = self_attn
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = mlp
        self.post_feedforward_layernorm = norm()

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, ropes: list[RotaryStep],
                ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output not yet added to the residual stream, the residual stream before it)."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.post_attention_layernorm(self.comm.all_reduce(self.self_attn(hidden, ropes, ctx)))
        hidden, residual = self.pre_feedforward_layernorm.add_forward(hidden, residual)
        return self.post_feedforward_layernorm(self.comm.all_reduce(self.mlp(hidden))), residual
