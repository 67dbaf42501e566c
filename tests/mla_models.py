"""Tiny multi-head latent attention checkpoints (DeepSeek-V2/V3, a Kimi-K2-shaped V3), written by HF transformers,
with a decisive init: wide weights (tiny_models.BASE), random norm weights and router biases, so a wrong rope layout,
softmax scale, routing rule or latent cache changes the greedy tokens."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from tiny_models import BASE

_MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=12, intermediate_size=96, moe_intermediate_size=16, first_k_dense_replace=1,
            num_hidden_layers=3, max_position_embeddings=256, tie_word_embeddings=False)
# DeepSeek's YaRN (factor, mscale, mscale_all_dim: the softmax scale grows) over 256 positions from 64
_YARN = {"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.8, "original_max_position_embeddings": 64,
         "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}

MLA_MODELS: dict[str, dict] = {
    # V3: q_lora_rank, interleaved rope with YaRN, noaux_tc over 4 groups (2 kept), a dense first layer
    "deepseek_v3": dict(cls="DeepseekV3Config", q_lora_rank=24, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                        topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                        rope_parameters=_YARN, rope_interleave=True),
    # V2-Lite's shape: no q_lora_rank (one q_proj), complex (interleaved) rope, softmax group_limited_greedy
    "deepseek_v2": dict(cls="DeepseekV2Config", q_lora_rank=None, n_routed_experts=8, num_experts_per_tok=2,
                        topk_method="group_limited_greedy", n_group=4, topk_group=2, n_shared_experts=2,
                        routed_scaling_factor=1.5),
    # Kimi K2: the V3 architecture with one expert group, more and narrower experts, fewer heads, its own
    # model_type; rope not interleaved here (the V3 switch off)
    "kimi_k2": dict(cls="DeepseekV3Config", model_type="kimi_k2", q_lora_rank=24, num_attention_heads=2,
                    num_key_value_heads=2, n_routed_experts=16, num_experts_per_tok=4, n_group=1, topk_group=1,
                    n_shared_experts=1, routed_scaling_factor=2.827, norm_topk_prob=True, rope_interleave=False,
                    rope_parameters={**_YARN, "factor": 8.0, "mscale_all_dim": 1.0,
                                     "original_max_position_embeddings": 32}),
}
# what a DeepSeek-V3 checkpoint carries past num_hidden_layers: one multi-token-prediction layer (unused)
MTP_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
               "mlp.experts.0.down_proj.weight", "shared_head.norm.weight")


def mla_config(name: str, **overrides):
    import transformers

    spec = {**BASE, **_MLA, **MLA_MODELS[name], **overrides}
    model_type = spec.pop("model_type", None)
    config = getattr(transformers, spec.pop("cls"))(**spec)
    return config, model_type


def hf_mla_model(name: str, seed: int = 0, **overrides):
    """The HF model (float32, eval) with the decisive init."""
    import transformers

    config, _ = mla_config(name, **overrides)
    torch.manual_seed(seed)
    cls = transformers.DeepseekV3ForCausalLM if "V3" in type(config).__name__ else transformers.DeepseekV2ForCausalLM
    model = cls(config).to(torch.float32).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.2)
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.rand_like(buffer) * 0.5)
    return model


def save_mla_checkpoint(model, name: str, path: Path, mtp_layers: int = 0) -> Path:
    """config.json (Kimi K2's model_type where the name says) + model.safetensors; `mtp_layers` adds random
    multi-token-prediction tensors past the last layer, as DeepSeek-V3 ships them."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(path)
    _, model_type = mla_config(name)
    config = json.loads((path / "config.json").read_text())
    if model_type is not None:
        config["model_type"] = model_type
    if mtp_layers:
        config["num_nextn_predict_layers"] = mtp_layers
        tensors = load_file(str(path / "model.safetensors"))
        layer = model.config.num_hidden_layers
        for leaf in MTP_TENSORS:
            tensors[f"model.layers.{layer}.{leaf}"] = torch.randn(4, 4)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    return path


def _quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 [N, K] -> (float8_e4m3fn [N, K], float32 scales [ceil(N / bn), ceil(K / bk)]): amax / 448 per block."""
    from cbatch.model.quant import expand_scales

    rows, cols = -(-weight.shape[0] // block[0]), -(-weight.shape[1] // block[1])
    padded = torch.zeros(rows * block[0], cols * block[1])
    padded[: weight.shape[0], : weight.shape[1]] = weight
    amax = padded.view(rows, block[0], cols, block[1]).abs().amax(dim=(1, 3))
    scale = (amax / 448.0).clamp(min=1e-12)
    return (weight / expand_scales(scale, weight.shape, block)).to(torch.float8_e4m3fn), scale


def save_fp8_block_checkpoint(model, path: Path, block: tuple[int, int]) -> Path:
    """`model` saved as DeepSeek ships FP8: every linear weight (the router aside) float8_e4m3fn with a float32
    weight_scale_inv per block, experts one by one; `model` itself then holds the dequantized weights (HF's
    reference)."""
    from safetensors.torch import save_file
    from cbatch.model.quant import dequantize

    save_mla_checkpoint(model, "deepseek_v3", path)
    tensors: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # stacked -> per expert
            prefix, kind = name.rsplit(".", 1)
            for e in range(value.shape[0]):
                parts = dict(zip(("gate_proj", "up_proj"), value[e].chunk(2))) if kind == "gate_up_proj" else {"down_proj": value[e]}
                tensors.update({f"{prefix}.{e}.{leaf}.weight": w.contiguous() for leaf, w in parts.items()})
        else:
            tensors[name] = value.contiguous()
    stored, dequantized = {}, {}
    for name, value in tensors.items():
        linear = value.dim() == 2 and not any(k in name for k in ("norm", "embed", "lm_head", "mlp.gate.weight"))
        if linear:
            q, scale = _quantize_blocks(value, block)
            stored[name], stored[name.replace(".weight", ".weight_scale_inv")] = q, scale
            dequantized[name] = dequantize(q, scale, block, torch.float32)
        else:
            stored[name] = value
    save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                prefix = name.rsplit(".", 1)[0]
                for e in range(param.shape[0]):
                    leaves = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
                    param[e] = torch.cat([dequantized[f"{prefix}.{e}.{leaf}.weight"] for leaf in leaves])
            elif name in dequantized:
                param.copy_(dequantized[name])
    return path
