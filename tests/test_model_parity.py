"""Greedy outputs token-identical to HF transformers `generate` (float32), per architecture."""
from __future__ import annotations

import pytest
from cbatch.config import SamplingParams
from cbatch.model.spec import UnsupportedModelError, parse_spec
from helpers import generate, make_engine, random_prompts
from tiny_models import ARCHS, hf_greedy, hf_model


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_hf_generate(arch, tiny_checkpoints):
    path = tiny_checkpoints[arch]
    prompts = random_prompts(6, vocab=384, seed=1, max_len=70)  # crosses mistral's 24-token sliding window
    reference = [hf_greedy(hf_model(path), p, 24) for p in prompts]
    engine = make_engine(path, max_num_seqs=64)
    got = generate(engine, prompts, SamplingParams(max_tokens=24))
    assert got == reference
    assert sum(map(len, got)) > 6 * 5  # real completions, not early stops everywhere


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_runs_close_to_float32(dtype, tiny_checkpoints):
    path = tiny_checkpoints["qwen3"]
    prompts = random_prompts(4, vocab=384, seed=2)
    ref = generate(make_engine(path), prompts, SamplingParams(max_tokens=8))
    got = generate(make_engine(path, dtype=dtype), prompts, SamplingParams(max_tokens=8))
    first_tokens_equal = sum(a[0] == b[0] for a, b in zip(ref, got))
    assert first_tokens_equal >= 3  # low precision may flip a near-tie, not most of them


def test_unsupported_architecture_is_named():
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}
    with pytest.raises(UnsupportedModelError, match="LlamaForCausalLM, MistralForCausalLM, .*, Qwen3MoeForCausalLM"):
        parse_spec(cfg)


def test_unsupported_rope_scaling_is_refused():
    cfg = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 4, "hidden_size": 64, "vocab_size": 10,
           "intermediate_size": 8, "num_hidden_layers": 1, "rope_scaling": {"rope_type": "mrope", "factor": 4.0}}
    with pytest.raises(UnsupportedModelError, match="'mrope' is not supported; supported: default, linear, dynamic, llama3, yarn, longrope"):
        parse_spec(cfg)


def test_sharded_checkpoint_loads(tiny_checkpoints, tmp_path):
    """Weights split over several safetensors files load like one."""
    from safetensors.torch import load_file, save_file
    import shutil

    src = tiny_checkpoints["qwen2"]
    dst = tmp_path / "sharded"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    (dst / "model.safetensors").unlink()
    names = sorted(tensors)
    save_file({n: tensors[n] for n in names[::2]}, str(dst / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[1::2]}, str(dst / "model-00002-of-00002.safetensors"))
    prompts = random_prompts(3, vocab=384, seed=3)
    params = SamplingParams(max_tokens=6)
    assert generate(make_engine(dst), prompts, params) == generate(make_engine(src), prompts, params)
