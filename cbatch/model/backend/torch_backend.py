"""The plain-torch backend: the CPU path and the reference the Triton kernels are tested against.

Attention over the paged cache (`TorchBackend.attention`) plus the ops the model routes through its
backend (RMSNorm, rotary, gated activations, mixture-of-experts, FP8 matmul) with HF transformers' numerics.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from cbatch.fp8_kv import FP8_KV_MAX
from cbatch.model.backend.metadata import AttentionLayer, AttentionMetadata, KVLayer, MLALayer
from cbatch.model.backend.mla import mla_attend
from cbatch.model.backend.registry import register
from cbatch.model.backend.rotary import RotaryStep
from cbatch.model.onednn import linear
from cbatch.model.mxfp4 import dequantize_mxfp4
from cbatch.model.quant import dequantize


class TorchBackend:
    """Plain-torch paged attention and model ops (the CPU path and the reference).

    Cache layout: `kv_cache_shape`, as for the Triton backend. Gathering blocks along dim 0 copies
    whole blocks (`block_size * Hkv * D` contiguous elements), several times the rate of a head-major
    layout whose gather copies one head's block at a time (benchmarks/NOTES.md, session 2).

    Rows with one query token (decodes) are batched in groups of similar context length: each group
    gathers its blocks once per layer through a block index built once per step, transposes them to
    `[rows, Hkv, L, D]` (cache-resident, so the second copy is cheap) and runs two batched matmuls;
    the padding past each row's length is masked by an additive bias, also built once per step. Rows
    with several query tokens (prefill chunks) run one attention each; a fresh prefill needs no
    gather at all.
    """

    name = "torch"
    supports_cuda_graphs = False  # `prepare` builds per-step host state that a graph cannot capture
    split_kv = False  # attention is one torch call per row group: nothing to split
    supports_tuning = False  # nothing to tune at start-up (no `tune`)
    groups_decodes = True  # decode rows in groups of similar context: slices of the batch when it is so ordered
    needs_warmup = False  # nothing compiles per step shape
    fused_sampling = False  # the torch sampler
    keeps_fp8_weights = False  # FP8 checkpoints are dequantized once, at load
    keeps_int_weights = False  # so are AWQ / GPTQ / compressed-tensors int checkpoints
    keeps_mxfp4_weights = False  # and MXFP4 experts

    def prepare(self, meta: AttentionMetadata) -> None:
        meta.backend_state = _TorchStepState.build(meta)

    def attention(self, qkv: torch.Tensor, layer: AttentionLayer, rope: RotaryStep, kv: KVLayer,
                  meta: AttentionMetadata) -> torch.Tensor:
        """The attention block on the packed projection qkv [T, (Hq + 2 Hkv) * D]: q/k norms (Qwen3, Gemma 3),
        rotary (partial where the model says), this step's k/v stored at `slot_mapping`, then attention over
        the cache (soft-capped for Gemma 2, with gpt-oss's sinks); returns [T, Hq, D]."""
        num_tokens, heads, kv_heads, head_dim = qkv.shape[0], layer.num_heads, layer.num_kv_heads, layer.head_dim
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = q.view(num_tokens, heads, head_dim)
        k = k.view(num_tokens, kv_heads, head_dim)
        v = v.contiguous().view(num_tokens, kv_heads, head_dim)
        if layer.q_norm is not None:
            q = self.rms_norm(q, layer.q_norm.weight, layer.q_norm.eps, layer.q_norm.unit_offset)
            k = self.rms_norm(k, layer.k_norm.weight, layer.k_norm.eps, layer.k_norm.unit_offset)
        q, k = self.apply_rotary(q, k, rope)
        return self.attend(q, k, v, kv, meta, layer.scale, layer.sliding_window, layer.softcap,
                           getattr(layer, "sinks", None))

    # MLA decodes in latent space (mla.py's absorbed form); False: up-projected per head like prefills
    mla_absorbed_decode = True

    def mla_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor,
                      layer: MLALayer, rope: RotaryStep, kv: KVLayer, meta: AttentionMetadata) -> torch.Tensor:
        """Multi-head latent attention (backend/mla.py): rotary on q_pe [T, H, R] and k_pe [T, R], [c_kv | k_pe]
        stored in the latent cache `kv.k`, attention; returns [T, H, V]."""
        q_pe, k_pe = self.apply_rotary(q_pe, k_pe.unsqueeze(1), rope)
        latent = torch.cat([c_kv, k_pe.squeeze(1)], dim=-1)  # [T, kv_lora_rank + R]
        return mla_attend(q_nope, q_pe, latent, layer, kv.k, meta, self.mla_absorbed_decode)

    def attend(self, q, k, v, kv: KVLayer, meta: AttentionMetadata, scale: float, sliding_window: int | None,
               softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Stores this step's k/v [T, Hkv, D] at `slot_mapping`, then attends; returns [T, Hq, D]. `softcap`
        (Gemma 2): scores = softcap * tanh(scale * q.k / softcap) before the mask. `sinks` (gpt-oss) [Hq]: each
        head's logit joins the softmax's denominator (a column of the softmax whose value weight is 0)."""
        state: _TorchStepState = meta.backend_state
        cache = _CacheReader(kv, q.dtype)
        stored_k, stored_v = cache.stored(k, kv.k_scale), cache.stored(v, kv.v_scale)  # what the cache will hold
        self.store_kv(stored_k, stored_v, cache, meta)
        if cache.scaled:  # attend to what the cache holds, whether read back or fresh: chunking changes nothing
            k, v = cache.dequantize(stored_k, kv.k_scale), cache.dequantize(stored_v, kv.v_scale)

        out = torch.empty_like(q)
        scoring = _Scoring(scale, sliding_window, softcap, sinks)
        if state.decode_rows:
            self.attend_decodes(q, out, cache, scoring, meta)
        self.attend_prefills(q, k, v, out, cache, scoring, meta)
        return out

    def store_kv(self, stored_k: torch.Tensor, stored_v: torch.Tensor, cache: "_CacheReader",
                 meta: AttentionMetadata) -> None:
        """The step's k/v [T, Hkv, D], as the cache holds them, to their slots (`slot_mapping`; rows with a
        negative slot are not stored)."""
        state: _TorchStepState = meta.backend_state
        num_kv_heads, head_dim = stored_k.shape[1], stored_k.shape[2]
        k_slots = cache.raw(cache.kv.k).view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
        v_slots = cache.raw(cache.kv.v).view(-1, num_kv_heads, head_dim)
        if state.store_all:
            k_slots.index_copy_(0, meta.slot_mapping, cache.raw(stored_k))
            v_slots.index_copy_(0, meta.slot_mapping, cache.raw(stored_v))
        else:
            k_slots.index_copy_(0, state.store_slots, cache.raw(stored_k)[state.store_rows])
            v_slots.index_copy_(0, state.store_slots, cache.raw(stored_v)[state.store_rows])

    def attend_prefills(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        cache: "_CacheReader", scoring: "_Scoring", meta: AttentionMetadata) -> None:
        """out[rows] for every prefill chunk: fresh prompts of one length in one SDPA call, the rest one by one.
        k, v [T, Hkv, D]: this step's keys and values (what a fresh prompt attends to), already in the cache."""
        state: _TorchStepState = meta.backend_state
        for group in state.fresh_groups:
            if group.batchable(q.dtype, scoring):
                group.attend(q, k, v, out, scoring)
            else:
                for chunk in group.chunks:
                    chunk.attend(q, k, v, cache, out, scoring)
        for chunk in state.prefills + state.image_chunks:
            chunk.attend(q, k, v, cache, out, scoring)

    def attend_decodes(self, q: torch.Tensor, out: torch.Tensor, cache: "_CacheReader", scoring: "_Scoring",
                       meta: AttentionMetadata) -> None:
        """out[row] for every single-token query row (a decode), over its cached context."""
        for group in meta.backend_state.decode_groups(meta):
            group.attend(q, out, cache, scoring)

    # ---- the model's small ops, with HF transformers' numerics ----------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
        """HF's LlamaRMSNorm: variance in float32, normalised value cast back before the weight multiply.
        unit_offset (HF's Gemma RMSNorm): times (1 + weight) in float32, then cast back."""
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        if unit_offset:
            return (h * (1.0 + weight.float())).to(dtype)
        return weight * h.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps, unit_offset), residual

    def rotary(self, positions: torch.Tensor, cos_sin: torch.Tensor, dtype: torch.dtype) -> RotaryStep:
        """This step's angles in the activations' dtype, rotate_half's sign folded into sin: [T, 1, R] each
        (R = the rotary dimensions: the head dimension unless partial)."""
        cos, sin = cos_sin[positions].to(dtype).chunk(2, dim=-1)  # [T, R/2] each
        return RotaryStep(positions, cos_sin, torch.cat([cos, cos], dim=-1).unsqueeze(1),
                          torch.cat([-sin, sin], dim=-1).unsqueeze(1))

    def apply_rotary(self, q: torch.Tensor, k: torch.Tensor, rope: RotaryStep) -> tuple[torch.Tensor, torch.Tensor]:
        """NeoX-style rotary (HF's rotate_half) on q [T, Hq, D] and k [T, Hkv, D]; with partial rotary only
        the first R dimensions turn, as HF's Phi-3 does."""
        rotary_dim = rope.cos.shape[-1]
        if rotary_dim == q.shape[-1]:
            return _rotate(q, rope), _rotate(k, rope)
        return (torch.cat([_rotate(q[..., :rotary_dim], rope), q[..., rotary_dim:]], dim=-1),
                torch.cat([_rotate(k[..., :rotary_dim], rope), k[..., rotary_dim:]], dim=-1))

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2 * intermediate] (gate | up) -> [T, intermediate]"""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # one [T, intermediate] allocation, not two

    def gelu_tanh_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """Gemma's MLP activation: gelu(gate, approximate="tanh") * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)

    def gated_activation(self, gate_up: torch.Tensor, activation) -> torch.Tensor:
        """[T, 2I] (gate | up) -> [T, I] by `activation`: silu | gelu_tanh (this backend's ops), or a callable
        (`ClampedSwiGLU`)."""
        if callable(activation):
            return activation(gate_up)
        return self.gelu_tanh_and_mul(gate_up) if activation == "gelu_tanh" else self.silu_and_mul(gate_up)

    def fp8_linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   bias: torch.Tensor | None) -> torch.Tensor:
        """x @ dequantize(weight).T (+ bias): the reference for the Triton kernel (the CPU path dequantizes at load)."""
        return linear(x, dequantize(weight, scale, block, x.dtype), bias)

    def int_linear(self, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                   perm: torch.Tensor | None, group_size: int, bits: int, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ dequantize(packed weight).T (+ bias): the reference for the Triton kernel (the CPU path
        dequantizes at load)."""
        from cbatch.model.int4 import dequantize_kept

        return linear(x, dequantize_kept(weight, scale, zero, perm, group_size, bits, x.dtype), bias)

    def fused_moe(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str, w13_scale: torch.Tensor | None = None,
                  w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                  int_experts=None, w13_bias: torch.Tensor | None = None,
                  w2_bias: torch.Tensor | None = None) -> torch.Tensor:
        """Experts on their own tokens only: x [T, H], w13 [E, 2I, H] (gate | up), w2 [E, H, I],
        topk_weights/ids [T, k] -> [T, H] = sum_j w_j * expert_j(x). Each expert runs once on its tokens
        gathered; a token's k contributions are then summed in ascending expert order, as HF's eager loop
        adds them (and as the Triton kernels do). `activation`: silu | gelu_tanh, or a `ClampedSwiGLU`
        (gpt-oss, whose experts also add w13_bias [E, 2I] and w2_bias [E, H])."""
        return self.fused_moe_slots(x, w13, w2, topk_weights, topk_ids, activation, w13_scale, w2_scale, block,
                                    int_experts, None, w13_bias, w2_bias).sum(dim=1)

    def fused_moe_slots(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor, activation: str, w13_scale: torch.Tensor | None = None,
                        w2_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
                        int_experts=None, first_expert: int | None = 0, w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None) -> torch.Tensor:
        """Each token's k weighted expert outputs [T, k, H], in ascending expert order. w13 / w2 hold experts
        [first_expert, first_expert + E) (expert parallelism: the other slots are zeros); None: every expert."""
        num_tokens, top_k = topk_ids.shape
        ids, perm = topk_ids.sort(dim=1)
        weights = topk_weights.gather(1, perm).reshape(-1, 1)  # [T * k, 1]
        flat_ids = ids.reshape(-1)
        local = w13.shape[0]
        if first_expert is not None:  # another rank's experts: bucket `local`, never computed
            flat_ids = flat_ids - first_expert
            flat_ids = torch.where((flat_ids >= 0) & (flat_ids < local), flat_ids, local)
        order = flat_ids.argsort(stable=True)  # assignments (token * k + j) grouped by expert
        counts = torch.bincount(flat_ids, minlength=local).tolist()[:local]
        make = torch.empty if first_expert is None else torch.zeros
        contributions = make((num_tokens * top_k, x.shape[1]), dtype=x.dtype, device=x.device)
        zeros = (None, None) if int_experts is None else (int_experts.w13_zero, int_experts.w2_zero)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            assignments = order[start : start + n]
            start += n
            gate_up = linear(x[assignments // top_k],
                             _expert_weight(w13, w13_scale, block, expert, x.dtype, zeros[0], int_experts),
                             None if w13_bias is None else w13_bias[expert])  # [n, 2I]
            act = self.gated_activation(gate_up, activation)  # [n, I]
            down = linear(act, _expert_weight(w2, w2_scale, block, expert, x.dtype, zeros[1], int_experts),
                          None if w2_bias is None else w2_bias[expert])  # [n, H]
            contributions[assignments] = (down * weights[assignments]).to(x.dtype)
        return contributions.view(num_tokens, top_k, -1)


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, block, expert: int, dtype: torch.dtype,
                   zero: torch.Tensor | None = None, int_experts=None) -> torch.Tensor:
    """Expert `expert`'s weight in `dtype`: as held, or dequantized from FP8, packed ints or MXFP4 (uint8 e2m1 pairs
    [N, K / 32, 16] with e8m0 scales) (the Triton kernels' reference; the CPU path dequantizes at load)."""
    if int_experts is not None:
        from cbatch.model.int4 import dequantize_kept

        k = w.shape[2] * (32 // int_experts.bits)
        group = k if int_experts.group_size == -1 else int_experts.group_size
        return dequantize_kept(w[expert], scale[expert], zero[expert], None, group, int_experts.bits, dtype)
    if w.dtype == torch.uint8:
        return dequantize_mxfp4(w[expert], scale[expert], dtype)
    return w[expert] if scale is None else dequantize(w[expert], scale[expert], block, dtype)


class _CacheReader:
    """Reads and writes one layer's cache in the activations' dtype. An fp8 cache stores
    (x / scale).clamp(+-448).to(float8_e4m3fn) per kv head (the Triton store's value) and reads back
    fp8 x scale; its copies go through uint8 views (CPU index ops do not take float8)."""

    __slots__ = ("kv", "dtype", "scaled")

    def __init__(self, kv: KVLayer, dtype: torch.dtype) -> None:
        self.kv, self.dtype = kv, dtype
        self.scaled = kv.k_scale is not None

    def raw(self, t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.uint8) if self.scaled else t

    def stored(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """x [T, Hkv, D] as the cache will hold it."""
        if not self.scaled:
            return x
        return (x.float() / scale[:, None]).clamp_(-FP8_KV_MAX, FP8_KV_MAX).to(self.kv.k.dtype)

    def dequantize(self, stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """[..., Hkv, D] cache values -> the activations' dtype."""
        if not self.scaled:
            return stored
        return (stored.float() * scale[:, None]).to(self.dtype)

    def gather(self, cache: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """cache[index] along dim 0, in the activations' dtype."""
        if not self.scaled:
            return cache.index_select(0, index)
        return self.dequantize(cache.view(torch.uint8).index_select(0, index).view(cache.dtype), scale)


def _rotate(x: torch.Tensor, rope: RotaryStep) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, bit for bit as HF computes it: rotate_half(x) = (-x2 | x1), and
    (-x2) * sin == x2 * (-sin) exactly, so the halves are swapped (one copy) and the sign rides on sin."""
    swapped = x.unflatten(-1, (2, -1)).flip(-2).flatten(-2)  # (x2 | x1)
    return (x * rope.cos).add_(swapped.mul_(rope.sin))


# Decode rows per group: smaller groups pad less, larger ones issue fewer ops (16 measured best on the
# CPU path in both dtypes: benchmarks/NOTES.md, session 2).
DECODE_GROUP_ROWS = 16

# Prefill chunks up to this many (query x key) pairs use matmuls and an explicit softmax in
# bfloat16/float16 (faster than the fused SDPA kernel at a few hundred tokens); longer ones, and all of
# float32 (where the two tie), go through SDPA, whose memory does not grow with query x key.
MATMUL_PREFILL_MAX_PAIRS = 512 * 512


@dataclass(frozen=True, slots=True)
class _Scoring:
    """How one layer turns q.k into pre-softmax scores."""

    scale: float
    sliding_window: int | None
    softcap: float | None
    sinks: torch.Tensor | None = None  # gpt-oss: [Hq] one logit per query head in each softmax's denominator

    def softmax(self, scores: torch.Tensor, heads: tuple[int, ...]) -> torch.Tensor:
        """Softmax over the last dimension; with sinks as HF's gpt-oss computes it: each head's sink logit
        appended as one more column, the softmax taken, the column dropped. `heads`: the view of the [Hq] sinks
        that broadcasts against `scores` (a 1 in the last dimension)."""
        if self.sinks is None:
            return torch.softmax(scores, dim=-1)
        sink = self.sinks.to(scores.dtype).view(heads).expand(*scores.shape[:-1], 1)
        return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]

    def scores(self, qk: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """bias + scale * qk, or with soft-capping bias + softcap * tanh(scale * qk / softcap) (HF's order)."""
        if self.softcap is None:
            return torch.add(bias, qk, alpha=self.scale)
        return qk.mul_(self.scale).div_(self.softcap).tanh_().mul_(self.softcap).add_(bias)


class _BiasCache:
    """Additive masks (0 where attended, -inf elsewhere), built on first use per (dtype, sliding window)
    and shared by every layer of the step."""

    __slots__ = ("_masks", "_by_key")

    def __init__(self, masked) -> None:
        self._masks = masked  # callable: sliding_window -> bool mask, True = not attended
        self._by_key: dict = {}

    def get(self, dtype: torch.dtype, sliding_window: int | None) -> torch.Tensor:
        key = (dtype, sliding_window)
        bias = self._by_key.get(key)
        if bias is None:
            masked = self._masks(sliding_window)
            bias = torch.zeros(masked.shape, dtype=dtype, device=masked.device).masked_fill_(masked, float("-inf"))
            self._by_key[key] = bias
        return bias


@dataclass(slots=True)
class _DecodeGroup:
    """Single-token query rows of similar context length, attended together."""

    rows: torch.Tensor | slice  # flat query rows (int64 [n]), or a slice when they are consecutive
    num_rows: int
    blocks: torch.Tensor  # int64 [n * max_blocks]: each row's block ids, padded to the group's longest
    lens: torch.Tensor  # int64 [n]: context length (incl. this token)
    length: int  # L: the group's gathered context, whole blocks of its longest row
    biases: _BiasCache = field(init=False)  # [n, 1, 1, L]

    def __post_init__(self) -> None:
        self.biases = _BiasCache(self._masked)

    def _masked(self, sliding_window: int | None) -> torch.Tensor:
        pos = torch.arange(self.length, device=self.lens.device)
        masked = pos[None, :] >= self.lens[:, None]  # [n, L]
        if sliding_window is not None:
            masked |= (self.lens[:, None] - 1 - pos[None, :]) >= sliding_window
        return masked[:, None, None, :]

    def attend(self, q, out, cache: _CacheReader, scoring: _Scoring) -> None:
        """out[rows] = attention of q[rows] [n, Hq, D] over the rows' gathered contexts."""
        n = self.num_rows
        num_heads, head_dim = q.shape[1], q.shape[2]
        kv = cache.kv
        num_kv_heads = kv.k.shape[2]
        # entries past a row's last block are stale or 0: they name zero-initialised or previously
        # written blocks (finite values), and the bias masks them out.
        keys = cache.gather(kv.k, self.blocks, kv.k_scale).view(n, -1, num_kv_heads, head_dim).transpose(1, 2).contiguous()
        values = cache.gather(kv.v, self.blocks, kv.v_scale).view(n, -1, num_kv_heads, head_dim).transpose(1, 2).contiguous()
        # query heads h*G .. h*G+G-1 share KV head h: batch over (row, KV head), the G heads as matrix rows
        q_rows = q[self.rows].reshape(n, num_kv_heads, num_heads // num_kv_heads, head_dim)  # a view unless q is strided
        scores = torch.matmul(q_rows, keys.transpose(2, 3))  # [n, Hkv, G, L]
        scores = scoring.scores(scores, self.biases.get(q.dtype, scoring.sliding_window))
        probs = scoring.softmax(scores, (1, num_kv_heads, num_heads // num_kv_heads, 1))  # float32 sums whatever the dtype
        out[self.rows] = torch.matmul(probs, values).view(n, num_heads, head_dim)  # [n, Hkv, G, D]


@dataclass(slots=True)
class _PrefillChunk:
    """Several query tokens of one sequence: a fresh prompt, or a chunk after cached context."""

    start: int  # first flat query row
    q_len: int
    seq_row: int  # the sequence's row in the step's batch (its block table row)
    ctx: int  # context length after this chunk
    slots: torch.Tensor | None  # int64 [ctx] cache slots of the whole context, None for a fresh prefill
    device: torch.device
    # Gemma 3's image runs: int32 [q_len] where each query's keys end (`AttentionMetadata.key_ends`); None: causal
    key_ends: torch.Tensor | None = None
    biases: _BiasCache = field(init=False)  # [q_len, ctx]

    def __post_init__(self) -> None:
        self.biases = _BiasCache(self._masked)

    def _masked(self, sliding_window: int | None) -> torch.Tensor:
        q_pos = torch.arange(self.ctx - self.q_len, self.ctx, device=self.device)[:, None]  # [n, 1]
        k_pos = torch.arange(self.ctx, device=self.device)[None, :]  # [1, ctx]
        masked = k_pos > q_pos if self.key_ends is None else k_pos >= self.key_ends[:, None]
        if sliding_window is not None:  # (HF's: the window bounds the earlier side only)
            masked |= q_pos - k_pos >= sliding_window
        return masked

    def attend(self, q, k, v, cache: _CacheReader, out, scoring: _Scoring) -> None:
        rows = slice(self.start, self.start + self.q_len)
        if self.slots is None:  # fresh prefill: the context is exactly this chunk
            k_seq, v_seq = k[rows], v[rows]  # [ctx, Hkv, D]
        else:
            kv = cache.kv
            num_kv_heads, head_dim = kv.k.shape[2], kv.k.shape[3]
            k_seq = cache.gather(kv.k.view(-1, num_kv_heads, head_dim), self.slots, kv.k_scale)
            v_seq = cache.gather(kv.v.view(-1, num_kv_heads, head_dim), self.slots, kv.v_scale)
        small = q.dtype != torch.float32 and self.q_len * self.ctx <= MATMUL_PREFILL_MAX_PAIRS
        if small or scoring.softcap is not None or scoring.sinks is not None:  # SDPA cannot soft-cap or take sinks
            out[rows] = self._attend_matmul(q[rows], k_seq, v_seq, scoring)
            return
        sliding_window, scale = scoring.sliding_window, scoring.scale
        mask = None  # a fresh prefill without a window or images is plainly causal
        if self.slots is not None or sliding_window is not None or self.key_ends is not None:
            mask = self.biases.get(q.dtype, sliding_window)
        attended = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0), k_seq.transpose(0, 1).unsqueeze(0), v_seq.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,  # [1, H, n|ctx, D] each
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = attended.squeeze(0).transpose(0, 1)

    def _attend_matmul(self, q, k, v, scoring: _Scoring) -> torch.Tensor:
        """q [n, Hq, D] against k, v [ctx, Hkv, D]; returns [n, Hq, D]."""
        n, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        group = num_heads // num_kv_heads
        q_heads = q.reshape(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)
        scores = torch.bmm(q_heads, k.permute(1, 2, 0)).view(num_kv_heads, group, n, self.ctx)
        scores = scoring.scores(scores, self.biases.get(q.dtype, scoring.sliding_window))
        probs = scoring.softmax(scores, (num_kv_heads, group, 1, 1)).reshape(num_kv_heads, group * n, self.ctx)
        attended = torch.bmm(probs, v.transpose(0, 1))  # [Hkv, G * n, D]
        return attended.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


@dataclass(slots=True)
class _FreshPrefills:
    """Fresh prompts of one length (no cached context before them) in one causal SDPA call over [n, H, L, D]
    instead of n calls: a step of many short prompts (embedding and classification jobs, short rows) pays one
    call's overhead per layer, not one per row. Bitwise each row's result alone (SDPA computes every (row,
    head) on its own, at the same size; tests/test_torch_attention.py checks it)."""

    q_len: int
    chunks: list[_PrefillChunk]  # at least two
    rows: torch.Tensor  # int64 [n * q_len]: the flat token rows, prompt by prompt

    def batchable(self, dtype: torch.dtype, scoring: _Scoring) -> bool:
        """The layer takes each chunk's plain causal SDPA path (`_PrefillChunk.attend`), which this batches."""
        small = dtype != torch.float32 and self.q_len * self.q_len <= MATMUL_PREFILL_MAX_PAIRS
        return not small and scoring.softcap is None and scoring.sliding_window is None and scoring.sinks is None

    def attend(self, q, k, v, out, scoring: _Scoring) -> None:
        n = len(self.chunks)

        def batched(x: torch.Tensor) -> torch.Tensor:  # [n * L, H, D] -> [n, H, L, D]
            return x[self.rows].view(n, self.q_len, x.shape[1], x.shape[2]).transpose(1, 2)

        attended = F.scaled_dot_product_attention(batched(q), batched(k), batched(v), is_causal=True, scale=scoring.scale,
                                                  enable_gqa=True)  # [n, Hq, L, D]
        out[self.rows] = attended.transpose(1, 2).reshape(n * self.q_len, q.shape[1], q.shape[2])


def _group_fresh(prefills: list[_PrefillChunk], device: torch.device) -> tuple[list[_FreshPrefills], list[_PrefillChunk]]:
    """(fresh prompts grouped by length where two or more share one, every other chunk)."""
    by_len: dict[int, list[_PrefillChunk]] = {}
    for chunk in prefills:
        if chunk.slots is None and chunk.key_ends is None:
            by_len.setdefault(chunk.q_len, []).append(chunk)
    groups = [c for c in by_len.values() if len(c) > 1]
    grouped = {id(chunk) for chunks in groups for chunk in chunks}
    fresh = [_FreshPrefills(chunks[0].q_len, chunks, torch.cat([torch.arange(c.start, c.start + c.q_len) for c in chunks])
                            .to(device)) for chunks in groups]
    return fresh, [c for c in prefills if id(c) not in grouped]


@dataclass(slots=True)
class _TorchStepState:
    store_all: bool
    store_rows: torch.Tensor | None
    store_slots: torch.Tensor | None
    query_starts: list[int]  # [B + 1] meta.query_start_loc on the host: each row's first flat token
    decode_rows: list[int]  # batch index of every single-token query row, in batch order
    prefills: list[_PrefillChunk]  # every chunk not in `fresh_groups`
    fresh_groups: list[_FreshPrefills]
    image_chunks: list[_PrefillChunk]  # chunks with Gemma 3's image runs (`meta.image_spans`): their own masks
    _groups: list[_DecodeGroup] | None = None
    decode_rows_i32: torch.Tensor | None = None  # int32 [n]: `decode_rows` for the compiled kernel (CpuBackend)
    chunks_i32: torch.Tensor | None = None  # int32 [4, P]: every prefill chunk for the compiled kernel (CpuBackend)

    def decode_groups(self, meta: AttentionMetadata) -> list[_DecodeGroup]:
        """The decode rows, shortest context first, in groups of DECODE_GROUP_ROWS: built on first use and shared
        by every layer (only this backend's own decode attention groups, so only it sorts)."""
        if self._groups is None:
            self._groups = _decode_groups(meta, self.decode_rows, self.query_starts)
        return self._groups

    @classmethod
    def build(cls, meta: AttentionMetadata) -> "_TorchStepState":
        device = meta.slot_mapping.device
        valid = meta.slot_mapping >= 0
        store_all = bool(valid.all())
        store_rows = None if store_all else valid.nonzero().squeeze(1)
        store_slots = None if store_all else meta.slot_mapping[store_rows]

        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens_host
        decode_rows = [b for b, n in enumerate(meta.query_lens_host) if n == 1]
        prefills = []
        spans = meta.image_spans or {}
        for b, q_len in enumerate(meta.query_lens_host):
            if q_len == 1:
                continue
            ctx = seq_lens[b]
            slots = _context_slots(meta, b) if ctx != q_len else None
            key_ends = meta.key_ends[starts[b] : starts[b] + q_len] if starts[b] in spans else None
            prefills.append(_PrefillChunk(starts[b], q_len, b, ctx, slots, device, key_ends))
        image_chunks = [c for c in prefills if c.key_ends is not None]
        fresh_groups, prefills = _group_fresh([c for c in prefills if c.key_ends is None], device)
        return cls(store_all, store_rows, store_slots, starts, decode_rows, prefills, fresh_groups, image_chunks)


def _context_slots(meta: AttentionMetadata, b: int) -> torch.Tensor:
    """int64 [ctx]: the cache slots of batch row b's whole context (this step's tokens included)."""
    ctx, block_size = meta.seq_lens_host[b], meta.block_size
    pos = torch.arange(ctx, device=meta.slot_mapping.device)
    table = meta.block_table[b, : -(-ctx // block_size)].long()
    return table[pos // block_size] * block_size + pos % block_size


def _decode_groups(meta: AttentionMetadata, decode_rows: list[int], starts: list[int]) -> list[_DecodeGroup]:
    device = meta.slot_mapping.device
    seq_lens = meta.seq_lens_host
    decode_rows = sorted(decode_rows, key=seq_lens.__getitem__)  # similar lengths pad less (the runner's order)
    groups = []
    for i in range(0, len(decode_rows), DECODE_GROUP_ROWS):
        members = decode_rows[i : i + DECODE_GROUP_ROWS]
        num_blocks = -(-max(seq_lens[b] for b in members) // meta.block_size)
        idx = torch.tensor(members, device=device)
        rows = [starts[b] for b in members]
        consecutive = rows == list(range(rows[0], rows[0] + len(rows)))
        groups.append(_DecodeGroup(
            rows=slice(rows[0], rows[0] + len(rows)) if consecutive else torch.tensor(rows, device=device),
            num_rows=len(members),
            blocks=meta.block_table[idx, :num_blocks].long().reshape(-1),
            lens=meta.seq_lens[idx].long(),
            length=num_blocks * meta.block_size,
        ))
    return groups


# runs wherever torch does; `auto` takes it where no backend made for the device can run (the CPU without a compiler)
register("torch", TorchBackend, devices=("cpu", "cuda"), fallback=True)
