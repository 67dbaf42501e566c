"""Tensor parallelism on CPU ranks (gloo): the same greedy tokens as one rank for every architecture, each
rank holding its share of the weights and of the KV pool, a dead rank stopping the job cleanly (and the rerun
completing it), and Ray replicas that are tensor-parallel groups."""
from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from cbatch.config import ConfigError, EngineConfig, SamplingParams
from cbatch.engine.build import build_engine
from cbatch.engine.engine import run_to_completion
from cbatch.engine.resolve import load_rank_model, resolve_model
from cbatch.engine import tensor_parallel
from cbatch.engine.tensor_parallel import Peers
from cbatch.model.decoder import LlamaForCausalLM
from cbatch.model.shard import check_tensor_parallel
from cbatch.model.spec import parse_spec
from cbatch.parallel.comm import Communicator
from helpers import random_prompts, ranks_generate
from ops_jobs import ROOT, part_records, run_inprocess, token_rows, write_jsonl
from tiny_models import ARCHS

# One checkpoint per way a model is split, not every family (each is two engines in processes): heads and MLP
# (llama), one KV head replicated + tied vocab rows (llama3-rope-tied), sharded qkv biases (qwen2), sandwich norms
# and local/global layers (gemma3), the multimodal checkpoint's names (gemma3-multimodal), checkpoint-fused qkv
# and gate_up (phi3), experts with a gated shared expert (qwen2_moe). Experts with q/k norms (qwen3_moe) split at
# 4 ranks in tests/test_tp_quant.py; MLA (DeepSeek) and gpt-oss: tests/test_tp_families.py.
SPLIT_ARCHS = ["llama", "llama3-rope-tied", "qwen2", "gemma3", "gemma3-multimodal", "phi3", "qwen2_moe"]


@pytest.mark.parametrize("arch", SPLIT_ARCHS)
def test_two_ranks_give_the_tokens_of_one(arch, tiny_checkpoints, family_checkpoint, monkeypatch):
    """Under chunked prefill (a 24-token step budget, prompts up to 60) and preemption (a pool too small for
    every row at once): TP=2 == TP=1, token for token. llama3-rope-tied has one KV head for two ranks
    (replicated); the others split theirs."""
    if arch == "llama":  # production's fresh interpreters; the suite's other ranks fork (tests/conftest.py)
        monkeypatch.setattr(tensor_parallel, "START_METHOD", "spawn")
    path = tiny_checkpoints[arch] if arch in ARCHS else family_checkpoint(arch)
    prompts = random_prompts(8, 384, seed=3, min_len=20, max_len=60)
    settings = dict(max_num_batched_tokens=24, max_num_seqs=6, num_kv_blocks=14, block_size=8)
    one, one_stats = ranks_generate(path, 1, prompts, **settings)
    two, two_stats = ranks_generate(path, 2, prompts, **settings)
    assert two == one
    assert one_stats["preemptions"] > 0 and two_stats == one_stats  # the same schedule, preemptions included
    assert len({tuple(t) for t in one}) > 4  # the rows differ: a model that repeats itself would prove nothing


class _Rank(Communicator):
    """A rank's identity without a group: loading a shard needs no collective."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world


@pytest.mark.parametrize("arch", ["llama", "llama3-rope-tied", "qwen3_moe"])
def test_each_rank_holds_half_the_weights_and_kv(arch, tiny_checkpoints, family_checkpoint, monkeypatch):
    """Every sharded matrix is half per rank and the two halves add up to the whole; replicated parts (norms,
    the router) are whole on each rank. A model with fewer KV heads than ranks (llama3-rope-tied: one) gives
    each rank a copy of its KV head: its qkv rows are half the query rows plus the whole K and V rows, and the
    KV pool's share is that one head.

    The weights are compared before oneDNN prepacking: on a CPU where it applies (AVX-512), prepacking moves
    each linear layer's weight out of `named_parameters()`, which once left only the norms and embeddings
    here and hid a wrong expectation for the replicated KV head from CI (it failed on AVX2 machines only)."""
    monkeypatch.setattr(LlamaForCausalLM, "prepack_for_cpu", lambda self: None)
    path = tiny_checkpoints[arch] if arch in ARCHS else family_checkpoint(arch)
    config = EngineConfig(model=str(path), device="cpu")
    resolved = resolve_model(config)
    spec = resolved.spec
    cpu = torch.device("cpu")
    full = dict(load_rank_model(config, resolved, _Rank(0, 1), cpu).named_parameters())
    ranks = [load_rank_model(config, resolved, _Rank(r, 2), cpu) for r in range(2)]
    shares = [dict(m.named_parameters()) for m in ranks]
    replicated = {name for name, p in full.items() if p.shape == shares[0][name].shape}
    assert all("norm" in n or n.endswith(".gate.weight") or n.endswith("bias") for n in replicated), replicated
    assert any(n.endswith("qkv_proj.weight") for n in full) and not any(n.endswith("proj.weight") for n in replicated)
    kv_rows = 2 * spec.num_kv_heads * spec.head_dim  # K and V rows of qkv_proj
    kv_replicated = spec.num_kv_heads < 2
    for name, param in full.items():
        if name in replicated:
            continue
        halves = [share[name] for share in shares]
        if kv_replicated and name.endswith("qkv_proj.weight"):
            q_rows = param.shape[0] - kv_rows
            for rank, half in enumerate(halves):
                assert half.shape == (q_rows // 2 + kv_rows, param.shape[1]), name
                assert torch.equal(half[q_rows // 2:], param[q_rows:]), f"{name}: rank {rank}'s K/V rows"
            assert torch.equal(torch.cat([h[: q_rows // 2] for h in halves]), param[:q_rows]), name
        else:
            assert halves[0].numel() == halves[1].numel() == param.numel() // 2, name
    for rank in ranks:
        expected_kv_heads = spec.num_kv_heads // 2 if spec.num_kv_heads >= 2 else 1
        assert rank.spec.num_kv_heads == expected_kv_heads and rank.spec.num_heads * 2 == spec.num_heads


def test_engine_reports_each_ranks_memory(tiny_checkpoints):
    """The runner's report of what rank 0 holds: half the KV bytes of one rank, less than TP=1's weights."""
    sizes = {}
    for tp in (1, 2):
        engine = build_engine(EngineConfig(model=str(tiny_checkpoints["llama"]), device="cpu", tensor_parallel_size=tp,
                                           num_kv_blocks=10))
        sizes[tp] = engine.runner.memory()
        engine.close()
    assert sizes[2]["tensor_parallel_size"] == 2
    assert sizes[2]["kv_cache_bytes_per_rank"] * 2 == sizes[1]["kv_cache_bytes_per_rank"] > 0
    assert sizes[1]["weight_bytes_per_rank"] / 2 < sizes[2]["weight_bytes_per_rank"] < sizes[1]["weight_bytes_per_rank"] * 0.6


def test_cpu_ranks_split_the_cores_and_the_process_gets_its_threads_back(tiny_checkpoints):
    """Without --threads each CPU rank takes its share of torch's threads (every rank's OpenMP pool took them all:
    two ranks on two cores ran ~4x slower); rank 0's process has its threads back once the engine closes (the
    library's caller goes on); --threads is each rank's own."""
    from cbatch.engine.tensor_parallel import rank_threads

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    before = torch.get_num_threads()
    torch.set_num_threads(6)  # (the process's threads as torch sees them; more than the machine's cores is fine here)
    try:
        assert rank_threads(EngineConfig(tensor_parallel_size=2), cpu) == 3
        assert rank_threads(EngineConfig(tensor_parallel_size=4), cpu) == 1
        assert rank_threads(EngineConfig(tensor_parallel_size=8), cpu) == 1
        assert rank_threads(EngineConfig(tensor_parallel_size=1), cpu) is None
        assert rank_threads(EngineConfig(tensor_parallel_size=2, num_threads=5), cpu) is None  # (set as it is)
        assert rank_threads(EngineConfig(tensor_parallel_size=2), cuda) is None
        engine = build_engine(EngineConfig(model=str(tiny_checkpoints["llama"]), device="cpu", tensor_parallel_size=2,
                                           num_kv_blocks=10))
        assert torch.get_num_threads() == 3
        assert run_to_completion(engine, [[5, 6, 7]], [SamplingParams(max_tokens=2, temperature=0.0)])[0].token_ids
        engine.close()
        assert torch.get_num_threads() == 6
    finally:
        torch.set_num_threads(before)


def test_splits_the_model_cannot_take_are_refused(tiny_checkpoints):
    spec = resolve_model(EngineConfig(model=str(tiny_checkpoints["llama"]), device="cpu")).spec
    with pytest.raises(ConfigError, match="does not divide the model's attention heads"):
        check_tensor_parallel(spec, 3)
    code, _, err = run_inprocess("run", str(ROOT / "sample_data" / "prompts.jsonl"), "--model",
                                 str(tiny_checkpoints["llama"]), "-o", "/tmp/never-written.jsonl", "--device", "cpu",
                                 "--tensor-parallel-size", "3")
    assert code == 2 and "--tensor-parallel-size: 3 does not divide" in err and "Traceback" not in err


def _tp_job(tmp_path, model, out, *extra):
    return run_inprocess("run", str(tmp_path / "in.jsonl"), "--model", str(model), "-o", str(out), "--device", "cpu",
                         "--tensor-parallel-size", "2", "--max-num-seqs", "4", "--display", "none", "--seed", "5", *extra)


def test_a_killed_rank_stops_the_job_with_its_rows_kept_and_the_rerun_completes(tiny_checkpoints, tmp_path, monkeypatch):
    """Fault injection by step count: rank 1 is SIGKILLed before rank 0 sends step 12. The job exits 74 with one
    line naming the rank, keeps the rows finished before, and the rerun's OUTPUT equals an uninterrupted run's."""
    model = tiny_checkpoints["llama"]
    write_jsonl(tmp_path / "in.jsonl", token_rows(24, 384, seed=11))
    reference = tmp_path / "reference.jsonl"
    assert _tp_job(tmp_path, model, reference)[0] == 0
    send_step, steps = Peers.send_step, []

    def kill_at_step_12(self, inputs):
        steps.append(1)
        if len(steps) == 12:
            os.kill(self.processes[0].pid, signal.SIGKILL)
            self.processes[0].join()
        send_step(self, inputs)

    monkeypatch.setattr(Peers, "send_step", kill_at_step_12)
    out = tmp_path / "out.jsonl"
    code, _, err = _tp_job(tmp_path, model, out)
    assert code == 74, err
    assert "tensor-parallel rank 1" in err and "died" in err and "Traceback" not in err
    assert not out.exists()
    assert 0 < len(part_records(out)) < 24  # some rows finished before the kill, and they are on disk
    monkeypatch.setattr(Peers, "send_step", send_step)
    code, _, err = _tp_job(tmp_path, model, out)
    assert code == 0, err
    assert "resuming" in err
    assert out.read_bytes() == reference.read_bytes()


def test_ray_replicas_of_two_ranks_match_a_local_run(tiny_checkpoints, tmp_path):
    """2 replicas x 2 ranks (4 CPU processes) give the bytes of a one-process, one-rank run."""
    ray = pytest.importorskip("ray")
    from cbatch.run.job import run_job
    from cbatch.run.preflight import JobOptions
    from cbatch.scaleout.ray_job import RayOptions, run_ray_job

    inp = write_jsonl(tmp_path / "in.jsonl", token_rows(20, 384, seed=4))

    def options(out, tp):  # one CPU thread per rank, as the replicas' ranks have (two on busy cores: much slower)
        engine = EngineConfig(model=str(tiny_checkpoints["qwen3"]), device="cpu", max_num_seqs=4, seed=7,
                              tensor_parallel_size=tp, num_threads=1)
        return JobOptions(input=inp, output=out, engine=engine, defaults=SamplingParams(max_tokens=8), token_ids=True,
                          quiet=True, display="none")

    threads = torch.get_num_threads()
    try:
        assert run_job(options(tmp_path / "local.jsonl", 1)) == 0
    finally:  # num_threads is set process-wide: the tests after this one keep their count
        torch.set_num_threads(threads)
    # address="local": a new instance of its own, never a cluster `ray start` left running on this machine
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning", log_to_driver=False)
    try:
        report = tmp_path / "report.json"
        code = run_ray_job(dataclasses_replace(options(tmp_path / "ray.jsonl", 2), report=report),
                           RayOptions(replicas=2, gpus_per_replica=0, block_rows=4))
    finally:
        ray.shutdown()
    assert code == 0
    assert (tmp_path / "ray.jsonl").read_bytes() == (tmp_path / "local.jsonl").read_bytes()
    replicas = json.loads(report.read_text())["replicas"]
    assert len(replicas) == 2 and all(r["rows"] > 0 and r["memory"]["tensor_parallel_size"] == 2 for r in replicas)


def dataclasses_replace(obj, **changes):
    from dataclasses import replace

    return replace(obj, **changes)


def test_plan_counts_one_ranks_share_and_the_all_reduces():
    """`cbatch plan --tensor-parallel-size 8` for a 70B-class model on H100s: it fits (no room on one rank),
    and a rank's prefill token costs about an eighth of one GPU's, plus the all-reduce traffic."""
    from cbatch.engine.resolve import ResolvedModel
    from cbatch.plan.devices import gpu_kind

    raw = dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=8192, intermediate_size=28672,
               num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=8192,
               rms_norm_eps=1e-5, torch_dtype="bfloat16")
    model = ResolvedModel(parse_spec(raw), torch.device("cuda"), torch.bfloat16, 8192)
    h100 = gpu_kind("H100")
    config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    with pytest.raises(Exception, match="H100"):
        h100.kv_pool(config, model)  # 140 GB of weights on one 80 GB GPU
    pool = h100.kv_pool(EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192, tensor_parallel_size=8), model)
    assert pool.num_blocks * 16 > 100_000  # tokens of KV on each rank (one KV head of 8 per rank)
    one, eight = h100.default_cost(model, 1), h100.default_cost(model, 8)
    assert one.per_prefill_token / 8 < eight.per_prefill_token < one.per_prefill_token / 4
    assert eight.per_step < one.per_step / 4  # each rank streams an eighth of the weights


def test_forks_logprobs_penalties_and_swap_preemption_across_ranks(tiny_checkpoints):
    """The other per-step inputs the workers mirror: forked samples' block copies, swaps to the host and back,
    prompt log-probabilities (the workers join the gathers of their logits)."""
    path = tiny_checkpoints["qwen2"]
    prompts = random_prompts(8, 384, seed=9, min_len=20, max_len=50)
    params = [SamplingParams(max_tokens=10, n=2, temperature=0.8, seed=1), SamplingParams(max_tokens=8, logprobs=2),
              SamplingParams(max_tokens=8, prompt_logprobs=1), SamplingParams(max_tokens=12, repetition_penalty=1.2)] * 2
    results = {}
    for tp in (1, 2):
        engine = build_engine(EngineConfig(model=str(path), device="cpu", tensor_parallel_size=tp, num_kv_blocks=16,
                                           block_size=8, max_num_seqs=6, preemption="swap"))
        try:
            outs = run_to_completion(engine, prompts, params)
            results[tp] = (outs, engine.scheduler.stats.swap_preemptions)
        finally:
            engine.close()
    (one, swaps_one), (two, swaps_two) = results[1], results[2]
    assert [o.token_ids for o in two] == [o.token_ids for o in one] and swaps_one == swaps_two > 0
    assert len(one) == 10  # 8 rows, the two n=2 rows gave two samples each
    assert sum(o.logprobs is not None for o in one) == 2 and sum(o.prompt_logprobs is not None for o in one) == 2
    for a, b in zip(one, two):
        for got, want in ((a.logprobs, b.logprobs), (a.prompt_logprobs, b.prompt_logprobs)):
            assert (got is None) == (want is None)
            if got is not None:
                assert got.token == pytest.approx(want.token, abs=1e-4) and got.top_ids == want.top_ids
