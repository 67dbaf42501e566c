"""--kv-cache-dtype fp8: one byte per cached element, the same values in both backends, bounded error
against a cache in the model's dtype, and swap/preemption that moves fp8 blocks intact."""
from __future__ import annotations

import pytest
import torch

from cbatch.cli.flags import flag_of
from cbatch.config import ConfigError, EngineConfig, SamplingParams
from cbatch.engine import memory
from cbatch.model.backend import FP8_KV_DTYPE
from cbatch.model.spec import ModelSpec
from helpers import generate, make_engine, random_prompts

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def _prefill_logits(engine, prompt: list[int]) -> torch.Tensor:
    from cbatch.engine.sequence import Sequence

    engine.reset()
    engine.scheduler.add(Sequence(seq_id=0, prompt_ids=prompt, params=PARAMS))
    return engine.runner.forward(engine.scheduler.schedule()).logits


def test_fp8_cache_is_one_byte_per_element(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["qwen3"], kv_cache_dtype="fp8", dtype="bfloat16")
    assert engine.runner.kv_cache.tensor.dtype == FP8_KV_DTYPE and engine.runner.kv_cache.tensor.element_size() == 1
    spec = engine.spec
    assert memory.bytes_per_block(spec, FP8_KV_DTYPE, 16) * 2 == memory.bytes_per_block(spec, torch.bfloat16, 16)
    config = EngineConfig(kv_cache_memory_gb=2**-10, max_num_seqs=64, block_size=16)  # 1 MiB
    fp8 = memory.cpu_kv_blocks(config, spec, FP8_KV_DTYPE, 4096)
    assert fp8 == 2 * memory.cpu_kv_blocks(config, spec, torch.bfloat16, 4096) > 0


def test_bad_kv_cache_dtype_names_the_flag():
    with pytest.raises(ConfigError) as err:
        EngineConfig(kv_cache_dtype="int4")
    assert err.value.field == "kv_cache_dtype" and flag_of("kv_cache_dtype") == "--kv-cache-dtype"


def test_fp8_changes_the_logits_a_little(tiny_checkpoints):
    """e4m3 keeps 3 mantissa bits: the logits move (a real quantisation), but stay close to the exact cache's.
    The random tiny models amplify errors far more than trained ones (benchmarks/fp8_kv_accuracy.py)."""
    path = tiny_checkpoints["qwen3"]
    prompt = random_prompts(1, vocab=384, seed=4, min_len=40, max_len=40)[0]
    exact = _prefill_logits(make_engine(path), prompt)
    fp8 = _prefill_logits(make_engine(path, kv_cache_dtype="fp8"), prompt)
    err = (fp8 - exact).abs().max() / exact.abs().max()
    assert 0 < err < 0.3, f"relative logit error {err:.3f}"


def test_fp8_same_tokens_in_both_backends(tiny_checkpoints):
    """The torch backend quantises exactly as the Triton store does (round to nearest even, saturating)."""
    pytest.importorskip("triton")
    path = tiny_checkpoints["mistral"]
    prompts = random_prompts(3, vocab=384, seed=12, max_len=30)
    settings = dict(kv_cache_dtype="fp8", max_num_batched_tokens=16, block_size=8)
    expected = generate(make_engine(path, attention_backend="torch", **settings), prompts, PARAMS)
    assert generate(make_engine(path, attention_backend="triton", **settings), prompts, PARAMS) == expected


def test_fp8_blocks_survive_swap_preemption(tiny_checkpoints):
    path = tiny_checkpoints["llama"]
    prompts = random_prompts(8, vocab=384, seed=13, max_len=40)
    reference = generate(make_engine(path, kv_cache_dtype="fp8"), prompts, PARAMS)
    engine = make_engine(path, kv_cache_dtype="fp8", num_kv_blocks=20, block_size=4, preemption="swap")
    assert generate(engine, prompts, PARAMS) == reference
    assert engine.scheduler.stats.preemptions > 0


def test_spec_kv_bytes_follow_the_dtype():
    spec = ModelSpec.__new__(ModelSpec)  # only the fields kv_bytes_per_token reads
    object.__setattr__(spec, "num_layers", 2)
    object.__setattr__(spec, "num_kv_heads", 3)
    object.__setattr__(spec, "head_dim", 8)
    object.__setattr__(spec, "mla", None)  # K and V (an MLA spec holds one latent: tests/test_mla.py)
    assert memory.bytes_per_block(spec, FP8_KV_DTYPE, 4) == 2 * 2 * 3 * 8 * 4


def test_fp8_is_part_of_the_resume_fingerprint(tiny_checkpoints, tmp_path):
    """Rows computed with an fp8 cache never mix with rows computed without one on resume."""
    from cbatch.engine.resolve import resolve_model
    from cbatch.run.preflight import JobOptions, job_fingerprint

    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt_token_ids": [5, 6]}\n')

    def fingerprint(**engine):
        config = EngineConfig(model=str(tiny_checkpoints["llama"]), device="cpu", **engine)
        options = JobOptions(input=source, output=tmp_path / "out.jsonl", engine=config, defaults=PARAMS)
        return job_fingerprint(options, resolve_model(config))

    assert fingerprint(kv_cache_dtype="fp8") != fingerprint()
    assert fingerprint(kv_cache_dtype="auto") == fingerprint(max_num_seqs=3)  # batch shape stays out of it
