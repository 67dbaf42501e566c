"""Model shapes without weights: built-in config.json contents for benchmarks and the simulator.

`cbatch bench --model-config NAME|config.json` builds the model from one of these with random
weights (no download, no tokenizer). The shapes are the published configs' (hidden sizes, heads,
layers, vocab, RoPE), so memory use and step cost match the real model's.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cbatch.model.spec import ModelSpec, UnsupportedModelError, parse_spec

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        torch_dtype="bfloat16", eos_token_id=151645,
    ),
    "qwen2.5-1.5b": dict(
        architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
        use_sliding_window=False, torch_dtype="bfloat16", eos_token_id=151643,
    ),
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
        rms_norm_eps=1e-5, tie_word_embeddings=True, torch_dtype="bfloat16", eos_token_id=128001,
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
        rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=128001,
    ),
    # mixtures of experts: FLOPs and bytes per step count the active experts (ModelSpec.active_params)
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=151645,
    ),
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
        sliding_window=None, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=2,
    ),
    # attention sinks, 128-token windows on every other layer, 32 experts (top 4) with the clamped SwiGLU; its hub
    # checkpoint's MXFP4 experts are dequantized at load: bf16 weights, ~42 GB
    "gpt-oss-20b": dict(
        architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_local_experts=32, num_experts_per_tok=4, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, sliding_window=128, attention_bias=True, swiglu_limit=7.0,
        max_position_embeddings=131072, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096},
        rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=[200002, 199999, 200012],
    ),
    # the text decoder of gemma-3-4b-it: five 1024-token sliding-window layers per global one
    "gemma-3-4b": dict(
        architectures=["Gemma3ForCausalLM"], vocab_size=262208, hidden_size=2560, intermediate_size=10240,
        num_hidden_layers=34, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6, max_position_embeddings=131072,
        rope_theta=1000000.0, rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        torch_dtype="bfloat16", eos_token_id=[1, 106],
    ),
    # A CPU-sized Llama: fast enough for tests and laptop benchmarks, long enough context for `chat`.
    "tiny": dict(
        architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        torch_dtype="float32", eos_token_id=2,
    ),
}


def preset_config(name_or_path: str) -> dict[str, Any]:
    """A preset's config dict, or a config.json file's contents."""
    if name_or_path in PRESETS:
        return dict(PRESETS[name_or_path])
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(
            f"--model-config {name_or_path!r}: not a preset ({', '.join(PRESETS)}) nor a config.json file"
        )
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"--model-config {path}: not readable JSON ({exc})") from None


def preset_spec(name_or_path: str) -> ModelSpec:
    return parse_spec(preset_config(name_or_path))
