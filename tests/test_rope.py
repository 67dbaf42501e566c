"""Every RoPE scaling against HF transformers' own rotary embedding modules: the cos/sin our table holds at
each position equal HF's bit for bit, read from a hub-style config.json (`rope_theta` + `rope_scaling`)
and from the spelling transformers 5 saves (`rope_parameters`)."""
from __future__ import annotations

import importlib

import pytest
import torch
import transformers

from cbatch.model.rope import rope_table
from cbatch.model.spec import UnsupportedModelError, parse_spec

SHAPE = dict(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=4096)
_LONG = [1.0 + 0.37 * i for i in range(12)]  # longrope factors: 12 = (32 * 0.75) / 2 frequencies
CASES = {
    # name: (architecture, config kwargs, max_model_len)
    "default": ("Llama", dict(rope_theta=500000.0), 4096),
    "linear": ("Llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0}), 4096),
    "dynamic": ("Llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 4096),
    "llama3": ("Llama", dict(rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512}), 4096),
    # Qwen2.5's long-context recipe, with the legacy "type" key
    "yarn": ("Qwen2", dict(rope_theta=1e6, rope_scaling={"type": "yarn", "factor": 4.0,
                                                         "original_max_position_embeddings": 1024}), 4096),
    "yarn-mscale": ("Llama", dict(rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
                                                "beta_fast": 24, "original_max_position_embeddings": 256}), 4096),
    "yarn-attention-factor": ("Llama", dict(rope_scaling={"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.2,
                                                          "truncate": False, "original_max_position_embeddings": 512}), 4096),
    "partial": ("Phi3", dict(partial_rotary_factor=0.5), 4096),
    # longrope with partial rotary (Phi-4-mini): short factors up to the original context, long beyond it
    "longrope-short": ("Phi3", dict(partial_rotary_factor=0.75, original_max_position_embeddings=1024, rope_scaling={
        "type": "longrope", "short_factor": _LONG[::-1], "long_factor": _LONG}), 1024),
    "longrope-long": ("Phi3", dict(partial_rotary_factor=0.75, original_max_position_embeddings=1024, rope_scaling={
        "type": "longrope", "short_factor": _LONG[::-1], "long_factor": _LONG}), 4096),
}


def _hf_cos_sin(arch: str, config, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    module = importlib.import_module(f"transformers.models.{arch.lower()}.modeling_{arch.lower()}")
    rotary = getattr(module, f"{arch}RotaryEmbedding")(config)
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions[None])
    return cos[0], sin[0]  # [T, R] each: cat(freqs, freqs)


@pytest.mark.parametrize("case", list(CASES))
def test_rope_table_is_hf_bit_for_bit(case):
    arch, kwargs, max_model_len = CASES[case]
    config = getattr(transformers, f"{arch}Config")(**SHAPE, **kwargs)
    hub_json = {"architectures": [f"{arch}ForCausalLM"], **SHAPE, **kwargs}  # what a hub config.json holds
    saved_json = {**config.to_dict(), "architectures": [f"{arch}ForCausalLM"]}  # what transformers 5 writes
    rope = parse_spec(hub_json).rope[0]
    assert parse_spec(saved_json).rope == (rope,)

    positions = torch.tensor([0, 1, 7, 300, max_model_len - 1])
    table = rope_table(rope, max_model_len)[positions]  # [T, R]: cos | sin
    half = table.shape[1] // 2
    cos, sin = _hf_cos_sin(arch, config, positions)
    assert cos.shape[1] == table.shape[1] == int(32 * float(kwargs.get("partial_rotary_factor", 1.0)))
    assert torch.equal(table[:, :half], cos[:, :half])
    assert torch.equal(table[:, half:], sin[:, :half])


@pytest.mark.parametrize("case", ["linear", "llama3", "yarn", "yarn-mscale", "yarn-attention-factor", "longrope-long"])
def test_each_scaling_changes_the_table(case):
    """The scaling is live: the same config without it gives another table (dynamic alone equals plain
    RoPE within max_position_embeddings, as in HF)."""
    arch, kwargs, max_model_len = CASES[case]
    plain = {k: v for k, v in kwargs.items() if k != "rope_scaling"}
    scaled, unscaled = (parse_spec({"architectures": [f"{arch}ForCausalLM"], **SHAPE, **kw}).rope[0] for kw in (kwargs, plain))
    assert not torch.allclose(rope_table(scaled, max_model_len), rope_table(unscaled, max_model_len))


def test_dynamic_is_plain_rope_within_the_context():
    dynamic = parse_spec({"architectures": ["LlamaForCausalLM"], **SHAPE, **CASES["dynamic"][1]}).rope[0]
    assert dynamic == parse_spec({"architectures": ["LlamaForCausalLM"], **SHAPE}).rope[0]


def test_gemma3_local_and_global_tables_from_either_spelling():
    """Gemma 3's hub configs: rope_theta (global), rope_local_base_freq and a rope_scaling of the global
    layers only, one global layer in `sliding_window_pattern`; transformers 5 writes nested rope_parameters."""
    hub = {"architectures": ["Gemma3ForCausalLM"], **SHAPE, "num_hidden_layers": 7, "head_dim": 32,
           "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
           "sliding_window": 512, "sliding_window_pattern": 6}
    spec = parse_spec(hub)
    local, full = spec.rope
    assert (local.theta, local.scaling) == (10000.0, None)
    assert (full.theta, full.scaling["rope_type"], full.scaling["factor"]) == (1e6, "linear", 8.0)
    assert spec.layer_windows == (512,) * 5 + (None, 512)
    assert spec.layer_rope == (0,) * 5 + (1, 0)
    saved = {**transformers.Gemma3TextConfig(**{k: v for k, v in hub.items() if k != "architectures"}).to_dict(),
             "architectures": ["Gemma3ForCausalLM"]}
    assert parse_spec(saved).rope == spec.rope and parse_spec(saved).layer_windows == spec.layer_windows


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "mrope"}, "'mrope' is not supported; supported: default, linear, dynamic, llama3, yarn, longrope"),
    ({"rope_type": "linear"}, "'linear' lacks factor"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 16}, "'longrope' lacks long_factor"),
])
def test_bad_rope_configs_are_refused_by_name(scaling, message):
    with pytest.raises(UnsupportedModelError, match=message):
        parse_spec({"architectures": ["LlamaForCausalLM"], **SHAPE, "rope_scaling": scaling})
