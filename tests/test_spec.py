"""config.json -> ModelSpec for the families HF derives things for: per-layer windows without `layer_types`,
MoE layouts, and refusals that name what is supported."""
from __future__ import annotations

import dataclasses

import pytest

from cbatch.model.spec import UnsupportedModelError, parse_spec

SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def spec(arch: str, **cfg):
    return parse_spec({"architectures": [arch], **SHAPE, **cfg})


@pytest.mark.parametrize("arch, cfg, windows", [
    ("MistralForCausalLM", dict(sliding_window=32), (32, 32, 32, 32)),
    ("MixtralForCausalLM", dict(sliding_window=32, num_local_experts=4, num_experts_per_tok=2), (32, 32, 32, 32)),
    ("Phi3ForCausalLM", dict(sliding_window=32), (32, 32, 32, 32)),
    ("Qwen2ForCausalLM", dict(sliding_window=32, use_sliding_window=True, max_window_layers=2), (None, None, 32, 32)),
    ("Qwen2ForCausalLM", dict(sliding_window=32, use_sliding_window=False), (None,) * 4),
    ("Qwen3MoeForCausalLM", dict(sliding_window=32, use_sliding_window=False, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=16), (None,) * 4),
    ("Gemma2ForCausalLM", dict(sliding_window=32), (32, None, 32, None)),
    ("Gemma3ForCausalLM", dict(sliding_window=32, sliding_window_pattern=3), (32, 32, None, 32)),
    ("Gemma3ForCausalLM", dict(sliding_window=32, layer_types=["full_attention", "sliding_attention"] * 2), (None, 32, None, 32)),
    ("LlamaForCausalLM", dict(sliding_window=32), (None,) * 4),  # Llama has no window, whatever the config says
])
def test_layer_windows_as_hf_derives_them(arch, cfg, windows):
    assert spec(arch, **cfg).layer_windows == windows


def test_moe_layouts():
    qwen2 = spec("Qwen2MoeForCausalLM", num_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                 shared_expert_intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[3])
    moe = qwen2.moe
    assert moe.sparse_layers == (False, True, False, False)  # every 2nd layer, but layer 3 kept dense
    assert (moe.shared_expert_size, moe.renormalize, moe.weights_in_model_dtype) == (48, False, True)
    assert qwen2.qkv_bias and not qwen2.o_bias
    qwen3 = spec("Qwen3MoeForCausalLM", num_local_experts=6, num_experts_per_tok=2, moe_intermediate_size=16,
                 norm_topk_prob=True, head_dim=32)
    assert (qwen3.moe.num_experts, qwen3.moe.renormalize, qwen3.moe.shared_expert_size, qwen3.qk_norm) == (6, True, 0, True)
    mixtral = spec("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2)
    assert (mixtral.moe.intermediate_size, mixtral.moe.renormalize, mixtral.moe.weights_in_model_dtype) == (96, True, False)
    # active parameters: top-2 of 8 experts; a step of one token reads those two only, a long step all eight
    expert = 3 * 64 * 96
    assert mixtral.num_params() - mixtral.active_params() == 4 * 6 * expert
    assert mixtral.params_read(1) == pytest.approx(mixtral.active_params())
    assert mixtral.params_read(10_000) == pytest.approx(mixtral.num_params())


def test_gemma_switches():
    gemma2 = spec("Gemma2ForCausalLM", head_dim=16, query_pre_attn_scalar=144, sliding_window=32)
    assert gemma2.softmax_scale == pytest.approx(1 / 12)
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (None, None)  # not in this config.json: off
    assert gemma2.norm_unit_offset and gemma2.sandwich_norms and gemma2.embed_scale == 8.0
    assert gemma2.hidden_act == "gelu_tanh" and gemma2.tie_word_embeddings


@pytest.mark.parametrize("arch, cfg, message", [
    ("Gemma3ForCausalLM", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("LlamaForCausalLM", dict(hidden_act="relu2"), "activation 'relu2' is not supported; supported: silu, gelu_pytorch_tanh"),
    ("Qwen2ForCausalLM", dict(sliding_window=8, use_sliding_window=True, layer_types=["chunked_attention"] * 4),
     "layer_types \\['chunked_attention'\\] is not supported"),
    ("MixtralForCausalLM", dict(num_experts_per_tok=2), "config.json of a MixtralForCausalLM lacks 'num_local_experts'"),
    ("Phi3ForCausalLM", dict(partial_rotary_factor=0.1), "need an even number"),
])
def test_refusals_name_the_problem(arch, cfg, message):
    with pytest.raises(UnsupportedModelError, match=message):
        spec(arch, **cfg)


def test_multimodal_gemma3_runs_its_text_decoder_with_hf_defaults():
    """gemma-3-4b-it's config.json: a text_config stating only what differs from Gemma3TextConfig's defaults."""
    from cbatch.model.presets import preset_spec
    from gemma3_vision_models import GEMMA_3_4B_CONFIG

    got = parse_spec(GEMMA_3_4B_CONFIG)
    assert dataclasses.replace(got, vision=None) == dataclasses.replace(preset_spec("gemma-3-4b"),
                                                                         architecture="Gemma3ForConditionalGeneration")
    vision = got.vision  # its SigLIP tower: 64 x 64 patches of 896 pixels pooled 4 x 4 into 256 tokens
    assert (vision.depth, vision.hidden_size, vision.patches_per_side, vision.pool, vision.out_hidden_size) == \
        (27, 1152, 64, 4, 2560)
    assert (vision.image_token_id, vision.boi_token_id, vision.eoi_token_id) == (262144, 255999, 256000)


def test_roofline_counts_active_experts_and_fp8_bytes():
    from cbatch.observe.metrics import StepSample
    from cbatch.observe.roofline import hardware_estimate

    mixtral = spec("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2)
    decode = [StepSample(t=1.0, running=1, waiting=0, scheduled_tokens=1, prefill_tokens=0, output_tokens=1, kv_used=0)]
    bf16 = hardware_estimate(mixtral, 2, decode, 1.0, None, True)
    fp8 = hardware_estimate(mixtral, 2, decode, 1.0, None, True, weight_bytes=1.0)
    assert bf16["model_flops"] == pytest.approx(2 * mixtral.active_params())  # not 2 x every expert
    assert bf16["bytes_moved"] == pytest.approx(2 * mixtral.active_params() + mixtral.kv_bytes_per_token(2))
    assert fp8["bytes_moved"] == pytest.approx(mixtral.active_params() + mixtral.kv_bytes_per_token(2))
