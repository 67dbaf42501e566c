"""One decoder for every supported family: Llama 2/3 (SmolLM2, TinyLlama), Mistral, Qwen2, Qwen3, Phi-3,
and through the spec's switches Gemma 2/3 (their layer: gemma.py), the mixtures of experts Mixtral,
Qwen2-MoE, Qwen3-MoE and gpt-oss (their MLP: moe.py; gpt-oss's attention sinks: `Attention.sinks`), and
DeepSeek-V2/V3 / Kimi K2 (their attention: mla.py).

The switches come from `ModelSpec` (q/k/v bias, q/k norm, per-layer sliding window and RoPE table,
soft-capping, tied embeddings...). The model sees a flat batch of tokens and an `AttentionMetadata`; it
knows nothing of requests. It is built with one compute backend (cbatch.model.backend) that every layer
calls. q/k/v and gate/up projections are packed into one matmul each (the loader packs the weights).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cbatch.model.backend import AttentionMetadata, Backend, KVLayer, RotaryStep
from cbatch.model.gemma import GemmaDecoderLayer
from cbatch.model.layers import Linear, RMSNorm
from cbatch.model.mla import MLAAttention
from cbatch.model.moe import ExpertLoad, feed_forward
from cbatch.model.mrope import mrope_cos_sin, section_axes
from cbatch.model.onednn import linear, packed_linear, prepack_weight
from cbatch.model.rope import rope_table
from cbatch.model.shard import Shard
from cbatch.model.siglip import SiglipTower
from cbatch.model.siglip_spec import SiglipSpec
from cbatch.model.spec import ModelSpec
from cbatch.model.vision import VisionTower
from cbatch.model.vision_qwen3 import Qwen3VisionTower
from cbatch.parallel.comm import SINGLE_RANK, Communicator


# where torch.mm(a, b, out_dtype=torch.float32) runs for bfloat16/float16 a, b: CUDA (aten::mm.dtype, torch >= 2.8)
FLOAT32_OUT_DEVICES: tuple[str, ...] = ("cuda",) if hasattr(torch.ops.aten.mm, "dtype") else ()


def mm_float32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for 16-bit a, b, written in float32 by the GEMM (cuBLAS accumulates in float32 anyway)."""
    return torch.mm(a, b, out_dtype=torch.float32)


@dataclass(slots=True)
class KVCacheView:
    """The per-layer K and V caches the attention layers write to and read from."""

    k: list[torch.Tensor]  # one per layer, `kv_cache_shape` (MLA: the latents)
    v: list[torch.Tensor]  # (MLA: the same tensors as `k`; the value is a prefix of the latent)
    scales: torch.Tensor | None = None  # fp8 caches: float32 [layers, 2 (K|V), num_kv_heads]

    def layer(self, i: int) -> KVLayer:
        if self.scales is None:
            return KVLayer(self.k[i], self.v[i])
        return KVLayer(self.k[i], self.v[i], self.scales[i, 0], self.scales[i, 1])


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_idx: int, backend: Backend) -> None:
        super().__init__()
        self.backend = backend
        self.layer_idx = layer_idx
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.scale = spec.softmax_scale
        self.softcap = spec.attn_softcap
        self.sliding_window = spec.layer_windows[layer_idx]
        self.rope_index = spec.layer_rope[layer_idx]  # which of the model's RoPE tables this layer uses
        self.qkv_proj = Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(spec.q_size, spec.hidden_size, bias=spec.o_bias)
        # gpt-oss: one learned logit per query head [Hq], a key-less entry in every softmax's denominator
        self.sinks = nn.Parameter(torch.empty(spec.num_heads)) if spec.attn_sinks else None
        self.q_norm = self.k_norm = None
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, backend, unit_offset=spec.norm_unit_offset)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, backend, unit_offset=spec.norm_unit_offset)

    def forward(self, hidden: torch.Tensor, ropes: list[RotaryStep], ctx: "ForwardContext") -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 * kv_size]
        # the backend splits heads, applies q/k norms and rotary, stores k/v and attends
        rope = ropes[self.rope_index]
        out = self.backend.attention(qkv, self, rope, ctx.kv.layer(self.layer_idx), ctx.meta)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class DecoderLayer(nn.Module):
    """Llama's pre-norm layer: h = x + attention(norm(x)); out = h + mlp(norm(h)). Under tensor parallelism
    attention and MLP end in row-parallel matmuls: their partial sums are all-reduced here, once each."""

    def __init__(self, spec: ModelSpec, self_attn: nn.Module, mlp: nn.Module, backend: Backend,
                 comm: Communicator = SINGLE_RANK) -> None:
        super().__init__()
        self.comm = comm
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        self.mlp = mlp

    def forward(self, hidden, residual, ropes: list[RotaryStep], ctx):
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_forward(hidden, residual)
        hidden = self.comm.all_reduce(self.self_attn(hidden, ropes, ctx))
        hidden, residual = self.post_attention_layernorm.add_forward(hidden, residual)
        out = self.mlp(hidden)
        return (out if getattr(self.mlp, "complete_output", False) else self.comm.all_reduce(out)), residual


def decoder_layer(spec: ModelSpec, layer_idx: int, backend: Backend, comm: Communicator,
                  expert_load: ExpertLoad | None = None) -> nn.Module:
    """Attention and MLP (dense or experts) arranged as the family does: Llama's or Gemma's norms."""
    layer_cls = GemmaDecoderLayer if spec.sandwich_norms else DecoderLayer
    attention = MLAAttention(spec, layer_idx, backend) if spec.mla is not None else Attention(spec, layer_idx, backend)
    return layer_cls(spec, attention, feed_forward(spec, layer_idx, backend, comm, expert_load), backend, comm)


class VocabEmbedding(nn.Module):
    """The token embedding; under tensor parallelism this rank's rows of it (vocab-parallel): a token outside
    them looks up zeros and the all-reduce adds the one rank that holds it (an exact sum)."""

    def __init__(self, vocab_size: int, hidden_size: int, comm: Communicator) -> None:
        super().__init__()
        shard = Shard(comm.rank, comm.world)
        self.weight = nn.Parameter(torch.empty(shard.local_vocab(vocab_size), hidden_size))
        self.start = shard.vocab_start(vocab_size)  # the first token id of this rank's rows
        self.comm = comm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.comm.world == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.comm.all_reduce(hidden.masked_fill_(outside[:, None], 0.0))


@dataclass(slots=True)
class ForwardContext:
    """What every layer of one step needs besides activations."""

    kv: KVCacheView
    meta: AttentionMetadata
    # images (engine/image_rows.py): (flat rows int64 [n], their embeddings [n, hidden]) put in place of the
    # placeholder tokens' embeddings, and M-RoPE's 3-D positions int64 [3, T] (None: `positions` on every axis).
    # Qwen3-VL: the embeddings are [n, hidden * (1 + K)], each row's K deepstack features beside its embedding
    # (model/vision_qwen3.py); feature k is added to the row's hidden state after decoder layer k
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None
    mrope_positions: torch.Tensor | None = None


class LlamaForCausalLM(nn.Module):
    """The whole model, or (`comm` of several ranks) one tensor-parallel rank's share of it: `spec` is then this
    rank's (`Shard.local_spec`: its heads and MLP widths; the full vocabulary)."""

    def __init__(self, spec: ModelSpec, max_positions: int, backend: Backend, comm: Communicator = SINGLE_RANK) -> None:
        super().__init__()
        spec = Shard(comm.rank, comm.world).local_spec(spec)
        self.spec = spec
        self.backend = backend
        self.comm = comm
        self.embed_tokens = VocabEmbedding(spec.vocab_size, spec.hidden_size, comm)
        # expert parallelism: the assignments each rank's experts take (the report's load balance)
        self.expert_load = None
        if spec.moe is not None and spec.moe.expert_range is not None and comm.world > 1:
            self.expert_load = ExpertLoad(comm.world, spec.moe.num_experts // comm.world)
        self.layers = nn.ModuleList(decoder_layer(spec, i, backend, comm, self.expert_load)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend, unit_offset=spec.norm_unit_offset)
        vocab_rows = self.embed_tokens.weight.shape[0]
        self.lm_head = Linear(spec.hidden_size, vocab_rows, bias=False) if spec.head == "lm" and not spec.tie_word_embeddings else None
        # a sequence classification head: [num_labels, hidden] on a pooled (last-token) hidden state
        self.score = Linear(spec.hidden_size, spec.num_labels, bias=False) if spec.head == "classify" else None
        self.max_positions = max_positions
        self.rope_tables: list[torch.Tensor] = []  # set by `build_rope_cache` once the device is known
        # a vision-language model's image encoder (model/vision.py; Qwen3-VL's: vision_qwen3.py; Gemma 3's:
        # siglip.py), called by the runner's image rows; whole on every rank under tensor parallelism (each encodes a
        # share of a step's images: engine/tower_shares.py)
        self.visual = None
        if spec.vision is not None:
            tower = (SiglipTower if isinstance(spec.vision, SiglipSpec)
                     else Qwen3VisionTower if spec.vision.tower == "qwen3" else VisionTower)
            self.visual = tower(spec.vision, backend)
        self._mrope_axes: torch.Tensor | None = None  # M-RoPE: the axis of each rotary column (`build_rope_cache`)

    def build_rope_cache(self, device: torch.device) -> None:
        # float32 on purpose, whatever the model's dtype (HF computes RoPE angles in float32);
        # plain attributes, not buffers, so `.to(dtype)` leaves them alone.
        self.rope_tables = [rope_table(r, self.max_positions).to(device) for r in self.spec.rope]  # [max_positions, R] each
        vision = self.spec.vision
        if vision is not None and vision.mrope_section:
            self._mrope_axes = section_axes(vision.mrope_section, self.spec.rope[0].rotary_dim,
                                            vision.mrope_interleaved).to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        hidden = self.embed_tokens(input_ids)
        if self.spec.embed_scale is not None:  # Gemma: HF rounds the scale to the activations' dtype first
            hidden = hidden * torch.tensor(self.spec.embed_scale, dtype=hidden.dtype)
        deepstack: list[torch.Tensor] = []
        if ctx.embeds is not None:  # image placeholders: the vision tower's embeddings
            rows, embeds = ctx.embeds
            embeds = embeds.to(hidden.dtype)
            size = hidden.shape[1]
            hidden[rows] = embeds[:, :size]
            deepstack = [embeds[:, start : start + size] for start in range(size, embeds.shape[1], size)]  # Qwen3-VL
        if ctx.mrope_positions is not None:  # each token's own cos | sin row, read at position t (0..T-1)
            tables = [mrope_cos_sin(table, ctx.mrope_positions, self._mrope_axes) for table in self.rope_tables]
            positions = torch.arange(hidden.shape[0], device=hidden.device)
        else:
            tables = self.rope_tables
        ropes = [self.backend.rotary(positions, table, hidden.dtype) for table in tables]
        residual = None
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(hidden, residual, ropes, ctx)
            if i < len(deepstack):  # the layer's output (its residual stream) gets the feature at the image rows
                hidden = hidden + residual
                hidden[rows] += deepstack[i]
                residual = None  # (the next layer or the final norm starts from `hidden` alone)
        if residual is None:
            return self.norm(hidden)
        hidden, _ = self.norm.add_forward(hidden, residual)
        return hidden

    def prepack_for_cpu(self) -> None:
        """oneDNN-prepacked weights for every linear layer and the logits (see `onednn.prepack_weight`).
        A tied embedding keeps its plain copy for the lookup; the logits get a packed one beside it."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
        if self.lm_head is None and self.spec.generates:
            self.packed_logits_weight = prepack_weight(self.embed_tokens.weight)

    packed_logits_weight: torch.Tensor | None = None
    # GPU, 16-bit activations: the lm_head GEMM writes float32 (EngineConfig.fp32_logits; load_rank_model sets it)
    fp32_logits: bool = True

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] pooled hidden states -> float32 logits [N, num_labels] of the classification head."""
        if self.score is None:
            raise ValueError(f"this {self.spec.architecture} has no classification head")
        return self.score(pooled).float()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab] (only for the rows that sample).

        With `fp32_logits`, bfloat16/float16 activations on CUDA: one cuBLAS GEMM of the 16-bit hidden states
        and weight with a float32 output (its accumulator's value, not rounded to 16 bits): no [N, vocab]
        16-bit tensor written, read back and converted (for 256 rows x 151,936 ids, 156 MB of traffic less per
        step), and the logits are the float32 model's to the GEMM's rounding instead of 8 (bf16) or 11 (fp16)
        bits. HF computes 16-bit logits, so a greedy near-tie can go the other way than HF's; the parity
        tests run in float32, where nothing changes (`--no-fp32-logits` gives HF's rounding). Gemma 2's
        final soft-capping then runs in float32 too (HF: tanh in the activations' dtype, kept when off).
        Tensor parallelism gathers the ranks' float32 logits. The CPU path is unchanged."""
        weight = self._fp32_logits_weight(hidden)
        if weight is not None:
            logits = mm_float32(hidden, weight.t())
        elif self.lm_head is not None:
            logits = self.lm_head(hidden)
        elif self.packed_logits_weight is not None:
            logits = packed_linear(hidden, self.packed_logits_weight)
        else:
            logits = linear(hidden, self.embed_tokens.weight)
        if self.comm.world > 1:  # each rank's vocab rows side by side, the padding past the vocab cut
            logits = self.comm.all_gather(logits)[:, : self.spec.vocab_size]
        cap = self.spec.final_softcap
        if cap is not None:  # Gemma 2, in the logits' dtype: the activations' as HF, or float32 (fp32_logits)
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def _fp32_logits_weight(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits weight [vocab rows, hidden] when the float32-output GEMM applies, else None."""
        if not (self.fp32_logits and hidden.device.type in FLOAT32_OUT_DEVICES
                and hidden.dtype in (torch.bfloat16, torch.float16)):
            return None
        if self.lm_head is None:  # tied embeddings
            weight = self.embed_tokens.weight
        elif type(self.lm_head) is Linear and self.lm_head.lora is None and self.lm_head.bias is None:
            weight = self.lm_head.weight  # (None once prepacked: the CPU's)
        else:
            weight = None
        return weight if weight is not None and weight.dtype == hidden.dtype else None
