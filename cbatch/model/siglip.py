"""Gemma 3's SigLIP vision tower and multi-modal projector on our layers: every image of a step in one call.

Input: the flattened patches of every image, concatenated ([B * N, C * P * P]: each image's N = (S / P)^2 patches
row-major, each patch channel-major, as io/images.py cuts them), and each image's grid (unused: every image is one
S x S square). Output: the language-model embeddings of the images ([B * mm_tokens_per_image, text hidden]).

Every image has the same number of patches, so the images of a step are one batch: rows [B * N, E] for the
matmuls, viewed [B, H, N, D] for one SDPA call per layer, bidirectional within each image. transformers'
numerics: the patch Conv2d as a matmul, LayerNorm, exact SDPA, then the projector's average pool, Gemma's (1 + w)
RMSNorm and the projection (`mm_input_projection_weight`, [E, text hidden]).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cbatch.model.backend import Backend
from cbatch.model.layers import Linear, RMSNorm
from cbatch.model.siglip_spec import SiglipSpec


class _PatchEmbedding(nn.Module):
    """transformers' Conv2d with kernel = stride = the patch: a linear map of each flattened patch (its weight kept
    in the checkpoint's shape [E, C, P, P])."""

    def __init__(self, vs: SiglipSpec) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vs.hidden_size, vs.in_channels, vs.patch_size, vs.patch_size))
        self.bias = nn.Parameter(torch.empty(vs.hidden_size))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return F.linear(patches.to(self.weight.dtype), self.weight.reshape(self.weight.shape[0], -1), self.bias)


class _Embeddings(nn.Module):
    def __init__(self, vs: SiglipSpec) -> None:
        super().__init__()
        self.patch_embedding = _PatchEmbedding(vs)
        self.position_embedding = nn.Embedding(vs.patches_per_side**2, vs.hidden_size)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """[B * N, C * P * P] -> [B * N, E]: each patch's embedding plus its position's."""
        embeds = self.patch_embedding(patches)
        positions = self.position_embedding.weight  # [N, E]
        return (embeds.view(-1, *positions.shape) + positions).view(embeds.shape)


class _Attention(nn.Module):
    def __init__(self, vs: SiglipSpec) -> None:
        super().__init__()
        self.num_heads, self.head_dim = vs.num_heads, vs.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (Linear(vs.hidden_size, vs.hidden_size, bias=True)
                                                                 for _ in range(4))

    def forward(self, x: torch.Tensor, patches: int) -> torch.Tensor:
        """x [B * N, E] (each image's N = `patches` rows in a block) -> [B * N, E]."""
        q, k, v = (proj(x).view(-1, patches, self.num_heads, self.head_dim).transpose(1, 2)
                   for proj in (self.q_proj, self.k_proj, self.v_proj))  # [B, H, N, D]
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # every patch of its image
        return self.out_proj(out.transpose(1, 2).reshape(x.shape))


class _MLP(nn.Module):
    def __init__(self, vs: SiglipSpec) -> None:
        super().__init__()
        self.approximate = "tanh" if vs.activation == "gelu_pytorch_tanh" else "none"
        self.fc1 = Linear(vs.hidden_size, vs.intermediate_size, bias=True)
        self.fc2 = Linear(vs.intermediate_size, vs.hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class _EncoderLayer(nn.Module):
    def __init__(self, vs: SiglipSpec) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(vs.hidden_size, eps=vs.layer_norm_eps)
        self.self_attn = _Attention(vs)
        self.layer_norm2 = nn.LayerNorm(vs.hidden_size, eps=vs.layer_norm_eps)
        self.mlp = _MLP(vs)

    def forward(self, x: torch.Tensor, patches: int) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), patches)
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, vs: SiglipSpec) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(vs) for _ in range(vs.depth))


class Gemma3Projector(nn.Module):
    """[B * N, E] patch states -> [B * mm_tokens_per_image, text hidden]: average pool over pool x pool patches,
    RMSNorm (1 + w), projection."""

    def __init__(self, vs: SiglipSpec, backend: Backend) -> None:
        super().__init__()
        self.side, self.pool = vs.patches_per_side, vs.pool
        self.mm_soft_emb_norm = RMSNorm(vs.hidden_size, vs.layer_norm_eps, backend, unit_offset=True)
        self.mm_input_projection_weight = nn.Parameter(torch.empty(vs.hidden_size, vs.out_hidden_size))

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        width = states.shape[-1]
        grid = states.view(-1, self.side * self.side, width).transpose(1, 2).reshape(-1, width, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.pool).flatten(2).transpose(1, 2)  # [B, T, E]
        normed = self.mm_soft_emb_norm(pooled.reshape(-1, width))  # [B * T, E]
        return torch.matmul(normed, self.mm_input_projection_weight).to(states.dtype)


class SiglipTower(nn.Module):
    """The SigLIP tower and Gemma 3's projector (`model.vision_tower.vision_model` and `model.multi_modal_projector`
    in transformers' checkpoints; `visual.*` and `visual.projector.*` here)."""

    def __init__(self, vs: SiglipSpec, backend: Backend) -> None:
        super().__init__()
        self.vs = vs
        self.embeddings = _Embeddings(vs)
        self.encoder = _Encoder(vs)
        self.post_layernorm = nn.LayerNorm(vs.hidden_size, eps=vs.layer_norm_eps)
        self.projector = Gemma3Projector(vs, backend)

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """patches [B * N, C * P * P] of every image (grids: one per image) -> [B * mm_tokens_per_image, hidden]."""
        states = self.embeddings(patches)  # [B * N, E]: image after image
        for layer in self.encoder.layers:
            states = layer(states, self.vs.patches_per_side**2)
        return self.projector(self.post_layernorm(states))
