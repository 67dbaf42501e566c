"""Expert parallelism (--expert-parallel) on CPU ranks over gloo: each rank holds num_experts / N whole experts (a
shared expert whole), attention stays split by heads; the tokens are those of one rank (the combine's all-to-all
sends each computed slot to its token's owner rank, which sums a token's slots in one rank's order: bitwise one
rank's output; tests/test_expert_combine.py checks its layouts case by case), and the report says how the
assignments spread over the ranks."""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from cbatch.config import ConfigError, EngineConfig
from cbatch.engine.resolve import load_rank_model, resolve_model
from cbatch.model.decoder import LlamaForCausalLM
from cbatch.model.shard import check_tensor_parallel
from cbatch.observe.roofline import engine_hardware
from cbatch.parallel.comm import Communicator
from helpers import random_prompts, ranks_generate

PROMPTS = random_prompts(6, 384, seed=17, min_len=12, max_len=40)
SETTINGS = dict(max_num_batched_tokens=32, max_num_seqs=4, num_kv_blocks=12, block_size=8)  # chunks, preemption


class _Rank(Communicator):
    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world


# Mixtral (8 experts, top-2) at 4 ranks: two experts each; Qwen2-MoE (a shared expert, a dense layer) and
# Qwen3-MoE at 2 ranks: four each
# (the combine's layouts at 2 and 4 ranks on every routing shape: tests/test_expert_combine.py, without processes)
@pytest.mark.parametrize("family, ranks", [("mixtral", 4), ("qwen2_moe", 2)])
def test_expert_parallel_ranks_give_the_tokens_of_one(family, ranks, family_checkpoint):
    """Under chunked prefill and preemption: the same tokens and schedule; the report's load balance counts every
    token of every MoE layer once per expert it picks, and every rank takes some. Mixtral at 4 ranks also meets
    uneven steps: decode steps of fewer rows than ranks (ranks owning no token in the combine) and layer-steps in
    which a rank's experts take no token (sending nothing)."""
    path = family_checkpoint(family)
    one, one_stats = ranks_generate(path, 1, PROMPTS, **SETTINGS)
    many, many_stats = ranks_generate(path, ranks, PROMPTS, expert_parallel=True, **SETTINGS)
    assert many == one
    load = many_stats.pop("expert_load")
    assert many_stats == one_stats and one_stats["preemptions"] > 0
    assert len({tuple(t) for t in one}) > 3  # the rows differ: a model repeating itself would prove nothing
    spec = resolve_model(EngineConfig(model=str(path), device="cpu")).spec
    moe_layers = sum(spec.moe.sparse_layers)
    assert load["ranks"] == ranks and load["layer_steps"] == one_stats["steps"] * moe_layers
    assert sum(load["assignments"]) == spec.moe.top_k * one_stats["scheduled_tokens"] * moe_layers
    assert min(load["assignments"]) > 0 and load["imbalance"] < ranks
    assert all(0 <= idle < load["layer_steps"] for idle in load["idle_layer_steps"])
    if ranks == 4:
        assert max(load["idle_layer_steps"]) > 0


def test_each_rank_holds_its_experts_whole(family_checkpoint, monkeypatch):
    """Qwen2-MoE at 2 ranks: rank r's expert stack is experts [4r, 4r + 4) of one rank's, unsplit; the shared
    expert and the router whole on each; attention split by heads as without expert parallelism."""
    monkeypatch.setattr(LlamaForCausalLM, "prepack_for_cpu", lambda self: None)
    path = family_checkpoint("qwen2_moe")
    cpu = torch.device("cpu")
    config = EngineConfig(model=str(path), device="cpu")
    whole = dict(load_rank_model(config, resolve_model(config), _Rank(0, 1), cpu).named_parameters())
    config = EngineConfig(model=str(path), device="cpu", tensor_parallel_size=2, expert_parallel=True)
    resolved = resolve_model(config)
    for rank in range(2):
        share = dict(load_rank_model(config, resolved, _Rank(rank, 2), cpu).named_parameters())
        for name in ("layers.0.mlp.experts.w13", "layers.0.mlp.experts.w2"):
            assert torch.equal(share[name], whole[name][4 * rank : 4 * rank + 4]), name
        for name in ("layers.0.mlp.shared_expert.gate_up_proj.weight", "layers.0.mlp.shared_expert.down_proj.weight",
                     "layers.0.mlp.gate.weight"):
            assert torch.equal(share[name], whole[name]), name
        assert share["layers.0.self_attn.o_proj.weight"].shape[1] * 2 == whole["layers.0.self_attn.o_proj.weight"].shape[1]
        assert share["layers.1.mlp.down_proj.weight"].shape[1] * 2 == whole["layers.1.mlp.down_proj.weight"].shape[1]


def test_the_report_carries_the_load_balance(family_checkpoint):
    """`hardware.expert_parallel` in the run's report is the model's `ExpertLoad` summary (one rank's share of the
    model loaded alone: no processes)."""
    config = EngineConfig(model=str(family_checkpoint("mixtral")), device="cpu", tensor_parallel_size=2,
                          expert_parallel=True)
    model = load_rank_model(config, resolve_model(config), _Rank(1, 2), torch.device("cpu"))
    model.expert_load.add(torch.tensor([[0, 5], [6, 7], [2, 4]]))  # experts 0-3 on rank 0, 4-7 on rank 1
    engine = SimpleNamespace(runner=SimpleNamespace(model=model, memory=dict), device=torch.device("cpu"),
                             dtype=torch.float32, spec=model.spec, kernel_tuning=None)
    model.expert_load.add(torch.tensor([[4, 5], [6, 7]]))  # rank 0's experts sit this layer-step out
    load = engine_hardware(engine, [], 1.0)["expert_parallel"]
    assert load == {"ranks": 2, "assignments": [2, 8], "layer_steps": 2, "tokens_per_rank_per_layer_step": [1.0, 4.0],
                    "imbalance": 1.6, "idle_layer_steps": [1, 0]}


def test_expert_parallel_needs_experts_and_ranks(tiny_checkpoints, family_checkpoint):
    with pytest.raises(ConfigError, match="give --tensor-parallel-size N > 1 as well"):
        EngineConfig(model="x", expert_parallel=True)
    with pytest.raises(ConfigError, match=r"has no experts to spread over the ranks; leave --expert-parallel off"):
        resolve_model(EngineConfig(model=str(tiny_checkpoints["llama"]), device="cpu", tensor_parallel_size=2,
                                   expert_parallel=True))
    spec = resolve_model(EngineConfig(model=str(family_checkpoint("mixtral")), device="cpu", tensor_parallel_size=2,
                                      expert_parallel=True)).spec
    check_tensor_parallel(spec, 4)
    with pytest.raises(ConfigError, match=r"4 does not divide the model's experts \(--expert-parallel gives each rank "
                                          r"whole experts\) \(6\); use a divisor of 6"):
        check_tensor_parallel(replace(spec, moe=replace(spec.moe, num_experts=6)), 4)


def test_plan_sizes_each_rank_and_suggests_the_layout_that_fits():
    """A Qwen3-235B-A22B-shaped MoE (bfloat16, ~470 GB) on H100s: one GPU is refused with the layout that fits (the
    fewest ranks); with expert parallelism each rank holds 16 of the 128 experts whole: the same bytes as 1/8 of
    every expert, and a KV pool beside them."""
    from cbatch.engine.resolve import ResolvedModel
    from cbatch.model.shard import with_expert_parallel
    from cbatch.model.spec import parse_spec
    from cbatch.plan.devices import PlanError, gpu_kind

    raw = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
               moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
               head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=40960,
               rms_norm_eps=1e-6, torch_dtype="bfloat16")
    spec = parse_spec(raw)
    h100, cuda = gpu_kind("H100"), torch.device("cuda")
    settings = dict(max_num_seqs=256, max_num_batched_tokens=8192)
    with pytest.raises(PlanError, match=r"H100: .*; --tensor-parallel-size 8 fits \(5\d\.\d GiB of weights per rank\)"):
        h100.kv_pool(EngineConfig(**settings), ResolvedModel(spec, cuda, torch.bfloat16, 8192))
    tp = EngineConfig(**settings, tensor_parallel_size=8)
    ep = EngineConfig(**settings, tensor_parallel_size=8, expert_parallel=True)
    split = h100.weight_bytes_per_rank(tp, ResolvedModel(spec, cuda, torch.bfloat16, 8192))
    whole = h100.weight_bytes_per_rank(ep, ResolvedModel(with_expert_parallel(spec), cuda, torch.bfloat16, 8192))
    assert 55 * 2**30 < whole < 60 * 2**30 and abs(whole - split) / split < 0.01
    assert h100.kv_pool(ep, ResolvedModel(with_expert_parallel(spec), cuda, torch.bfloat16, 8192)).num_blocks > 1000
    # a decode step streams the experts its tokens touch: 16 whole ones per rank, or a slice of each of 128
    split_cost = h100.default_cost(ResolvedModel(spec, cuda, torch.bfloat16, 8192), 8)
    whole_cost = h100.default_cost(ResolvedModel(with_expert_parallel(spec), cuda, torch.bfloat16, 8192), 8)
    assert 0 < whole_cost.per_step == pytest.approx(split_cost.per_step, rel=0.02)
