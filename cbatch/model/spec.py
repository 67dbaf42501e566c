"""What a checkpoint's config.json says, reduced to the switches our Llama-family model reads.

Parsed from the raw JSON (not transformers' config classes) so it reads the same under every
transformers version; both the old (`rope_theta`, `rope_scaling`) and the new (`rope_parameters`)
spellings are understood.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cbatch.config import UserError

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    # architecture name -> model family switch
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class UnsupportedModelError(UserError):
    """The checkpoint is not one cbatch can run correctly; the message names what is supported."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    architecture: str
    family: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # the rope_type and its parameters, None for plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over each head of q and k before RoPE
    sliding_window: int | None
    torch_dtype: str | None  # the checkpoint's dtype as config.json states it
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameters that take part in a token's forward pass (embedding lookup excluded, lm_head included)."""
        h, i = self.hidden_size, self.intermediate_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = 3 * h * i
        return self.num_layers * (attn + mlp) + self.vocab_size * h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(f"{model_dir} has no config.json; --model must be a Hugging Face checkpoint folder")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"{path} is not readable JSON ({exc}); the checkpoint looks damaged") from None


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = dict(params)
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg["rope_scaling"]) if isinstance(cfg.get("rope_scaling"), dict) else {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE scaling {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    return theta, scaling


def _eos_ids(cfg: dict[str, Any], generation_cfg: dict[str, Any]) -> tuple[int, ...]:
    # HF `generate` stops on generation_config.eos_token_id, falling back to the model config's.
    value = generation_cfg.get("eos_token_id", cfg.get("eos_token_id"))
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def parse_spec(cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None) -> ModelSpec:
    architectures = cfg.get("architectures") or []
    arch = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        named = ", ".join(architectures) if architectures else f"model_type {cfg.get('model_type')!r}"
        raise UnsupportedModelError(
            f"unsupported architecture ({named}); cbatch runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    head_dim = cfg.get("head_dim") or hidden // num_heads
    theta, scaling = _rope(cfg)
    attention_bias = bool(cfg.get("attention_bias", False))
    sliding = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        sliding = None  # Qwen configs carry a window size even when it is off
    layer_types = set(cfg.get("layer_types") or [])
    if layer_types == {"full_attention"}:
        sliding = None
    elif layer_types and (len(layer_types) > 1 or sliding is None):
        raise UnsupportedModelError("mixed full/sliding-window attention layers are not supported")
    return ModelSpec(
        architecture=arch,
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
        sliding_window=int(sliding) if sliding else None,
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        eos_token_ids=_eos_ids(cfg, generation_cfg or {}),
    )
