"""`cbatch bench`: one workload, one run per policy (real or simulated), a side-by-side table, a report."""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cbatch.bench.result import BenchRun, comparison_rows, comparison_table
from cbatch.bench.simulator import SIMULATED_VOCAB, CostModel, check_acceptance, cost_settings, simulated_engine
from cbatch.bench.trial import make_bench_engine, run_trial, warm_up, workload_images, workload_prompts
from cbatch.bench.workload import (BenchRequest, WorkloadError, parse_distribution, parse_image_sizes, read_trace,
                                   synthetic_workload, with_images)
from cbatch.config import POLICIES, EngineConfig

ALL_POLICIES = ("static", "fcfs", "longest-first", "prefix")  # static first: the baseline of the comparison
COMPARED_POLICIES = ALL_POLICIES[:3]  # `--policy all`; prefix runs when asked by name (benchmarks/prefix_admission.py)


@dataclass(slots=True)
class BenchOptions:
    engine: EngineConfig
    model_config: str | None = None  # preset name or config.json: random weights, no tokenizer
    num_prompts: int = 256
    input_len: str = "100:1024"
    output_len: str = "100:1024"
    seed: int = 0
    trace: Path | None = None
    policy: str = "all"  # one of ALL_POLICIES, or all
    simulate: bool = False
    cost: CostModel = CostModel()
    report: Path | None = None
    plot: Path | None = None
    quiet: bool = False
    warmup: bool = True
    shared_prefix: int = 0  # every prompt starts with the same this many tokens
    speculative_acceptance: float | None = None  # --simulate with --speculative: the share of drafts kept
    images: int = 0  # synthetic images per prompt (a vision-language --model)
    image_size: str = "896x1152"  # WxH, or several drawn per image


def policies_of(name: str) -> list[str]:
    if name == "all":
        return list(COMPARED_POLICIES)
    if name not in ALL_POLICIES:
        raise WorkloadError(f"--policy: must be one of {', '.join(ALL_POLICIES)} or all, not {name!r}")
    return [name]


def trials_of(options: BenchOptions) -> list[tuple[str, str, dict[str, Any]]]:
    """(label, policy, scheduling settings) of each run: every asked policy; with --shared-prefix (and the
    prefix cache on) also the last continuous policy without the cache, to show what the cache saves."""
    cache = {"enable_prefix_cache": options.engine.enable_prefix_cache}
    trials = [(policy, policy, cache) for policy in policies_of(options.policy)]
    continuous = [policy for policy in policies_of(options.policy) if policy != "static"]
    if options.shared_prefix and options.engine.enable_prefix_cache and continuous:
        trials.append((f"{continuous[-1]}, no prefix cache", continuous[-1], {"enable_prefix_cache": False}))
    return trials


def make_workload(options: BenchOptions) -> tuple[list[BenchRequest], dict[str, Any]]:
    """The requests (a trace, or the synthetic distributions) and what the report says of them. --shared-prefix
    N puts N shared tokens in front of each prompt's own (as vLLM's benchmarks' prefix length does): the
    requests' prompt lengths include them."""
    if options.trace is not None:
        requests = read_trace(options.trace)
        workload = {"trace": str(options.trace), "num_prompts": len(requests)}
    else:
        if options.num_prompts < 1:
            raise WorkloadError("--num-prompts: must be at least 1")
        input_len = parse_distribution(options.input_len, "--input-len")
        output_len = parse_distribution(options.output_len, "--output-len")
        requests = synthetic_workload(options.num_prompts, input_len, output_len, options.seed)
        workload = {"num_prompts": options.num_prompts, "input_len": options.input_len,
                    "output_len": options.output_len, "seed": options.seed}
    if options.shared_prefix:
        requests = [replace(r, prompt_len=options.shared_prefix + r.prompt_len) for r in requests]
        workload["shared_prefix"] = options.shared_prefix
    if options.images:
        if options.simulate or options.model_config is not None:
            raise WorkloadError("--images: a real run of a vision-language checkpoint (--model: its image processor "
                                "reads the images), not --simulate or --model-config")
        sizes = parse_image_sizes(options.image_size, "--image-size")
        requests = with_images(requests, options.images, sizes, options.seed)
        workload.update(images_per_prompt=options.images, image_size=options.image_size)
    return requests, workload


def _sim_max_model_len(options: BenchOptions, requests: list[BenchRequest]) -> int:
    """The model's context if a model is named, else room for the workload's longest request."""
    if options.engine.max_model_len:
        return options.engine.max_model_len
    if options.model_config is not None:
        from cbatch.model.presets import preset_spec

        return preset_spec(options.model_config).max_position_embeddings
    return max(r.prompt_len + r.output_len for r in requests) + 1


def run_bench(options: BenchOptions) -> dict[str, Any]:
    """Runs the benchmark, prints the table; returns the whole report (also written to --report)."""
    from rich.console import Console

    requests, workload = make_workload(options)
    workload["prompt_tokens"] = sum(r.prompt_len for r in requests)
    workload["output_tokens"] = sum(r.output_len for r in requests)
    engine, clock = _bench_engine(options, requests)
    vocab = engine.spec.vocab_size if engine.spec is not None else SIMULATED_VOCAB
    vision = engine.spec.vision if engine.spec is not None else None  # (with images or not: no random placeholder)
    prompts = workload_prompts(requests, vocab, options.seed, options.shared_prefix, vision)
    images = workload_images(requests, options.seed) if options.images else None
    runs: list[BenchRun] = []
    for label, policy, settings in trials_of(options):
        if not options.quiet and not options.simulate:
            print(f"cbatch bench: running {len(requests)} requests: {label} ...", file=sys.stderr, flush=True)
        run = run_trial(engine, requests, prompts, policy, clock, label, images, **settings)
        run.build_report(engine.config.max_num_seqs, _run_settings(options, engine, policy),
                         options.cost.unit if options.simulate else "s", _hardware(options, engine, run))
        runs.append(run)
    reports = [run.report for run in runs]
    result = {"workload": workload, "runs": reports, "comparison": comparison_rows(reports)}
    console = Console(file=sys.stdout)
    if len(reports) > 1:
        console.print(comparison_table(reports))
    else:
        from cbatch.observe.report import summary_table

        console.print(summary_table(reports[0]))
    if options.report is not None:
        from cbatch.observe.report import write_report

        write_report(options.report, result)
    if options.plot is not None:
        from cbatch.observe.plot import plot_reports

        plot_reports(reports, options.plot)
    return result


def _bench_engine(options: BenchOptions, requests: list[BenchRequest]):
    """(engine, clock): the real engine (warmed up) on wall time, or the simulator on its cost clock."""
    if options.simulate:
        from cbatch.model.presets import preset_spec

        longest = max(r.prompt_len + r.output_len for r in requests)
        spec = preset_spec(options.model_config) if options.model_config is not None else None
        acceptance = check_acceptance(options.speculative_acceptance, options.engine)
        engine = simulated_engine(options.engine, options.cost, _sim_max_model_len(options, requests), longest, spec,
                                  acceptance)
        return engine, lambda: engine.runner.forward_seconds
    if options.speculative_acceptance is not None:
        raise WorkloadError("--speculative-acceptance: only with --simulate (a real run measures its own acceptance)")
    graphs = options.engine.cuda_graph_max_batch or len(requests)  # no CUDA graph above what the workload can run
    engine = make_bench_engine(replace(options.engine, cuda_graph_max_batch=graphs), options.model_config, options.seed)
    first_image = next((r.image_sizes[0] for r in requests if r.image_sizes), None)  # (--images)
    if first_image is not None and engine.spec.vision is None:
        raise WorkloadError(f"--images: {engine.config.model} reads no images; give --model a vision-language "
                            "checkpoint (docs/vision.md lists them)")
    if options.warmup:
        warm_up(engine, options.seed, first_image)
    return engine, None


def _run_settings(options: BenchOptions, engine, policy: str) -> dict[str, Any]:
    settings: dict[str, Any] = {"engine": {**asdict(engine.config), "policy": policy}, "simulated": options.simulate,
                                "max_model_len": engine.max_model_len, "shared_prefix": options.shared_prefix}
    if options.simulate:
        settings["cost_model"] = cost_settings(options.cost)
        if options.engine.speculative != "off":
            settings["speculative_acceptance"] = options.speculative_acceptance or 0.0
    else:
        settings.update(model=options.model_config or options.engine.model or "default", device=str(engine.device),
                        dtype=str(engine.dtype))
    return settings


def _hardware(options: BenchOptions, engine, run: BenchRun) -> dict[str, Any] | None:
    if options.simulate:
        return None
    from cbatch.observe.roofline import engine_hardware

    return engine_hardware(engine, run.metrics.series, run.metrics.forward_seconds)
