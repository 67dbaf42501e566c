"""Tiny random-weight checkpoints of every supported architecture, written by HF transformers itself."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

BASE = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    # a wide init makes logits peaked, so greedy argmax is far from ties and comparisons are meaningful
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

ARCHS: dict[str, dict] = {
    "llama": dict(cls="LlamaConfig", tie_word_embeddings=False),
    "llama3-rope-tied": dict(
        cls="LlamaConfig",
        tie_word_embeddings=True,
        num_key_value_heads=1,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
        rope_theta=500000.0,
    ),
    "mistral": dict(cls="MistralConfig", sliding_window=24, tie_word_embeddings=False),
    "qwen2": dict(cls="Qwen2Config", tie_word_embeddings=True),
    "qwen3": dict(cls="Qwen3Config", head_dim=32, tie_word_embeddings=False, num_key_value_heads=4),
}


def make_checkpoint(arch: str, path: Path, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Writes config.json + model.safetensors (+ generation_config.json) for `arch` into `path`."""
    import transformers

    spec = dict(ARCHS[arch])
    cls = getattr(transformers, spec.pop("cls"))
    config = cls(**{**BASE, **spec, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(path)
    return path


def hf_model(path: Path, dtype: torch.dtype = torch.float32):
    """transformers' model of the checkpoint at `path`, the reference: eager attention (transformers 5.17's default,
    SDPA, drops Gemma 2's attention soft-capping; later versions pick eager for it themselves). Skips the test where
    the installed transformers cannot express the checkpoint (`_unexpressible`)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
    reason = _unexpressible(model)
    if reason is not None:
        pytest.skip(reason)
    return model


def _unexpressible(model) -> str | None:
    """Why this transformers computes another model than its checkpoint's config says, or None. gpt-oss: before
    5.18 the experts' clamp is fixed at 7.0 (`swiglu_limit` ignored; the tiny family's is 1.5: it must bite)."""
    limit = getattr(model.config, "swiglu_limit", None)
    experts = next((m for m in model.modules() if type(m).__name__ == "GptOssExperts"), None)
    if experts is not None and limit is not None and getattr(experts, "limit", limit) != limit:
        import transformers

        return (f"transformers {transformers.__version__} fixes gpt-oss's swiglu_limit at {experts.limit}, not this "
                f"checkpoint's {limit}: no reference")
    return None


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """HF `generate`, greedy, stopping at the checkpoint's EOS like cbatch does: the reference completion."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()


def make_lora_adapter(checkpoint: Path, folder: Path, seed: int, **config) -> Path:
    """A random PEFT LoRA adapter of `checkpoint`, made by PEFT with a decisive init (`init_lora_weights=False`: B
    is not zero), saved into `folder`."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(hf_model(checkpoint), LoraConfig(init_lora_weights=False, **config))
    model.save_pretrained(folder)
    return folder


# The families added with issue 17, built on demand (`family_checkpoint` fixture) so sessions that do not
# test them do not pay for them. Small head_dim, two or three layers, windows (8) shorter than the prompts.
_LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.6], "long_factor": [1.1, 2.0, 3.9, 7.5]}
FAMILIES: dict[str, dict] = {
    # Gemma scales embeddings by sqrt(hidden): shrunk (`embed_gain`) so that attention, not the current
    # token alone, decides the argmax (else a wrong window or soft-cap would still give the same tokens)
    "gemma2": dict(cls="Gemma2Config", head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                   attn_logit_softcapping=20.0, final_logit_softcapping=2.0, embed_gain=0.1),
    "gemma3": dict(cls="Gemma3TextConfig", head_dim=16, query_pre_attn_scalar=24, sliding_window=8, embed_gain=0.1,
                   num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}),
    # gemma-3-4b and up are published text + vision: the same text decoder inside a Gemma3Config
    "gemma3-multimodal": dict(cls="Gemma3Config", embed_gain=0.1, mm_tokens_per_image=4, image_token_index=383,
                              boi_token_index=381, eoi_token_index=382,
                              text_config=dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
                                               layer_types=["sliding_attention", "full_attention"]),
                              vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=28, patch_size=14)),
    "phi3": dict(cls="Phi3Config", tie_word_embeddings=False, sliding_window=8),
    # partial rotary (8 of 16 dimensions) with longrope past an original context of 16
    "phi3-longrope": dict(cls="Phi3Config", tie_word_embeddings=False, num_attention_heads=4, head_dim=16,
                          partial_rotary_factor=0.5, original_max_position_embeddings=16, rope_scaling=_LONGROPE),
    "mixtral": dict(cls="MixtralConfig", num_local_experts=8, num_experts_per_tok=2, intermediate_size=48,
                    sliding_window=8, tie_word_embeddings=False),
    "qwen2_moe": dict(cls="Qwen2MoeConfig", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1],
                      tie_word_embeddings=False),
    "qwen3_moe": dict(cls="Qwen3MoeConfig", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, head_dim=16, tie_word_embeddings=False),
    # attention sinks, alternating sliding (8) / full layers, YaRN as gpt-oss configures it, 4 experts (top 2) with
    # biases and the clamped SwiGLU; widths (64, 32) multiples of MXFP4's 32-element blocks. `spread_biases`: the
    # biases and sinks drawn wide (HF zeroes the experts' biases and draws sinks at initializer_range), so a wrong
    # sink or bias changes the tokens
    "gpt_oss": dict(cls="GptOssConfig", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
                    sliding_window=8, swiglu_limit=1.5, tie_word_embeddings=False, spread_biases=True,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 256, "rope_theta": 150000.0}),
}


def make_family_checkpoint(name: str, path: Path, seed: int = 0, **overrides) -> Path:
    """Like `make_checkpoint`, for FAMILIES; RMSNorm weights are randomised too (HF initialises Gemma's to
    0 and the others' to 1, which would hide a wrong norm formula), and with `spread_biases` every bias (N(0, 0.3))
    and attention sink (N(0, 2))."""
    import transformers

    spec = dict(FAMILIES[name])
    cls = getattr(transformers, spec.pop("cls"))
    embed_gain = spec.pop("embed_gain", 1.0)
    spread_biases = spec.pop("spread_biases", False)
    if "text_config" in spec:  # a multimodal config: the shapes go to its text decoder
        text = {**BASE, **spec.pop("text_config")}
        config = cls(text_config=text, initializer_range=text.pop("initializer_range"), **spec, **overrides)
    else:
        config = cls(**{**BASE, **spec, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(torch.randn_like(param) * 0.2)
            elif spread_biases and param_name.endswith(("bias", "sinks")):
                param.copy_(torch.randn_like(param) * (2.0 if param_name.endswith("sinks") else 0.3))
        model.get_input_embeddings().weight.mul_(embed_gain)
    model.save_pretrained(path)
    return path


def make_thinking_checkpoint(path: Path, tokenizer_dir: Path, chat_template: str, seed: int = 0):
    """A tiny random Qwen3 at `path` with the tokenizer of `tokenizer_dir`, `<think>` and `</think>` added as one
    token each, and `chat_template`; returns the tokenizer (the caller scripts or edits the weights)."""
    from transformers import AddedToken, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tokenizer.chat_template = chat_template
    make_checkpoint("qwen3", path, seed=seed, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(path)
    return tokenizer

