"""Step limits: the CPU runs 256 sequences / 2048 tokens; a GPU starts from 1024 / 8192 and gives way to the
KV pool (the sizing loop runs here with the GPU's measurements replaced by a model of them)."""
from __future__ import annotations

import pytest
import torch

from cbatch.config import EngineConfig
from cbatch.engine import memory
from helpers import make_engine

CUDA = torch.device("cuda")


def test_cpu_engine_limits(tiny_checkpoints):
    engine = make_engine(tiny_checkpoints["llama"])
    assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (256, 2048)
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_num_batched_tokens) == (256, 2048)
    mine = make_engine(tiny_checkpoints["llama"], max_num_seqs=3, max_num_batched_tokens=100)
    assert (mine.config.max_num_seqs, mine.config.max_num_batched_tokens) == (3, 100)


def test_limits_defaults_per_device():
    assert memory.with_step_limits(EngineConfig(), torch.device("cpu")).max_num_seqs == 256
    gpu = memory.with_step_limits(EngineConfig(), CUDA)
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens) == (1024, 8192)
    assert memory.with_step_limits(EngineConfig(max_num_seqs=7), CUDA).max_num_seqs == 7  # the user's value wins


def test_dummy_step_samples_at_max_num_seqs_rows():
    """The memory profile's step spreads the token budget over max_num_seqs sequences: every one samples."""
    lengths = memory.dummy_step_lengths(8192, 1024, 2047)
    assert len(lengths) == 1024 and sum(lengths) == 8192
    lengths = memory.dummy_step_lengths(100, 1024, 2047)
    assert len(lengths) == 100 and set(lengths) == {1}
    assert memory.dummy_step_lengths(5000, 2, 1000) == [1000, 1000]  # capped by the longest sequence


@pytest.mark.parametrize("free_gib, expect_seqs, expect_tokens", [(80, 1024, 8192), (3, 512, 4096), (1.2, 64, 2048)])
def test_gpu_sizing_halves_until_the_pool_holds_enough(monkeypatch, free_gib, expect_seqs, expect_tokens):
    """Activations modelled as 200 KB per batched token + the logits of every sampling row; the pool gets
    what is left of `free_gib`. Halving stops once the pool holds MIN_POOL_SEQUENCES sequences, or at 64/2048."""
    from cbatch.model.presets import preset_spec

    spec = preset_spec("qwen3-0.6b")
    seen = []

    def profile(make_runner, config, max_model_len):
        seen.append((config.max_num_seqs, config.max_num_batched_tokens))
        return config.max_num_batched_tokens * 200_000 + config.max_num_seqs * spec.vocab_size * 4

    def blocks(config, spec_, kv_dtype, max_model_len, peak):
        budget = free_gib * 2**30 - peak - memory.cuda_graph_reserve(config, spec_)
        num = int(budget // memory.bytes_per_block(spec_, kv_dtype, config.block_size))
        if num < 1:
            raise MemoryError("no GPU memory left for the KV cache")  # as the real one does
        return num

    monkeypatch.setattr(memory, "profile_activation_peak", profile)
    monkeypatch.setattr(memory, "gpu_kv_blocks", blocks)
    config, num_blocks = memory.gpu_step_and_pool(EngineConfig(), spec, torch.bfloat16, 2048, make_runner=None)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (expect_seqs, expect_tokens)
    assert seen[0] == (1024, 8192) and seen[-1] == (config.max_num_seqs, config.max_num_batched_tokens)
    assert config.max_num_seqs <= max(1, num_blocks)


def test_gpu_sizing_gives_up_only_at_the_smallest_step(monkeypatch):
    """No room for KV even at 64 sequences / 2048 tokens: the memory error reaches the user."""
    from cbatch.model.presets import preset_spec

    tried = []

    def profile(make_runner, config, max_model_len):
        tried.append((config.max_num_seqs, config.max_num_batched_tokens))
        return 0

    def no_room(*args):
        raise MemoryError("no GPU memory left for the KV cache")

    monkeypatch.setattr(memory, "profile_activation_peak", profile)
    monkeypatch.setattr(memory, "gpu_kv_blocks", no_room)
    with pytest.raises(MemoryError):
        memory.gpu_step_and_pool(EngineConfig(), preset_spec("qwen3-0.6b"), torch.bfloat16, 2048, make_runner=None)
    assert tried == [(1024, 8192), (512, 4096), (256, 2048), (128, 2048), (64, 2048)]


def test_a_job_captures_no_cuda_graph_above_its_rows(tiny_checkpoints, tmp_path):
    """The decode graphs stop at the job's sequence count (rows x n): a 256-row job on a GPU (max_num_seqs 1024)
    captures 20 graphs, not 68; n > 1 counts each sample; max_num_seqs stays the bound."""
    from cbatch.config import EngineConfig, SamplingParams
    from cbatch.engine.build import graph_batch_limit
    from cbatch.engine.cuda_graphs import decode_buckets
    from cbatch.run.preflight import JobOptions, preflight
    from ops_jobs import write_jsonl

    rows = [{"id": f"r{i}", "prompt_token_ids": [5, 6, 7]} for i in range(256)]
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    engine = EngineConfig(model=str(tiny_checkpoints["llama"]), device="cpu", max_num_seqs=1024)
    prepared = preflight(JobOptions(input=source, output=tmp_path / "o.jsonl", engine=engine,
                                    defaults=SamplingParams(max_tokens=2, n=1)))
    assert prepared.config.cuda_graph_max_batch == 256
    assert len(decode_buckets(graph_batch_limit(prepared.config))) == 20 and len(decode_buckets(1024)) == 68
    n2 = preflight(JobOptions(input=source, output=tmp_path / "o2.jsonl", engine=engine,
                              defaults=SamplingParams(max_tokens=2, n=2)))
    assert graph_batch_limit(n2.config) == 512
    few = EngineConfig(model=str(tiny_checkpoints["llama"]), device="cpu", max_num_seqs=64)
    assert graph_batch_limit(preflight(JobOptions(input=source, output=tmp_path / "o3.jsonl", engine=few,
                                                  defaults=SamplingParams(max_tokens=2))).config) == 64
