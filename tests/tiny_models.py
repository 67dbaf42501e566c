"""Tiny random-weight checkpoints of every supported architecture, written by HF transformers itself."""
from __future__ import annotations

from pathlib import Path

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
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


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
