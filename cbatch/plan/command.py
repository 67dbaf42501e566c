"""`cbatch plan`: options, the printed plan, the --report JSON, and the exit code (as `cbatch run`'s:
0, or 1 when some rows would be error rows unless --allow-errors; 2 for a bad plan; 74 for an unwritable
report). Never loads weights: the config, the tokenizer and the cost model are all it reads."""
from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cbatch.bench.simulator import CostModel, check_acceptance, cost_settings
from cbatch.config import EngineConfig, SamplingParams
from cbatch.engine.memory import kv_cache_dtype, kv_per_token
from cbatch.engine.resolve import ResolvedModel, engine_backend
from cbatch.model.shard import Shard
from cbatch.io.reader import InputFile, inspect_input, iter_rows, open_input
from cbatch.io.state import StorageError
from cbatch.io.writer import check_writable
from cbatch.model.pooling_config import ClassifierTokens
from cbatch.observe.report import speculation_text, write_report
from cbatch.plan.devices import DeviceKind, device_kind
from cbatch.plan.lengths import OutputLengths
from cbatch.plan.simulate import (CheckedRows, PlanSetup, Simulation, check_rows, fastest, search, simulate_checked,
                                  simulate_every_row)
from cbatch.run.deadline import Deadline
from cbatch.run.exit_codes import EXIT_OK, EXIT_ROW_ERRORS
from cbatch.run.preflight import JobError, resolve_or_fail, resolve_task
from cbatch.run.result_cache import DEFAULT_CACHE_LIMIT, CacheSpec, cache_spec
from cbatch.tasks import Task, task_class

MAX_ERRORS_SHOWN = 50  # printed; --report lists every one


@dataclass(slots=True)
class PlanOptions:
    input: str | Path  # a file, folder, glob or fsspec URL
    engine: EngineConfig
    defaults: SamplingParams
    cost_from: Path | None = None  # a real run's --report: the cost model is fitted to it
    lengths_from: Path | None = None  # an earlier run's --report of this job: output lengths drawn from it
    device_kind: str | None = None  # the machine the run will use (default: this one)
    report: Path | None = None
    search: bool = True
    allow_errors: bool = False
    quiet: bool = False
    lookahead: int = 16384
    result_cache: Path | None = None  # rows found there are not simulated (the run would copy them)
    deadline: Deadline | None = None  # the run's --max-wall-time / --deadline: a prediction past it is warned of
    task: str = "generate"  # --task and its settings, as the run's (cbatch/tasks/)
    pooling: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    reasoning_split: bool = True  # (changes a record's columns, so the rows the result cache holds for the run)
    tool_call_parser: str | None = None
    effort_budgets: dict[str, int] | None = None
    classifier: ClassifierTokens | None = None
    score_template: str | None = None
    speculative_acceptance: float | None = None  # with --speculative: the share of drafted tokens kept (default 0)


def run_plan(options: PlanOptions) -> int:
    """The whole `cbatch plan`. Raises a UserError (exit 2) for a plan that cannot be made."""
    source, total_rows = check_paths(options)
    kind = device_kind(options.device_kind, options.engine)
    model = resolve_or_fail(options.engine, device=kind.device)
    task = resolve_task(options, model)
    engine_backend(options.engine, kind.device)  # a backend the run could not use fails here, as there
    config = replace(options.engine, model=str(model.checkpoint.path))
    if config.loras:  # every adapter folder checked against the model as a run's preflight does (no model weights)
        from cbatch.lora.registry import adapter_digests

        adapter_digests(config.loras, model.spec, config.max_lora_rank)
    cost, cost_source = cost_model(options, kind, model)
    acceptance = check_acceptance(options.speculative_acceptance, config)
    lengths = (OutputLengths.from_report(options.lengths_from, config.seed) if options.lengths_from is not None
               else OutputLengths(source="max_tokens, an upper bound"))
    setup = PlanSetup(model, kind, plan_tokenizer(model), cost, lengths, task, options.lookahead, acceptance)
    cache = plan_cache(options, kind, model, config, task)
    if task.decodes:  # rows checked, then an even sample replayed and searched; prefill-only rows: each simulated once
        checked = check_rows(iter_rows(source), config, setup, total_rows, cache)
        first = simulate_checked(checked, config, setup)
    else:
        checked, first = simulate_every_row(iter_rows(source), config, setup, total_rows, cache)
    simulations = search(first, checked, setup) if options.search and checked.sample else [first]
    plan = plan_report(options, setup, cost_source, checked, simulations)
    print_plan(plan, options.quiet)
    if options.deadline is not None and (warning := deadline_warning(plan, options.deadline, cost.unit)):
        plan["deadline_warning"] = warning
        print(f"cbatch plan: warning: {warning}", file=sys.stderr)
    if options.report is not None:
        try:
            write_report(options.report, plan)
        except OSError as exc:
            raise StorageError(options.report, exc, "the plan") from None
    return EXIT_ROW_ERRORS if checked.errors and not options.allow_errors else EXIT_OK


def check_paths(options: PlanOptions) -> tuple[InputFile, int]:
    """The input is a usable prompts file and --report can be written (raises JobError); the input and its
    row count."""
    try:
        if options.report is not None:
            check_writable(options.report, flag="--report")
        source = open_input(options.input)
        return source, inspect_input(source, fields=task_class(options.task).input_fields)
    except ValueError as exc:
        raise JobError(str(exc)) from None


def plan_tokenizer(model: ResolvedModel) -> Any:
    """The checkpoint's tokenizer, as a run loads it (no weights)."""
    from cbatch.tokenizer import load_tokenizer

    try:
        return load_tokenizer(model.checkpoint.path)
    except Exception as exc:  # a damaged tokenizer file: the run would fail to load too
        raise JobError(f"--model {model.checkpoint.path}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from None


def cost_model(options: PlanOptions, kind: DeviceKind, model: ResolvedModel) -> tuple[CostModel, str]:
    if options.cost_from is not None:
        return CostModel.fit(options.cost_from), f"fitted to {options.cost_from}"
    engine = options.engine
    source = (f"the default for {kind.name} from the model's FLOPs and bytes: rough; "
              "--cost-from a real run's report makes it accurate")
    return kind.default_cost(model, engine.tensor_parallel_size, engine.enforce_eager), source


def plan_cache(options: PlanOptions, kind: DeviceKind, model: ResolvedModel, config: EngineConfig,
               task: Task) -> CacheSpec | None:
    """--result-cache, for lookups only; consulted only for a plan of this machine (the key names the device)."""
    if options.result_cache is None:
        return None
    if not kind.is_this_machine:
        print(f"cbatch plan: --result-cache is not consulted: the plan is for {kind.name}, not this machine, and "
              "cached rows are keyed by their device", file=sys.stderr)
        return None
    return cache_spec(options.result_cache, DEFAULT_CACHE_LIMIT, model, config, task, writable=False)


def plan_report(options: PlanOptions, setup: PlanSetup, cost_source: str, checked: CheckedRows,
                simulations: list[Simulation]) -> dict[str, Any]:
    """The plan as JSON: what was assumed, the error rows, the prediction, and the search."""
    first, best = simulations[0], fastest(simulations)
    errors, total = checked.errors, checked.total
    return {
        "input": str(options.input), "model": str(setup.model.checkpoint.path), "device_kind": setup.kind.name,
        "dtype": str(setup.model.dtype), "max_model_len": setup.model.max_model_len,
        "layout": layout(first.config, setup),
        "settings": {"engine": asdict(first.config), "defaults": asdict(options.defaults)},
        "cost_model": {**cost_settings(setup.cost), "source": cost_source},
        "output_lengths": setup.lengths.source if setup.task.decodes else f"none (--task {options.task}: prefill only)",
        **({"speculative_acceptance": setup.acceptance} if first.config.speculative != "off" else {}),
        **({} if setup.task.decodes else {"task": options.task}),
        "requests": {"total": total, "ok": total - len(errors), "error": len(errors), "cached": checked.cached},
        "errors": [{"index": r.index, "id": r.row_id, "error": r.error} for r in errors],
        "predicted": first.predicted(),
        "kv_cache": plan_kv_per_token(first.config, setup.model),
        **({"lora": adapter_usage(checked, first)} if checked.adapters else {}),  # rows and tokens per adapter
        "search": {
            "best": best.predicted(),
            "tried": [{"max_num_seqs": s.config.max_num_seqs, "max_num_batched_tokens": s.config.max_num_batched_tokens,
                       "wall_seconds": s.wall, "error_rows": len(s.errors)} for s in simulations],
        },
    }


def layout(config: EngineConfig, setup: PlanSetup) -> dict[str, Any]:
    """How the run splits the model: ranks, expert parallelism, the bytes a rank sends per token (more than one
    rank: prefill tokens and decode tokens), and (a GPU plan) the weight bytes each rank holds."""
    out: dict[str, Any] = {"tensor_parallel_size": config.tensor_parallel_size, "expert_parallel": config.expert_parallel}
    if config.tensor_parallel_size > 1:
        sent = setup.kind.comm_bytes(setup.model, config.tensor_parallel_size, config.enforce_eager)
        out["comm_bytes_per_token"] = {"prefill": round(sent.prefill), "decode": round(sent.decode)}
    if setup.kind.memory_gib is not None:
        out["weight_bytes_per_rank"] = round(setup.kind.weight_bytes_per_rank(config, setup.model))
    return out


def adapter_usage(checked: CheckedRows, first: Simulation) -> dict[str, dict[str, int]]:
    """Rows per LoRA adapter (every row checked), with the simulated rows' tokens scaled to the job."""
    simulated = first.report.get("lora", {})
    return {name: {"rows": rows, **{k: round(simulated.get(name, {}).get(k, 0) * first.scale)
                                    for k in ("prompt_tokens", "output_tokens")}}
            for name, rows in sorted(checked.adapters.items())}


def deadline_warning(plan: dict[str, Any], deadline: Deadline, unit: str) -> str | None:
    """Why the predicted run does not fit the deadline (None: it fits, or the costs are not in seconds)."""
    if unit != "s":
        return None
    left, wall = deadline.at - deadline.clock(), plan["predicted"]["wall_seconds"]
    if wall <= left:
        return None
    return (f"the predicted run ({wall:,.0f} s, model loading aside) does not fit {deadline.flag} ({max(left, 0):,.0f} s "
            "from now): the rows left at the deadline would expire; allow more time, or run fewer rows")


def plan_kv_per_token(config: EngineConfig, model: ResolvedModel) -> dict[str, int | str]:
    """One token's KV bytes on one rank, and how they come about (MLA: its latent)."""
    spec = Shard(0, config.tensor_parallel_size).local_spec(model.spec)
    return kv_per_token(spec, kv_cache_dtype(config, model.dtype))


def print_plan(plan: dict[str, Any], quiet: bool) -> None:
    r, p = plan["requests"], plan["predicted"]
    cached = f" ({r['cached']} from the result cache)" if r["cached"] else ""
    print(f"cbatch plan: {plan['input']}: {r['total']} rows: {r['ok']} would run{cached}, {r['error']} error rows")
    if plan["errors"] and not quiet:
        print("error rows (id: what OUTPUT's `error` column will say):")
        for row in plan["errors"][:MAX_ERRORS_SHOWN]:
            print(f"  {row['id']}: {row['error']}")
        if len(plan["errors"]) > MAX_ERRORS_SHOWN:
            print(f"  ... and {len(plan['errors']) - MAX_ERRORS_SHOWN} more (every one is in --report)")
    if "lora" in plan:
        print("rows per LoRA adapter: " + ", ".join(f"{name} {u['rows']}" for name, u in plan["lora"].items()))
    shape = plan["layout"]
    if shape["tensor_parallel_size"] > 1 or "weight_bytes_per_rank" in shape:
        ranks = f"{shape['tensor_parallel_size']} ranks" + (" (experts spread whole)" if shape["expert_parallel"] else "")
        weights = (f", {shape['weight_bytes_per_rank'] / 2**30:,.1f} GiB of weights per rank"
                   if "weight_bytes_per_rank" in shape else "")
        sent = shape.get("comm_bytes_per_token")
        sends = f", each sends {sent['prefill']:,} B per prefill token, {sent['decode']:,} per decode token" if sent else ""
        print(f"layout: {ranks}{weights}{sends}")
    print(f"predicted on {plan['device_kind']}, {plan['dtype'].removeprefix('torch.')} (costs: "
          f"{plan['cost_model']['source']}; output lengths: {plan['output_lengths']}):")
    rates = (f"{p['requests_per_s']:,.1f} rows/s, {p['total_tokens_per_s']:,.1f} prompt tok/s" if "task" in plan else
             f"{p['output_tokens_per_s']:,.1f} output tok/s ({p['total_tokens_per_s']:,.1f} total)")
    print(f"  wall {p['wall_seconds']:,.1f} s, {rates}, {p['steps']:,} steps, occupancy {p['mean_batch_occupancy']:.0%}, "
          f"peak KV {p['peak_kv_usage']:.0%} of {p['num_kv_blocks']:,} blocks, {p['preemptions']} preemptions"
          + (f", prefix cache hits {p['prefix_cache_hit_rate']:.0%}" if p["prefix_cache_hit_rate"] else ""))
    if "speculative" in p:
        print(f"  speculative ({plan['settings']['engine']['speculative']}, acceptance "
              f"{plan['speculative_acceptance']:.0%} assumed): {speculation_text(p['speculative'])}")
    kv = plan["kv_cache"]
    print(f"  KV cache: {kv['bytes_per_token']:,} bytes per token ({kv['layout']}), "
          f"{p['num_kv_blocks'] * plan['settings']['engine']['block_size']:,} tokens in the pool")
    best = plan["search"]["best"]
    if len(plan["search"]["tried"]) > 1:
        same = (best["max_num_seqs"], best["max_num_batched_tokens"]) == (p["max_num_seqs"], p["max_num_batched_tokens"])
        if same:
            print(f"search: these settings are the fastest of {len(plan['search']['tried'])} tried")
        else:
            print(f"search: fastest of {len(plan['search']['tried'])} tried: --max-num-seqs {best['max_num_seqs']} "
                  f"--max-num-batched-tokens {best['max_num_batched_tokens']}: wall {best['wall_seconds']:,.1f} s "
                  f"({1 - best['wall_seconds'] / max(p['wall_seconds'], 1e-12):.0%} less)")
