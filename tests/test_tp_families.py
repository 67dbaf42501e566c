"""DeepSeek's multi-head latent attention and gpt-oss under tensor parallelism (CPU ranks over gloo): split by heads
(MLA's latent replicated, gpt-oss's sinks with their heads), their experts split or spread whole (--expert-parallel),
FP8 blocks and MXFP4 blocks kept whole; the greedy tokens are one rank's (which are HF's: test_mla.py,
test_gpt_oss.py), and a split that would cut a scale block is refused in one sentence."""
from __future__ import annotations

import pytest
import torch

from cbatch.config import ConfigError, EngineConfig
from cbatch.engine.resolve import load_rank_model, resolve_model
from cbatch.model.decoder import LlamaForCausalLM
from cbatch.model.mxfp4 import dequantize_mxfp4
from cbatch.model.quant import FP8_DTYPE, dequantize
from cbatch.model.shard import check_tensor_parallel
from helpers import random_prompts, ranks_generate
from mla_models import hf_mla_model, save_fp8_block_checkpoint, save_mla_checkpoint
from test_gpt_oss import write_mxfp4_checkpoint
from test_tp_quant import _Rank
from tiny_models import make_family_checkpoint

PROMPTS = random_prompts(6, 380, seed=3, min_len=12, max_len=40)
SETTINGS = dict(max_num_batched_tokens=24, max_num_seqs=4, num_kv_blocks=14, block_size=8)  # chunks, preemption
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> a tiny checkpoint, written on first use: DeepSeek-V3 (a dense layer, a MoE layer with a shared
    expert) in FP8 with 8x8 or 16x16 blocks; gpt-oss in MXFP4 with experts 64 wide (two 32-column blocks, one per
    rank at 2 ranks) or 32 (one block, which 2 ranks would cut); DeepSeek-V2 (one q_proj) in float32."""
    root, made = tmp_path_factory.mktemp("tp-families"), {}

    def get(name: str):
        if name not in made:
            if name.startswith("deepseek_v3-fp8"):
                block = int(name.rpartition("-")[2])
                model = hf_mla_model("deepseek_v3", seed=4, num_hidden_layers=2)
                made[name] = save_fp8_block_checkpoint(model, root / name, block=(block, block))
            elif name.startswith("gpt_oss-mxfp4"):
                width = int(name.rpartition("-")[2])
                src = make_family_checkpoint("gpt_oss", root / f"{name}-float", intermediate_size=width)
                made[name] = write_mxfp4_checkpoint(src, root / name)
            else:
                made[name] = save_mla_checkpoint(hf_mla_model(name), name, root / name)
        return made[name]

    return get


@pytest.fixture(scope="module")
def one_rank():
    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = ranks_generate(path, 1, PROMPTS, **SETTINGS)
        return cache[path]

    return get


# (DeepSeek's experts spread whole go through the expert-parallel code every MoE family shares: test_expert_parallel.py;
# gpt-oss's stored [E, in, out] interleaved experts are read apart from the others, so both of its layouts run here)
@pytest.mark.parametrize("name, expert_parallel", [("deepseek_v3-fp8-8", False), ("gpt_oss-mxfp4-64", False),
                                                   ("gpt_oss-mxfp4-64", True)])
def test_two_ranks_give_the_tokens_of_one(name, expert_parallel, checkpoints, one_rank):
    """Under chunked prefill and preemption, the same tokens and schedule at 2 ranks: DeepSeek-V3's MLA split by
    heads with FP8 8x8 blocks (q_b_proj and kv_b_proj two heads of rows each, o_proj their value columns), its
    dense layer, shared expert and experts split; gpt-oss's heads and sinks, its biased MXFP4 experts split on
    whole 32-column blocks (the down bias added once) or spread whole."""
    path = checkpoints(name)
    one, one_stats = one_rank(path)
    two, two_stats = ranks_generate(path, 2, PROMPTS, expert_parallel=expert_parallel, **SETTINGS)
    assert two == one
    load = two_stats.pop("expert_load", None)
    assert two_stats == one_stats and one_stats["preemptions"] > 0
    assert (load is not None) == expert_parallel and (load is None or min(load["assignments"]) > 0)
    assert len({tuple(t) for t in one}) > 4  # the rows differ: a model repeating itself would prove nothing


def _shares(path, world: int, backend: str = "torch", **settings) -> tuple[dict, list[dict], list[LlamaForCausalLM]]:
    """(one rank's parameters, each of `world` ranks' parameters, the ranks' models), loaded without a group."""
    config = EngineConfig(model=str(path), device="cpu", attention_backend=backend, **settings)
    whole = dict(load_rank_model(config, resolve_model(config), _Rank(0, 1), CPU).named_parameters())
    config = EngineConfig(model=str(path), device="cpu", attention_backend=backend, tensor_parallel_size=world, **settings)
    models = [load_rank_model(config, resolve_model(config), _Rank(r, world), CPU) for r in range(world)]
    return whole, [dict(m.named_parameters()) for m in models], models


def test_mla_ranks_hold_their_heads_and_the_whole_latent(checkpoints, monkeypatch):
    """DeepSeek-V2 (one q_proj) at 4 ranks, one head each: rank r's q_proj and kv_b_proj rows are head r's,
    its o_proj columns head r's values; the latent's projection and norm are whole on every rank, so each rank's
    cache holds every token's whole latent ((16 + 8) x 3 layers per token, as one rank's)."""
    monkeypatch.setattr(LlamaForCausalLM, "prepack_for_cpu", lambda self: None)
    whole, shares, models = _shares(checkpoints("deepseek_v2"), 4)
    attention = "layers.0.self_attn."
    for name, dim in [("q_proj.weight", 0), ("kv_b_proj.weight", 0), ("o_proj.weight", 1)]:
        parts = [share[attention + name] for share in shares]
        assert parts[0].shape[dim] * 4 == whole[attention + name].shape[dim], name
        assert torch.equal(torch.cat(parts, dim=dim), whole[attention + name]), name
    for name in ("kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight"):
        assert all(torch.equal(share[attention + name], whole[attention + name]) for share in shares), name
    spec = models[0].spec
    assert spec.num_heads == 1 and spec.num_kv_heads == 1 and spec.kv_bytes_per_token(4) == (16 + 8) * 3 * 4
    assert models[0].layers[0].self_attn.kv_b_proj.weight.shape == (16 + 12, 16)  # W_UK | W_UV of its one head


def test_gpt_oss_ranks_hold_their_heads_sinks_and_expert_slices(checkpoints, monkeypatch):
    """gpt-oss MXFP4 at 2 ranks: sinks and q/k/v rows by head; each expert's gate and up rows [32r, 32r + 32) (stored
    interleaved) and its down_proj inputs likewise, the down bias on rank 0 only. The GPU path (Triton backend)
    keeps each rank's share as stored (blocks and scales), which decodes to the CPU path's floats exactly."""
    monkeypatch.setattr(LlamaForCausalLM, "prepack_for_cpu", lambda self: None)
    path = checkpoints("gpt_oss-mxfp4-64")
    whole, shares, _ = _shares(path, 2)
    sinks = "layers.0.self_attn.sinks"
    assert torch.equal(torch.cat([s[sinks] for s in shares]), whole[sinks]) and shares[0][sinks].shape == (2,)
    experts = "layers.0.mlp.experts."
    w13, width = whole[experts + "w13"], 64
    for rank, share in enumerate(shares):
        rows = [*range(32 * rank, 32 * rank + 32), *range(width + 32 * rank, width + 32 * rank + 32)]  # gate | up
        assert torch.equal(share[experts + "w13"], w13[:, rows]) and torch.equal(share[experts + "w13_bias"],
                                                                                 whole[experts + "w13_bias"][:, rows])
        assert torch.equal(share[experts + "w2"], whole[experts + "w2"][:, :, 32 * rank: 32 * rank + 32])
    assert torch.equal(shares[0][experts + "w2_bias"], whole[experts + "w2_bias"])
    assert not shares[1][experts + "w2_bias"].any()  # added once, by rank 0
    _, kept, _ = _shares(path, 2, backend="triton")
    for rank in range(2):
        for name in ("w13", "w2"):
            blocks, scales = kept[rank][experts + name], kept[rank][experts + name + "_scale"]
            assert blocks.dtype == torch.uint8
            assert torch.equal(dequantize_mxfp4(blocks, scales), shares[rank][experts + name]), f"rank {rank}: {name}"


def test_kept_fp8_mla_weights_hold_each_ranks_blocks(checkpoints, monkeypatch):
    """DeepSeek-V3 FP8 8x8 at 2 ranks on the GPU path: q_a_proj whole, q_b_proj / o_proj / the experts' FP8 shares
    with their scale blocks, kv_b_proj dequantized from its rank's blocks: all exactly the CPU path's floats."""
    monkeypatch.setattr(LlamaForCausalLM, "prepack_for_cpu", lambda self: None)
    path = checkpoints("deepseek_v3-fp8-8")
    _, floats, _ = _shares(path, 2)
    _, kept, _ = _shares(path, 2, backend="triton")
    for rank in range(2):
        fp8 = [n for n, p in kept[rank].items() if p.dtype == FP8_DTYPE]
        assert {"layers.1.self_attn.q_a_proj.weight", "layers.1.self_attn.q_b_proj.weight",
                "layers.1.self_attn.o_proj.weight", "layers.1.mlp.experts.w13", "layers.0.mlp.down_proj.weight"} <= set(fp8)
        for name in fp8:
            weight = dequantize(kept[rank][name], kept[rank][name + "_scale"], (8, 8), torch.float32)
            assert torch.equal(weight, floats[rank][name]), f"rank {rank}: {name}"
        kv_b = "layers.1.self_attn.kv_b_proj.weight"
        assert kept[rank][kv_b].dtype == torch.float32 and torch.equal(kept[rank][kv_b], floats[rank][kv_b])


def test_splits_that_cut_a_scale_block_are_refused_in_one_sentence(checkpoints):
    """16x16 FP8 blocks: 2 ranks would give each 56 of kv_b_proj's 112 rows (two heads of 16 + 12); MXFP4 experts 32
    wide: 2 ranks would cut their one 32-column block (whole experts, --expert-parallel, would not)."""
    fp8 = resolve_model(EngineConfig(model=str(checkpoints("deepseek_v3-fp8-16")), device="cpu")).spec
    with pytest.raises(ConfigError, match=r"^tensor_parallel_size: 2 ranks split the kv_b_proj output \(attention heads x "
                                          r"\(qk_nope_head_dim \+ v_head_dim\)\) of 112 into 56 rows per rank, which cuts "
                                          r"the FP8 checkpoint's 16x16 scale blocks; use --tensor-parallel-size 1$"):
        check_tensor_parallel(fp8, 2)
    mxfp4 = resolve_model(EngineConfig(model=str(checkpoints("gpt_oss-mxfp4-32")), device="cpu")).spec
    with pytest.raises(ConfigError, match=r"2 ranks split the experts' down_proj input of 32 into 16 columns per rank, "
                                          r"which cuts the MXFP4 checkpoint's 32-column scale blocks; use "
                                          r"--tensor-parallel-size 1, or keep 2 ranks with --expert-parallel"):
        check_tensor_parallel(mxfp4, 2)
    resolve_model(EngineConfig(model=str(checkpoints("gpt_oss-mxfp4-32")), device="cpu", tensor_parallel_size=2,
                               expert_parallel=True))


def test_plan_sizes_deepseek_v3_671b_fp8_per_rank():
    """DeepSeek-V3's config.json alone (FP8 128x128, no weights) at -tp 8: ~85 GB of weights per rank (a byte per
    decoder weight, its heads' share of MLA and a slice of every expert, the latent's projection whole), the whole
    latent per token on every rank; 8 x H200 leave room for ~680k tokens of it, 8 x H100 none."""
    from cbatch.engine.resolve import ResolvedModel
    from cbatch.model.spec import parse_spec
    from cbatch.plan.command import plan_kv_per_token
    from cbatch.plan.devices import PlanError, gpu_kind
    from test_mla import V3_671B

    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    model = ResolvedModel(parse_spec({**V3_671B, "torch_dtype": "bfloat16", "quantization_config": fp8}),
                          torch.device("cuda"), torch.bfloat16, 8192)
    config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, tensor_parallel_size=8)
    h200 = gpu_kind("H200")
    assert 84e9 < h200.weight_bytes_per_rank(config, model) < 87e9
    assert plan_kv_per_token(config, model)["bytes_per_token"] == (512 + 64) * 61 * 2
    assert 600_000 < h200.kv_pool(config, model).num_blocks * config.block_size < 750_000
    with pytest.raises(PlanError, match=r"H100: the model does not fit one machine's 8 GPUs: .* 79\.6 GiB of the GPU's "
                                        r"80\.0 GiB, .*\(--device-kind h200 fits\)"):
        gpu_kind("H100").kv_pool(config, model)
