"""What a checkpoint's config.json says, reduced to the switches our decoder reads.

Parsed from the raw JSON (not transformers' config classes) so it reads the same under every
transformers version; both the old (`rope_theta`, `rope_scaling`) and the new (`rope_parameters`,
`layer_types`) spellings are understood. The architecture picks a family here, and only here; the model
code reads the switches, never the family name.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from cbatch.model.errors import UnsupportedModelError
from cbatch.model.mla_spec import MLASpec, mla_softmax_scale, parse_mla
from cbatch.model.quant import QuantSpec, parse_quantization
from cbatch.model.rope import RopeSpec, rope_spec
from cbatch.model.siglip_spec import SiglipSpec, parse_siglip
from cbatch.model.vision_spec import VISION_ARCHITECTURES, VisionSpec, parse_vision, text_config

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    # architecture name -> model family
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",  # its text decoder and the SigLIP tower (model/siglip.py)
    "Phi3ForCausalLM": "phi3",
    # vision-language: a Qwen2 text decoder with M-RoPE, and the vision tower (model/vision.py, vision_spec.py)
    "Qwen2VLForConditionalGeneration": "qwen2",
    "Qwen2_5_VLForConditionalGeneration": "qwen2",
    "Qwen3VLForConditionalGeneration": "qwen3",  # a Qwen3 decoder, Qwen3-VL's tower (model/vision_qwen3.py)
    "Qwen3VLMoeForConditionalGeneration": "qwen3_moe",  # the same with a Qwen3-MoE decoder
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    # multi-head latent attention (mla_spec.py) with DeepSeek's MoE; Kimi K2 ships as DeepseekV3ForCausalLM
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "GptOssForCausalLM": "gpt_oss",
    # prefill-only checkpoints (engine/pooling.py): a classification head `score` [num_labels, hidden] on the last
    # token (classify, reward, cross-encoder score), or the bare decoder (hidden states: embeddings)
    "LlamaForSequenceClassification": "llama",
    "MistralForSequenceClassification": "mistral",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    "Gemma2ForSequenceClassification": "gemma2",
    "LlamaModel": "llama",
    "MistralModel": "mistral",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
    "Gemma2Model": "gemma2",
}
_DEFAULT_ROPE_THETA = {"gpt_oss": 150_000.0}  # HF config classes' defaults where they are not 10000
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # HF name -> backend activation
# transformers' Gemma3TextConfig defaults: hub configs of Gemma3ForConditionalGeneration state only the
# text_config values that differ from them (gemma-3-4b-it omits the vocabulary, head_dim, rope_theta...)
_GEMMA3_TEXT_DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072, rms_norm_eps=1e-6,
    query_pre_attn_scalar=256, sliding_window=4096, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
)


@dataclass(frozen=True, slots=True)
class MoESpec:
    num_experts: int
    top_k: int
    intermediate_size: int  # of each expert
    renormalize: bool  # the top-k routing weights are divided by their sum
    weights_in_model_dtype: bool  # Qwen casts the routing weights to the activations' dtype; Mixtral keeps float32
    shared_expert_size: int  # Qwen2-MoE: a shared MLP scaled by sigmoid(shared_expert_gate(x)); 0: none
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or the dense MLP of `intermediate_size`
    shared_expert_gated: bool = True  # False: the shared MLP is added as is (DeepSeek's shared experts)
    # DeepSeek's router (moe.GroupLimitedRouter), None: softmax top-k as above. "softmax": V2 (greedy, or
    # group_limited_greedy: groups ranked by their best expert); "sigmoid": V3's noaux_tc (sigmoid scores, the
    # choice made on scores + e_score_correction_bias, groups ranked by the sum of their best two)
    grouped_scoring: str | None = None
    num_groups: int = 1  # n_group: experts in this many equal groups; the top `topk_groups` groups are eligible
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0  # the routing weights' final factor
    # "softmax_topk": softmax over every expert's logit, then the top k (Mixtral, Qwen); "topk_softmax": the top k
    # logits, then a softmax over those k only (gpt-oss)
    routing: str = "softmax_topk"
    biased: bool = False  # gpt-oss: the router and every expert's two projections add a bias
    # gpt-oss's clamped SwiGLU: gate <= limit, -limit <= up <= limit, (up + 1) * gate * sigmoid(alpha * gate);
    # None: the spec's `hidden_act` gated MLP
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    # gpt-oss checkpoints: the stacked experts stored [E, in, out] (w13's gate and up columns interleaved: gate 0,
    # up 0, gate 1, ...); the loader turns them into ours (weights.Placement.transposed / .interleaved)
    experts_in_out_interleaved: bool = False
    # --expert-parallel: the experts spread whole over the tensor-parallel ranks (cbatch/model/shard.py)
    expert_parallel: bool = False
    # a rank's share under expert parallelism: the [first, stop) of the experts it holds; None: every expert
    expert_range: tuple[int, int] | None = None

    @property
    def held_experts(self) -> int:
        """The experts this (rank's) model holds."""
        return self.num_experts if self.expert_range is None else self.expert_range[1] - self.expert_range[0]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    architecture: str
    family: str  # a SUPPORTED_ARCHITECTURES value
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # of the dense MLP
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3, Gemma 3: RMSNorm over each head of q and k before RoPE
    torch_dtype: str | None  # the checkpoint's dtype as config.json states it
    eos_token_ids: tuple[int, ...]
    rope: tuple[RopeSpec, ...]  # one table per distinct RoPE (Gemma 3: local and global)
    layer_rope: tuple[int, ...]  # per layer: index into `rope`
    layer_windows: tuple[int | None, ...]  # per layer: sliding window (keys within this distance), None = full
    hidden_act: str = "silu"  # gated MLP activation: silu | gelu_tanh
    attn_scale: float | None = None  # softmax scale; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    embed_scale: float | None = None  # Gemma: embeddings multiplied by sqrt(hidden_size)
    norm_unit_offset: bool = False  # Gemma: RMSNorm scales by (1 + weight), in float32
    attn_sinks: bool = False  # gpt-oss: a learned logit per query head joins each softmax's denominator (`sinks`)
    sandwich_norms: bool = False  # Gemma: RMSNorm after attention and after the MLP too, before the residual add
    moe: MoESpec | None = None
    quant: QuantSpec | None = None
    mla: MLASpec | None = None  # multi-head latent attention: num_kv_heads 1, head_dim = its latent size
    head: str = "lm"  # lm (logits over the vocabulary) | classify (`score`: num_labels logits) | none (hidden states)
    num_labels: int = 0  # classify: the head's outputs
    labels: tuple[str, ...] = ()  # classify: config.json's id2label, in id order
    # a vision-language model's image side (vision_spec.py; Gemma 3's: siglip_spec.py); None: text only
    vision: VisionSpec | SiglipSpec | None = None

    @property
    def generates(self) -> bool:
        """The checkpoint has logits over the vocabulary (its own lm_head, or tied embeddings)."""
        return self.head == "lm" or (self.head == "none" and self.tie_word_embeddings)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def kv_cache_parts(self) -> int:
        """Tensors per layer in the KV cache: K and V, or MLA's one latent (its value is a prefix of it)."""
        return 1 if self.mla is not None else 2

    def is_sparse(self, layer: int) -> bool:
        return self.moe is not None and self.moe.sparse_layers[layer]

    def _layer_params(self, experts_per_token: int | None) -> int:
        """Matrix parameters of every layer; `experts_per_token` None counts every expert."""
        h = self.hidden_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.mla is not None:
            attn = self.mla.attention_params(h, self.num_heads)
        total = 0
        for layer in range(self.num_layers):
            total += attn
            if not self.is_sparse(layer):
                total += 3 * h * self.intermediate_size
                continue
            moe = self.moe
            held = moe.held_experts  # (an expert-parallel rank: its own, and its share of a token's top-k)
            experts = held if experts_per_token is None else experts_per_token
            if experts_per_token is not None and moe.expert_range is not None:
                experts = experts_per_token * held / moe.num_experts  # on average
            total += h * moe.num_experts + experts * 3 * h * moe.intermediate_size  # router + experts
            total += 3 * h * moe.shared_expert_size + (h if moe.shared_expert_size and moe.shared_expert_gated else 0)
        return total

    def num_params(self) -> int:
        """Every parameter a decoder forward pass may use (embedding lookup excluded, lm_head included): the
        published size of a dense text model; for a mixture of experts every expert counts. A vision-language
        model's tower is not in it (`tower_params`: it runs only on steps that encode images)."""
        return self._layer_params(None) + self.vocab_size * self.hidden_size

    def tower_params(self) -> int:
        """A vision-language model's image encoder (tower, merger or projector) as a run holds it, whole on rank 0
        (vision_spec.py, siglip_spec.py); 0 for a text model."""
        return 0 if self.vision is None else self.vision.num_params()

    def active_params(self) -> int:
        """Parameters one token's forward pass multiplies (lm_head included): a mixture of experts counts
        its top-k experts only. The FLOPs per token are twice this."""
        return self._layer_params(self.moe.top_k if self.moe else None) + self.vocab_size * self.hidden_size

    def params_read(self, tokens: float) -> float:
        """Parameters a step of `tokens` tokens reads from memory (lm_head included): every dense weight,
        and of each MoE layer's experts the expected number that at least one token picks,
        E * (1 - (1 - k / E) ** tokens) with uniform routing (all of them once tokens >> E / k)."""
        if self.moe is None:
            return float(self.num_params())
        moe = self.moe
        touched = moe.held_experts * (1.0 - (1.0 - moe.top_k / moe.num_experts) ** max(tokens, 0.0))
        untouched_params = (moe.held_experts - touched) * 3 * self.hidden_size * moe.intermediate_size
        return self.num_params() - sum(moe.sparse_layers) * untouched_params

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """One token's cache over every layer: K and V per KV head, or MLA's latent
        (kv_lora_rank + qk_rope_head_dim values)."""
        return self.kv_cache_parts * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(f"{model_dir} has no config.json; --model must be a Hugging Face checkpoint folder")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"{path} is not readable JSON ({exc}); the checkpoint looks damaged") from None


def _rope_params(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """One standardised rope dict from either spelling (`rope_parameters`, or `rope_theta` + `rope_scaling`)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("rope_theta" in params or "rope_type" in params):
        params = dict(params)
    else:
        params = dict(cfg["rope_scaling"]) if isinstance(cfg.get("rope_scaling"), dict) else {}
    params.setdefault("rope_theta", cfg.get("rope_theta", _DEFAULT_ROPE_THETA.get(family, 10000.0)))
    params.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rope_type = params.pop("type", None) or params.get("rope_type", "default")
    if family == "phi3" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # HF's Phi3Config reads these legacy names as longrope
    params["rope_type"] = rope_type
    if family == "phi3" and "original_max_position_embeddings" in cfg:
        params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]  # HF: the top level wins
    return params


def _gemma3_rope_params(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Gemma 3: {"sliding_attention": local rope, "full_attention": global rope}. Old configs give
    `rope_theta` (global), `rope_local_base_freq` and a `rope_scaling` of the global layers."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        out = {kind: dict(params.get(kind) or {"rope_type": "default"}) for kind in ("sliding_attention", "full_attention")}
    else:
        out = {"sliding_attention": {"rope_type": "default"}, "full_attention": {"rope_type": "default"}}
        if isinstance(cfg.get("rope_scaling"), dict):
            out["full_attention"].update(cfg["rope_scaling"])
    out["full_attention"].setdefault("rope_theta", cfg.get("rope_theta", 1_000_000.0))
    out["sliding_attention"].setdefault("rope_theta", cfg.get("rope_local_base_freq", 10_000.0))
    return out


def _layer_types(cfg: dict[str, Any], family: str, num_layers: int) -> list[str]:
    """Per layer: "sliding_attention" or "full_attention", as each family's HF config derives it."""
    window = cfg.get("sliding_window") or None
    if family in ("mistral", "mixtral", "phi3", "qwen3_moe"):  # HF applies the window to every layer
        if family == "qwen3_moe" and not cfg.get("use_sliding_window", False):
            window = None
        return ["sliding_attention" if window else "full_attention"] * num_layers
    if family == "gpt_oss" and window and not cfg.get("layer_types"):  # HF's GptOssConfig: sliding first, alternating
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if family == "llama" or not window:
        return ["full_attention"] * num_layers
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    if family == "gemma2":
        return ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if family == "gemma3":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    use, first = cfg.get("use_sliding_window", False), int(cfg.get("max_window_layers", 0))
    if family == "qwen2_moe":
        return ["sliding_attention" if use and (i + 1) % 2 and i < first else "full_attention" for i in range(num_layers)]
    return ["sliding_attention" if use and i >= first else "full_attention" for i in range(num_layers)]  # qwen2, qwen3


def _layer_windows(cfg: dict[str, Any], family: str, num_layers: int) -> tuple[int | None, ...]:
    types = _layer_types(cfg, family, num_layers)
    unknown = set(types) - {"sliding_attention", "full_attention"}
    if unknown or len(types) != num_layers:
        raise UnsupportedModelError(
            f"layer_types {sorted(unknown) or types} is not supported; cbatch runs sliding_attention and full_attention layers"
        )
    window = cfg.get("sliding_window") or None
    return tuple(int(window) if t == "sliding_attention" else None for t in types)


def _eos_ids(cfg: dict[str, Any], generation_cfg: dict[str, Any]) -> tuple[int, ...]:
    # HF `generate` stops on generation_config.eos_token_id, falling back to the model config's.
    value = generation_cfg.get("eos_token_id", cfg.get("eos_token_id"))
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def _deepseek_moe_spec(cfg: dict[str, Any], family: str, num_layers: int) -> MoESpec | None:
    """DeepSeek-V2/V3 (and Kimi K2): routed experts from layer first_k_dense_replace on, n_shared_experts shared
    MLPs of moe_intermediate_size (one MLP of their total width, ungated), group-limited routing."""
    num_experts = int(cfg.get("n_routed_experts") or 0)
    if not num_experts:
        return None
    size = int(cfg["moe_intermediate_size"])
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    if family == "deepseek_v3":  # HF's DeepseekV3 router is always noaux_tc
        scoring, groups, topk_groups = "sigmoid", int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
        renormalize = bool(cfg.get("norm_topk_prob", True))
    else:
        method = cfg.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise UnsupportedModelError(f"DeepSeek-V2 topk_method {method!r} is not supported; supported: greedy, "
                                        f"group_limited_greedy")
        limited = method == "group_limited_greedy"
        scoring = "softmax"
        groups = int(cfg.get("n_group") or 1) if limited else 1
        topk_groups = int(cfg.get("topk_group") or 1) if limited else 1
        renormalize = False  # HF's DeepseekV2 router never renormalises (norm_topk_prob is not read)
    if num_experts % groups or not 0 < topk_groups <= groups:
        raise UnsupportedModelError(f"n_group {groups} with topk_group {topk_groups} does not split "
                                    f"{num_experts} experts into equal groups")
    return MoESpec(num_experts, int(cfg["num_experts_per_tok"]), size, renormalize=renormalize,
                   weights_in_model_dtype=False, shared_expert_size=size * int(cfg.get("n_shared_experts") or 0),
                   sparse_layers=tuple(i >= first_dense for i in range(num_layers)), shared_expert_gated=False,
                   grouped_scoring=scoring, num_groups=groups, topk_groups=topk_groups,
                   routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0))


def _moe_spec(cfg: dict[str, Any], family: str, num_layers: int) -> MoESpec | None:
    if family in ("deepseek_v2", "deepseek_v3"):
        return _deepseek_moe_spec(cfg, family, num_layers)
    if family == "gpt_oss":  # every layer sparse; no shared expert
        return MoESpec(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]), int(cfg["intermediate_size"]),
                       renormalize=False, weights_in_model_dtype=True, shared_expert_size=0,
                       sparse_layers=(True,) * num_layers, routing="topk_softmax", biased=True,
                       swiglu_limit=float(cfg.get("swiglu_limit", 7.0)), swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                       experts_in_out_interleaved=True)
    if family == "mixtral":
        return MoESpec(int(cfg["num_local_experts"]), int(cfg["num_experts_per_tok"]), int(cfg["intermediate_size"]),
                       renormalize=True, weights_in_model_dtype=False, shared_expert_size=0,
                       sparse_layers=(True,) * num_layers)
    if family not in ("qwen2_moe", "qwen3_moe"):
        return None
    num_experts = int(cfg.get("num_experts") or cfg["num_local_experts"])
    dense_layers = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1))
    sparse = tuple(i not in dense_layers and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return MoESpec(num_experts, int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]),
                   renormalize=bool(cfg.get("norm_topk_prob", False)), weights_in_model_dtype=True,
                   shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0) if family == "qwen2_moe" else 0,
                   sparse_layers=sparse)


def _rope_specs(cfg: dict[str, Any], family: str, head_dim: int, windows: tuple[int | None, ...],
                max_pos: int) -> tuple[tuple[RopeSpec, ...], tuple[int, ...]]:
    if family != "gemma3":
        return (rope_spec(_rope_params(cfg, family), head_dim, max_pos),), (0,) * len(windows)
    params = _gemma3_rope_params(cfg)
    local, full = (rope_spec(params[k], head_dim, max_pos) for k in ("sliding_attention", "full_attention"))
    return (local, full), tuple(0 if w is not None else 1 for w in windows)


def _gemma_switches(cfg: dict[str, Any], family: str, hidden: int) -> dict[str, Any]:
    if family not in ("gemma2", "gemma3"):
        return {}
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention (an embedding model) is not supported; cbatch runs causal decoders")
    return dict(
        attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping") or None,
        final_softcap=cfg.get("final_logit_softcapping") or None,
        embed_scale=hidden**0.5,
        norm_unit_offset=True,
        sandwich_norms=True,
    )


def _activation(cfg: dict[str, Any], family: str) -> str:
    gemma = family in ("gemma2", "gemma3")
    name = cfg.get("hidden_activation") or cfg.get("hidden_act") or ("gelu_pytorch_tanh" if gemma else "silu")
    if gemma and name == "gelu":
        name = "gelu_pytorch_tanh"  # early Gemma configs say gelu; HF runs the tanh approximation
    if name not in _ACTIVATIONS:
        raise UnsupportedModelError(f"activation {name!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    return _ACTIVATIONS[name]


def _architecture(cfg: dict[str, Any]) -> tuple[str, str]:
    architectures = cfg.get("architectures") or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        named = ", ".join(architectures) if architectures else f"model_type {cfg.get('model_type')!r}"
        raise UnsupportedModelError(
            f"unsupported architecture ({named}); cbatch runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch, SUPPORTED_ARCHITECTURES[arch]


def parse_spec(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None) -> ModelSpec:
    arch, family = _architecture(cfg)
    if arch in VISION_ARCHITECTURES:  # text + vision: the text decoder's config, and the vision side
        vision = parse_vision(cfg, arch)
        text = text_config(cfg)
        if arch == "Qwen3VLMoeForConditionalGeneration":  # its router always renormalizes the top-k (no switch)
            text["norm_topk_prob"] = True
        spec = _parse_or_refuse(text, arch, family, generation_cfg or {})
        return replace(spec, vision=vision)
    if arch == "Gemma3ForConditionalGeneration":  # text + vision: the text decoder's config, and SigLIP's side
        text = {**_GEMMA3_TEXT_DEFAULTS, **(cfg.get("text_config") or {})}
        text = {**text, "eos_token_id": cfg.get("eos_token_id", text.get("eos_token_id")),
                "torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype") or text.get("torch_dtype")}
        spec = _parse_or_refuse(text, arch, family, generation_cfg or {})
        return replace(spec, vision=parse_siglip(cfg, spec.hidden_size))
    return _parse_or_refuse(cfg, arch, family, generation_cfg or {})


def _parse_or_refuse(cfg: dict[str, Any], arch: str, family: str, generation_cfg: dict[str, Any]) -> ModelSpec:
    try:
        return _parse(cfg, arch, family, generation_cfg)
    except KeyError as exc:
        raise UnsupportedModelError(f"config.json of a {arch} lacks {exc.args[0]!r}; the checkpoint looks incomplete") from None


def _parse(cfg: dict[str, Any], arch: str, family: str, generation_cfg: dict[str, Any]) -> ModelSpec:
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    num_layers = int(cfg["num_hidden_layers"])
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    windows = _layer_windows(cfg, family, num_layers)
    attention_bias = bool(cfg.get("attention_bias", family == "gpt_oss"))  # HF's GptOssConfig defaults it on
    qkv_bias = family == "qwen2" or (family == "qwen2_moe" and bool(cfg.get("qkv_bias", True))) or attention_bias
    num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
    mla = parse_mla(cfg, family) if family in ("deepseek_v2", "deepseek_v3") else None
    mla_switches: dict[str, Any] = {}
    if mla is not None:  # the cache's view of MLA: one "head" holding the latent (mla_spec.py)
        rope = (rope_spec(_rope_params(cfg, family), mla.qk_rope_head_dim, max_pos),)
        layer_rope = (0,) * num_layers
        num_kv_heads, head_dim, qkv_bias = 1, mla.latent_size, False
        mla_switches = dict(mla=mla, attn_scale=mla_softmax_scale(mla, _rope_params(cfg, family)))
    else:
        rope, layer_rope = _rope_specs(cfg, family, head_dim, windows, max_pos)
    return ModelSpec(
        architecture=arch,
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", family in ("gemma2", "gemma3"))),
        qkv_bias=qkv_bias,
        o_bias=family not in ("qwen2", "qwen2_moe") and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3"),
        attn_sinks=family == "gpt_oss",
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        eos_token_ids=_eos_ids(cfg, generation_cfg),
        rope=rope,
        layer_rope=layer_rope,
        layer_windows=windows,
        hidden_act=_activation(cfg, family),
        moe=_moe_spec(cfg, family, num_layers),
        quant=parse_quantization(cfg.get("quantization_config")),
        **_gemma_switches(cfg, family, hidden),
        **mla_switches,
        **_head(cfg, arch),
    )


def _head(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The checkpoint's head: a sequence classification head (num_labels from config.json, default 2 as HF),
    none (a bare decoder: `*Model`), or the language-model head (also a *ForSequenceClassification config naming
    `classifier_from_token`: vLLM's spelling of an LM-head reranker, whose checkpoint holds the LM head)."""
    if arch.endswith("ForSequenceClassification") and cfg.get("classifier_from_token") is None:
        id2label = cfg.get("id2label") or {}
        num_labels = int(cfg.get("num_labels") or len(id2label) or 2)
        labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels))
        return dict(head="classify", num_labels=num_labels, labels=labels)
    return dict(head="none") if arch.endswith("Model") else {}
