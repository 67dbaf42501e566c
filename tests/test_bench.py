"""`cbatch bench`: workload distributions, traces, the simulator (the engine's own scheduler), and
the real engine agreeing with it."""
from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from cbatch.bench.result import comparison_rows
from cbatch.bench.simulator import CostModel, CostModelError, simulate
from cbatch.bench.workload import (
    CHAT_BUCKETS, BenchRequest, WorkloadError, parse_distribution, read_trace, synthetic_workload,
)
from cbatch.config import EngineConfig


def chat_workload(n: int, seed: int) -> list[BenchRequest]:
    chat = parse_distribution("chat", "--output-len")
    return synthetic_workload(n, chat, chat, seed)


# ---- distributions ---------------------------------------------------------------------------------
def test_fixed_and_uniform_are_exact_and_inclusive():
    rng = random.Random(1)
    assert set(parse_distribution("37", "--input-len").sample(rng, 50)) == {37}
    values = parse_distribution("3:6", "--input-len").sample(rng, 2000)
    assert set(values) == {3, 4, 5, 6}  # both ends drawn


def test_lognormal_median_and_spread():
    values = sorted(parse_distribution("lognormal:200:0.5", "--output-len").sample(random.Random(7), 4001))
    median = values[2000]
    assert 180 <= median <= 220
    assert min(values) >= 1 and values[-1] > 2 * median  # a right tail


def test_chat_preset_buckets_and_shares():
    values = parse_distribution("chat", "--output-len").sample(random.Random(3), 10000)
    shares = Counter(next(i for i, (_, lo, hi) in enumerate(CHAT_BUCKETS) if lo <= v <= hi) for v in values)
    for i, (share, _, _) in enumerate(CHAT_BUCKETS):
        assert abs(shares[i] / len(values) - share) < 0.02
    assert min(values) >= 10 and max(values) <= 2000


def test_workload_is_seeded():
    a, b, c = chat_workload(50, 5), chat_workload(50, 5), chat_workload(50, 6)
    assert a == b and a != c


@pytest.mark.parametrize("text", ["0", "5:2", "abc", "lognormal:0:1", "lognormal:10", "1:2:3", ""])
def test_bad_distribution_names_the_flag(text):
    with pytest.raises(WorkloadError, match="--input-len"):
        parse_distribution(text, "--input-len")


def test_trace_rows_and_errors(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_len": 5, "output_len": 3}\n\n{"prompt_len": 2, "output_len": 9, "arrival": 4}\n')
    assert read_trace(path) == [BenchRequest(5, 3, 0), BenchRequest(2, 9, 4)]
    path.write_text('{"prompt_len": 5, "output_len": 3}\n{"prompt_len": 5, "output_len": "x"}\n')
    with pytest.raises(WorkloadError, match="line 2: `output_len`"):
        read_trace(path)


# ---- simulator -----------------------------------------------------------------------------------
def sim(requests, policy, max_num_seqs=8, **settings):
    config = EngineConfig(max_num_seqs=max_num_seqs, policy=policy, **settings)
    return simulate(requests, config, CostModel(), max_model_len=4096)


def test_simulated_lengths_are_exact_and_steps_are_the_clock():
    requests = chat_workload(60, 2)
    run = sim(requests, "fcfs")
    assert run.metrics.ok_rows == 60
    assert run.metrics.output_tokens == sum(r.output_len for r in requests)
    assert run.metrics.prompt_tokens == sum(r.prompt_len for r in requests)
    assert run.wall == run.stats.steps == len(run.metrics.series)  # 1 cost unit per step
    assert max(run.finish_step) == run.stats.steps


def test_continuous_batching_finishes_well_ahead_of_static_on_chat():
    requests = chat_workload(200, 0)
    static, fcfs, longest = (sim(requests, p) for p in ("static", "fcfs", "longest-first"))
    assert static.wall > 2.0 * fcfs.wall  # static waits for each group's longest member
    assert static.stats.padding_tokens > 0 and fcfs.stats.padding_tokens == 0
    assert longest.wall <= fcfs.wall


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("dist", ["chat", "lognormal:60:1.2"])
def test_longest_first_makespan_no_worse_than_fcfs_on_skewed_workloads(seed, dist):
    output = parse_distribution(dist, "--output-len")
    requests = synthetic_workload(120, parse_distribution("10:200", "--input-len"), output, seed)
    assert sim(requests, "longest-first").wall <= sim(requests, "fcfs").wall


def test_cost_model_terms_add_up():
    requests = chat_workload(40, 4)
    config = EngineConfig(max_num_seqs=8, policy="fcfs")
    cost = CostModel(per_step=0.5, per_prefill_token=0.01, per_context_token=0.001)
    run = simulate(requests, config, cost, max_model_len=4096)
    expected = sum(0.5 * s.steps + 0.01 * s.prefill_tokens + 0.001 * s.context_tokens for s in run.metrics.series)
    assert run.wall == pytest.approx(expected)
    assert run.stats.steps == sim(requests, "fcfs").stats.steps  # costs never change the schedule


def test_kv_pressure_preempts_and_recomputes():
    requests = chat_workload(60, 9)
    run = sim(requests, "longest-first", num_kv_blocks=260)
    assert run.stats.preemptions > 0 and run.stats.recomputed_tokens > 0
    assert run.metrics.output_tokens == sum(r.output_len for r in requests)  # nothing lost


def test_trace_arrivals_delay_admission():
    requests = [BenchRequest(10, 5), BenchRequest(10, 5, arrival=50)]
    run = sim(requests, "fcfs")
    assert run.finish_step[0] < 50 < run.finish_step[1]
    assert run.stats.steps >= 55


def test_cost_fit_recovers_coefficients(tmp_path):
    rng = random.Random(0)
    steps = [rng.randint(1, 5) for _ in range(40)]
    prefill = [rng.randint(0, 500) for _ in range(40)]
    context = [rng.randint(100, 5000) for _ in range(40)]
    dt = [0.02 * s + 1e-4 * p + 2e-6 * c for s, p, c in zip(steps, prefill, context)]
    report = {"time_unit": "s", "series": {"steps": steps, "prefill_tokens": prefill, "context_tokens": context, "dt": dt}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"runs": [report]}))
    cost = CostModel.fit(path)
    assert cost.unit == "s"
    assert cost.per_step == pytest.approx(0.02, rel=1e-6)
    assert cost.per_prefill_token == pytest.approx(1e-4, rel=1e-6)
    assert cost.per_context_token == pytest.approx(2e-6, rel=1e-6)
    path.write_text(json.dumps({"time_unit": "cost", "series": report["series"]}))
    with pytest.raises(CostModelError, match="real run"):
        CostModel.fit(path)


def test_simulator_runs_thousands_of_requests_on_hundreds_of_slots():
    """3k requests x 512 slots, every token accounted for (its speed: benchmarks/simulator_speed.py)."""
    requests = chat_workload(3000, 0)
    run = simulate(requests, EngineConfig(max_num_seqs=512, max_num_batched_tokens=8192, policy="longest-first"),
                   CostModel(), max_model_len=4096)
    assert run.metrics.ok_rows == 3000
    assert run.metrics.output_tokens == sum(r.output_len for r in requests)
    assert run.stats.peak_kv_blocks > 0 and run.metrics.engine.running == 0


# ---- the real engine agrees with the simulator ------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_engine():
    from cbatch.bench.trial import make_bench_engine, warm_up

    config = EngineConfig(device="cpu", max_num_seqs=4, num_kv_blocks=40, block_size=8, max_num_batched_tokens=64)
    engine = make_bench_engine(config, "tiny", seed=0)
    warm_up(engine, seed=0)
    return engine


def test_real_engine_takes_the_simulators_steps(tiny_engine):
    """Same scheduler code, same workload: the engine's schedule is the simulator's, step for step."""
    from cbatch.bench.trial import run_trial, workload_prompts

    requests = synthetic_workload(16, parse_distribution("4:40", "--input-len"),
                                  parse_distribution("lognormal:12:1.3", "--output-len"), 3)
    requests = [BenchRequest(r.prompt_len, min(r.output_len, 100)) for r in requests]
    config = tiny_engine.config
    reports = {}
    for policy in ("static", "fcfs", "longest-first"):
        real = run_trial(tiny_engine, requests, workload_prompts(requests, tiny_engine.spec.vocab_size, 0), policy)
        simulated = simulate(requests, config, CostModel(), tiny_engine.max_model_len, policy)
        assert real.finish_step == simulated.finish_step
        assert real.stats.steps == simulated.stats.steps
        assert real.stats.preemptions == simulated.stats.preemptions
        assert real.metrics.output_tokens == simulated.metrics.output_tokens == sum(r.output_len for r in requests)
        report = real.build_report(config.max_num_seqs, {}, "s")
        assert report["utilization"]["preemptions"] == tiny_engine.scheduler.stats.preemptions
        reports[policy] = (report, simulated.build_report(config.max_num_seqs, {}, "cost"))
    # direction: continuous batching well ahead of static in the simulator's cost, and in the real engine's
    # steps (its wall time on this tiny model is ~0.15 s either way: too close for a timed assertion)
    sim_static, sim_fcfs = (reports[p][1]["time"]["wall_seconds"] for p in ("static", "fcfs"))
    assert sim_static > 1.5 * sim_fcfs
    real_static, real_fcfs = (reports[p][0]["utilization"]["steps"] for p in ("static", "fcfs"))
    assert real_static > 1.2 * real_fcfs
    rows = comparison_rows([reports[p][0] for p in reports])
    assert rows[0]["policy"] == "static" and rows[0]["ratio"]["wall_time"] == 1.0


def test_static_under_kv_pressure_makes_progress():
    """Preemption can take a static group's last unfinished members; the finished ones must then leave
    (they used to pad forever holding the blocks the preempted members waited for: a deadlock)."""
    requests = synthetic_workload(16, parse_distribution("4:40", "--input-len"),
                                  parse_distribution("lognormal:12:1.3", "--output-len"), 5)
    requests = [BenchRequest(r.prompt_len, min(r.output_len, 100)) for r in requests]
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=40, block_size=8, max_num_batched_tokens=64, policy="static")
    run = simulate(requests, config, CostModel(), max_model_len=4096)
    assert run.metrics.ok_rows == 16 and run.stats.preemptions > 0
    assert run.metrics.output_tokens == sum(r.output_len for r in requests)


# ---- presets -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,billions,active", [
    # published parameter counts (untied models: minus the input embedding, which no token multiplies);
    # a mixture of experts' active count: its published "A3B" / 12.9B active, also minus the embedding
    ("qwen3-0.6b", 0.60, None), ("qwen2.5-1.5b", 1.54, None), ("llama-3.2-1b", 1.24, None),
    ("llama-3.1-8b", 8.03 - 0.525, None), ("gemma-3-4b", 3.21 + 0.67, None),  # non-embedding + tied lm_head
    ("qwen3-30b-a3b", 30.5 - 0.31, 3.3 - 0.31), ("mixtral-8x7b", 46.7 - 0.13, 12.9 - 0.13),
    ("gpt-oss-20b", 20.91 - 0.58, 3.61),  # OpenAI's model card: 20.91B, 3.61B active (counted without the embedding)
])
def test_presets_have_the_real_shapes(name, billions, active):
    from cbatch.model.presets import preset_spec

    spec = preset_spec(name)
    assert spec.num_params() / 1e9 == pytest.approx(billions, rel=0.03)
    assert spec.active_params() / 1e9 == pytest.approx(active or billions, rel=0.03)
    assert spec.hidden_size == spec.num_heads * spec.head_dim or spec.family in ("qwen3", "qwen3_moe", "gemma3", "gpt_oss")


def test_preset_from_a_config_json_and_unknown_names(tmp_path):
    from cbatch.model.presets import PRESETS, preset_spec
    from cbatch.model.spec import UnsupportedModelError

    (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama-3.2-1b"]))
    assert preset_spec(str(tmp_path)) == preset_spec(str(tmp_path / "config.json")) == preset_spec("llama-3.2-1b")
    with pytest.raises(UnsupportedModelError, match="not a preset"):
        preset_spec("gpt-9")


def test_shared_prefix_bench_shows_the_prefix_cache_hits_and_speed_up(capsys):
    """`cbatch bench --shared-prefix N`: every prompt opens with the same N tokens; the run with the prefix
    cache hits them and costs less than the added run without it (a prefill-priced cost model)."""
    from cbatch.bench.command import BenchOptions, run_bench

    options = BenchOptions(
        engine=EngineConfig(max_num_seqs=8, max_num_batched_tokens=256), num_prompts=40, input_len="80:120",
        output_len="4:16", policy="longest-first", simulate=True, shared_prefix=64,
        cost=CostModel(per_step=1.0, per_prefill_token=0.05),
    )
    result = run_bench(options)
    cached, uncached = result["runs"]
    assert uncached["label"] == "longest-first, no prefix cache" and uncached["settings"]["engine"]["enable_prefix_cache"] is False
    hits = cached["utilization"]["prefix_cache_saved_tokens"]
    assert hits >= 39 * 48  # every prompt after the first reuses at least the prefix's 3 full 16-token blocks
    assert uncached["utilization"]["prefix_cache_hit_rate"] == 0
    assert cached["time"]["wall_seconds"] < uncached["time"]["wall_seconds"]
    assert cached["tokens"] == uncached["tokens"]  # the same work delivered
    table = capsys.readouterr().out
    assert "prefix cache hits" in table and "no prefix cache" in table


# ---- a real bench run honours every engine flag its report names --------------------------------------
BENCH = ["bench", "--model-config", "tiny", "--device", "cpu", "--no-warmup", "--policy", "fcfs", "--num-prompts", "8",
         "--input-len", "18:40", "--output-len", "6:12", "--shared-prefix", "16", "-q"]
# every other engine flag away from its default too: (flag, value, EngineConfig field, value there)
OTHER_FLAGS = [("--dtype", "float32", "dtype", "float32"), ("--max-num-seqs", "6", "max_num_seqs", 6),
               ("--max-num-batched-tokens", "96", "max_num_batched_tokens", 96), ("--block-size", "8", "block_size", 8),
               ("--attention-backend", "torch", "attention_backend", "torch"), ("--max-model-len", "512", "max_model_len", 512),
               ("--gpu-memory-utilization", "0.5", "gpu_memory_utilization", 0.5), ("--enforce-eager", None, "enforce_eager", True),
               ("--priority-aging-steps", "7", "priority_aging_steps", 7)]
SMALL_POOL = ["--num-kv-blocks", "12"]  # 12 blocks of 8 tokens for 6 rows of up to 56: preemption or stalls


@pytest.mark.parametrize("flags,asked,shows", [
    pytest.param(["--prefix-cache"], dict(enable_prefix_cache=True),
                 lambda u: u["prefix_cache_hit_rate"] > 0 and u["prefix_cache_saved_tokens"] > 0, id="prefix-cache"),
    pytest.param(["--no-prefix-cache"], dict(enable_prefix_cache=False),
                 lambda u: u["prefix_cache_hit_rate"] == u["prefix_cache_saved_tokens"] == 0, id="no-prefix-cache"),
    pytest.param([*SMALL_POOL, "--preemption", "swap", "--swap-space", "0.0001"],
                 dict(num_kv_blocks=12, preemption="swap", swap_space_gb=0.0001),
                 lambda u: u["swap_preemptions"] == u["preemptions"] > 0 and u["swapped_out_blocks"] > 0
                 and u["recomputed_tokens"] == 0, id="swap"),
    pytest.param([*SMALL_POOL, "--preemption", "swap", "--swap-space", "0"],
                 dict(num_kv_blocks=12, preemption="swap", swap_space_gb=0.0),  # no room on the host: recompute
                 lambda u: u["preemptions"] > 0 and u["recomputed_tokens"] > 0 and u["swapped_out_blocks"] == 0,
                 id="swap-space-0"),
    # the same pool preempts with optimistic admission (above); reserve admission never does
    pytest.param([*SMALL_POOL, "--admission", "reserve"], dict(num_kv_blocks=12, admission="reserve"),
                 lambda u: u["preemptions"] == 0 and u["admission_stalls"]["reserved"] > 0, id="reserve"),
])
def test_a_bench_run_honours_every_engine_flag_its_report_names(tmp_path, monkeypatch, flags, asked, shows):
    """The report's `settings.engine` is what was asked, the scheduler each trial ran was built with it,
    and the counters show it (a bench run once rebuilt its scheduler without these settings)."""
    from dataclasses import asdict

    import cbatch.bench.command
    from ops_jobs import run_inprocess

    schedulers = []
    real_trial = cbatch.bench.command.run_trial

    def watched_trial(engine, *args, **kwargs):
        run = real_trial(engine, *args, **kwargs)
        schedulers.append(engine.scheduler)
        return run

    monkeypatch.setattr(cbatch.bench.command, "run_trial", watched_trial)
    other = [arg for flag, value, _, _ in OTHER_FLAGS for arg in (flag, value) if arg is not None]
    report = tmp_path / "r.json"
    code, _, err = run_inprocess(*BENCH, *other, *flags, "--report", str(report))
    assert code == 0, err
    runs = json.loads(report.read_text())["runs"]
    run = runs[0]
    wanted = EngineConfig(device="cpu", policy="fcfs", **{field: value for _, _, field, value in OTHER_FLAGS}, **asked)
    # (auto settings appear as what ran: asynchronous scheduling is off on a CPU, CUDA graphs stop at the 8 prompts)
    asked_settings = json.loads(json.dumps({**asdict(wanted), "async_scheduling": False, "cuda_graph_max_batch": 8}))
    assert run["settings"]["engine"] == asked_settings  # (through JSON, as the report holds them: tuples are lists)
    # --shared-prefix adds a run of the same policy without the prefix cache, when the cache is on
    assert len(runs) == len(schedulers) == (2 if wanted.enable_prefix_cache else 1)

    scheduler = schedulers[0]
    assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens, scheduler.pool.block_size) == (6, 96, 8)
    assert scheduler.policy.name == "fcfs" and scheduler.priority.aging_steps == 7
    assert scheduler.pool.enable_caching == wanted.enable_prefix_cache
    assert scheduler.pool.num_blocks == (12 if wanted.num_kv_blocks else run["utilization"]["kv_blocks_total"])
    assert scheduler.preemption.mode == wanted.preemption and scheduler.admission.name == wanted.admission
    if wanted.preemption == "recompute" or wanted.swap_space_gb == 0:
        assert scheduler.host.num_blocks == 0
    else:  # from --swap-space, below the cap of 4 pools' worth
        assert 0 < scheduler.host.num_blocks < 4 * scheduler.pool.num_blocks
    assert shows(run["utilization"]), run["utilization"]


def test_rows_starting_together_compute_a_shared_prefix_once():
    """`--input-len 8 --shared-prefix 96`: 96 shared tokens in front of each prompt's 8 (issue 39 saw 0% hits when
    the prefix was cut to the prompt's length). All 12 rows are admitted in the first steps: the first computes
    the prefix's 6 blocks, the others wait that one step and reuse them, so it is computed once."""
    from cbatch.bench.command import BenchOptions, run_bench

    options = BenchOptions(engine=EngineConfig(max_num_seqs=16, max_num_batched_tokens=2048), num_prompts=12,
                           input_len="8", output_len="4", policy="longest-first", simulate=True, shared_prefix=96,
                           quiet=True)
    cached, uncached = run_bench(options)["runs"]
    assert cached["tokens"]["prompt"] == 12 * 104
    assert cached["utilization"]["prefix_cache_saved_tokens"] == 11 * 96
    assert uncached["utilization"]["prefix_cache_saved_tokens"] == 0


def test_images_per_prompt_bench_a_vision_language_checkpoint(tmp_path, tiny_checkpoints):
    """`--images N --image-size WxH,...`: each prompt gets N synthetic images of its own (never shared: the encoder
    encodes every one), their placeholders expanded as a row's, every policy the same images; the report's images
    and the table's images/s. A text model, --simulate and --model-config are refused by flag."""
    from cbatch.bench.command import BenchOptions, run_bench
    from cbatch.bench.workload import WorkloadError
    from ops_jobs import run_inprocess
    from vision_models import make_vl_checkpoint

    model = make_vl_checkpoint("qwen2_vl", tmp_path / "vl")
    report = tmp_path / "r.json"
    code, out, err = run_inprocess("bench", "--model", str(model), "--device", "cpu", "--num-prompts", "4",
                                   "--input-len", "6:10", "--output-len", "3:5", "--images", "2", "--image-size",
                                   "56x84,28x28", "--policy", "all", "-q", "--report", str(report))
    assert code == 0, err
    result = json.loads(report.read_text())
    workload = result["workload"]
    assert workload["images_per_prompt"] == 2 and workload["image_size"] == "56x84,28x28"
    first = result["runs"][0]["images"]
    for run in result["runs"]:  # (each trial counts its own encoding)
        images = run["images"]
        assert run["requests"]["error"] == 0 and run["tokens"]["output"] == workload["output_tokens"]
        assert images["images"] == images["encoded"] == 8 and images["image_tokens"] == images["encoded_tokens"]
        assert {k: images[k] for k in ("images", "image_tokens")} == {k: first[k] for k in ("images", "image_tokens")}
        # text tokens, each image's run (6 tokens at 56 x 84, 1 at 28 x 28) and its start and end tokens
        assert run["tokens"]["prompt"] == workload["prompt_tokens"] + images["image_tokens"] + 2 * 8
    assert 8 < first["image_tokens"] < 48  # both sizes drawn
    assert "images/s" in out

    # without --images the random prompts draw no image or video token (the tiny vocabulary's ids 6-9 were drawn)
    text_only = run_bench(BenchOptions(engine=EngineConfig(model=str(model), device="cpu"), num_prompts=4,
                                       input_len="40", output_len="2", policy="fcfs", warmup=False, quiet=True))
    assert text_only["runs"][0]["requests"]["error"] == 0 and "images" not in text_only["runs"][0]

    options = dict(engine=EngineConfig(device="cpu"), num_prompts=2, input_len="4", output_len="2", images=1)
    with pytest.raises(WorkloadError, match="--images: a real run of a vision-language checkpoint"):
        run_bench(BenchOptions(**options, simulate=True))
    with pytest.raises(WorkloadError, match="--image-size: expected WIDTHxHEIGHT"):
        run_bench(BenchOptions(**{**options, "engine": EngineConfig(model=str(model), device="cpu")}, image_size="896"))
    with pytest.raises(WorkloadError, match="--images: .* reads no images; give --model a vision-language"):
        run_bench(BenchOptions(**{**options, "engine": EngineConfig(model=str(tiny_checkpoints["llama"]),
                                                                       device="cpu")}, warmup=False, quiet=True))
