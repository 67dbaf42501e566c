"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) against HF transformers (float32, tiny random checkpoints
with a decisive init: tests/mla_models.py): greedy tokens alone, in a batch, under chunked prefill and preemption;
the absorbed decode against the naive form; DeepSeek's routers against HF's; the latent KV cache's size in the
pool and in `cbatch plan`; an FP8 128x128-style block checkpoint against its dequantized weights; the refusals.
Under tensor parallelism: tests/test_tp_families.py."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from cbatch.config import ConfigError, EngineConfig, SamplingParams
from cbatch.engine.resolve import resolve_model
from cbatch.model.backend import AttentionMetadata
from cbatch.model.backend.mla import mla_attend
from cbatch.model.spec import parse_spec
from helpers import generate, make_engine, random_prompts
from mla_models import MLA_MODELS, hf_mla_model, save_fp8_block_checkpoint, save_mla_checkpoint
from ops_jobs import run_inprocess, write_jsonl
from tiny_models import hf_greedy

PROMPTS = random_prompts(3, vocab=380, seed=1, min_len=12, max_len=26)
# chunked prefill (16-token budget) and 10 blocks of 4 tokens: one row fits, the three cannot
PRESSURE = dict(max_num_batched_tokens=16, block_size=4, num_kv_blocks=10)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def mla_checkpoint(tmp_path_factory):
    """name -> (checkpoint folder, HF's greedy completions of PROMPTS). DeepSeek-V3's carries an MTP layer."""
    root = tmp_path_factory.mktemp("mla")
    made: dict[str, tuple] = {}

    def get(name: str):
        if name not in made:
            model = hf_mla_model(name)
            path = save_mla_checkpoint(model, name, root / name, mtp_layers=1 if name == "deepseek_v3" else 0)
            made[name] = path, [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
        return made[name]

    return get


# Kimi K2's rows are preempted by swapping their latent blocks out and back, the others' by recomputing them
@pytest.mark.parametrize("name,preemption", [("deepseek_v3", "recompute"), ("deepseek_v2", "recompute"),
                                             ("kimi_k2", "swap")])
def test_greedy_matches_hf_alone_batched_chunked_and_preempted(name, preemption, mla_checkpoint):
    assert set(MLA_MODELS) == {"deepseek_v3", "deepseek_v2", "kimi_k2"}  # every model is covered here
    path, reference = mla_checkpoint(name)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    assert len({t for row in reference for t in row}) > 2 * MAX_TOKENS  # decisive: not one repeated token
    engine = make_engine(path, block_size=4)
    assert generate(engine, PROMPTS[:1], params) == reference[:1]
    assert generate(engine, PROMPTS, params) == reference
    assert engine.scheduler.stats.prefix_cache_hit_tokens > 0  # the batch's first row read the latents cached alone
    engine = make_engine(path, preemption=preemption, swap_space_gb=0.01, **PRESSURE)
    assert generate(engine, PROMPTS, params) == reference
    assert engine.scheduler.stats.preemptions > 0
    assert engine.scheduler.stats.swap_preemptions > 0 or preemption == "recompute"


def _decode_step(contexts: list[int], block_size: int, rank: int, rope: int):
    """Metadata of one decode step of len(contexts) rows over a shuffled block pool, and a random cache."""
    gen = torch.Generator().manual_seed(0)
    blocks_per_row = [-(-c // block_size) for c in contexts]
    order = torch.randperm(sum(blocks_per_row), generator=gen).tolist()
    table = torch.zeros(len(contexts), max(blocks_per_row), dtype=torch.int32)
    slots = []
    for b, (ctx, n) in enumerate(zip(contexts, blocks_per_row)):
        table[b, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
        slots.append(int(table[b, (ctx - 1) // block_size]) * block_size + (ctx - 1) % block_size)
    cache = torch.randn(sum(blocks_per_row), block_size, 1, rank + rope, generator=gen)
    meta = AttentionMetadata(query_start_loc=torch.arange(len(contexts) + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(contexts, dtype=torch.int32), block_table=table,
                             slot_mapping=torch.tensor(slots), max_query_len=1, max_seq_len=max(contexts),
                             query_lens_host=[1] * len(contexts), seq_lens_host=contexts, block_size=block_size)
    return cache, meta, gen


def test_absorbed_decode_equals_the_naive_form_to_rounding():
    """Decodes in latent space (q through W_UK, output through W_UV) against per-head keys and values up-projected
    from the same cache: the same product regrouped."""
    heads, nope, rope, v_dim, rank = 4, 16, 8, 12, 32
    cache, meta, gen = _decode_step([1, 7, 30], block_size=4, rank=rank, rope=rope)
    layer = SimpleNamespace(num_heads=heads, kv_lora_rank=rank, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                            v_head_dim=v_dim, scale=0.3,
                            kv_b_proj=SimpleNamespace(weight=torch.randn(heads * (nope + v_dim), rank, generator=gen)))
    q_nope, q_pe = torch.randn(3, heads, nope, generator=gen), torch.randn(3, heads, rope, generator=gen)
    latent = torch.randn(3, rank + rope, generator=gen)
    absorbed = mla_attend(q_nope, q_pe, latent, layer, cache.clone(), meta, absorbed_decode=True)
    naive = mla_attend(q_nope, q_pe, latent, layer, cache.clone(), meta, absorbed_decode=False)
    assert absorbed.shape == (3, heads, v_dim) and absorbed.abs().max() > 0.1
    torch.testing.assert_close(absorbed, naive, rtol=1e-4, atol=1e-4)
    assert not torch.equal(absorbed, naive[torch.tensor([2, 0, 1])])  # rows differ: each attends its own context


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_router_picks_and_weighs_as_hf(name):
    """GroupLimitedRouter (noaux_tc over groups, V2's softmax group-limited greedy) against HF's router module."""
    from cbatch.model.moe import GroupLimitedRouter

    hf = hf_mla_model(name)
    hf_router = hf.model.layers[1].mlp.gate
    spec = parse_spec({**hf.config.to_dict(), "architectures": [type(hf).__name__]})
    router = GroupLimitedRouter(spec.moe, spec.hidden_size)
    with torch.no_grad():
        router.weight.copy_(hf_router.weight)
        if router.e_score_correction_bias is not None:
            router.e_score_correction_bias.copy_(hf_router.e_score_correction_bias)
    x = torch.randn(64, spec.hidden_size, generator=torch.Generator().manual_seed(3))
    weights, ids = router(x)
    _, hf_weights, hf_ids = hf_router(x)
    got, want = ids.sort(dim=-1), hf_ids.sort(dim=-1)
    assert torch.equal(got.values, want.values)
    torch.testing.assert_close(weights.gather(1, got.indices), hf_weights.gather(1, want.indices), rtol=0, atol=0)
    assert len(ids.unique()) > spec.moe.top_k  # tokens spread over the experts


# DeepSeek-V3-671B's config.json, the shapes that size its cache
V3_671B = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168, intermediate_size=18432,
               moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
               n_shared_experts=1, n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
               qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
               first_k_dense_replace=3, norm_topk_prob=True, max_position_embeddings=163840, num_nextn_predict_layers=1,
               rope_scaling={"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096})


def test_kv_cache_holds_one_latent_per_token_and_plan_shows_it(mla_checkpoint, tmp_path):
    big = parse_spec(V3_671B)
    assert big.kv_bytes_per_token(2) == (512 + 64) * 61 * 2 == 70_272  # not 2 x 128 heads x 192 x 61 x 2
    assert abs(big.num_params() / 1e9 - 671) < 10  # the published size, MTP layer aside
    # YaRN factor 40 with mscale_all_dim 1: HF's softmax scale, qk_head_dim ** -0.5 x mscale ** 2
    assert big.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    path, _ = mla_checkpoint("deepseek_v3")
    engine = make_engine(path, block_size=4, num_kv_blocks=10)
    spec = engine.runner.model.spec
    assert spec.kv_bytes_per_token(4) == (16 + 8) * 3 * 4
    assert engine.runner.kv_cache.tensor.shape == (3, 1, 10, 4, 1, 16 + 8)  # [layers, one latent, blocks, bs, 1, L]
    assert engine.runner.kv_cache.nbytes == 10 * 4 * spec.kv_bytes_per_token(4)
    rows = [{"id": f"r{i}", "prompt_token_ids": p, "max_tokens": 4} for i, p in enumerate(PROMPTS)]
    source = write_jsonl(tmp_path / "job.jsonl", rows)
    code, stdout, err = run_inprocess("plan", str(source), "--model", str(path), "--device", "cpu", "--block-size", "4",
                                      "--num-kv-blocks", "40", "--no-search", "--report", str(tmp_path / "plan.json"))
    assert code == 0, err
    assert "KV cache: 288 bytes per token (MLA latent: (16 + 8) x 3 layers x 4 bytes), 160 tokens in the pool" in stdout
    assert json.loads((tmp_path / "plan.json").read_text())["kv_cache"]["bytes_per_token"] == 288


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """A DeepSeek-V3 FP8 block checkpoint (16x16 blocks: several per tiny matrix, ragged edges) and HF's greedy
    completions of PROMPTS with its dequantized weights."""
    model = hf_mla_model("deepseek_v3", seed=4, num_hidden_layers=2)  # a dense layer, a MoE layer
    path = save_fp8_block_checkpoint(model, tmp_path_factory.mktemp("mla-fp8") / "ckpt", block=(16, 16))
    return path, [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def test_fp8_block_checkpoint_matches_its_dequantized_weights(fp8_checkpoint):
    """DeepSeek's layout (weight_scale_inv per block, experts one by one), dequantized at load on the CPU path."""
    path, reference = fp8_checkpoint
    assert generate(make_engine(path, **PRESSURE), PROMPTS, SamplingParams(max_tokens=MAX_TOKENS)) == reference


def test_triton_backend_matches_hf(fp8_checkpoint):
    """The GPU path under the Triton interpreter, chunked and preempted: MLA's projections (kv_b_proj aside) and the
    experts kept in FP8 and dequantized tile by tile, rotary, the fused MoE and the MLA decode kernel."""
    path, reference = fp8_checkpoint
    engine = make_engine(path, attention_backend="triton", max_num_batched_tokens=16, block_size=4, num_kv_blocks=7)
    attention = engine.runner.model.layers[1].self_attn
    assert attention.q_a_proj.weight.dtype == torch.float8_e4m3fn and attention.kv_b_proj.weight.dtype == torch.float32
    assert engine.runner.model.layers[1].mlp.experts.w13.dtype == torch.float8_e4m3fn
    assert generate(engine, PROMPTS, SamplingParams(max_tokens=3)) == [r[:3] for r in reference]
    assert engine.scheduler.stats.preemptions > 0


def test_refusals_name_the_flag(mla_checkpoint):
    path, _ = mla_checkpoint("deepseek_v2")
    with pytest.raises(ConfigError, match="tensor_parallel_size: 3 does not divide the model's attention heads \\(4\\)"):
        resolve_model(EngineConfig(model=str(path), tensor_parallel_size=3))  # (2 and 4 split it: test_tp_families.py)
    with pytest.raises(ConfigError, match="kv_cache_dtype.*use --kv-cache-dtype auto"):
        resolve_model(EngineConfig(model=str(path), kv_cache_dtype="fp8"))


def test_softmax_scale_follows_deepseeks_yarn_mscale():
    """qk_head_dim ** -0.5 x mscale(factor, mscale_all_dim) ** 2 (HF DeepSeek's); a YaRN config without `factor` takes
    the context's growth over the original, as the RoPE tables do; unscaled RoPE keeps the plain scale."""
    import math

    from cbatch.model.mla_spec import MLASpec, mla_softmax_scale

    mla = MLASpec(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  rope_interleave=True)
    plain = 24**-0.5
    assert mla_softmax_scale(mla, {"rope_type": "default"}) == plain
    mscale = 0.1 * 0.707 * math.log(40) + 1.0
    stated = {"rope_type": "yarn", "factor": 40, "mscale_all_dim": 0.707}
    assert mla_softmax_scale(mla, stated) == pytest.approx(plain * mscale**2, rel=1e-12)
    grown = {"rope_type": "yarn", "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
             "max_position_embeddings": 163840}
    assert mla_softmax_scale(mla, grown) == pytest.approx(plain * mscale**2, rel=1e-12)
