"""`cbatch plan`: the error rows are exactly `run`'s, no weights are loaded, the simulated schedule is the
run's and its time is the fitted cost model priced over it, the search, output lengths, device presets,
the result cache, exit codes."""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cbatch.bench.simulator import CostModel
from cbatch.config import SamplingParams
from cbatch.engine.memory import blocks_for_every_slot
from cbatch.plan.lengths import OutputLengths
from ops_jobs import read_jsonl, run_inprocess, write_jsonl

WORDS = "the of a batch cache model token row plan night job queue steady river stone light".split()


def text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def mixed_rows(seed: int) -> list:
    """Text, chat and token-id rows, and every kind of bad row `run` turns into an error row."""
    rng = random.Random(seed)
    rows: list = []
    for i in range(24):
        kind = i % 3
        row = {"id": f"r{i}", "max_tokens": rng.randint(2, 6)}
        if kind == 0:
            row["prompt"] = text(rng, rng.randint(2, 20))
        elif kind == 1:
            row["messages"] = [{"role": "user", "content": text(rng, rng.randint(2, 12))}]
        else:
            row["prompt_token_ids"] = [rng.randrange(3, 49152) for _ in range(rng.randint(1, 20))]
        if i % 4 == 1:
            row.update(temperature=0.8, stop=["river"])
        rows.append(row)
    rows += [
        '{"id": "x1", "prompt": "unterminated',  # not JSON
        "[1, 2]",  # not an object
        {"id": "x3", "max_tokens": 4},  # no prompt
        {"id": "x4", "prompt": "a", "messages": [{"role": "user", "content": "b"}]},  # two prompts
        {"id": "x5", "prompt": "fine", "max_tokens": -1},
        {"id": "x6", "prompt": "fine", "temperature": "hot"},
        {"id": "x7", "messages": [{"content": "no role"}]},
        {"id": "x8", "prompt": "   "},
        {"id": "x9", "prompt_token_ids": [5, 49152 + 3]},  # outside the vocabulary
        {"id": "x10", "prompt": text(rng, 120)},  # longer than --max-model-len
        {"id": "x11", "prompt": text(rng, 10), "max_tokens": 80},  # prompt + max_tokens: more blocks than the pool
        {"id": "x12", "prompt": "fine", "stop": [""]},
    ]
    rng.shuffle(rows)
    return rows


CHAT_FLAGS = ["--device", "cpu", "--max-model-len", "96", "--num-kv-blocks", "5", "--block-size", "16", "--seed", "2"]


def plan(*args: str) -> tuple[int, str, str]:
    return run_inprocess("plan", *args)


def test_plan_lists_exactly_the_error_rows_run_produces(tiny_chat_model, tmp_path):
    source = write_jsonl(tmp_path / "in.jsonl", mixed_rows(7))
    flags = ["--model", str(tiny_chat_model), *CHAT_FLAGS]
    code, stdout, err = plan(str(source), *flags, "--report", str(tmp_path / "plan.json"), "--no-search")
    assert code == 1, err  # like run: error rows make exit 1
    planned = json.loads((tmp_path / "plan.json").read_text())
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "out.jsonl"), *flags)
    assert code == 1, err
    produced = [(r["id"], r["error"]) for r in read_jsonl(tmp_path / "out.jsonl") if r["error"] is not None]
    assert [(e["id"], e["error"]) for e in planned["errors"]] == produced
    assert len(produced) == 12  # every kind of bad row above, the context and pool checks included
    assert any("context is 96" in e for _, e in produced) and any("KV blocks" in e for _, e in produced)
    for row_id, error in produced:
        assert f"  {row_id}: {error}" in stdout
    assert planned["requests"] == {"total": 36, "ok": 24, "error": 12, "cached": 0}
    assert f"{planned['requests']['total']} rows: 24 would run, 12 error rows" in stdout


def test_plan_never_loads_weights(tiny_chat_model, tmp_path, monkeypatch):
    import cbatch.engine.build as build
    import cbatch.engine.resolve as resolve
    import cbatch.model.loader as loader
    from cbatch.model.weights import TensorIndex

    def refuse(*args, **kwargs):
        raise AssertionError("cbatch plan loaded weights")

    for module, name in ((loader, "load_model"), (TensorIndex, "get"), (resolve, "load_model"), (build, "build_engine")):
        monkeypatch.setattr(module, name, refuse)
    source = write_jsonl(tmp_path / "in.jsonl", [r for r in mixed_rows(3) if isinstance(r, dict) and "id" in r][:20])
    code, stdout, err = plan(str(source), "--model", str(tiny_chat_model), *CHAT_FLAGS, "--allow-errors")
    assert code == 0, err
    assert "predicted on cpu" in stdout and "wall" in stdout


def token_rows(n: int, seed: int) -> list[dict]:
    """Mixed lengths, EOS ignored: the run generates exactly max_tokens, as the plan assumes."""
    rng = random.Random(seed)
    return [{"id": f"t{i}", "prompt_token_ids": [rng.randrange(3, 384) for _ in range(rng.randint(2, 60))],
             "max_tokens": rng.choice([2, 4, 8, 16, 24]), "ignore_eos": True} for i in range(n)]


@pytest.fixture(scope="module")
def calibration(tiny_checkpoints, tmp_path_factory):
    """A real run's report on one input: what --cost-from fits a cost model to."""
    root = tmp_path_factory.mktemp("plan-calibration")
    source = write_jsonl(root / "calibration.jsonl", token_rows(40, seed=1))
    flags = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--max-num-seqs", "8",
             "--num-kv-blocks", "20", "--block-size", "8"]
    code, _, err = run_inprocess("run", str(source), "--out", str(root / "out.jsonl"), *flags,
                                 "--report", str(root / "report.json"))
    assert code == 0, err
    return {"flags": flags, "report": root / "report.json"}


def test_plan_takes_the_runs_schedule_and_prices_it_with_the_fitted_costs(calibration, tmp_path):
    """Fitted on another input, the plan of a job steps exactly as its run does (the same scheduler over the
    same prompts and lengths, preemptions included), and its wall time is the fitted cost model priced over
    that schedule. How close that time is to the run's: benchmarks/plan_accuracy.py."""
    source = write_jsonl(tmp_path / "job.jsonl", token_rows(60, seed=2))
    code, _, err = plan(str(source), *calibration["flags"], "--cost-from", str(calibration["report"]),
                        "--report", str(tmp_path / "plan.json"), "--no-search")
    assert code == 0, err
    predicted = json.loads((tmp_path / "plan.json").read_text())
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "out.jsonl"), *calibration["flags"],
                                 "--report", str(tmp_path / "run.json"))
    assert code == 0, err
    run = json.loads((tmp_path / "run.json").read_text())
    p, u = predicted["predicted"], run["utilization"]
    assert (p["steps"], p["preemptions"], p["recomputed_tokens"]) == (u["steps"], u["preemptions"], u["recomputed_tokens"])
    assert p["preemptions"] > 0  # the small pool makes the schedule non-trivial
    assert (p["prompt_tokens"], p["output_tokens"]) == (run["tokens"]["prompt"], run["tokens"]["output"])
    assert p["peak_kv_usage"] == u["peak_kv_usage"] and p["num_kv_blocks"] == 20
    cost = CostModel.fit(calibration["report"])
    for term in ("per_step", "per_prefill_token", "per_decode_token", "per_context_token"):
        assert predicted["cost_model"][term] == getattr(cost, term), term
    s = run["series"]
    priced = (cost.per_step * sum(s["steps"]) + cost.per_prefill_token * sum(s["prefill_tokens"])
              + cost.per_context_token * sum(s["context_tokens"])
              + cost.per_decode_token * (sum(s["scheduled_tokens"]) - sum(s["prefill_tokens"])))
    assert p["wall_seconds"] == pytest.approx(priced, rel=1e-9)


def test_search_finds_faster_settings_and_they_replay_alike(tiny_checkpoints, tmp_path):
    source = write_jsonl(tmp_path / "job.jsonl", token_rows(48, seed=4))
    flags = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--max-num-seqs", "2"]
    code, stdout, err = plan(str(source), *flags, "--report", str(tmp_path / "plan.json"))
    assert code == 0, err
    result = json.loads((tmp_path / "plan.json").read_text())
    best, tried = result["search"]["best"], result["search"]["tried"]
    assert best["max_num_seqs"] > 2 and best["wall_seconds"] < result["predicted"]["wall_seconds"]
    assert best["wall_seconds"] == min(t["wall_seconds"] for t in tried) and len(tried) >= 8
    assert f"--max-num-seqs {best['max_num_seqs']} --max-num-batched-tokens {best['max_num_batched_tokens']}" in stdout
    # the search's replay of the rows predicts what a plan with those settings predicts
    code, _, err = plan(str(source), *flags, "--max-num-seqs", str(best["max_num_seqs"]), "--max-num-batched-tokens",
                        str(best["max_num_batched_tokens"]), "--no-search", "--report", str(tmp_path / "best.json"))
    assert code == 0, err
    assert json.loads((tmp_path / "best.json").read_text())["predicted"] == best


def test_output_lengths_from_an_earlier_report(tiny_chat_model, tmp_path):
    rows = [r for r in mixed_rows(5) if isinstance(r, dict) and "x" not in r.get("id", "x")]
    rows = [dict(r, max_tokens=40, stop=["e"] if i % 2 else []) for i, r in enumerate(rows)]  # lengths that vary
    source = write_jsonl(tmp_path / "in.jsonl", rows)
    flags = ["--model", str(tiny_chat_model), "--device", "cpu"]
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "out.jsonl"), *flags,
                                 "--report", str(tmp_path / "run.json"))
    assert code == 0, err
    lengths = sorted(r["completion_tokens"] for r in read_jsonl(tmp_path / "out.jsonl"))
    quantiles = json.loads((tmp_path / "run.json").read_text())["lengths"]["output_tokens"]
    assert len(quantiles) == 101 and quantiles[0] == lengths[0] and quantiles[-1] == lengths[-1]
    assert quantiles[50] == lengths[round(50 * (len(lengths) - 1) / 100)]
    code, _, err = plan(str(source), *flags, "--lengths-from", str(tmp_path / "run.json"), "--no-search",
                        "--report", str(tmp_path / "plan.json"))
    assert code == 0, err
    predicted = json.loads((tmp_path / "plan.json").read_text())["predicted"]["output_tokens"]
    assert len(rows) * lengths[0] <= predicted <= len(rows) * lengths[-1] and predicted < 40 * len(rows)
    code, _, err = plan(str(source), *flags, "--lengths-from", str(source))
    assert code == 2 and "--lengths-from" in err and err.count("\n") == 1, err


def test_planned_length_of_a_row():
    lengths = OutputLengths([3] * 101, "test", seed=0)
    assert lengths.of(0, SamplingParams(max_tokens=10), stops_at_eos=True) == 3
    assert lengths.of(1, SamplingParams(max_tokens=2), stops_at_eos=True) == 2  # capped at max_tokens
    assert lengths.of(2, SamplingParams(max_tokens=10, ignore_eos=True), stops_at_eos=True) == 10
    assert lengths.of(3, SamplingParams(max_tokens=10), stops_at_eos=False) == 10  # a model without EOS
    spread = OutputLengths(list(range(1, 102)), "test", seed=0)
    draws = [spread.of(i, SamplingParams(max_tokens=500), True) for i in range(400)]
    assert draws == [spread.of(i, SamplingParams(max_tokens=500), True) for i in range(400)]  # a pure function
    assert min(draws) < 15 and max(draws) > 85 and 40 < sum(draws) / len(draws) < 62
    assert OutputLengths().of(0, SamplingParams(max_tokens=7), True) == 7


def test_gpu_preset_sizes_the_pool_from_its_memory(tiny_checkpoints, tmp_path):
    source = write_jsonl(tmp_path / "job.jsonl", token_rows(10, seed=5))
    code, stdout, err = plan(str(source), "--model", str(tiny_checkpoints["llama"]), "--device-kind", "h100",
                             "--report", str(tmp_path / "plan.json"), "--no-search")
    assert code == 0, err
    result = json.loads((tmp_path / "plan.json").read_text())
    assert result["device_kind"] == "H100" and "predicted on H100" in stdout
    from cbatch.config import EngineConfig
    from cbatch.engine.memory import GPU_MAX_NUM_SEQS, with_step_limits

    # 80 GiB holds every slot (the GPU's default step, 1024 sequences) at the full context: the pool is capped
    # there, as a run's is
    gpu_config = with_step_limits(EngineConfig(), torch.device("cuda"))
    assert gpu_config.max_num_seqs == GPU_MAX_NUM_SEQS
    assert result["predicted"]["num_kv_blocks"] == blocks_for_every_slot(gpu_config, result["max_model_len"])
    code, _, err = plan(str(source), "--model", str(tiny_checkpoints["llama"]), "--device-kind", "tpu-v9")
    assert code == 2 and "--device-kind" in err and "h100" in err and err.count("\n") == 1, err


def test_default_costs_follow_the_model_and_the_device(tiny_checkpoints):
    from cbatch.config import EngineConfig
    from cbatch.engine.resolve import resolve_model
    from cbatch.plan.devices import device_kind

    config = EngineConfig(model=str(tiny_checkpoints["llama"]), dtype="bfloat16")
    h100, a100 = (device_kind(name, config) for name in ("h100", "a100"))
    model = resolve_model(config, device=h100.device)
    fast, slow = h100.default_cost(model), a100.default_cost(model)
    for term in ("per_step", "per_prefill_token", "per_decode_token", "per_context_token"):
        assert 0 < getattr(fast, term) < getattr(slow, term), term
    assert fast.per_decode_token > fast.per_prefill_token  # a decode token also pays for the lm_head
    fp32 = h100.default_cost(replace(model, dtype=__import__("torch").float32))
    assert fp32.per_prefill_token > 8 * fast.per_prefill_token  # no tensor cores in float32


def small_moe(**changes) -> "ResolvedModel":
    """A Qwen2-MoE-shaped spec in bfloat16 (no checkpoint: the plan's device figures read the spec alone): 4 layers
    of hidden 64, the first dense (`mlp_only_layers`), the other 3 with 8 experts of top-2."""
    from cbatch.engine.resolve import ResolvedModel
    from cbatch.model.spec import parse_spec

    raw = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=256, hidden_size=64, intermediate_size=128,
               moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
               num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0], max_position_embeddings=512,
               rms_norm_eps=1e-6, torch_dtype="bfloat16")
    return ResolvedModel(parse_spec({**raw, **changes}), torch.device("cuda"), torch.bfloat16, 512)


def test_expert_parallel_prices_the_combine_from_its_bytes():
    """4 ranks, H = 64 bfloat16 (128 B a vector), k = 2, a step of 10 prefill and 6 decode tokens, by hand:
    a ring all-reduce sends 2 x 3/4 x 128 = 192 B a token; every layer's attention all-reduces (4 x 192 = 768), and
    the MLP: the dense layer 0 all-reduces (192); each of the 3 MoE layers under --expert-parallel combines instead,
    routed in eager (prefill) steps 3/4 x (2/4 + 1) x 128 = 144 B, padded in CUDA-graph decode steps 3/4 x 3 x 128
    = 288 B. So 1,392 B per prefill token, 1,824 per decode token; plain tensor parallelism 8 x 192 = 1,536 both."""
    from cbatch.model.shard import with_expert_parallel
    from cbatch.plan.devices import NVLINK_TB_S, BANDWIDTH_EFFICIENCY, cpu_kind, gpu_kind

    plain = small_moe()
    expert = replace(plain, spec=with_expert_parallel(plain.spec))
    h100 = gpu_kind("H100")
    sent = h100.comm_bytes(expert, 4)
    assert (sent.prefill, sent.decode) == (1392, 1824)
    assert sent.per_step(10, 6) == 10 * 1392 + 6 * 1824 == 24_864
    assert h100.comm_bytes(plain, 4).per_step(10, 6) == 16 * 1536
    eager = 16 * 1392  # no CUDA graphs (--enforce-eager, or a CPU): every step routed
    assert h100.comm_bytes(expert, 4, enforce_eager=True).per_step(10, 6) == cpu_kind().comm_bytes(expert, 4).per_step(10, 6) == eager
    assert h100.comm_bytes(expert, 1).per_step(10, 6) == 0
    # the cost model prices those bytes at NVLink's speed: only the decode token's combine differs when eager
    graphs, no_graphs = h100.default_cost(expert, 4), h100.default_cost(expert, 4, enforce_eager=True)
    assert graphs.per_prefill_token == no_graphs.per_prefill_token
    assert graphs.per_decode_token - no_graphs.per_decode_token == pytest.approx(
        (1824 - 1392) / (NVLINK_TB_S * 1e12 * BANDWIDTH_EFFICIENCY))


def test_a_model_too_big_for_one_machine_says_what_it_needs():
    """A ~2.6 TB bfloat16 MoE does not fit 8 GPUs of any preset: the message gives the weights per rank at 8 ranks
    against the GPU's memory and the fix, not --gpu-memory-utilization; ~260 GB of weights fit 8 H100s but not 8 L4s
    (a bigger GPU is named); a model that 8 GPUs hold at a higher --gpu-memory-utilization keeps that advice."""
    from cbatch.config import EngineConfig
    from cbatch.plan.devices import PlanError, gpu_kind

    huge = small_moe(hidden_size=8192, moe_intermediate_size=4096, num_hidden_layers=100, num_experts=128,
                     num_attention_heads=64, num_key_value_heads=8, vocab_size=32000)
    config = EngineConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    h200 = gpu_kind("H200")
    per_rank = h200.weight_bytes_per_rank(replace(config, tensor_parallel_size=8), huge)  # (whole experts: the same)
    assert 141 * 2**30 < per_rank < per_rank * 8 < 2.7e12  # more than an H200 holds
    for tp in (1, 8):
        with pytest.raises(PlanError) as refused:
            h200.kv_pool(replace(config, tensor_parallel_size=tp), huge)
        assert str(refused.value) == (
            "--device-kind H200: the model does not fit one machine's 8 GPUs: at --tensor-parallel-size 8 each rank's "
            f"weights take {per_rank / 2**30:,.1f} GiB of the GPU's 141.0 GiB, which "
            "leaves no room for a KV cache even at --gpu-memory-utilization 1.0; use a smaller (quantized) checkpoint: "
            "more GPUs than one machine holds is not supported")
    mid = small_moe(hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=80, num_experts=64,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)  # ~260 GB: ~30 GiB per rank at 8
    with pytest.raises(PlanError, match=r"^--device-kind L4: the model does not fit one machine's 8 GPUs: at "
                                        r"--tensor-parallel-size 8 each rank's weights take "
                                        r"\d+\.\d GiB of the GPU's 24\.0 GiB, .*; use a GPU with more memory "
                                        r"\(--device-kind l40s fits\) or a smaller \(quantized\) checkpoint$"):
        gpu_kind("L4").kv_pool(replace(config, tensor_parallel_size=8), mid)
    h100 = gpu_kind("H100")
    assert h100.kv_pool(replace(config, tensor_parallel_size=8), mid).num_blocks > 0
    with pytest.raises(PlanError, match=r"H100: no GPU memory left .*raise --gpu-memory-utilization"):
        h100.kv_pool(replace(config, tensor_parallel_size=8, gpu_memory_utilization=0.05), mid)


def test_plan_consults_the_result_cache_without_writing_it(tiny_checkpoints, tmp_path):
    source = write_jsonl(tmp_path / "job.jsonl", token_rows(12, seed=6))
    flags = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu"]
    cache = tmp_path / "cache"
    code, _, err = run_inprocess("run", str(source), "--out", str(tmp_path / "out.jsonl"), *flags,
                                 "--result-cache", str(cache))
    assert code == 0, err
    before = {p: p.stat().st_mtime_ns for p in (cache / "v1" / "entries").glob("*/*.json")}
    more = write_jsonl(tmp_path / "more.jsonl", token_rows(12, seed=6) + token_rows(15, seed=7)[12:])
    code, stdout, err = plan(str(more), *flags, "--result-cache", str(cache), "--report", str(tmp_path / "plan.json"))
    assert code == 0, err
    result = json.loads((tmp_path / "plan.json").read_text())
    assert result["requests"]["cached"] == 12 and "(12 from the result cache)" in stdout
    assert result["predicted"]["output_tokens"] == sum(r["max_tokens"] for r in token_rows(15, seed=7)[12:])
    assert {p: p.stat().st_mtime_ns for p in (cache / "v1" / "entries").glob("*/*.json")} == before


def test_plan_exit_codes_and_one_line_errors(tiny_checkpoints, tmp_path, monkeypatch):
    source = write_jsonl(tmp_path / "job.jsonl", token_rows(4, seed=8) + [{"id": "bad", "prompt_token_ids": []}])
    model = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--no-search"]
    assert plan(str(source), *model)[0] == 1
    assert plan(str(source), *model, "--allow-errors")[0] == 0
    not_a_report = write_jsonl(tmp_path / "x.jsonl", [{"a": 1}])
    for args, expected in (([str(tmp_path / "missing.jsonl")], "no such input file"),
                           ([str(source), "--cost-from", str(not_a_report)], "--cost-from"),
                           ([str(source), "--report", str(tmp_path / "no" / "plan.json")], "--report"),
                           ([str(source), "--max-num-seqs", "0"], "--max-num-seqs")):
        code, _, err = plan(*args, *model)
        assert code == 2 and expected in err and err.count("\n") == 1, (args, err)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # a backend the run could not use on this CPU
    code, _, err = plan(str(source), *model, "--attention-backend", "triton")
    assert code == 2 and "--attention-backend" in err and err.count("\n") == 1, err


def test_cost_fit_recovers_the_decode_term(tmp_path):
    rng = random.Random(0)
    n = 60
    steps = [rng.randint(1, 5) for _ in range(n)]
    prefill = [rng.randint(0, 500) for _ in range(n)]
    decode = [rng.randint(0, 64) for _ in range(n)]
    context = [rng.randint(100, 5000) for _ in range(n)]
    dt = [0.02 * s + 1e-4 * p + 3e-4 * d + 2e-6 * c for s, p, d, c in zip(steps, prefill, decode, context)]
    series = {"steps": steps, "prefill_tokens": prefill, "context_tokens": context, "dt": dt,
              "scheduled_tokens": [p + d for p, d in zip(prefill, decode)]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"time_unit": "s", "series": series}))
    cost = CostModel.fit(path)
    expected = {"per_step": 0.02, "per_prefill_token": 1e-4, "per_decode_token": 3e-4, "per_context_token": 2e-6}
    for name, value in expected.items():
        assert getattr(cost, name) == pytest.approx(value, rel=1e-6), name


def test_plan_accuracy_script_runs(tiny_chat_model, tmp_path):
    """benchmarks/plan_accuracy.py (the figure for RESULTS.md) in its --quick mode: chat rows, calibration on
    another input, plan, run. The plan's steps are the run's; the timing itself is for a quiet machine."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_accuracy.py"
    spec = importlib.util.spec_from_file_location("plan_accuracy", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    result = script.main(["--quick", "--model", str(tiny_chat_model), "--workdir", str(tmp_path)])
    assert result["predicted_steps"] == result["measured_steps"] > 0
    assert result["predicted_wall_s"] > 0 and result["measured_wall_s"] > 0


def test_a_long_job_is_checked_whole_and_simulated_on_an_even_sample(tiny_checkpoints, tmp_path, monkeypatch):
    """Above PLAN_SIMULATED_ROWS every row is still checked (the error rows are the full plan's), while the schedule
    is simulated on every k-th row and its totals scaled: close to the whole simulation's."""
    import cbatch.plan.simulate as simulate

    rows = token_rows(800, seed=6)
    bad = range(5, 800, 97)  # bad rows spread through the input
    for i in bad:
        rows[i] = {"id": f"bad{i}", "prompt_token_ids": [3, 4], "max_tokens": -1}
    source = write_jsonl(tmp_path / "job.jsonl", rows)
    flags = ["--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--max-num-seqs", "32", "--no-search",
             "--allow-errors"]
    assert plan(str(source), *flags, "--report", str(tmp_path / "whole.json"))[0] == 0
    monkeypatch.setattr(simulate, "PLAN_SIMULATED_ROWS", 200)
    assert plan(str(source), *flags, "--report", str(tmp_path / "sample.json"))[0] == 0
    whole, sample = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("whole", "sample"))
    assert sample["errors"] == whole["errors"] and len(whole["errors"]) == 9
    assert sample["requests"] == whole["requests"]
    w, s = whole["predicted"], sample["predicted"]
    assert w["simulated_rows"] == 791 and s["simulated_rows"] == len(set(range(0, 800, 4)) - set(bad))  # every 4th
    for key in ("wall_seconds", "output_tokens", "prompt_tokens", "steps"):
        assert s[key] == pytest.approx(w[key], rel=0.03), (key, s[key], w[key])  # seen: within 1.2%
    assert s["wall_seconds"] != w["wall_seconds"]  # a real sample, not the whole again


def test_plan_takes_a_speculative_acceptance(tiny_checkpoints, tmp_path):
    """--speculative with --speculative-acceptance: drafted tokens priced as decode tokens, each kept by a seeded
    draw. 4 rows of 23 planned tokens (filler 0 0 0 ...: an n-gram draft of 4 from the third token on): kept all,
    23 tokens in 1 + 1 + 1 + 4 steps, 16 drafted tokens a row; kept none, the plain run's 23 steps."""
    rng = random.Random(2)
    rows = [{"id": f"s{i}", "prompt_token_ids": [rng.randrange(3, 384) for _ in range(12)], "max_tokens": 23,
             "ignore_eos": True} for i in range(4)]
    source = write_jsonl(tmp_path / "job.jsonl", rows)
    flags = [str(source), "--model", str(tiny_checkpoints["llama"]), "--device", "cpu", "--no-search",
             "--max-num-seqs", "4", "--report", str(tmp_path / "plan.json")]
    predicted, printed = {}, {}
    for name, extra in (("off", []), ("none", ["--speculative", "ngram"]),
                        ("all", ["--speculative", "ngram", "--speculative-acceptance", "1"]),
                        ("some", ["--speculative", "ngram", "--speculative-acceptance", "0.6"])):
        code, printed[name], err = plan(*flags, *extra)
        assert code == 0, err
        predicted[name] = json.loads((tmp_path / "plan.json").read_text())["predicted"]
    assert "speculative" not in predicted["off"] and predicted["off"]["steps"] == 23
    assert predicted["none"]["steps"] == 23 and predicted["none"]["speculative"]["accepted_tokens"] == 0
    assert predicted["all"]["steps"] == 7
    assert predicted["all"]["speculative"]["drafted_tokens"] == predicted["all"]["speculative"]["accepted_tokens"] == 64
    some = predicted["some"]
    assert 7 < some["steps"] < 23 and 0 < some["speculative"]["accepted_tokens"] < some["speculative"]["drafted_tokens"]
    assert all(p["output_tokens"] == 4 * 23 for p in predicted.values())
    assert "speculative (ngram, acceptance 100% assumed): 64/64 drafted tokens kept (100%)" in printed["all"]
    assert "acceptance 0% assumed" in printed["none"]
    code, _, err = plan(*flags, "--speculative-acceptance", "0.5")
    assert code == 2 and "--speculative-acceptance: needs --speculative" in err and err.count("\n") == 1, err
