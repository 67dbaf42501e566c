"""Quantized checkpoints under tensor parallelism (CPU ranks over gloo): FP8 per tensor, per channel and per block
split on their scales' boundaries give the tokens of one rank; a split that would cut a scale block is refused
with the sizes that work; the GPU path's kept FP8 weights and scales hold each rank's share. Act-order 4-bit
checkpoints likewise (their row-parallel layers held dequantized on the GPU path)."""
from __future__ import annotations

import pytest
import torch

from cbatch.config import ConfigError, EngineConfig
from cbatch.engine.resolve import load_rank_model, resolve_model
from cbatch.model.decoder import LlamaForCausalLM
from cbatch.model.int4 import dequantize_kept
from cbatch.model.layers import Int4Linear
from cbatch.model.quant import FP8_DTYPE, dequantize
from cbatch.model.shard import check_tensor_parallel
from cbatch.parallel.comm import Communicator
from fp8_models import LAYOUTS, fp8_config, write_fp8_checkpoint
from helpers import random_prompts, ranks_generate
from int_checkpoints import make_int_checkpoint
from ops_jobs import ROOT, run_inprocess

PROMPTS = random_prompts(6, 384, seed=21, min_len=12, max_len=40)
SETTINGS = dict(max_num_batched_tokens=32, max_num_seqs=4)  # chunked prefills, rows waiting for a slot
FP8_LAYOUTS = {**LAYOUTS, "fp8-block8": (fp8_config([8, 8]), (8, 8), False)}


class _Rank(Communicator):
    """A rank's identity without a group: loading a shard needs no collective."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world


@pytest.fixture(scope="module")
def fp8_checkpoint(family_checkpoint, tmp_path_factory):
    """layout -> a tiny Qwen3-MoE quantized in it (attention and experts FP8), written on first use."""
    root, made = tmp_path_factory.mktemp("tp-fp8"), {}

    def get(layout: str):
        if layout not in made:
            made[layout] = write_fp8_checkpoint(family_checkpoint("qwen3_moe"), root / layout, *FP8_LAYOUTS[layout])[0]
        return made[layout]

    return get


@pytest.fixture(scope="module")
def one_rank():
    """(checkpoint, settings) -> the one-rank tokens, computed once."""
    cache = {}

    def get(path, **settings):
        key = (str(path), tuple(sorted(settings.items())))
        if key not in cache:
            cache[key] = ranks_generate(path, 1, PROMPTS, **SETTINGS, **settings)[0]
        return cache[key]

    return get


# per channel (scales split with their rows) at 2 ranks, 8x8 blocks at 4 (a rank holds one 8-row block of each
# expert's gate and up, and one 8-column block of its down_proj); per-tensor scales (broadcast to channels, then
# split as those) load through the same code: the kept-weights test below checks every layout's shares
@pytest.mark.parametrize("layout, ranks", [("ct-channel", 2), ("fp8-block8", 4)])
def test_fp8_checkpoints_give_the_tokens_of_one_rank(layout, ranks, fp8_checkpoint, one_rank):
    path = fp8_checkpoint(layout)
    tokens = ranks_generate(path, ranks, PROMPTS, **SETTINGS)[0]
    assert tokens == one_rank(path)
    assert len({tuple(t) for t in tokens}) > 3  # the rows differ: a model repeating itself would prove nothing


def test_a_split_inside_a_scale_block_is_refused_with_the_sizes_that_work(fp8_checkpoint, tmp_path):
    """16x16 blocks: 4 ranks leave each 8 rows of an expert's gate/up (32): refused before anything loads."""
    path = fp8_checkpoint("fp8-block")
    spec = resolve_model(EngineConfig(model=str(path), device="cpu")).spec
    check_tensor_parallel(spec, 2)
    with pytest.raises(ConfigError, match=r"4 ranks split the experts' gate_proj/up_proj output of 32 into 8 rows per "
                                          r"rank, which cuts the FP8 checkpoint's 16x16 scale blocks; use "
                                          r"--tensor-parallel-size 1, 2, or keep 4 ranks with --expert-parallel "
                                          r"\(whole experts, unsplit\)$"):
        check_tensor_parallel(spec, 4)
    code, _, err = run_inprocess("run", str(ROOT / "sample_data" / "prompts.jsonl"), "--model", str(path), "-o",
                                 str(tmp_path / "never.jsonl"), "--device", "cpu", "--tensor-parallel-size", "4")
    assert code == 2 and "cuts the FP8 checkpoint's 16x16 scale blocks" in err and "Traceback" not in err


@pytest.mark.parametrize("layout", ["fp8-tensor", "ct-channel", "fp8-block8"])
def test_kept_fp8_weights_hold_each_ranks_share_of_weights_and_scales(layout, fp8_checkpoint, monkeypatch):
    """The GPU path (Triton backend: FP8 weights and scales kept as stored) at 2 ranks: each rank's FP8 weight x its
    scales (per-tensor scales broadcast per channel, channel scales split with their rows, blocks with their blocks)
    is exactly the float weight the CPU path's rank holds (dequantized piece by piece at load)."""
    monkeypatch.setattr(LlamaForCausalLM, "prepack_for_cpu", lambda self: None)
    path = fp8_checkpoint(layout)
    block = FP8_LAYOUTS[layout][1]
    cpu = torch.device("cpu")
    for rank in range(2):
        models = {}
        for backend in ("torch", "triton"):
            config = EngineConfig(model=str(path), device="cpu", attention_backend=backend, tensor_parallel_size=2)
            models[backend] = dict(load_rank_model(config, resolve_model(config), _Rank(rank, 2), cpu).named_parameters())
        kept = [n for n, p in models["triton"].items() if p.dtype == FP8_DTYPE]
        assert {"layers.0.self_attn.qkv_proj.weight", "layers.0.self_attn.o_proj.weight", "layers.1.mlp.experts.w13",
                "layers.1.mlp.experts.w2"} <= set(kept)
        for name in kept:
            weight = dequantize(models["triton"][name], models["triton"][name + "_scale"], block, torch.float32)
            assert torch.equal(weight, models["torch"][name]), f"rank {rank}: {name}"


# ---- act-order 4-bit: g_idx scatters each group over the input rows ---------------------------------------------
@pytest.fixture(scope="module")
def act_order_checkpoint(tiny_checkpoints, family_checkpoint, tmp_path_factory):
    root, made = tmp_path_factory.mktemp("tp-int4"), {}

    def get(arch: str, variant: str):
        if (arch, variant) not in made:
            src = tiny_checkpoints[arch] if arch in tiny_checkpoints else family_checkpoint(arch)
            made[arch, variant] = make_int_checkpoint(src, root / f"{arch}-{variant}", variant)
        return made[arch, variant]

    return get


# GPTQ desc_act on a dense model at 2 ranks; compressed-tensors actorder on a MoE at 4 (each rank 8 of an expert's
# 32 down_proj inputs, which fall in any of its groups)
@pytest.mark.parametrize("arch, variant, ranks", [("llama", "gptq-g32-actorder", 2),
                                                  ("qwen3_moe", "ct-w4-g32-asym-actorder", 4)])
def test_act_order_checkpoints_give_the_tokens_of_one_rank(arch, variant, ranks, act_order_checkpoint, one_rank):
    path = act_order_checkpoint(arch, variant)
    tokens = ranks_generate(path, ranks, PROMPTS, **SETTINGS)[0]
    assert tokens == one_rank(path)
    assert len({tuple(t) for t in tokens}) > 3


def test_act_order_row_parallel_layers_are_held_dequantized_on_the_gpu_path(act_order_checkpoint, monkeypatch):
    """Triton backend at 2 ranks: q/k/v and gate/up stay packed with the whole g_idx's perm (they take every input
    row); o_proj and down_proj, whose rank holds input rows of any group, are dequantized at load. Either way each
    rank's weights are exactly the CPU path's share."""
    monkeypatch.setattr(LlamaForCausalLM, "prepack_for_cpu", lambda self: None)
    path = act_order_checkpoint("llama", "gptq-g32-actorder")
    cpu = torch.device("cpu")
    for rank in range(2):
        models = {}
        for backend in ("torch", "triton"):
            config = EngineConfig(model=str(path), device="cpu", attention_backend=backend, tensor_parallel_size=2)
            models[backend] = load_rank_model(config, resolve_model(config), _Rank(rank, 2), cpu)
        floats = dict(models["torch"].named_parameters())
        for name, module in models["triton"].named_modules():
            if isinstance(module, Int4Linear):
                assert module.weight_perm is not None and name.endswith(("qkv_proj", "gate_up_proj")), name
                weight = dequantize_kept(module.weight, module.weight_scale, module.weight_zero, module.weight_perm,
                                         module.group_size, module.bits, torch.float32)
                assert torch.equal(weight, floats[name + ".weight"]), f"rank {rank}: {name}"
            elif name.endswith(("o_proj", "down_proj")):
                assert torch.equal(module.weight, floats[name + ".weight"]), f"rank {rank}: {name}"
        assert isinstance(models["triton"].layers[0].self_attn.qkv_proj, Int4Linear)
        assert not isinstance(models["triton"].layers[0].self_attn.o_proj, Int4Linear)
